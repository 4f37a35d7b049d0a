#!/usr/bin/env bash
# H100 / H200 (one GPU), one device call (issue 21, session 35): session 35's two new serving defaults — the
# `direct` BF16 products (SGLANG_DSV41_BF16_GEMM) and the `auto` indexer head sum (fp32 at eager prefill) —
#   1. pytest -m gpu: the dense products and graph replay (test_runtime_dense_ops_gpu, test_runtime_cuda_graph_gpu),
#      the teacher-forced contracts but FlashMLA's (test_runtime_triton_backend -k "teacher_forced and not
#      flashmla": the default, the opt-ins, the defaults before; -rP logs each contract summary), then
#      test_runtime_forward_gpu;
#   2. the 8K prefill profile of `default` against `session34` (the default before) in one process;
#   3. the whole model's decode step at N = 1 / 8 / 64 / 256 with the new defaults.
# Run from the checkout root with `.gpu` carried: bash scripts/gpu/session35c.sh
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
: "${BUDGET:=590}"
mkdir -p "$OUT/logs" "$OUT/tests"
gpu_setup
OUT=$OUT/tests BUDGET=$(left 330) TESTS="tests/test_runtime_dense_ops_gpu.py tests/test_runtime_cuda_graph_gpu.py" \
  bash scripts/gpu/gpu_tests_subset.sh
echo "== dense / graph tests rc=$?"
PYTEST_ADDOPTS=-rP OUT=$OUT/tests BUDGET=$(left 240) PYTEST_K="teacher_forced and not flashmla" \
  TESTS="tests/test_runtime_triton_backend.py" bash scripts/gpu/gpu_tests_subset.sh
echo "== contracts rc=$?"
prefill_profile "default session34" 100
model_step "default" "1 8 64 256" 120
OUT=$OUT/tests BUDGET=$(left 5) TESTS="tests/test_runtime_forward_gpu.py" bash scripts/gpu/gpu_tests_subset.sh
echo "== forward tests rc=$?"
rm -f "$OUT/decode_step.json"
pack_logs

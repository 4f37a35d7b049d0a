#!/usr/bin/env bash
# H200 / H100 (one GPU), one device call (after session 29; issue 21): the rest of session 29's GPU tests —
# the whole forward with the quantised hand-off against the CPU (tests/test_runtime_forward_gpu.py), its graph
# replay (tests/test_runtime_cuda_graph_gpu.py), the serving contract of w8a8_fold (test_runtime_triton_backend.py
# -k w8a8_fold), and the two kernels whose split-K sum moved into `_last_chunk_sum` not run by session30a.sh
# (tests/test_kernels_fp8_gemv.py, tests/test_kernels_bf16_linear.py). Logs in $OUT/logs.tar.gz.
# Run from the checkout root with `.gpu` carried: bash scripts/gpu/session30b.sh
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
: "${BUDGET:=560}"
mkdir -p "$OUT/logs" "$OUT/tests"
gpu_setup
OUT=$OUT/tests BUDGET=$(left 200) TESTS="tests/test_runtime_forward_gpu.py tests/test_runtime_cuda_graph_gpu.py \
tests/test_kernels_fp8_gemv.py tests/test_kernels_bf16_linear.py" bash scripts/gpu/gpu_tests_subset.sh
echo "== gpu tests rc=$?"
OUT=$OUT/tests BUDGET=$(left 5) PYTEST_K="w8a8_fold" TESTS="tests/test_runtime_triton_backend.py" \
  bash scripts/gpu/gpu_tests_subset.sh
echo "== contract rc=$?"
mv "$OUT"/tests/*.log "$OUT/logs/" 2>/dev/null; rmdir "$OUT/tests" 2>/dev/null
(cd "$OUT" && tar czf logs.tar.gz logs 2>/dev/null; rm -rf logs)
ls -R "$OUT"

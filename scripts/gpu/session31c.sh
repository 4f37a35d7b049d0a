#!/usr/bin/env bash
# H100 / H200 (one GPU), one device call (issue 21, session 31, after session31a.sh on the same warm machine):
# the graph replay of the new default against eager (tests/test_runtime_cuda_graph_gpu.py), then
# SGLANG_DSV41_BF16_GEMM=direct against the default `whole` (model_step, N = 1 / 8, alternating, one process each).
# Run from the checkout root with `.gpu` carried: BUDGET=300 bash scripts/gpu/session31c.sh
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
: "${BUDGET:=300}" "${STEP_S:=52}"
mkdir -p "$OUT/logs" "$OUT/tests"
gpu_setup
OUT=$OUT/tests BUDGET=$(left $((4 * STEP_S))) TESTS="tests/test_runtime_cuda_graph_gpu.py" bash scripts/gpu/gpu_tests_subset.sh
echo "== gpu tests rc=$?"
for i in 1 2; do
  model_step "whole$i" "1 8" "$STEP_S"
  model_step "direct$i" "1 8" "$STEP_S" SGLANG_DSV41_BF16_GEMM=direct
done
pack_logs

#!/usr/bin/env bash
# H200 / H100 (one GPU), one device call (after session 30; issue 21): the whole forward with session 30's glue
# kernels against the CPU (tests/test_runtime_forward_gpu.py) and its graph replay (tests/test_runtime_cuda_graph_gpu.py),
# the serving contract (test_runtime_triton_backend.py -k w8a8_fold), the split-K helper's other readers
# (tests/test_kernels_fp8_w8a8.py, tests/test_kernels_fp8_gemv.py, tests/test_kernels_bf16_linear.py) — session 30b's
# queue, never run — then SGLANG_DSV41_BF16_GEMM=direct against the default `whole` (model_step at N = 1,
# alternating; ≈ 80 s a process), then the stream profile of the new default at N = 1 (`model_step.py --profile`: what glue is left).
# Logs in $OUT/logs.tar.gz. Run from the checkout root with `.gpu` carried: bash scripts/gpu/session31b.sh
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
: "${BUDGET:=585}"
mkdir -p "$OUT/logs" "$OUT/tests"
gpu_setup
OUT=$OUT/tests BUDGET=$(left 420) TESTS="tests/test_runtime_forward_gpu.py tests/test_runtime_cuda_graph_gpu.py \
tests/test_kernels_fp8_w8a8.py tests/test_kernels_fp8_gemv.py tests/test_kernels_bf16_linear.py" \
  bash scripts/gpu/gpu_tests_subset.sh
echo "== gpu tests rc=$?"
OUT=$OUT/tests BUDGET=$(left 330) PYTEST_K="w8a8_fold" TESTS="tests/test_runtime_triton_backend.py" \
  bash scripts/gpu/gpu_tests_subset.sh
echo "== contract rc=$?"
for i in 1 2; do                                # the BF16 linears without the padded copy (opt-in `direct`)
  model_step "whole$i" "1" 80
  model_step "direct$i" "1" 80 SGLANG_DSV41_BF16_GEMM=direct
done
MODEL_STEP_EXTRA="--profile" model_step "profiled" "1" 85
pack_logs

#!/usr/bin/env bash
# H100 / H200 (one GPU), one device call (issue 21, session 34):
#   1. the two GPU tests session34b.sh failed on test-side errors, fixed: the screened SwiGLU at 8,192 × 2,304
#      (its statistics line) and the whole-rows BF16 operand used as is (an fp32 BF16-valued weight);
#   2. benchmarks/model_step.py (4 Flash-width layers, 8K context, side stream off / on) at N = 1 / 8 / 64 / 256
#      with this tree's defaults: the whole model's decode step per layer on this machine (JSON in
#      $OUT/model_step_new).
# Run from the checkout root with `.gpu` carried: bash scripts/gpu/session34c.sh
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
: "${BUDGET:=585}" "${TEST_S:=150}" "${STEP_S:=400}"
mkdir -p "$OUT/logs" "$OUT/tests"
gpu_setup
OUT=$OUT/tests BUDGET=$TEST_S PYTEST_K="swiglu_screen or whole_rows" TESTS="tests/test_kernels_fused_elementwise.py \
tests/test_runtime_dense_ops_gpu.py" bash scripts/gpu/gpu_tests_subset.sh
echo "== gpu tests rc=$?"
timeout 60 python3 -m pytest -m gpu -q -s -p no:cacheprovider tests/test_kernels_fused_elementwise.py -k swiglu_screen 2>&1 \
  | grep "swiglu screen"
model_step new "1 8 64 256" "$STEP_S"
pack_logs

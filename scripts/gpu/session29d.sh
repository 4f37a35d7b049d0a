#!/usr/bin/env bash
# H200 / H100 (one GPU), one device call (session 29; issue 21): the scale-folded FP8 tier for 1–16 rows
# (`kernels/fp8_fold.py`, opt-in SGLANG_DSV41_FP8_GEMM=w8a8_fold):
#   1. pytest -m gpu: tests/test_kernels_fp8_fold.py (Flash shapes within the bound, row invariance, graph replay)
#      and the serving contract of test_runtime_triton_backend.py for w8a8_fold and the default w8a8_f16;
#   2. benchmarks/fp8_decode_floor.py: the tier per Flash weight at one row against the default kernel, with
#      one configuration field changed at a time (and the read floors again);
#   3. benchmarks/model_step.py (4 Flash-width layers, 8K context, side stream off / on) at N = 1 / 8 / 16:
#      default, fold, default, fold — one process each, so the spread shows next to the ratio.
# JSONs in $OUT/fp8_decode_floor and $OUT/model_step_{default,fold}{1,2}; logs in $OUT/logs.tar.gz.
# Run from the checkout root with `.gpu` carried: bash scripts/gpu/session29d.sh
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
: "${BUDGET:=580}" "${TEST_S:=170}" "${STEP_S:=75}"
mkdir -p "$OUT/logs" "$OUT/tests" "$OUT/fp8_decode_floor"
gpu_setup
OUT=$OUT/tests BUDGET=$TEST_S TESTS="tests/test_kernels_fp8_fold.py" bash scripts/gpu/gpu_tests_subset.sh
echo "== fold gpu tests rc=$?"
OUT=$OUT/tests BUDGET=$TEST_S PYTEST_K="w8a8_fold or w8a8_f16" TESTS="tests/test_runtime_triton_backend.py" \
  bash scripts/gpu/gpu_tests_subset.sh
echo "== contract gpu tests rc=$?"
timeout "$(cap 100)" python3 benchmarks/fp8_decode_floor.py --out "$OUT/fp8_decode_floor" --replays 10 2>&1 \
  | tee "$OUT/logs/fp8_decode_floor.log" | grep -E "current|fold|stream_t264_bk256|scaled_mm" | tail -120
result "fp8_decode_floor rc=${PIPESTATUS[0]}"
for i in 1 2; do
  model_step "default$i" "1 8 16" "$STEP_S"
  model_step "fold$i" "1 8 16" "$STEP_S" SGLANG_DSV41_FP8_GEMM=w8a8_fold
done
mv "$OUT"/tests/*.log "$OUT/logs/" 2>/dev/null; rmdir "$OUT/tests" 2>/dev/null
find "$OUT" -name "*.png" -delete
(cd "$OUT" && tar czf logs.tar.gz logs 2>/dev/null; rm -rf logs)
ls -R "$OUT"

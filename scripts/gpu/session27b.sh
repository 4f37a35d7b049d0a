#!/usr/bin/env bash
# H200 (one GPU), one device call (session 27; issue 21): the FP8 GPU tests that session26.sh does not run —
# the SHAPE_CONFIGS and row tiers of session 24 (tests/test_kernels_fp8_w8a8.py, never run since), the fp32 /
# BF16 output forms (tests/test_kernels_fp8_w8a8_out.py) and session 25's CUDA-core GEMV tier
# (tests/test_kernels_fp8_gemv.py, opt-in w8a8_gemv, never run); then, with what is left,
# benchmarks/mhc_decode.py (the `registers` mHC coefficients against `tile`, T = 1 … 64).
# JSON in $OUT/mhc; logs in $OUT/logs.tar.gz.
# Run from the checkout root with `.gpu` carried: bash scripts/gpu/session27b.sh
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
: "${BUDGET:=420}" "${TEST_S:=320}" "${MHC_S:=90}"
mkdir -p "$OUT/logs" "$OUT/tests" "$OUT/mhc"
gpu_setup
OUT=$OUT/tests BUDGET=$TEST_S \
  TESTS="tests/test_kernels_fp8_gemv.py tests/test_kernels_fp8_w8a8.py tests/test_kernels_fp8_w8a8_out.py" \
  bash scripts/gpu/gpu_tests_subset.sh
echo "== gpu tests rc=$?"
s=$(cap "$MHC_S")
if [ "$s" -gt 40 ]; then
  timeout -s INT -k 10 "$s" python3 benchmarks/mhc_decode.py --tokens 1 2 4 8 16 64 --out "$OUT/mhc" \
    >"$OUT/logs/mhc_decode.log" 2>&1
  result mhc_decode rc=$?
  grep -v -i warn "$OUT/logs/mhc_decode.log" | tail -12
else
  result mhc_decode "skipped: $s s left"
fi
mv "$OUT"/tests/*.log "$OUT/logs/" 2>/dev/null; rmdir "$OUT/tests" 2>/dev/null
find "$OUT" -name "*.png" -delete
(cd "$OUT" && tar czf logs.tar.gz logs 2>/dev/null; rm -rf logs)
ls -R "$OUT"

#!/usr/bin/env bash
# H200 (one GPU), one device call (session 25; issue 21): the CUDA-core FP8 GEMV tier (kernels/fp8_gemv.py,
# opt-in SGLANG_DSV41_FP8_GEMM=w8a8_gemv) and session 24's untested final defaults:
#   1. pytest -m gpu tests/test_kernels_fp8_gemv.py tests/test_kernels_fp8_w8a8.py (the GEMV tier and the
#      SHAPE_CONFIGS within the bound, split-K == one program, a row's bits, graph replay), then the
#      teacher-forced contracts of tests/test_runtime_triton_backend.py (every FP8 mode, w8a8_gemv included);
#   2. benchmarks/fp8_w8a8.py at 1 / 2 / 4 / 8 rows: the row tiers against the GEMV variants, per weight at 1 row;
#   3. benchmarks/model_step.py at N = 1 / 2 / 4 / 8, the defaults, then with SGLANG_DSV41_FP8_GEMM=w8a8_gemv.
# JSONs in $OUT/fp8, $OUT/model_step_{default,gemv}; logs in $OUT/logs.tar.gz.
# Run from the checkout root with `.gpu` carried: bash scripts/gpu/session25a.sh
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
: "${BUDGET:=575}" "${TEST_S:=200}" "${FP8_S:=120}"
mkdir -p "$OUT/logs" "$OUT/tests" "$OUT/fp8"
gpu_setup
OUT=$OUT/tests BUDGET=$TEST_S \
  TESTS="tests/test_kernels_fp8_gemv.py tests/test_kernels_fp8_w8a8.py tests/test_runtime_triton_backend.py" \
  bash scripts/gpu/gpu_tests_subset.sh
echo "== gpu tests rc=$?"
s=$(cap "$FP8_S")
timeout -s INT -k 10 "$s" python3 benchmarks/fp8_w8a8.py --rows 1 2 4 8 --per-weight-rows 1 --cap-s 0.1 \
  --variants gemv gemv_prequant gemv_bn32 gemv_bn128_w8 gemv_sub2 gemv_t528 gemv_t2112 --out "$OUT/fp8" >"$OUT/logs/fp8.log" 2>&1
result fp8_w8a8 rc=$?
grep -v -i warn "$OUT/logs/fp8.log" | tail -12
model_step default "1 2 4 8" 120 SGLANG_DSV41_FP8_GEMM=w8a8_f16
model_step gemv "1 2 4 8" 120 SGLANG_DSV41_FP8_GEMM=w8a8_gemv
mv "$OUT"/tests/*.log "$OUT/logs/" 2>/dev/null; rmdir "$OUT/tests"
find "$OUT" -name "*.png" -delete
(cd "$OUT" && tar czf logs.tar.gz logs 2>/dev/null; rm -rf logs)
ls -R "$OUT"

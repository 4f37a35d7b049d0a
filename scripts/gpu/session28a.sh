#!/usr/bin/env bash
# H200 (one GPU), one device call (session 28; issue 21), the most telling work first when machines are scarce:
#   1. pytest -m gpu on session 28's touched kernels (rms_segment: the RMSNorm and RMSNorm-pair kernels) and on
#      session 25's CUDA-core FP8 GEMV tier (tests/test_kernels_fp8_gemv.py, never run), TEST_S at most;
#   2. benchmarks/model_step.py (4 Flash-width layers, 8K context, side stream off / on) at N = 1 / 2 / 4 / 8:
#      the defaults, then SGLANG_DSV41_FP8_GEMM=w8a8_gemv (the GEMV tier for 1-4 rows) — the same-machine
#      ratio of the dense FP8 lever at N = 1, the largest part of the N = 1 step (session 23's profile). The
#      default run also traces its graphs (--profile, benchmarks/stream_profile.py): each kernel's exposed
#      time with the side stream on, i.e. what shortening it can save.
# JSONs in $OUT/model_step_{default,gemv}; logs in $OUT/logs.tar.gz.
# Run from the checkout root with `.gpu` carried: bash scripts/gpu/session28a.sh
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
: "${BUDGET:=570}" "${TEST_S:=230}"
mkdir -p "$OUT/logs" "$OUT/tests"
gpu_setup
OUT=$OUT/tests BUDGET=$TEST_S \
  TESTS="tests/test_kernels_stacked_halves.py tests/test_kernels_fused_elementwise.py tests/test_kernels_fp8_gemv.py" \
  bash scripts/gpu/gpu_tests_subset.sh
echo "== gpu tests rc=$?"
MODEL_STEP_EXTRA=--profile model_step default "1 2 4 8" 150
model_step gemv "1 2 4 8" 150 SGLANG_DSV41_FP8_GEMM=w8a8_gemv
mv "$OUT"/tests/*.log "$OUT/logs/" 2>/dev/null; rmdir "$OUT/tests" 2>/dev/null
find "$OUT" -name "*.png" -delete
(cd "$OUT" && tar czf logs.tar.gz logs 2>/dev/null; rm -rf logs)
ls -R "$OUT"

#!/usr/bin/env bash
# H200 / H100 (one GPU), one device call (session 29; issue 21): the new serving default `w8a8_fold` (1–16 FP8
# rows on kernels/fp8_fold.py, one decode row quantising only that row), most telling first:
#   1. benchmarks/model_step.py (4 Flash-width layers, 8K context, side stream off / on) at N = 1 / 8: the new
#      default (with its stream profile, after the timings), then SGLANG_DSV41_FP8_GEMM=w8a8_f16 (the old
#      default), one process each;
#   2. benchmarks/fp8_decode_floor.py --only current fold: the tier per Flash weight at one row (the one-row path)
#      against the old default and the structure with x quantised before the launch;
#   3. pytest -m gpu: tests/test_kernels_fp8_fold.py, tests/test_runtime_forward_gpu.py (the serving default's
#      choices, the forward against the CPU), tests/test_runtime_cuda_graph_gpu.py (graph replay of both modes).
# JSONs in $OUT/model_step_{new,f16} and $OUT/fp8_decode_floor; logs in $OUT/logs.tar.gz.
# Run from the checkout root with `.gpu` carried: bash scripts/gpu/session29e.sh
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
: "${BUDGET:=420}" "${STEP_S:=70}"
mkdir -p "$OUT/logs" "$OUT/tests" "$OUT/fp8_decode_floor"
gpu_setup
MODEL_STEP_EXTRA=--profile model_step new "1 8" "$STEP_S"
model_step f16 "1 8" "$STEP_S" SGLANG_DSV41_FP8_GEMM=w8a8_f16
timeout "$(cap 60)" python3 benchmarks/fp8_decode_floor.py --out "$OUT/fp8_decode_floor" --replays 10 \
  --only current fold_tier fold_n64 2>&1 | tee "$OUT/logs/fp8_decode_floor.log" | grep -E "current|fold" | tail -40
result "fp8_decode_floor rc=${PIPESTATUS[0]}"
OUT=$OUT/tests BUDGET=$(left 5) \
  TESTS="tests/test_kernels_fp8_fold.py tests/test_runtime_forward_gpu.py tests/test_runtime_cuda_graph_gpu.py" \
  bash scripts/gpu/gpu_tests_subset.sh
echo "== gpu tests rc=$?"
mv "$OUT"/tests/*.log "$OUT/logs/" 2>/dev/null; rmdir "$OUT/tests" 2>/dev/null
find "$OUT" -name "*.png" -delete
(cd "$OUT" && tar czf logs.tar.gz logs 2>/dev/null; rm -rf logs)
ls -R "$OUT"

#!/usr/bin/env bash
# H200 (one GPU), one device call (session 24; issue 21): the speed side of session24a.sh's changes.
#   1. benchmarks/model_step.py (4 Flash-width layers, 8K context, side stream off / on) with
#      SGLANG_DSV41_BF16_GEMM=whole (cuBLAS on padded rows: the default until now), then with the new
#      default (`triton`: kernels/bf16_linear.py below 129 rows);
#   2. benchmarks/fp8_w8a8.py --sweep: decode and mid-tier W8A8 configurations per Flash weight shape
#      (SHAPE_CONFIGS suggestions; lost with session 22's call);
#   3. model_step.py with SGLANG_DSV41_ATTN_DECODE=auto on top (BF16-row decode attention);
#   4. decode_step.py --quick --profile: the layer-2 step by component under the new defaults.
# JSONs in $OUT/model_step_{whole,triton,auto}, $OUT/fp8, $OUT/step; logs in $OUT/logs.tar.gz.
# Run from the checkout root with `.gpu` carried: bash scripts/gpu/session24b.sh
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
: "${BUDGET:=575}" "${SWEEP_S:=190}"
mkdir -p "$OUT/logs" "$OUT/fp8" "$OUT/step"
gpu_setup
model_step() {  # LABEL ENV=VALUE...
  local label=$1 b; shift
  b=$(( $(left) - 10 )); [ "$b" -gt 150 ] && b=150
  [ "$b" -gt 60 ] || { echo "model_step $label: skipped, $(left) s left"; return; }
  env "$@" timeout -s INT -k 10 "$b" python3 benchmarks/model_step.py --layers 4 --batches 1 8 64 256 \
    --context 8192 --cap-s 0.5 --budget-s $((b - 40)) --out "$OUT/model_step_$label" >"$OUT/logs/model_step_$label.log" 2>&1
  result "model_step $label" rc=$?
  grep '^{' "$OUT/logs/model_step_$label.log"
}
model_step whole SGLANG_DSV41_BF16_GEMM=whole
model_step triton SGLANG_DSV41_BF16_GEMM=triton
s=$(cap "$SWEEP_S")
timeout -s INT -k 10 "$s" python3 benchmarks/fp8_w8a8.py --sweep --jobs 12 --budget-s $((s - 30)) \
  --cap-s 0.02 --out "$OUT/fp8" >"$OUT/logs/fp8_sweep.log" 2>&1
result fp8_sweep rc=$?
grep -v -i warn "$OUT/logs/fp8_sweep.log" | tail -30
model_step auto SGLANG_DSV41_ATTN_DECODE=auto
b=$(( $(left) - 8 ))
if [ "$b" -gt 40 ]; then
  timeout -s INT -k 5 "$b" python3 benchmarks/decode_step.py --quick --no-prefill --profile --profile-fp8 w8a8_f16 \
    --batches 1 8 64 256 --budget-s $((b - 15)) --out "$OUT/step" >"$OUT/logs/decode_step.log" 2>&1
  result decode_step rc=$?
  grep -v -i warn "$OUT/logs/decode_step.log" | tail -12
fi
find "$OUT" -name "*.png" -delete
(cd "$OUT" && tar czf logs.tar.gz logs 2>/dev/null; rm -rf logs)
ls -R "$OUT"

#!/usr/bin/env bash
# H200 (one GPU), one device call (session 25; issue 21): the register-resident mHC coefficient kernel
# (SGLANG_DSV41_MHC_COEFF=registers, kernels/mhc_coef.py; its GPU tests passed in session23a.sh, never timed).
# At one token the `tile` coefficient kernel takes ≈ 20 µs twice a layer (session 23's profile): a
# latency chain (19 Sinkhorn steps of 8 shuffles and 8 `div.rn` each in its sm_90 build).
#   1. benchmarks/mhc_decode.py at T = 1 … 64 (rows / rows_regcoef / dot / fused, CUDA-graph replays);
#   2. benchmarks/model_step.py at N = 1 / 8 / 64: `tile` (the default), then `registers`;
#   3. both opt-ins of session 25 with `registers` (FP8 GEMV tier + MoE split_k=2) at N = 1 / 8.
# JSONs in $OUT/mhc, $OUT/model_step_{tile,registers,all}; logs in $OUT/logs.tar.gz.
# Run from the checkout root with `.gpu` carried: bash scripts/gpu/session25c.sh
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
: "${BUDGET:=575}" "${MHC_S:=90}"
mkdir -p "$OUT/logs" "$OUT/mhc"
gpu_setup
s=$(cap "$MHC_S")
timeout -s INT -k 10 "$s" python3 benchmarks/mhc_decode.py --tokens 1 2 4 8 16 64 --out "$OUT/mhc" \
  >"$OUT/logs/mhc_decode.log" 2>&1
result mhc_decode rc=$?
grep -v -i warn "$OUT/logs/mhc_decode.log" | tail -12
model_step tile "1 8 64" 150 SGLANG_DSV41_MHC_COEFF=tile
model_step registers "1 8 64" 150 SGLANG_DSV41_MHC_COEFF=registers
model_step all "1 8" 150 SGLANG_DSV41_MHC_COEFF=registers SGLANG_DSV41_FP8_GEMM=w8a8_gemv SGLANG_DSV41_MOE_DECODE_FLAGS=split_k=2
find "$OUT" -name "*.png" -delete
(cd "$OUT" && tar czf logs.tar.gz logs 2>/dev/null; rm -rf logs)
ls -R "$OUT"

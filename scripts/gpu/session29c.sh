#!/usr/bin/env bash
# H200 / H100 (one GPU), one device call (session 29; issue 21): where the dense FP8 GEMM's time goes at one
# decode row — benchmarks/fp8_decode_floor.py: per Flash weight, the runtime's kernel (and without its activation
# quantisation, and the GEMV tier) against a pure read of the weight on the same grid (the structure's floor),
# an experimental 128-wide folded-scale BF16 MMA structure, cuBLAS BF16 and cuBLASLt FP8, each the mean of
# back-to-back graphed calls over weight copies that miss the L2.
# JSON in $OUT/fp8_decode_floor; log in $OUT/logs.tar.gz.
# Run from the checkout root with `.gpu` carried: bash scripts/gpu/session29c.sh
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
: "${BUDGET:=400}"
mkdir -p "$OUT/logs" "$OUT/fp8_decode_floor"
gpu_setup
timeout "$(cap 380)" python3 benchmarks/fp8_decode_floor.py --out "$OUT/fp8_decode_floor" 2>&1 \
  | tee "$OUT/logs/fp8_decode_floor.log" | grep -v "^\s*$" | tail -150
result "fp8_decode_floor rc=${PIPESTATUS[0]}"
(cd "$OUT" && tar czf logs.tar.gz logs 2>/dev/null; rm -rf logs)
ls -R "$OUT"

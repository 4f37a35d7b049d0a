#!/usr/bin/env bash
# H200 (one GPU), one device call (session 24; issue 21):
#   1. session23e.sh under SGLANG_DSV41_ATTN_DECODE=auto: the serving contract with the BF16-row decode
#      attention, the gather-vs-packed equality, test_runtime_forward_gpu.py (refused for lack of device
#      time in session 23);
#   2. benchmarks/fp8_w8a8.py --sweep: decode and mid-tier W8A8 configurations per Flash weight shape
#      (SHAPE_CONFIGS suggestions for kernels/fp8_w8a8.py; lost with session 22's call).
# Outputs: $OUT/auto/logs.tar.gz, $OUT/fp8/fp8_w8a8_sweep.json, $OUT/fp8_sweep.log.
# Run from the checkout root with `.gpu` carried: bash scripts/gpu/session24a.sh
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
: "${BUDGET:=560}" "${AUTO_S:=230}" "${SWEEP_S:=200}"
mkdir -p "$OUT/auto" "$OUT/fp8"
gpu_setup
OUT=$OUT/auto BUDGET=$AUTO_S SGLANG_DSV41_ATTN_DECODE=auto bash scripts/gpu/session23e.sh
result auto rc=$?
s=$(cap "$SWEEP_S")
timeout -s INT -k 10 "$s" python3 benchmarks/fp8_w8a8.py --sweep --jobs 12 --budget-s $((s - 30)) \
  --cap-s 0.02 --out "$OUT/fp8" >"$OUT/fp8_sweep.log" 2>&1
result fp8_sweep rc=$?
grep -v -i warn "$OUT/fp8_sweep.log" | tail -45
find "$OUT" -name "*.png" -delete
ls -R "$OUT"

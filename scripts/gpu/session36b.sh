#!/usr/bin/env bash
# H200 (or H100), one device call (issue 21, session 36): the benchmarks' Flash layer 2 re-timed now that its
# router spreads like the model's (flash_layer.ROUTER_BIAS_STD, session 35; no GPU figure used it before):
#   1. benchmarks/decode_step.py --quick --batches 1 8 64 256 --no-prefill (one layer, 8K context, CUDA graph);
#   2. the 8K prefill profile of `default` (its log names the device's copy bandwidth).
# Run from the checkout root with a runtime carried (GPU_DIR, default .gpu): bash scripts/gpu/session36b.sh
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
: "${BUDGET:=300}"
mkdir -p "$OUT/logs"
gpu_setup
b=$(cap 150)
timeout -s INT -k 10 "$b" python3 benchmarks/decode_step.py --quick --batches 1 8 64 256 --no-prefill \
  --budget-s $((b - 15)) --out "$OUT" >"$OUT/logs/decode.log" 2>&1
result "decode_step rc=$?"
grep -h -i -e "µs" -e "us/step" -e "copy bandwidth" -e "experts" "$OUT/logs/decode.log" | tail -12
[ -f "$OUT/decode_step.json" ] && mv "$OUT/decode_step.json" "$OUT/decode_step_router_fixed.json"
prefill_profile default "$(left 5)"
grep -h "copy bandwidth" "$OUT/logs/prefill.log" | head -1
rm -f "$OUT/decode_step.json"
pack_logs

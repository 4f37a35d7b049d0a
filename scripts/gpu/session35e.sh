#!/usr/bin/env bash
# H200 (or H100), one device call (issue 21, session 35): the status table re-measured with session 35's defaults —
#   1. the whole model's decode step at N = 1 / 8 / 64 / 256 (`model_step.py`, 4 Flash-width layers, 8K context);
#   2. the 8K prefill profile of Flash layer 2 (`default`; its log names the device's copy bandwidth).
# Run from the checkout root with `.gpu` carried: bash scripts/gpu/session35e.sh
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
: "${BUDGET:=280}"
mkdir -p "$OUT/logs"
gpu_setup
model_step "default" "1 8 64 256" "$(left 95)"
prefill_profile default "$(left 5)"
grep -h "copy bandwidth" "$OUT/logs/prefill.log" | head -1
rm -f "$OUT/decode_step.json"
pack_logs

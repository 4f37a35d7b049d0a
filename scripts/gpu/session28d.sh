#!/usr/bin/env bash
# H200 / H100 (one GPU), one device call (session 28; issue 21): the labelled decode profile of Flash layer 2
# (benchmarks/decode_step.py --profile, step_profile.py) at N = 1 / 8 / 64 with the current defaults, the first
# since session 23 (sessions 24-27 changed the step). JSON in $OUT; log in $OUT/logs.tar.gz.
# Run from the checkout root with `.gpu` carried: bash scripts/gpu/session28d.sh
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
: "${BUDGET:=300}"
mkdir -p "$OUT/logs"
gpu_setup
b=$(( $(left) - 20 ))
timeout $((b + 15)) python3 benchmarks/decode_step.py --out "$OUT" --quick --no-prefill --batches 1 8 64 \
  --profile --profile-fp8 w8a8_f16 --budget-s "$b" >"$OUT/logs/profile.log" 2>&1
result profile rc=$?
grep -v "^ " "$OUT/logs/profile.log" | grep -v -i warn | tail -30
find "$OUT" -name "*.png" -delete
(cd "$OUT" && tar czf logs.tar.gz logs 2>/dev/null; rm -rf logs)
ls -R "$OUT"

#!/usr/bin/env bash
# H200 / H100 (one GPU), one device call (session 28; issue 21): session26.sh's 8K prefill part alone — ONE
# process of benchmarks/decode_step.py --profile-prefill (one 8,192-token prefill of Flash layer 2), the
# default against fp32_activations (benchmarks/prefill_profile.py VARIANTS): the same-run ratio of session 26's
# BF16 activations at prefill, with the profile of the default. JSON in $OUT; log in $OUT/logs.tar.gz.
# Run from the checkout root with `.gpu` carried: bash scripts/gpu/session28c.sh
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
: "${BUDGET:=560}"
mkdir -p "$OUT/logs"
gpu_setup
b=$(( $(left) - 20 ))
timeout $((b + 15)) python3 benchmarks/decode_step.py --out "$OUT" --quick --no-decode --batches 1 \
  --profile-prefill --prefill-variants default fp32_activations --budget-s "$b" >"$OUT/logs/prefill.log" 2>&1
result prefill rc=$?
grep -v "^ " "$OUT/logs/prefill.log" | grep -v -i warn | tail -30
find "$OUT" -name "*.png" -delete
(cd "$OUT" && tar czf logs.tar.gz logs 2>/dev/null; rm -rf logs)
ls -R "$OUT"

#!/usr/bin/env bash
# H200 (or H100), one device call (issue 21, after session 41): why a short prompt's prefill is slow per token at
# Flash width. Session 41 served 1K prompts at ≈ 7.5 ms a layer (GPU-bound: prefill graphs did not move the TTFT)
# against ≈ 3 ms per 1K tokens inside an 8K prefill. One Flash layer's prefill profiled by component at 1,024
# and at 8,192 tokens in the same call (benchmarks/decode_step.py --profile-prefill --prefill-tokens: the
# serving default variant). Run from the checkout root with `.gpu` carried:
#   BUDGET=420 bash scripts/gpu/prefill_short.sh
# Results: $OUT/summary.txt, $OUT/prefill_1024/prefill_profile.json, $OUT/prefill_8192/prefill_profile.json
# (PNG dropped), $OUT/logs/.
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
BUDGET=${BUDGET:-420}; SUMMARY=$OUT/summary.txt
gpu_setup
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader | tee "$SUMMARY"
for tokens in ${TOKENS:-1024 8192}; do
  lines=$(prefill_profile "${VARIANTS:-default}" "${CAP_EACH:-190}" "$tokens")   # its RESULT line is in $SUMMARY already
  echo "$lines"; grep -v "^RESULT" <<<"$lines" >>"$SUMMARY"
done
find "$OUT" -name "*.png" -delete
result done

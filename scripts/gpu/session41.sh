#!/usr/bin/env bash
# H100 / H200 (one GPU), device calls chained on the warm machine (issue 21, session 41): do prefill graph buckets
# to 2,048 tokens pay as a default? A prompt of 257–2,048 tokens runs eagerly today (buckets stop at 256) and the
# eager forward is host-bound (the tiny server's TTFT 5× the tiny Llama's at C = 1).
#   flash  the 4-layer Flash-width dummy server, defaults against `ours_b2k` (buckets 4 … 2,048, default chunked
#          prefill), same client, 1K in / 256 out, C = 1 / 16 / 64 (serving_e2e.sh; capture time and memory in
#          the server logs)
#   tiny   the tiny checkpoint, defaults and `tiny_b2k`, against the 8-layer tiny Llama (tiny_vs_llama.sh)
# Run from the checkout root with `.gpu` carried:  bash scripts/gpu/session41.sh flash|tiny
# Results: $OUT/summary.txt, $OUT/serving_e2e.json or $OUT/tiny_vs_llama.json, $OUT/e2e/.
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
MODE=${1:?usage: session41.sh flash|tiny}
case $MODE in
  flash) GRAPH_BS="1 16 64" STEPS="prep ours ours_b2k" OURS_STARTUP_S=${OURS_STARTUP_S:-240} BUDGET=${BUDGET:-560} \
           bash "$(dirname "$0")/serving_e2e.sh" ;;
  tiny)  STEPS="tiny tiny_b2k llama8" BUDGET=${BUDGET:-540} bash "$(dirname "$0")/tiny_vs_llama.sh" ;;
  *) echo "unknown mode $MODE"; exit 2 ;;
esac

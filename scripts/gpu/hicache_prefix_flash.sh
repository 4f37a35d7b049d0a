#!/usr/bin/env bash
# H200 (one GPU), one device call (issues 14 and 21; docs/hicache.md "What a hit costs"): the HiCache
# prefix benchmark on a model whose cold prefill is not negligible, plus what a hit costs by itself.
#   MODE=flash (default): benchmarks/hicache_prefix.py --dummy-flash $LAYERS — a Flash-width model of
#     LAYERS (4) layers with dummy weights, from a config-only directory made here (--load-format
#     dummy; the weights are generated on the GPU at load). First, on server A, the hit-cost phase
#     (--hit-lengths 1024 8192 32768: per length a fresh prompt cold, then the same prompt again: a
#     full device hit with no tier transfer; one more hit of the last length under SGLang's torch
#     profiler, --profile-hit: its CPU span against its GPU busy time says whether a hit's cost is host
#     or device), then the usual cases on a 32K prefix: cold, GPU hit,
#     L2 hit, L3 hit in server B (A and B start together, B serves only after A stops). Each server
#     --mem-fraction-static $MEM (0.7: each sizes its pool from what is free when it loads, and
#     --max-total-tokens caps the pool far below that), --context-length 40960, page 64, io kernel,
#     decode CUDA graphs (GRAPH), --language-model-only.
#   MODE=tiny-hit: the tiny checkpoint (the session-14 run: cold 742 ms, GPU hit 204 ms at 32K),
#     --hit-cost-only at the same lengths (and --profile-hit): the fixed and per-token parts of its hit cost.
# Run from the checkout root with `.gpu` carried:
#   bash scripts/gpu/hicache_prefix_flash.sh            (then, if device time is left, MODE=tiny-hit)
# Knobs: BUDGET (290 s), LAYERS (4), PREFIX (32768), HIT_LENGTHS ("1024 8192 32768"), REPS (1), MEM (0.7),
# GRAPH (1: decode CUDA graphs to batch 8; 0: --disable-cuda-graph, session 14's setting).
# Results: $OUT/summary.txt (the tables), $OUT/all.tgz (JSON, PNG, server logs). rc 0 = every hit came
# from its tier, hit its whole prompt but the last page, and equals its cold run; the TTFT goals are
# reported (`vs_cold`, and `net_of_hit`: a tier's TTFT less the device hit's against cold less the same).
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
BUDGET=${BUDGET:-290}; MODE=${MODE:-flash}; LAYERS=${LAYERS:-4}; MEM=${MEM:-0.7}
HIT_LENGTHS=${HIT_LENGTHS-1024 8192 32768}   # HIT_LENGTHS= (empty): no hit-cost phase, no profile
PROFILE=--profile-hit; [ -n "$HIT_LENGTHS" ] || PROFILE=
gpu_setup
R=/tmp/hicache_prefix_flash; rm -rf $R; mkdir -p $R; SUMMARY=$OUT/summary.txt
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader 2>&1 | sed 's/^/gpu: /' | tee "$SUMMARY"
FLAGS="--hicache-io-backend kernel --hicache-ratio 4 --swa-full-tokens-ratio 1.0 \
--hicache-storage-prefetch-policy wait_complete --context-length 40960 --mem-fraction-static $MEM"
# GRAPH=1 (default): decode CUDA graphs up to batch 8. SGLang's overlap scheduler sends a prefill's first
# token only after launching the next batch (the request's first decode step), so with
# --disable-cuda-graph every TTFT also holds an eager decode forward's host time (docs/hicache.md).
if [ "${GRAPH:-1}" = 1 ]; then FLAGS="$FLAGS --cuda-graph-max-bs 8"; else FLAGS="$FLAGS --disable-cuda-graph"; fi
case $MODE in
  flash) MODEL=(--model-path /tmp/hicache_flash_model --dummy-flash "$LAYERS")
         FLAGS="$FLAGS --language-model-only" ;;   # as serving_e2e.sh: no vision tower to generate
  tiny-hit) export SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1
            tiny_checkpoint /tmp/tiny || exit 4
            MODEL=(--model-path /tmp/tiny --hit-cost-only) ;;
  *) echo "MODE must be flash or tiny-hit, got $MODE"; exit 2 ;;
esac
result setup mode=$MODE graph=${GRAPH:-1}
# shellcheck disable=SC2086
timeout -s TERM -k 30 "$(left 35)" python3 benchmarks/hicache.py --mode prefix "${MODEL[@]}" --device cuda \
    --prefix-tokens "${PREFIX:-32768}" --suffix-tokens 32 --new-tokens 8 --reps "${REPS:-1}" --start-b-with-a \
    --page-size 64 --hit-lengths $HIT_LENGTHS $PROFILE --flags="$FLAGS" \
    --startup-timeout 200 --request-timeout 120 --settle-cap-s 30 \
    --out $R/hicache_prefix_$MODE.json --log-dir $R 2>&1 | tail -30 | tee -a "$SUMMARY"
rc=${PIPESTATUS[0]}
result hicache_prefix_flash mode=$MODE rc=$rc
tar -czf "$OUT/all.tgz" --exclude="*_hit_trace" -C $R . 2>/dev/null   # the trace stays: its summary is in the JSON
exit $rc

#!/usr/bin/env bash
# H200 (one GPU), one device call: where one L3 (file) hit's time goes (issue 14, docs/hicache.md "What an
# L3 hit costs"). benchmarks/hicache_l3_hit.py on the tiny checkpoint: server A writes a 32K prefix
# (page 64, write_through, wait_complete) and is stopped; server B on the same directory serves, REPS
# times, the prompt after a /flush_cache (an L3 hit) and then again (a device hit of the same prompt),
# each equal to A's cold run. B logs one line per prefetch (runtime/hicache_prefetch.py): queue, query,
# wait for the read, read (KV µs/page), wait for the scheduler, total. In the same process, on this
# host's CPU: a plain read of the page files, and SGLang's generic page read against the plugin's batched
# one, alone and beside a thread spinning in Python (the session-14 H200 L3 hit: 1,272 ms, 171 % of cold).
#   * tiny checkpoint with --context-length 65536 and SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1 (timings
#     only), io `kernel`, --mem-fraction-static 0.3, --disable-cuda-graph;
#   * PREFIX (32768) and REPS (2: the first L3 hit of a fresh server B may pay first-use costs);
#   * VARIANTS (default `after=.`): with time to spare (one more server start, ~60 s more),
#     VARIANTS="spin=.@SGLANG_DSV41_HICACHE_PREFETCH_WAIT_MS=0 after=." also serves B with SGLang's spinning
#     loop (the plugin's batched read kept), the before of the loop's wait.
# Run from the checkout root with `.gpu` carried:
#   BUDGET=290 bash scripts/gpu/hicache_l3_hit.sh
# Results: $OUT/all.tgz (JSON, server logs), $OUT/summary.txt. rc 0 = every L3 hit came from storage and
# every hit equals the cold run. Read in summary.txt: the `l3` and `device` medians of `after`, the
# prefetch lines' `total` (the prefetch) against l3 − device, and the roofline's µs/page beside the spinner.
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
BUDGET=${BUDGET:-290}
gpu_setup
CK=/tmp/tiny; R=/tmp/hicache_l3_hit; rm -rf $R; mkdir -p $R
tiny_checkpoint $CK || exit 4
result checkpoint
timeout -s TERM -k 20 "$(left 30)" python3 benchmarks/hicache_l3_hit.py --model-path $CK --device cuda \
    --tokens "${PREFIX:-32768}" --reps "${REPS:-2}" $(for v in ${VARIANTS:-after=.}; do printf -- '--variant %s ' "$v"; done) \
    --flags="--hicache-io-backend kernel --hicache-ratio 4 --swa-full-tokens-ratio 1.0 --mem-fraction-static 0.3 \
--disable-cuda-graph" \
    --startup-timeout 150 --request-timeout 120 \
    --out $R/hicache_l3_hit_h200.json --log-dir $R 2>&1 | tail -60 | tee $R/summary.txt
rc=${PIPESTATUS[0]}
result hicache_l3_hit rc=$rc
tar -czf "$OUT/all.tgz" -C $R . && cp $R/summary.txt "$OUT/" 2>/dev/null
exit $rc

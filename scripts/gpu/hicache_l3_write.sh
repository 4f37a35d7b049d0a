#!/usr/bin/env bash
# H200 (one GPU), one device call (issue 14, branch l3write): the rate at which one long prompt's pages
# reach the HiCache `file` tier (benchmarks/hicache_l3_write.py; docs/hicache.md "L3 write throughput").
#   1. page 2 (the old default, now given explicitly), the flags of scripts/gpu/hicache_prefix.sh, with a
#      no-server probe first: µs per page file through SGLang's HiCacheFile in /tmp, alone and beside a
#      thread spinning in Python (tells a slow file system from GIL contention);
#   2. the plugin's default with a storage backend (page 64), a 32K prompt;
#   3. page 2 + --sleep-on-idle (the idle scheduler blocks instead of spinning: the GIL question in a server;
#      last, so a slow start-up cuts this one).
# Each case starts its own server on the tiny checkpoint (--context-length 40960, timings only).
# Run from the checkout root with `.gpu` carried:
#   BUDGET=290 bash scripts/gpu/hicache_l3_write.sh   (CASES="default page2_sleep" runs a subset;
#   FS_PROBE_FILES sizes the probe: at 30 ms a file beside a spinning thread, 2000 files take 60 s)
# Results: $OUT/*.json, $OUT/summary.txt, server logs in $OUT/all.tgz. A pass: case 2 ("default") reports
# "page_size": 64 and "complete": true (every KV page of the 32K prompt stored) with tokens_per_s far above
# case 1's; the probe (case 1's "fs_probe") and case 3 say where case 1's per-file time goes: record the
# three rates and the probe in docs/hicache.md "L3 write throughput".
set -uo pipefail
source "$(dirname "$0")/lib.sh"
: "${BUDGET:=290}" "${CASES:=page2 default page2_sleep}"
gpu_setup
export SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1
CK=/tmp/tiny; R=/tmp/hicache_l3w; rm -rf $R; mkdir -p $R
tiny_checkpoint $CK || exit 4
F="--hicache-io-backend kernel --hicache-storage-prefetch-policy wait_complete --context-length 40960 \
--mem-fraction-static 0.3 --disable-cuda-graph"
one() {  # name, prompt tokens, cap s, extra benchmark args...
  local name=$1 n=$2 cap=$3; shift 3
  echo "RESULT $name start at $((SECONDS - T0)) s"
  timeout -s TERM -k 30 "$(left 10)" python3 benchmarks/hicache_l3_write.py --model-path $CK --device cuda \
      --prompt-tokens "$n" --cap-s "$cap" --quiet-s 3 --poll-s 0.1 --startup-timeout 150 \
      --out "$OUT/$name.json" --log "$R/$name.log" "$@" 2>&1 | tail -22
  echo "RESULT $name rc=${PIPESTATUS[0]} at $((SECONDS - T0)) s"
}
{
  for c in $CASES; do case $c in
    page2)       one page2 8192 40 --page-size 2 --fs-probe "${FS_PROBE_FILES:-2000}" --flags="$F" ;;
    default)     one default 32768 60 --flags="$F" ;;
    page2_sleep) one page2_sleep 8192 40 --page-size 2 --flags="$F --sleep-on-idle" ;;
  esac; done
} 2>&1 | tee $R/summary.txt
cp $R/summary.txt "$OUT/"
tar -czf "$OUT/all.tgz" -C $R . 2>/dev/null
exit 0

#!/usr/bin/env bash
# H200 (one GPU), one device call (issue 14, branches l3write, l3gil): the rate at which one long prompt's pages
# reach the HiCache `file` tier (benchmarks/hicache_l3_write.py; docs/hicache.md "L3 write throughput",
# "L3 and the GIL"). SGLANG_DSV41_HICACHE_SWITCH_INTERVAL_MS=0.2 (opt-in, runtime/hicache_gil.py) gives the
# scheduler process a 0.2 ms switch interval when a storage backend is configured; unset keeps CPython's 5 ms.
#   1. page2: page 2 (given explicitly) with SGLANG_DSV41_HICACHE_SWITCH_INTERVAL_MS=0.2, an 8K prompt, with a no-server probe first: µs per page file through
#      SGLang's HiCacheFile in /tmp, alone and beside a thread spinning in Python, at 5 ms and at 0.2 ms;
#   2. default: the plugin's default with a storage backend (page 64, 5 ms), a 32K prompt;
#   3. page2_off: case 1 without the opt-in (the session-14 state: 23 files/s).
# Each case starts its own server on the tiny checkpoint (--context-length 40960, timings only). The
# benchmark stops its server's whole process group on SIGTERM / exit (serving_client.Proc), and each case
# first checks that no server of an earlier case is left (`left_over`).
# Run from the checkout root with `.gpu` carried:
#   BUDGET=290 bash scripts/gpu/hicache_l3_write.sh   (CASES="default page2" runs a subset;
#   FS_PROBE_FILES sizes the probe, default 300)
# Results: $OUT/*.json, $OUT/summary.txt, server logs in $OUT/all.tgz. A pass: every case rc=0 with
# "complete": true; page2's "switch_interval_log" says "-> 0.200 ms" and its files_per_s is at least 10x
# session 14's 23 files/s (>= 230) while page2_off stays near 23; the probe's
# spinning_thread_us_per_file_switch_0.2ms is far below spinning_thread_us_per_file (30 ms in session 14);
# no "LEFT OVER" line. Record the rates and the probe in docs/hicache.md "L3 and the GIL".
set -uo pipefail
source "$(dirname "$0")/lib.sh"
: "${BUDGET:=290}" "${CASES:=page2 default page2_off}"
gpu_setup
export SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1
CK=/tmp/tiny; R=/tmp/hicache_l3w; rm -rf $R; mkdir -p $R
tiny_checkpoint $CK || exit 4
F="--hicache-io-backend kernel --hicache-storage-prefetch-policy wait_complete --context-length 40960 \
--mem-fraction-static 0.3 --disable-cuda-graph"
left_over() {  # a server of an earlier case still running? (the session-14 leak)
  local p c
  for p in /proc/[0-9]*; do
    c=$(tr '\0' ' ' <"$p/cmdline" 2>/dev/null) || continue
    case $c in *"sglang_dsv41.cli serve"*|*"sglang.launch_server"*) echo "LEFT OVER before $1: ${p#/proc/} ${c:0:160}" ;; esac
  done
}
one() {  # name, prompt tokens, cap s, extra benchmark args...
  local name=$1 n=$2 cap=$3; shift 3
  left_over "$name"
  echo "RESULT $name start at $((SECONDS - T0)) s"
  timeout -s TERM -k 30 "$(left 10)" python3 benchmarks/hicache_l3_write.py --model-path $CK --device cuda \
      --prompt-tokens "$n" --cap-s "$cap" --quiet-s 3 --poll-s 0.1 --startup-timeout 150 \
      --out "$OUT/$name.json" --log "$R/$name.log" "$@" 2>&1 | tail -22
  echo "RESULT $name rc=${PIPESTATUS[0]} at $((SECONDS - T0)) s"
}
{
  for c in $CASES; do case $c in
    page2)     SGLANG_DSV41_HICACHE_SWITCH_INTERVAL_MS=0.2 one page2 8192 40 --page-size 2 --fs-probe "${FS_PROBE_FILES:-300}" --flags="$F" ;;
    default)   one default 32768 60 --flags="$F" ;;
    page2_off) SGLANG_DSV41_HICACHE_SWITCH_INTERVAL_MS=off one page2_off 8192 30 --page-size 2 --flags="$F" ;;
  esac; done
  left_over end
} 2>&1 | tee $R/summary.txt
cp $R/summary.txt "$OUT/"
tar -czf "$OUT/all.tgz" -C $R . 2>/dev/null
exit 0

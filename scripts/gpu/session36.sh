#!/usr/bin/env bash
# H200 (or H100), three or four device calls chained within 30 s of each other (issue 21 item 4, session 36):
# the end-to-end serving benchmark with SGLang 0.5.17's own DeepSeek-V4-Flash server as the same-run
# baseline (`serving_e2e.sh`, 4 layers, dummy weights, 1K in / 256 out, C = 1 / 16 / 64, decode graphs
# 1 / 16 / 64 for both servers).
#
# The runtime is `.gpu_v4` (the project's runtime plus SGLang's V4 extras, 91 MiB in two parts: carried by the
# first two calls). SGLang's JIT cache travels as `.gpu_jit/` in the first call. Session 36 built it on the CPU
# machine (`benchmarks/sglang_jit_prebuild.py --cache-dir /tmp/sglang_jit`: the tvm-ffi modules, sm_90a, no GPU
# needed; `benchmarks/sglang_jit_cache.py pack`), so its server compiled only DeepGEMM, TileLang and Triton
# kernels. The `sglang` call's pack, with those as well, is `.gpu_jit/` since (docs/sglang_v4_jit.md).
#
#   1. carry .gpu_v4/bin, .gpu_v4/site/extra-*.part00 and .gpu_jit:  bash scripts/gpu/session36.sh stage
#   2. carry .gpu_v4/bin, .gpu_v4/site/base-*.part00:                 bash scripts/gpu/session36.sh sglang
#   3. carry .gpu_v4/bin:                                             bash scripts/gpu/session36.sh ours
#   (sglang again on the warm machine when its server was not up in call 2; its JIT cache is kept in /tmp)
#   `ours_host` instead of `ours`: our server with device and with host Engram tables, one after the other;
#   then, on the same warm machine: `sglang_rerun` and `ours_rerun` (C = 16 / 64 again: session 36's first
#   C = 64 level of each server JIT-compiled inside the timed level)
#
# Each call's results come back as $OUT/summary.txt and $OUT/results_<mode>.tar.gz (serving_e2e.json,
# routing_spread.json, e2e/: per-label JSON, server logs, the start-up watcher); `sglang` also returns the JIT
# cache packed so far ($OUT/jit, parts + manifest) for a later session's `.gpu_jit/`.
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
MODE=${1:?usage: session36.sh stage|sglang|ours}
export GPU_DIR=.gpu_v4 OUT
case $MODE in
  stage)
    (gpu_setup); echo "setup-rc=$? (3: parts staged, expected here)" | tee "$OUT/summary.txt"
    [ -d .gpu_jit ] && timeout 120 python3 benchmarks/sglang_jit_cache.py restore /tmp/sglang_jit .gpu_jit | tee -a "$OUT/summary.txt"
    exit 0 ;;
  sglang)
    GRAPH_BS="1 16 64" STEPS="prep sglang jitpack" SGLANG_STARTUP_S=${SGLANG_STARTUP_S:-330} BUDGET=${BUDGET:-580} \
      bash scripts/gpu/serving_e2e.sh ;;
  ours)
    GRAPH_BS="1 16 64" STEPS="prep ours" BUDGET=${BUDGET:-500} bash scripts/gpu/serving_e2e.sh ;;
  sglang_rerun)     # the same server again on the warm machine (caches kept), C = 16 / 64 only
    CONC="16 64" SGLANG_STARTUP_S=240 BUDGET=${BUDGET:-420} PREBUILD=0 GRAPH_BS="1 16 64" STEPS="sglang" \
      bash scripts/gpu/serving_e2e.sh ;;
  ours_host)        # the Engram tables in pinned host memory against `ours` (the issue's <= 3 % decode target)
    GRAPH_BS="1 16 64" STEPS="prep ours ours_host" BUDGET=${BUDGET:-580} bash scripts/gpu/serving_e2e.sh ;;
  ours_rerun)
    CONC="16 64" OURS_STARTUP_S=200 BUDGET=${BUDGET:-300} GRAPH_BS="1 16 64" STEPS="ours" bash scripts/gpu/serving_e2e.sh ;;
  *) echo "unknown mode $MODE"; exit 2 ;;
esac
rc=$?
(cd "$OUT" && tar czf "results_$MODE.tar.gz" --ignore-failed-read serving_e2e.json routing_spread.json e2e 2>/dev/null
 rm -rf e2e serving_e2e.json serving_e2e.png routing_spread.json)
ls -R "$OUT"
exit $rc

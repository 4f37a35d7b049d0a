#!/usr/bin/env bash
# H200 (one GPU), one device call (issue 21 items 3-4, issue 16 "Benchmark"): the end-to-end serving
# benchmark of benchmarks/serving_e2e.py — a 4-layer full-width DeepSeek-V4.1-Flash served by plain
# `python -m sglang.launch_server --load-format dummy` from a config-only directory (config.json +
# tokenizer; the weights are generated on the GPU at load, runtime/dummy_weights.py), against SGLang
# 0.5.17's own DeepSeek-V4-Flash at the same layer count with dummy weights, driven by the same client
# (random ids, 1K in / 256 out, concurrency 1 / 16 / 64): output tokens/s, TTFT, ITL and their ratios.
#
# Steps (STEPS, in this order, default "prep ours sglang"):
#   prep    the two model directories (serving_e2e.py model-dirs, ~15 s) and the routing spread of the
#           dummy routers on the GPU ($OUT/routing_spread.json: distinct experts per step vs uniform);
#   ours    our server, the client, stop. With dspark in STEPS the levels are 1 8 16 32 64 (no-spec
#           baseline of the DSpark variant at 8 / 32 too);
#   ours_host  the same server with the Engram tables in pinned host memory (SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE=1,
#           label ours_engram_host): the issue's host-against-device target (<= 3 % decode, <= 5 % prefill);
#   ours_b2k   the same server with prefill graph buckets to 2,048 tokens and the default chunked prefill: a prompt
#           of up to 2,048 tokens alone replays one graph instead of running eagerly (session 41: the default's question);
#   ours_c2k   the same server with chunked prefill and prefill graph buckets to 2,048 tokens (the tiny server's
#           latency recipe, docs/prefill_graphs.md) — with IN_LEN well above 2,048 it answers whether that
#           recipe costs long-prompt prefill throughput at Flash width;
#   ours_overlap  the same server with the side stream (SGLANG_DSV41_OVERLAP=on, runtime/overlap.py: mHC
#           coefficients, shared expert and Engram rows forked beside the main chain at <= 256 tokens) — run
#           next to `ours` on the same machine, it decides the switch's default;
#   dspark  our server + its bundled drafter, --speculative-algorithm DSPARK (block 5), synthetic
#           acceptance SGLANG_SIMULATE_ACC_LEN=${ACC_LEN:-3.51} (benchmarks only; verify-all), levels 1 8 32;
#   sglang  SGLang's DeepseekV4ForCausalLM (V4-Flash widths, 4 layers, dummy, marlin MXFP4 experts). Needs
#           the GPU runtime built with EXTRA (tilelang, deep-gemm: benchmarks/sglang_v4_baseline.py's
#           docstring) — without tilelang it is skipped with the reason; its CUDA-graph capture JIT-compiles
#           for minutes on a fresh machine (session 4: 55 s at bs 1, 511 s at bs 256), so run it on a
#           machine that is still warm or give it SGLANG_STARTUP_S (default 200) — JIT caches in
#           /tmp/sglang_jit (kept while the machine stays warm). SGLANG_SIMULATE_UNIFORM_EXPERTS=1 (SGLang's
#           benchmark switch, srt/layers/moe/topk.py; SGLANG_UNIFORM=0 turns it off) spreads its routing the way
#           our dummy routers spread (routing_spread.json): SGLang's dummy routers concentrate on a few experts,
#           which would let it read far fewer expert bytes per step than real routing.
#           GPU_DIR=.gpu_v4 picks a runtime built with those extras (lib.sh). A watcher (watch_sglang) logs the
#           start-up to $OUT/e2e/sglang_watch.log and, if the server is not up by SGLANG_STARTUP_S − 15 s, makes
#           the scheduler dump its Python stacks into the server log (SIGABRT, PYTHONFAULTHANDLER=1).
#           With .gpu_jit/ carried (parts of an earlier `jitpack`, copied there on the CPU machine) the cache
#           is restored first (benchmarks/sglang_jit_cache.py restore; parts may come over several calls).
#           PREBUILD=1 (default; 0 = off): right before the server, benchmarks/sglang_jit_prebuild.py builds
#           SGLang's tvm-ffi JIT modules (Marlin-MoE first) in the background into the same cache
#           ($PREBUILD_JOBS workers, default 16, niced, its own process group, capped by the step's budget,
#           log $OUT/e2e/sglang_jit_prebuild.log, summary .json); the server starts at once and finds the
#           .so or waits on tvm-ffi's lock. After the step it is stopped if still running, and a dry run
#           lists the cache directories it does not know ($OUT/e2e/sglang_jit_prebuild_after.json).
#   jitpack /tmp/sglang_jit packed into $OUT/jit (<= 4 parts of 14 MiB + manifest; PACK_RESERVE_S, default 50,
#           is kept back from the sglang step for it), so a later session starts with the kernels built so far.
#   report  $OUT/serving_e2e.json + .png (always run at the end when any client ran).
# Lead's order: STEPS="prep ours" first (~150 s), then STEPS="prep sglang" (warm machine), then
# STEPS="prep ours dspark". Every wait is capped; the script stops starting steps past BUDGET (s,
# default 300). Knobs: CONC (override levels), LAYERS (4), IN_LEN (1024), OUT_LEN (256), ROUNDS (2),
# GRAPH_BS (decode graph batch sizes of both servers, e.g. "1 16 64": SGLang's V4 JIT compiles kernels per size;
# default: --cuda-graph-max-bs 64), OURS_EXTRA (more server arguments of ours, e.g. prefill buckets), OURS_STARTUP_S (300: on a fresh machine our server compiles its Triton kernels in the prefill-graph capture and was not up after 150 s in session 36), SGLANG_STARTUP_S (200), MEM (0.85), DSPARK_MEM (0.7: the drafter's ~8 GB load after
# the target's pool, its stored tensors on the GPU while they convert), ACC_LEN (3.51).
# Outputs in $OUT: summary.txt, serving_e2e.json/.png, routing_spread.json, e2e/<label>.json and
# e2e/<label>_server.log (the lead copies serving_e2e.json/.png to benchmarks/results/).
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
mkdir -p "$OUT/e2e"
BUDGET=${BUDGET:-300}; SUMMARY=$OUT/summary.txt
gpu_setup
STEPS=${STEPS:-prep ours sglang}; LAYERS=${LAYERS:-4}; M=/tmp/e2e_models
IN_LEN=${IN_LEN:-1024}; OUT_LEN=${OUT_LEN:-256}; ROUNDS=${ROUNDS:-2}; MEM=${MEM:-0.85}
CTX=$(( (IN_LEN + OUT_LEN + 64 + 255) / 256 * 256 ))
if [ -n "${GRAPH_BS:-}" ]; then read -ra GRAPH <<<"--cuda-graph-bs-decode $GRAPH_BS"; else GRAPH=(--cuda-graph-max-bs 64); fi
case " $STEPS " in *" jitpack "*) RESERVE=${PACK_RESERVE_S:-50} ;; *) RESERVE=0 ;; esac
JIT=/tmp/sglang_jit
CLIENT="python3 benchmarks/serving_e2e.py client --out-dir $OUT/e2e --input-len $IN_LEN --output-len $OUT_LEN --rounds $ROUNDS"
OURS=(python3 -m sglang.launch_server --model-path $M/dsv41 --load-format dummy --context-length $CTX
      --max-running-requests 64 "${GRAPH[@]}" --random-seed 0 --language-model-only ${OURS_EXTRA:-})
BUCKETS_2K=(--cuda-graph-bs-prefill 4 8 16 32 64 128 256 512 1024 2048)   # ours_b2k, ours_c2k
case " $STEPS " in *" dspark "*) OURS_CONC=${CONC:-1 8 16 32 64} ;; *) OURS_CONC=${CONC:-1 16 64} ;; esac
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader | tee "$OUT/summary.txt"
# watch_sglang LOG STARTUP_S: while SGLang's server starts, every WATCH_EVERY s (default 30) the busiest
# processes, how many compilers (nvcc / cicc / ptxas / gcc) run and the JIT cache sizes go to LOG — JIT
# work or a hang. Once STARTUP_S − 15 s have passed without a healthy server, SIGABRT to its scheduler
# (started with PYTHONFAULTHANDLER=1) writes every thread's Python stack into the server log.
watch_sglang() {
  local log=$1 until=$(( SECONDS + $2 - 15 )) up=0
  while [ $SECONDS -lt $until ]; do
    sleep "${WATCH_EVERY:-30}"
    grep -q "ready to roll" "$OUT/e2e/sglang_v4_server.log" 2>/dev/null && { up=1; break; }
    { echo "== $(date -u +%T) +$SECONDS s compilers: $(pgrep -c -f 'nvcc|cicc|ptxas|gcc|g\+\+' 2>/dev/null || echo 0)"
      ps -eo pid,etimes,pcpu,rss,args --sort=-pcpu 2>/dev/null | head -8 | cut -c1-200
      du -sm "$JIT" /tmp/cache 2>/dev/null
      tail -1 "$OUT/e2e/sglang_v4_server.log" 2>/dev/null | cut -c1-200; } >>"$log"
  done
  if [ $up = 0 ]; then
    for p in $(pgrep -f 'sglang::scheduler' 2>/dev/null); do kill -ABRT "$p" && echo "SIGABRT to scheduler $p" >>"$log"; done
  fi
}
ran=0
for step in $STEPS; do
  [ "$(left)" -lt 30 ] && { echo "$step: skipped, $(left) s left" | tee -a "$OUT/summary.txt"; continue; }
  case $step in
    prep) rc=0; { [ -f $M/sglang_v4/tokenizer.json ] && grep -q "\"num_hidden_layers\": $LAYERS," $M/dsv41/config.json; } ||
          timeout "$(cap 90)" python3 benchmarks/serving_e2e.py model-dirs $M --layers "$LAYERS" &&
          timeout "$(cap 60)" python3 -m sglang_dsv41.runtime.routing_spread $M/dsv41 --device cuda \
            --batches 1 16 64 256 --out "$OUT/routing_spread.json" | python3 -c \
            'import json,sys; d=json.load(sys.stdin); [print("routing spread N=%d: %.1f distinct experts (uniform %.1f)" % (r["tokens"], r["distinct_experts"], r["uniform_expectation"])) for r in d["per_batch"]]' \
            | tee -a "$OUT/summary.txt" || rc=$? ;;
    ours|ours_host|ours_b2k|ours_c2k|ours_overlap) s=${OURS_STARTUP_S:-300}; b=$(( $(cap $((s + 150))) - 15 - RESERVE ))
          label=$step; envx=(); extra=()
          [ "$step" = ours_host ] && { label=ours_engram_host; envx=(SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE=1); }
          [ "$step" = ours_overlap ] && envx=(SGLANG_DSV41_OVERLAP=on)
          [ "$step" = ours_c2k ] && extra=(--chunked-prefill-size 2048 "${BUCKETS_2K[@]}")
          [ "$step" = ours_b2k ] && extra=("${BUCKETS_2K[@]}")
          env "${envx[@]}" timeout $((b + 10)) $CLIENT --label "$label" --budget-s $b --startup-s "$s" --concurrency $OURS_CONC \
            -- "${OURS[@]}" "${extra[@]}" --mem-fraction-static $MEM
          rc=$?; ran=1 ;;
    dspark) s=${OURS_STARTUP_S:-300}; b=$(( $(cap $((s + 120))) - 15 ))
          SGLANG_SIMULATE_ACC_LEN=${ACC_LEN:-3.51} timeout $((b + 10)) $CLIENT --label ours_dspark --budget-s $b \
            --startup-s "$s" --concurrency ${DSPARK_CONC:-1 8 32} -- "${OURS[@]}" \
            --speculative-algorithm DSPARK --speculative-dspark-block-size 5 --mem-fraction-static ${DSPARK_MEM:-0.7}
          rc=$?; ran=1 ;;
    sglang) python3 -c 'import tilelang' 2>/dev/null || {
              echo "sglang: skipped: tilelang missing (build the GPU runtime with EXTRA, sglang_v4_baseline.py)" \
                | tee -a "$OUT/summary.txt"; continue; }
          if [ -d .gpu_jit ]; then
            timeout "$(cap 120)" python3 benchmarks/sglang_jit_cache.py restore $JIT .gpu_jit | tee -a "$OUT/summary.txt"
          fi
          envs=$(python3 -c 'import sys; sys.path.insert(0, "benchmarks"); import importlib.util as u
from sglang_v4_baseline import sglang_env; import sglang_jit_cache as j; from pathlib import Path
e = {**sglang_env(u.find_spec("deep_gemm") is not None), **j.jit_cache_env(Path("'"$JIT"'"))}
print(" ".join(f"{k}={v}" for k, v in e.items()))')
          echo "sglang env: $envs" | tee -a "$OUT/summary.txt"
          s=${SGLANG_STARTUP_S:-200}; b=$(( $(cap $((s + 150))) - 15 - RESERVE ))
          PREBUILD_PID=
          if [ "${PREBUILD:-1}" = 1 ]; then
            start_server "$OUT/e2e/sglang_jit_prebuild.log" timeout "$b" nice -n 5 python3 benchmarks/sglang_jit_prebuild.py \
              --jobs "${PREBUILD_JOBS:-16}" --cache-dir "$JIT" --summary "$OUT/e2e/sglang_jit_prebuild.json"
            PREBUILD_PID=$SERVER_PID; echo "sglang: JIT prebuild started (group $PREBUILD_PID)" | tee -a "$OUT/summary.txt"
          fi
          watch_sglang "$OUT/e2e/sglang_watch.log" "$s" </dev/null >/dev/null 2>&1 &
          WATCHER=$!
          env $envs PYTHONFAULTHANDLER=1 SGLANG_SIMULATE_UNIFORM_EXPERTS=${SGLANG_UNIFORM:-1} timeout $((b + 10)) $CLIENT --label sglang_v4 --budget-s $b --startup-s "$s" --concurrency ${CONC:-1 16 64} -- \
            python3 -m sglang.launch_server --model-path $M/sglang_v4 --load-format dummy --trust-remote-code \
            --context-length $CTX --mem-fraction-static $MEM --max-running-requests 64 "${GRAPH[@]}" \
            --moe-runner-backend marlin --swa-full-tokens-ratio 1.0 --sampling-backend pytorch \
            --cuda-graph-backend-prefill disabled --random-seed 0
          rc=$?; ran=1; pkill -P "$WATCHER" 2>/dev/null; kill "$WATCHER" 2>/dev/null; wait "$WATCHER" 2>/dev/null
          if [ -n "$PREBUILD_PID" ]; then
            kill -TERM -- "-$PREBUILD_PID" 2>/dev/null
            for _ in 1 2 3 4 5 6 7 8 9 10; do any_alive "$PREBUILD_PID" || break; sleep 1; done
            kill -KILL -- "-$PREBUILD_PID" 2>/dev/null; wait "$PREBUILD_PID" 2>/dev/null
            grep -e "^\[prebuild\] done" -e " error " -e " timeout " "$OUT/e2e/sglang_jit_prebuild.log" | tail -6 | tee -a "$OUT/summary.txt"
            timeout "$(cap 60)" python3 benchmarks/sglang_jit_prebuild.py --cache-dir "$JIT" --dry-run \
              --summary "$OUT/e2e/sglang_jit_prebuild_after.json" 2>/dev/null | tail -1 | tee -a "$OUT/summary.txt"
          fi ;;
    jitpack) timeout "$(cap 120)" python3 benchmarks/sglang_jit_cache.py pack $JIT "$OUT/jit" | tee -a "$OUT/summary.txt"
          rc=${PIPESTATUS[0]} ;;
    *) echo "unknown step $step"; continue ;;
  esac
  result "$step" rc=$rc
done
if [ $ran = 1 ]; then
  timeout 60 python3 benchmarks/serving_e2e.py report "$OUT/e2e" --out "$OUT/serving_e2e.json" | tail -40 | tee -a "$OUT/summary.txt"
fi
grep -h -e "dummy weights" -e "up after" "$OUT"/e2e/*_server.log 2>/dev/null | head -4 | tee -a "$OUT/summary.txt"
for log in "$OUT"/e2e/*_server.log; do graph_summary "$(basename "$log" _server.log)" "$log"; done
result "done"

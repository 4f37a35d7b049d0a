# shellcheck shell=bash
# The preamble and helpers shared by the device scripts in scripts/gpu/. Sourced, never run: the
# scripts start with `set -uo pipefail` and `source "$(dirname "$0")/lib.sh"` (run from the checkout
# root as `bash scripts/gpu/X.sh`). Sourcing it sets OUT (default /tmp/out, made), T0 (the start,
# for `left` and `result`) and an EXIT trap that stops every group started by `start_server`.
# Every wait here is capped.
#
#   left [RESERVE]   seconds of BUDGET left since T0, less RESERVE; at least 1, so a `timeout`
#                    never gets 0 (no limit) or a negative duration
#   cap N            N, or when less is left, what is left less 5 s (at least 1)
#   gpu_setup        source $GPU_DIR/bin/setup.sh (GPU_DIR default .gpu; e.g. .gpu_v4, a runtime built
#                    with SGLang's V4 extras) (exit 3 when it fails); XDG_CACHE_HOME=/tmp/cache,
#                    HF_HUB_OFFLINE=1
#   gpu_start        mkdir $OUT/logs, `gpu_setup`, then the GPU's name and clocks as the first line of $SUMMARY
#   tiny_checkpoint [DIR [CAP]]
#                    the tiny checkpoint (seed 0) in DIR (default /tmp/tiny): reused when DIR holds
#                    a complete one (tiny_checkpoint_ok.py), else written with --overwrite (a warm
#                    machine keeps /tmp between calls; make-checkpoint refuses a non-empty DIR
#                    without it); CAP s (default 120) for both; non-zero when it is not there
#   start_server LOG CMD...
#                    CMD in a process group of its own (setsid), stdout and stderr to LOG;
#                    SERVER_PID is its pid (= the group), kept in SERVERS
#   stop_servers     TERM every started group, up to STOP_GRACE s (15) for them to go, then KILL
#                    what is left (and up to 5 s more for that); SERVERS is emptied
#   wait_up URL SECONDS [PID]
#                    0 once URL answers with a 2xx (curl -sf); 1 after SECONDS, or once PID exited
#   result TEXT...   the line "RESULT TEXT at N s" (N: seconds since T0), appended to $SUMMARY
#                    too when SUMMARY is set
#   model_step LABEL "BATCHES" CAP ENV=VALUE...
#                    benchmarks/model_step.py (4 Flash-width layers, 8K context) at BATCHES under the
#                    ENV settings, at most CAP s (and what is left less 10 s; skipped below 50 s), JSON in
#                    $OUT/model_step_LABEL, log in $OUT/logs; prints its RESULT and JSON lines;
#                    MODEL_STEP_EXTRA (e.g. --profile) is appended to its arguments
#   prefill_profile "VARIANTS" CAP [TOKENS]
#                    one process of benchmarks/decode_step.py --quick --no-decode --profile-prefill: the 8K
#                    prefill of Flash layer 2 by component for VARIANTS (benchmarks/prefill_profile.py), at
#                    most CAP s (`cap`), JSON in $OUT, log $OUT/logs/prefill.log; prints its RESULT and the
#                    variants' summary lines; returns its status. With TOKENS: a prefill of that many tokens
#                    (--prefill-tokens), JSON in $OUT/prefill_TOKENS, log $OUT/logs/prefill_TOKENS.log
#   prefill_host CAP TOKENS
#                    `prefill_profile default CAP TOKENS` with its lines appended to $SUMMARY, then the host profile
#                    it logged (the cProfile lines after its "prefill default" line) appended too
#   graph_summary NAME LOG
#                    a server log's CUDA-graph lines, each prefixed "NAME: ": how many prefill batches ran
#                    graphed and eagerly, the capture-end lines and our first prefill replay; appended to
#                    $SUMMARY too when SUMMARY is set
#   tests_result NAME JUNIT RC [EXPECTED]
#                    the verdict of a pytest run (scripts/gpu/junit_verdict.py: rc 0 and the junit's
#                    test count = the collected count (or EXPECTED), no failure / error / interrupted
#                    entry) as `result NAME rc=RC pass` or `result NAME rc=RC FAIL: reasons`; status 0
#                    only for a pass. A killed run (rc 124 / 137) is never a pass.
: "${OUT:=/tmp/out}"; mkdir -p "$OUT"
T0=$SECONDS
GPU_LIB_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
SERVERS=()
SERVER_PID=

left() {
  local l=$((BUDGET - (SECONDS - T0) - ${1:-0}))
  if [ "$l" -gt 1 ]; then echo "$l"; else echo 1; fi
}

cap() {
  local l; l=$(left)
  if [ "$1" -lt "$l" ]; then echo "$1"; elif [ "$l" -gt 5 ]; then echo $((l - 5)); else echo 1; fi
}

gpu_setup() {
  # shellcheck source=/dev/null
  source "${GPU_DIR:-.gpu}/bin/setup.sh" || exit 3
  export XDG_CACHE_HOME=/tmp/cache HF_HUB_OFFLINE=1
}

gpu_start() {
  mkdir -p "$OUT/logs"
  gpu_setup
  nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader | tee "$SUMMARY"
}

tiny_checkpoint() {
  local dir=${1:-/tmp/tiny} cap=${2:-120} t=$SECONDS rest
  if [ -f "$dir/model.safetensors.index.json" ] &&
     timeout "$cap" python3 "$GPU_LIB_DIR/tiny_checkpoint_ok.py" "$dir"; then
    return 0
  fi
  rest=$((cap - (SECONDS - t))); [ "$rest" -gt 1 ] || rest=1
  timeout "$rest" python3 -m sglang_dsv41.cli make-checkpoint --preset tiny --out "$dir" --quiet --overwrite
}

start_server() {
  local log=$1; shift
  setsid "$@" >"$log" 2>&1 &
  SERVER_PID=$!
  SERVERS+=("$SERVER_PID")
}

any_alive() {  # PGID...: does a process of one of these groups still run (zombies do not count)?
  local f st want=" $* "
  for f in /proc/[0-9]*/stat; do
    { read -r st <"$f"; } 2>/dev/null || continue
    st=${st##*) }                  # after the command name: state ppid pgrp ...
    read -r st _ pg _ <<<"$st"
    case $want in *" $pg "*) [ "$st" != Z ] && [ "$st" != X ] && return 0 ;; esac
  done
  return 1
}

stop_servers() {
  local p i
  [ ${#SERVERS[@]} -gt 0 ] || return 0
  for p in "${SERVERS[@]}"; do kill -TERM -- "-$p" 2>/dev/null; done
  for ((i = 0; i < ${STOP_GRACE:-15}; i++)); do any_alive "${SERVERS[@]}" || break; sleep 1; done
  for p in "${SERVERS[@]}"; do kill -KILL -- "-$p" 2>/dev/null; done
  for ((i = 0; i < 5; i++)); do any_alive "${SERVERS[@]}" || break; sleep 1; done
  SERVERS=()
}
trap stop_servers EXIT

wait_up() {
  local s0=$SECONDS rest
  while rest=$(($2 - (SECONDS - s0))); [ "$rest" -gt 0 ]; do
    curl -sf -m $((rest < 10 ? rest : 10)) -o /dev/null "$1" && return 0
    if [ -n "${3:-}" ] && ! kill -0 "$3" 2>/dev/null; then return 1; fi
    sleep 2
  done
  return 1
}

model_step() {
  local label=$1 batches=$2 b=$3; shift 3
  [ "$b" -lt $(( $(left) - 10 )) ] || b=$(( $(left) - 10 ))
  [ "$b" -gt 50 ] || { echo "model_step $label: skipped, $(left) s left"; return 0; }
  mkdir -p "$OUT/logs"
  # shellcheck disable=SC2086
  env "$@" timeout -s INT -k 10 "$b" python3 benchmarks/model_step.py --layers 4 --batches $batches \
    --context 8192 --cap-s 0.5 --budget-s $((b - 40)) ${MODEL_STEP_EXTRA:-} --out "$OUT/model_step_$label" >"$OUT/logs/model_step_$label.log" 2>&1
  result "model_step $label" rc=$?
  grep '^{' "$OUT/logs/model_step_$label.log"
}

graph_summary() {
  local name=$1 log=$2
  [ -f "$log" ] || return 0
  { echo "prefill batches cuda graph True $(grep -c 'Prefill batch.*cuda graph: True' "$log")" \
         "False $(grep -c 'Prefill batch.*cuda graph: False' "$log")"
    grep -h -e "Capture .* CUDA graph end" -e "first prefill CUDA-graph replay" "$log"
  } | sed "s/^/$name: /" | cut -c1-220 | tee -a "${SUMMARY:-/dev/null}"
}

prefill_profile() {
  local variants=$1 b tokens=${3:-} out=$OUT log=$OUT/logs/prefill.log extra=(); b=$(cap "$2")
  if [ -n "$tokens" ]; then
    out=$OUT/prefill_$tokens; log=$OUT/logs/prefill_$tokens.log; extra=(--prefill-tokens "$tokens")
  fi
  mkdir -p "$OUT/logs" "$out"
  # shellcheck disable=SC2086
  timeout -k 10 "$b" python3 benchmarks/decode_step.py --out "$out" --quick --no-decode --batches 1 \
    --profile-prefill --prefill-variants $variants "${extra[@]}" --budget-s $((b > 40 ? b - 20 : 20)) >"$log" 2>&1
  local rc=$?
  result "prefill${tokens:+ $tokens}" rc=$rc
  grep "^prefill \|^attention sweep" "$log" | tail -8
  return $rc
}

prefill_host() {  # usage above; returns prefill_profile's status
  local lines rc
  lines=$(prefill_profile default "$1" "$2"); rc=$?
  echo "$lines"
  [ -n "${SUMMARY:-}" ] && grep -v "^RESULT" <<<"$lines" >>"$SUMMARY"
  grep -A17 "^prefill default" "$OUT/logs/prefill_$2.log" 2>/dev/null | tail -17 | cut -c1-400 | tee -a "${SUMMARY:-/dev/null}"
  return $rc
}

pack_logs() {  # $OUT/tests/*.log into $OUT/logs, PNGs dropped, $OUT/logs packed as $OUT/logs.tar.gz; lists $OUT
  mkdir -p "$OUT/logs"
  mv "$OUT"/tests/*.log "$OUT/logs/" 2>/dev/null; rmdir "$OUT/tests" 2>/dev/null
  find "$OUT" -name "*.png" -delete
  (cd "$OUT" && tar czf logs.tar.gz logs 2>/dev/null; rm -rf logs)
  ls -R "$OUT"
}

result() {
  local line="RESULT $* at $((SECONDS - T0)) s"
  if [ -n "${SUMMARY:-}" ]; then echo "$line" | tee -a "$SUMMARY"; else echo "$line"; fi
}

tests_result() {
  local v st
  v=$(timeout 20 python3 "$GPU_LIB_DIR/junit_verdict.py" "$2" "$3" ${4:+"$4"} 2>&1); st=$?
  if [ "$st" = 0 ]; then
    result "$1" rc="$3" pass
  else
    result "$1" rc="$3" "FAIL: $(printf '%s' "$v" | tail -1 | cut -c1-400)"
  fi
  return "$st"
}

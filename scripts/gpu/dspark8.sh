#!/usr/bin/env bash
# H200 (one GPU), one device call (issue 16: why 1.82x and not 2.5x at concurrency 1; preemption with DSpark).
#   1. profile: the 4-layer full-width dummy server of serving_e2e.sh with its bundled drafter
#      (--speculative-algorithm DSPARK, block 5, SGLANG_SIMULATE_ACC_LEN=3.51, graphs to bs 8) and SGLang's
#      own per-step DSpark timing (SGLANG_DSPARK_DEBUG_DUMP: CUDA events around the draft proposal and the
#      target verify). benchmarks/dspark_step.py sends one 1K-in / 256-out request, prints the per-phase
#      table (draft / verify / rest of the step, host time between steps, ms a token, the speed-up it
#      implies against the plain ITL 4.65 ms), then a torch.profiler trace of 10 decode steps (/start_profile)
#      and its kernel time by name.
#   2. retract (skipped with < 110 s left): tests/test_runtime_dspark_retract_gpu.py, the tiny checkpoint
#      served plain and DSPARK with SGLANG_TEST_RETRACT=1: greedy == plain at batch 8 after retractions.
# Usage (checkout root, `.gpu` carried): bash scripts/gpu/dspark8.sh   (BUDGET s caps the call, default 290;
# STEPS="profile retract" by default)
# Outputs in $OUT: summary.txt, all.tgz (profile.log, records.json, summary.json, the trace, server logs, retract.log).
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
: "${BUDGET:=290}" "${STEPS:=profile retract}"; SUMMARY=$OUT/summary.txt
W=/tmp/dspark8_work; rm -rf $W; mkdir -p $W/logs
gpu_setup
M=/tmp/e2e_models; PORT=31878; rc=0
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader 2>&1 | sed 's/^/gpu: /' | tee "$OUT/summary.txt"
finish() {
  tar -czf "$OUT/all.tgz" -C $W . 2>/dev/null
  result dspark8 rc=$rc; exit $rc; }
for step in $STEPS; do
  case $step in
  profile)
    { [ -f $M/dsv41/config.json ] && grep -q '"num_hidden_layers": 4,' $M/dsv41/config.json; } ||
      timeout 90 python3 benchmarks/serving_e2e.py model-dirs $M --layers 4 >$W/logs/model_dirs.log 2>&1 ||
      { echo "RESULT profile rc=1 (model-dirs failed)" | tee -a "$OUT/summary.txt"; rc=1; continue; }
    SGLANG_SIMULATE_ACC_LEN=3.51 SGLANG_DSPARK_DEBUG_DUMP=core,step_cpu_time,step_gpu_time,draft_gpu_time,target_verify_gpu_time \
      start_server $W/logs/dspark_server.log python3 -m sglang.launch_server --model-path $M/dsv41 --load-format dummy \
      --context-length 1536 --max-running-requests 8 --cuda-graph-max-bs 8 --random-seed 0 --language-model-only \
      --port $PORT --speculative-algorithm DSPARK --speculative-dspark-block-size 5 --mem-fraction-static 0.7
    up=0; wait_up http://127.0.0.1:$PORT/health_generate "$(left 60)" "$SERVER_PID" && up=1
    echo "server up=$up at $((SECONDS - T0)) s" | tee -a "$OUT/summary.txt"
    grep -hE "folded into the draft|kept eager|Disable DSpark draft cuda graph|ragged-verify|Capture cuda graph end|DSpark draft loaded" \
      $W/logs/dspark_server.log | cut -c1-220 | head -8 | tee -a "$OUT/summary.txt"
    if [ $up = 1 ]; then
      timeout $(( $(left) > 130 ? 120 : $(left) - 10 )) python3 benchmarks/dspark_step.py run --url http://127.0.0.1:$PORT \
        --out $W/profile >$W/profile.log 2>&1; prc=$?
      head -60 $W/profile.log | tee -a "$OUT/summary.txt"
    else prc=1; tail -20 $W/logs/dspark_server.log | tee -a "$OUT/summary.txt"; fi
    stop_servers
    result profile rc=$prc; [ $prc = 0 ] || rc=1 ;;
  retract)
    [ "$(left)" -lt 110 ] && { echo "RESULT retract skipped: $(left) s left" | tee -a "$OUT/summary.txt"; continue; }
    timeout -s INT -k 15 "$(left 20)" python3 -m pytest -m gpu -q -s -p no:cacheprovider -rf --tb=short \
      --basetemp=$W/pt tests/test_runtime_dspark_retract_gpu.py >$W/retract.log 2>&1; trc=$?
    grep -E "DSpark retract|passed|failed|^E " $W/retract.log | head -15 | tee -a "$OUT/summary.txt"
    result retract rc=$trc; [ $trc = 0 ] || rc=1 ;;
  *) echo "unknown step $step" ;;
  esac
done
finish

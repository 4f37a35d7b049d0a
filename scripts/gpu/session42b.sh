#!/usr/bin/env bash
# H100 or H200, one device call (issue 21, session 42): the workspace decode in one launch
# (kernels/entry_decode.py) and the prefill workspace inside prefill graphs of ≥ 512 tokens. Run from the
# checkout root with `.gpu` carried:
#   BUDGET=420 bash scripts/gpu/session42b.sh
# Steps (STEPS, in this order by default):
#   tests    the GPU tests of the changed code: tests/test_kernels_entry_decode.py and
#            tests/test_runtime_prefill_graph_server_gpu.py (the tiny graph server, now with 512 / 1,024
#            buckets, against an eager one: greedy equal, replays counted)
#   probe    benchmarks/prefill_graph_probe.py on the tiny checkpoint at 512 / 600 / 1,024 new tokens, context
#            2,048: the graph (workspace path) against the eager forward, bits / greedy and wall times
#   host1k   one Flash layer's 1,024-token prefill profiled, device and host (as session42.sh's host1k)
# Results: $OUT/summary.txt, $OUT/tests.xml, $OUT/prefill_graph.json, $OUT/prefill_1024/prefill_profile.json,
# $OUT/logs/.
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
BUDGET=${BUDGET:-420}; SUMMARY=$OUT/summary.txt
gpu_start
for step in ${STEPS:-tests probe host1k}; do
  case $step in
    tests)
      timeout -s INT -k 10 "$(cap 220)" python3 -m pytest -m gpu -q -p no:cacheprovider --junitxml "$OUT/tests.xml" \
        tests/test_kernels_entry_decode.py tests/test_runtime_prefill_graph_server_gpu.py >"$OUT/logs/tests.log" 2>&1
      tests_result gpu_tests "$OUT/tests.xml" $?
      grep -E "max \|Δ log p\||passed|failed|Error" "$OUT/logs/tests.log" | tail -6 | cut -c1-300 | tee -a "$SUMMARY" ;;
    probe)
      tiny_checkpoint /tmp/tiny || continue
      timeout -s TERM -k 20 "$(cap 120)" python3 benchmarks/prefill_graph_probe.py --model-path /tmp/tiny \
        --table-width 2048 --reps 5 --cases 0 512 512 --cases 0 600 1024 --cases 0 1024 1024 \
        --out "$OUT/prefill_graph.json" >"$OUT/logs/probe.log" 2>&1
      result probe rc=$?
      grep -v -i warn "$OUT/logs/probe.log" | tail -5 | cut -c1-400 | tee -a "$SUMMARY" ;;
    host1k)
      prefill_host "${CAP_EACH:-130}" 1024 ;;
    *) echo "unknown step $step" ;;
  esac
done
find "$OUT" -name "*.png" -delete
result done

#!/usr/bin/env bash
# H200 (one GPU), one device call (issue 16, docs/dspark.md): the DSpark GPU tests with the measured
# acceptance of the tiny checkpoint under real verification.
#   * tests/test_runtime_dspark_accept_gpu.py (SGLang's sampled accept vs the oracle's chain
#     rejection, no server) runs in the background, next to
#   * tests/test_runtime_dspark_server_gpu.py: three servers started together (plain; DSPARK with
#     uniform verify; configs/tiny-h200-tp1-dspark.yaml through `sglang-dsv41 launch`, adaptive
#     verification with a trimming SPS table) — greedy == plain at batch 1 and 8, prefix hit, sampled
#     decoding, per-request acceptance and the spec counters.
# Prints per test file a RESULT line, then the acceptance lines the server tests print ("DSpark ...":
# accept length per request, mean, gauges, verify windows). Exit 0 only when both files pass.
#
# Usage (checkout root, `.gpu` carried): bash scripts/gpu/dspark7.sh   (BUDGET s caps the call, default 290)
# Outputs in $OUT: summary.txt, accept.log, server.log, dspark7_server_logs.tgz (the three servers' logs).
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
: "${BUDGET:=290}"; SUMMARY=$OUT/summary.txt
W=/tmp/dspark7_work; rm -rf $W; mkdir -p $W
gpu_setup
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader 2>&1 | sed 's/^/gpu: /' | tee "$OUT/summary.txt"
PYTEST=(python3 -m pytest -m gpu -q -p no:cacheprovider -rf --tb=short)
lim=$(left 25)   # SIGINT at the cap: pytest stops its servers (-k 20: then KILL)
timeout -s INT -k 20 "$lim" "${PYTEST[@]}" tests/test_runtime_dspark_accept_gpu.py >"$OUT/accept.log" 2>&1 &
ACC=$!
timeout -s INT -k 20 "$lim" "${PYTEST[@]}" -s --durations=0 --basetemp=$W/pt tests/test_runtime_dspark_server_gpu.py >"$OUT/server.log" 2>&1
src=$?
wait $ACC; arc=$?
echo "RESULT tests/test_runtime_dspark_accept_gpu.py rc=$arc $(tail -1 "$OUT/accept.log")" | tee -a "$OUT/summary.txt"
echo "RESULT tests/test_runtime_dspark_server_gpu.py rc=$src $(tail -1 "$OUT/server.log")" | tee -a "$OUT/summary.txt"
grep -oE "DSpark (tiny|adaptive|prefix|sampled).*|[0-9]+ (passed|failed).*|^[0-9.]+s (call|setup) .*" "$OUT/server.log" | head -24 | tee -a "$OUT/summary.txt"
for f in accept server; do
  grep -qE "(failed|error)" "$OUT/$f.log" && grep -E "^(FAILED|ERROR|E )" "$OUT/$f.log" | head -15 | tee -a "$OUT/summary.txt"
done
find $W/pt -name '*.log' -path '*dspark_servers*' -print0 2>/dev/null | tar -czf "$OUT/dspark7_server_logs.tgz" --null -T - 2>/dev/null
rc=$(( arc != 0 || src != 0 ))
result dspark7 rc=$rc
exit $rc

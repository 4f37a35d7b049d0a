#!/usr/bin/env bash
# H200 (one GPU), one device call: the tiny checkpoint served by plain `python -m sglang.launch_server`
# (plugin defaults) with room for 256 running requests, then `benchmarks/load.py --requests 256`
# (issue 20 item 3: 0 lost, 0 without [DONE], 0 garbled, identical greedy text, prefix-cache hits,
# pool back to baseline). Run from the checkout root with `.gpu` carried; every wait is capped;
# the JSON and the server log land in $OUT.
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
gpu_setup
CK=/tmp/tiny; U=http://127.0.0.1:30000
tiny_checkpoint $CK || exit 4
start_server "$OUT/load_server.log" python3 -m sglang.launch_server --model-path $CK --max-running-requests 256 \
  --enable-cache-report
up=0; S0=$SECONDS
wait_up $U/health_generate 240 "$SERVER_PID" && up=1
echo "load server up=$up after $((SECONDS - S0)) s"
rc=9
if [ $up = 1 ]; then
  timeout 300 python3 benchmarks/load.py --url $U --requests 256 --timeout-s 240 \
    --out "$OUT/load_h200.json" --label "H200, tiny checkpoint, plain launch_server" 2>&1 | tail -30
  rc=${PIPESTATUS[0]}
fi
stop_servers
[ $up = 1 ] || tail -60 "$OUT/load_server.log"
result load_256 up=$up rc=$rc

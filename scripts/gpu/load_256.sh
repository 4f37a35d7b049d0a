#!/usr/bin/env bash
# H200 (one GPU), one device call: the tiny checkpoint served by plain `python -m sglang.launch_server`
# (plugin defaults) with room for 256 running requests, then `benchmarks/load.py --requests 256`
# (issue 20 item 3: 0 lost, 0 without [DONE], 0 garbled, identical greedy text, prefix-cache hits,
# pool back to baseline). Run from the checkout root with `.gpu` carried; every wait is capped;
# the JSON and the server log land in $OUT.
set -uo pipefail
: "${OUT:=/tmp/out}"; mkdir -p "$OUT"
T0=$SECONDS
source .gpu/bin/setup.sh || exit 3
export XDG_CACHE_HOME=/tmp/cache HF_HUB_OFFLINE=1
CK=/tmp/tiny; U=http://127.0.0.1:30000
[ -d $CK ] || timeout 120 python3 -m sglang_dsv41.cli make-checkpoint --preset tiny --out $CK --quiet || exit 4
setsid python3 -m sglang.launch_server --model-path $CK --max-running-requests 256 --enable-cache-report \
  >"$OUT/load_server.log" 2>&1 & P=$!
up=0; S0=$SECONDS
while [ $((SECONDS - S0)) -lt 240 ]; do
  curl -sf -m 10 $U/health_generate >/dev/null && { up=1; break; }
  kill -0 $P 2>/dev/null || break; sleep 3
done
echo "load server up=$up after $((SECONDS - S0)) s"
rc=9
if [ $up = 1 ]; then
  timeout 300 python3 benchmarks/load.py --url $U --requests 256 --timeout-s 240 \
    --out "$OUT/load_h200.json" --label "H200, tiny checkpoint, plain launch_server" 2>&1 | tail -30
  rc=${PIPESTATUS[0]}
fi
kill -- -$P 2>/dev/null; sleep 4; kill -9 -- -$P 2>/dev/null
[ $up = 1 ] || tail -60 "$OUT/load_server.log"
echo "RESULT load_256 up=$up rc=$rc at $((SECONDS - T0)) s"

#!/usr/bin/env bash
# H200 (one GPU), one device call, ≤ 300 s (docs/pd.md "PD + DSpark"): PD 1P1D of the tiny
# checkpoint with `--speculative-algorithm DSPARK` on BOTH servers (prefill and decode sharing GPU 0,
# --mem-fraction-static 0.3 each, Mooncake over TCP on 127.0.0.1), greedy /generate for prompts of
# odd and even length (41, 42, 97: the boundary row of the pair ring travels for the odd ones) and
# the greedy output compared token for token with a colocated plain server (no speculation).
# The DSpark draft's context rows travel in kv_data (2 global buffers + 3 stages + 1 pad), the
# layout fingerprint's dspark_context must agree (printed from both logs).
#
# Usage (checkout root, `.gpu` carried, the CUDA Mooncake wheel + libibverbs1 installed):
#   bash scripts/gpu/pd_dspark.sh [equal|unequal]
#   equal    (default) both servers γ = 5 (--speculative-dspark-block-size 5);
#   unequal  prefill γ = 5 (pair ring 8), decode γ = 7 (pair ring 16): the boundary row lands in
#            each side's own ring slot; the fingerprint must still agree.
# Caps: checkpoint 60 s, each server start 120 s, each request 60 s, each shutdown 15 s; no server
# is started after BUDGET (default 200) s, so the call ends < 300 s. The client posts to both
# servers with bootstrap host/port/room (what sglang-router does; the router wheel does not fit
# the call). Outputs in $OUT: summary.txt, plain / prefill / decode logs. Exit 0 only when every
# PD output equals the plain server's.
set -uo pipefail
: "${OUT:=/tmp/out}"; mkdir -p "$OUT"
MODE=${1:-equal}
BUDGET=${BUDGET:-200}
T0=$SECONDS
source .gpu/bin/setup.sh || exit 3
export XDG_CACHE_HOME=/tmp/cache HF_HUB_OFFLINE=1
export MC_FORCE_TCP=1 MOONCAKE_PROTOCOL=tcp SGLANG_HOST_IP=127.0.0.1
python3 -c "import mooncake.engine" 2>"$OUT/pd_imports.log" || {
  cat "$OUT/pd_imports.log"; echo "RESULT pd_dspark missing the PD stack (pip install -e '.[pd-cuda]'; apt-get install libibverbs1)"; exit 5; }
case $MODE in
  equal) PG=5; DG=5 ;;
  unequal) PG=5; DG=7 ;;
  *) echo "usage: pd_dspark.sh [equal|unequal]"; exit 2 ;;
esac
CK=/tmp/tiny; W=/tmp/pd_dspark; rm -rf $W; mkdir -p $W
P=http://127.0.0.1:30010; D=http://127.0.0.1:30020; C=http://127.0.0.1:30030
timeout 60 python3 -m sglang_dsv41.cli make-checkpoint --preset tiny --out $CK --quiet || exit 4
PIDS=()
start() {  # name, args...
  local name=$1; shift
  if [ $((SECONDS - T0)) -gt "$BUDGET" ]; then echo "$name: not started (budget)" | tee -a "$OUT/summary.txt"; return 1; fi
  setsid "$@" >"$OUT/$name.log" 2>&1 & PIDS+=($!)
}
stop_all() {
  for p in "${PIDS[@]}"; do kill -- -"$p" 2>/dev/null; done
  for _ in 1 2 3 4 5; do alive=0; for p in "${PIDS[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
    [ $alive = 0 ] && break; sleep 3; done
  for p in "${PIDS[@]}"; do kill -9 -- -"$p" 2>/dev/null; done; PIDS=()
}
trap stop_all EXIT
wait_up() {  # url, seconds
  local s0=$SECONDS
  while [ $((SECONDS - s0)) -lt "$2" ]; do curl -sf -m 10 "$1" >/dev/null && return 0; sleep 2; done; return 1
}
ask() {  # out-file, url [, bootstrap room] -> /generate of the three prompts, sequential
  timeout 200 python3 - "$@" <<'PY'
import json, sys, threading, urllib.request
out, url = sys.argv[1], sys.argv[2]
pd = len(sys.argv) > 3
P = "http://127.0.0.1:30010"
def post(u, body, into):
    req = urllib.request.Request(u + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        into.append(json.load(r))
res = {}
for k, n in enumerate((41, 42, 97)):
    body = {"input_ids": [0] + [(7 * i) % 900 + 3 for i in range(n - 1)],
            "sampling_params": {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True}}
    got, side = [], []
    if pd:
        body.update(bootstrap_host="127.0.0.1", bootstrap_port=38998, bootstrap_room=int(sys.argv[3]) + k)
        t = threading.Thread(target=post, args=(P, body, side)); t.start()
    post(url, body, got)
    if pd:
        t.join(65)
    res[n] = {"output_ids": got[0]["output_ids"], "accept_length": got[0]["meta_info"].get("spec_accept_length")}
json.dump(res, open(out, "w"))
PY
}
# 1. the colocated plain reference
start plain python3 -m sglang.launch_server --model-path $CK --mem-fraction-static 0.3 --port 30030 --disable-cuda-graph
if wait_up $C/health_generate 120; then ask $W/plain.json $C || echo "plain requests failed" | tee -a "$OUT/summary.txt"
else echo "plain server not up" | tee -a "$OUT/summary.txt"; tail -30 "$OUT/plain.log"; fi
echo "plain done at $((SECONDS - T0)) s" | tee -a "$OUT/summary.txt"
stop_all
# 2. 1P1D, DSpark on both sides
SPEC=(--speculative-algorithm DSPARK --disable-cuda-graph)
COMMON=(--model-path $CK --mem-fraction-static 0.3 --disaggregation-transfer-backend mooncake)
up=0
start prefill python3 -m sglang.launch_server "${COMMON[@]}" "${SPEC[@]}" --speculative-dspark-block-size $PG \
  --port 30010 --disaggregation-mode prefill --disaggregation-bootstrap-port 38998 && \
start decode python3 -m sglang.launch_server "${COMMON[@]}" "${SPEC[@]}" --speculative-dspark-block-size $DG \
  --port 30020 --disaggregation-mode decode && \
wait_up $P/health 120 && wait_up $D/health 120 && up=1
echo "PD up=$up (prefill γ=$PG, decode γ=$DG) at $((SECONDS - T0)) s" | tee -a "$OUT/summary.txt"
if [ $up = 1 ]; then ask $W/pd.json $D 5000 || echo "PD requests failed" | tee -a "$OUT/summary.txt"; fi
grep -h -m1 "sglang-dsv41 PD layout" "$OUT/prefill.log" "$OUT/decode.log" 2>/dev/null | cut -c1-400 | tee -a "$OUT/summary.txt"
stop_all
python3 - "$W" "$MODE" <<'PY' | tee -a "$OUT/summary.txt"
import json, sys
w, mode = sys.argv[1], sys.argv[2]
try:
    plain, pd = (json.load(open(f"{w}/{t}.json")) for t in ("plain", "pd"))
except Exception as e:
    print(f"RESULT pd_dspark_{mode}_greedy_equal 0 (missing output: {e})"); sys.exit(1)
ok = True
for n, ref in plain.items():
    got = pd.get(n, {}).get("output_ids")
    eq = got == ref["output_ids"]
    ok = ok and eq and len(ref["output_ids"]) == 48
    first = None if eq or got is None else next(i for i, (a, b) in enumerate(zip(ref["output_ids"], got)) if a != b)
    print(f"n={n}: PD+DSpark == plain {eq}, decode accept length {pd.get(n, {}).get('accept_length')}"
          + ("" if eq else f", first difference at token {first}"))
print(f"RESULT pd_dspark_{mode}_greedy_equal {int(ok)}")
sys.exit(0 if ok else 1)
PY
rc=$?
[ $rc = 0 ] || { grep -nE "Error|error|Traceback|sglang-dsv41" "$OUT/prefill.log" "$OUT/decode.log" | tail -30; }
echo "RESULT pd_dspark mode=$MODE rc=$rc at $((SECONDS - T0)) s" | tee -a "$OUT/summary.txt"
exit $rc

#!/usr/bin/env bash
# H200 (one GPU), one device call, < 300 s (docs/pd.md "PD + DSpark"): PD 1P1D of the tiny
# checkpoint with `--speculative-algorithm DSPARK` on BOTH servers of a pair (prefill and decode
# sharing GPU 0, Mooncake over TCP on 127.0.0.1), greedy /generate for prompts of odd and even
# length (41, 42, 97: the boundary row of the pair ring travels for the odd ones) and the greedy
# output compared token for token with a colocated plain server (no speculation) on the same GPU.
# The DSpark draft's context rows travel in kv_data (2 global buffers + 3 stages + 1 pad), the
# layout fingerprint's dspark_context must agree (printed from both logs).
#
# Usage (checkout root, `.gpu` built with PD=1 carried: it holds the Mooncake transfer engine):
#   bash scripts/gpu/pd_dspark.sh [both|equal|unequal]
#   equal    one pair, both servers γ = 5 (--speculative-dspark-block-size 5);
#   unequal  two pairs, prefill γ = 5 (pair ring 8) → decode γ = 7 (pair ring 16) and the reverse
#            (7 → 5): the boundary row lands in each side's own ring slot, the fingerprint must still
#            agree, and a decode drafts the block of its own flag (the checkpoint's is 5); plus a
#            colocated DSpark server with γ = 7 (6 servers, 7 files back);
#   both     (default) the equal pair and the 5 → 7 pair side by side (5 servers), each checked
#            against the plain one.
# Every server starts at once (one start-up wait; --mem-fraction-static 0.12 each and a 65,536-token
# pool cap, as each sizes its static memory from what is free when it starts). Caps: checkpoint
# 60 s, every wait and request by what is left of BUDGET (default 285 s from the start), each
# shutdown 15 s. The client posts to both servers of a pair with bootstrap host/port/room (what
# sglang-router does; the router wheel does not fit the call). Outputs: summary.txt and the server
# logs in $OUT (at most 8 files come back: plain, 4 PD logs, the colocated log, summary). Exit 0 only
# when every PD output equals the plain server's. Pass: per pair "n=41/42/97: PD+DSpark == plain
# True" (colocated: "DSpark == plain True"), two equal "sglang-dsv41 PD layout" lines per pair,
# "RESULT pd_dspark mode=<mode> rc=0".
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
MODE=${1:-both}
BUDGET=${BUDGET:-285}
SUMMARY=$OUT/summary.txt
gpu_setup
export MC_FORCE_TCP=1 MOONCAKE_PROTOCOL=tcp SGLANG_HOST_IP=127.0.0.1
python3 -c "import mooncake.engine" 2>/tmp/pd_imports.log || {
  cat /tmp/pd_imports.log; echo "RESULT pd_dspark missing the PD stack (carry .gpu built with PD=1: ../shared/gpu/build.sh)"; exit 5; }
COLO=()   # colocated DSpark servers: name γ port
case $MODE in
  equal) PAIRS=("equal 5 5 30010 30020 38998") ;;
  unequal) PAIRS=("unequal 5 7 30010 30020 38998" "reverse 7 5 30040 30050 38999"); COLO=("colo7 7 30060") ;;
  both) PAIRS=("equal 5 5 30010 30020 38998" "unequal 5 7 30040 30050 38999") ;;
  *) echo "usage: pd_dspark.sh [both|equal|unequal]"; exit 2 ;;
esac
CK=/tmp/tiny; W=/tmp/pd_dspark; rm -rf $W; mkdir -p $W
C=http://127.0.0.1:30030
tiny_checkpoint $CK 60 || exit 4
ask() {  # out-file, url [, prefill url, bootstrap port, bootstrap room] -> /generate of the three prompts, sequential
  timeout "$(left 25)" python3 - "$@" <<'PY'
import json, sys, threading, urllib.request
out, url = sys.argv[1], sys.argv[2]
pd = len(sys.argv) > 3
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
        body.update(bootstrap_host="127.0.0.1", bootstrap_port=int(sys.argv[4]), bootstrap_room=int(sys.argv[5]) + k)
        t = threading.Thread(target=post, args=(sys.argv[3], body, side)); t.start()
    post(url, body, got)
    if pd:
        t.join(65)
    res[n] = {"output_ids": got[0]["output_ids"], "accept_length": got[0]["meta_info"].get("spec_accept_length")}
json.dump(res, open(out, "w"))
PY
}
# every server at once: the colocated plain reference and each DSpark pair
CAP=(--mem-fraction-static 0.12 --max-total-tokens 65536 --disable-cuda-graph)
start_server "$OUT/plain.log" python3 -m sglang.launch_server --model-path $CK "${CAP[@]}" --port 30030
SPEC=(--speculative-algorithm DSPARK)
COMMON=(--model-path $CK "${CAP[@]}" --disaggregation-transfer-backend mooncake)
for pair in "${PAIRS[@]}"; do
  read -r name pg dg pport dport boot <<<"$pair"
  start_server "$OUT/prefill_$name.log" python3 -m sglang.launch_server "${COMMON[@]}" "${SPEC[@]}" --speculative-dspark-block-size "$pg" \
    --port "$pport" --disaggregation-mode prefill --disaggregation-bootstrap-port "$boot"
  start_server "$OUT/decode_$name.log" python3 -m sglang.launch_server "${COMMON[@]}" "${SPEC[@]}" --speculative-dspark-block-size "$dg" \
    --port "$dport" --disaggregation-mode decode
done
for colo in "${COLO[@]}"; do
  read -r name g port <<<"$colo"
  start_server "$OUT/colo_$name.log" python3 -m sglang.launch_server --model-path $CK "${CAP[@]}" "${SPEC[@]}" \
    --speculative-dspark-block-size "$g" --port "$port"
done
if wait_up $C/health_generate "$(left 40)"; then ask $W/plain.json $C || echo "plain requests failed" | tee -a "$OUT/summary.txt"
else echo "plain server not up" | tee -a "$OUT/summary.txt"; tail -30 "$OUT/plain.log"; fi
echo "plain done at $((SECONDS - T0)) s" | tee -a "$OUT/summary.txt"
room=5000
for pair in "${PAIRS[@]}"; do
  read -r name pg dg pport dport boot <<<"$pair"
  P=http://127.0.0.1:$pport; D=http://127.0.0.1:$dport
  up=0; wait_up $P/health "$(left 30)" && wait_up $D/health "$(left 30)" && up=1
  echo "PD $name up=$up (prefill γ=$pg, decode γ=$dg) at $((SECONDS - T0)) s" | tee -a "$OUT/summary.txt"
  if [ $up = 1 ]; then ask "$W/pd_$name.json" "$D" "$P" "$boot" $room || echo "PD $name requests failed" | tee -a "$OUT/summary.txt"; fi
  room=$((room + 100))
  grep -h -m1 "sglang-dsv41 PD layout" "$OUT/prefill_$name.log" "$OUT/decode_$name.log" 2>/dev/null | cut -c1-400 | tee -a "$OUT/summary.txt"
done
for colo in "${COLO[@]}"; do
  read -r name g port <<<"$colo"
  U=http://127.0.0.1:$port
  up=0; wait_up $U/health_generate "$(left 30)" && up=1
  echo "colocated $name up=$up (γ=$g) at $((SECONDS - T0)) s" | tee -a "$OUT/summary.txt"
  if [ $up = 1 ]; then ask "$W/pd_$name.json" "$U" || echo "colocated $name requests failed" | tee -a "$OUT/summary.txt"; fi
done
stop_servers
python3 - "$W" "$MODE" "${PAIRS[@]}" "${COLO[@]}" <<'PY' | tee -a "$OUT/summary.txt"
import json, sys
w, mode, pairs = sys.argv[1], sys.argv[2], [p.split()[0] for p in sys.argv[3:]]
ok = True
try:
    plain = json.load(open(f"{w}/plain.json"))
except Exception as e:
    print(f"RESULT pd_dspark_{mode}_greedy_equal 0 (no plain output: {e})"); sys.exit(1)
for name in pairs:
    try:
        pd = json.load(open(f"{w}/pd_{name}.json"))
    except Exception as e:
        print(f"{name}: missing output ({e})"); ok = False; continue
    for n, ref in plain.items():
        got = pd.get(n, {}).get("output_ids")
        eq = got == ref["output_ids"]
        ok = ok and eq and len(ref["output_ids"]) == 48
        first = None if eq or got is None else next(i for i, (a, b) in enumerate(zip(ref["output_ids"], got)) if a != b)
        what = "DSpark" if name.startswith("colo") else "PD+DSpark"
        print(f"{name} n={n}: {what} == plain {eq}, decode accept length {pd.get(n, {}).get('accept_length')}"
              + ("" if eq else f", first difference at token {first}"))
print(f"RESULT pd_dspark_{mode}_greedy_equal {int(ok)}")
sys.exit(0 if ok else 1)
PY
rc=$?
if [ $rc != 0 ]; then
  for f in "$OUT"/prefill_*.log "$OUT"/decode_*.log "$OUT"/colo_*.log; do
    [ -f "$f" ] && grep -nE "Error|error|Traceback|sglang-dsv41" "$f" | tail -15
  done
fi
result pd_dspark mode=$MODE rc=$rc
exit $rc

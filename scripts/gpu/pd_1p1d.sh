#!/usr/bin/env bash
# H200 (one GPU), one device call: PD 1P1D of the tiny checkpoint (docs/pd.md) — a prefill and a
# decode server sharing GPU 0 with a colocated reference server (--mem-fraction-static 0.2 each),
# Mooncake over TCP on 127.0.0.1, sglang-router in front when it is installed; greedy /generate
# (odd and even prompt lengths, a repeat for the prefill-side prefix hit) compared with the
# colocated server's tokens, and a chat request (reasoning split) through the router. Needs the
# Mooncake transfer engine: `.gpu` built with `PD=1` (../shared/gpu/build.sh; the image has
# libibverbs); exits 5 naming what is missing. Exit 0 only when every PD output equals the
# colocated one. Pass: "n=41: PD == colocated [True, True]", "n=42: ... [True]", the second n=41
# with cached_tokens ≥ 40, both PD layout lines equal, "RESULT pd_1p1d ... ok=1 equal=1".
# Run from the checkout root with `.gpu` carried. Every wait is capped by what is left of BUDGET
# (default 290 s from the start, so the call ends < 300 s), every process group killed; logs and
# results in $OUT. `pd_1p1d.sh bench` runs benchmarks/pd.py instead (below).
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
BUDGET=${BUDGET:-290}
gpu_setup
export MC_FORCE_TCP=1 MOONCAKE_PROTOCOL=tcp SGLANG_HOST_IP=127.0.0.1
python3 -c "import mooncake.engine" 2>/tmp/pd_imports.log || {
  cat /tmp/pd_imports.log; echo "RESULT pd_1p1d missing the PD stack (carry .gpu built with PD=1: ../shared/gpu/build.sh)"; exit 5; }
# The router wheel (30 MB) does not fit a device call beside `.gpu`: without it the client does what
# the router does for /generate (the same body to prefill and decode with bootstrap host/port/room)
# and the chat request is left out; the RESULT line says which mode ran.
ROUTER=1; python3 -c "import sglang_router" 2>/dev/null || ROUTER=0
CK=/tmp/tiny; J='Content-Type: application/json'
W=/tmp/pd_1p1d; rm -rf $W; mkdir -p $W   # request outputs (only 8 files come back from $OUT: logs there)
P=http://127.0.0.1:30010; D=http://127.0.0.1:30020; R=http://127.0.0.1:30000; C=http://127.0.0.1:30030
tiny_checkpoint $CK || exit 4
# `pd_1p1d.sh bench`: benchmarks/pd.py instead — the device-to-device copy bandwidth of the GPU,
# then colocated and 1P1D (both servers on the same GPU) at prompts of 1K, 8K and 32K tokens
# (BENCH_PROMPTS), concurrency 1 and 8 (BENCH_CONC), 32 new tokens: TTFT, ITL, throughput, SGLang's
# per-request KV transfer size / latency / bandwidth. The tiny checkpoint's context is 4K, so the
# servers get --context-length 40960 (SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1: numbers only,
# outputs past 4K are not meaningful). All three servers start at once (--start-together: one
# start-up wait of ~130 s instead of two; each uses --mem-fraction-static 0.25 and a 400K-token
# pool cap, far below it), the set-ups are measured in turn. JSON + PNG + server logs in $OUT; the
# benchmark gets what is left of BUDGET (SIGTERM keeps the finished set-ups in the JSON).
if [ "${1:-}" = bench ]; then
  NR=(); [ $ROUTER = 1 ] || NR=(--no-router)
  export SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1
  # shellcheck disable=SC2086
  timeout -k 15 "$(left 15)" python3 benchmarks/pd.py --device cuda --checkpoint $CK "${NR[@]}" --start-together \
    --server-arg=--mem-fraction-static --server-arg=0.25 --server-arg=--context-length --server-arg=40960 \
    --concurrency ${BENCH_CONC:-1 8} --rounds 1 --prompt-len ${BENCH_PROMPTS:-1024 8192 32768} --new-tokens 32 \
    --max-total-tokens 400000 --startup-s 200 --out "$OUT/pd_h200.json"
  rc=$?; result pd_bench rc=$rc router=$ROUTER; exit $rc
fi
# the three servers start at once (one start-up wait); 0.2 of the GPU each, as each server sizes
# its static memory from what is free when it starts
COMMON=(--model-path $CK --mem-fraction-static 0.2 --disaggregation-transfer-backend mooncake)
start_server "$OUT/colocated.log" python3 -m sglang.launch_server --model-path $CK --mem-fraction-static 0.2 --port 30030
start_server "$OUT/prefill.log" python3 -m sglang.launch_server "${COMMON[@]}" --port 30010 --disaggregation-mode prefill \
  --disaggregation-bootstrap-port 38998
start_server "$OUT/decode.log" python3 -m sglang.launch_server "${COMMON[@]}" --port 30020 --disaggregation-mode decode
up=0; wait_up $P/health "$(left 60)" && wait_up $D/health "$(left 60)" && up=1
echo "servers up=$up at $((SECONDS - T0)) s"
ok=0
if [ $up = 1 ]; then
  if [ $ROUTER = 1 ]; then
    start_server "$OUT/router.log" python3 -m sglang_router.launch_router --pd-disaggregation --host 127.0.0.1 --port 30000 \
      --prefill $P 38998 --decode $D --policy round_robin
    if wait_up $R/readiness "$(left 60)"; then
      for n in 41 42 41; do
        ids=$(python3 -c "print([0]+[(7*i)%900+3 for i in range($n-1)])")
        curl -sf -m "$(left 30)" $R/generate -H "$J" -d "{\"input_ids\":$ids,\"sampling_params\":{\"max_new_tokens\":16,\"temperature\":0,\"ignore_eos\":true}}" \
          >"$W/pd_gen_$n.json.$(date +%s%N)" || echo "request n=$n failed"
      done
      curl -sf -m "$(left 30)" $R/v1/chat/completions -H "$J" -d '{"model":"x","messages":[{"role":"user","content":"What is 17*19?"}],"max_tokens":32}' \
        >"$W/pd_chat.json" && ok=1
    fi
  else
    timeout "$(left 50)" python3 - "$P" "$D" "$W" <<'PY' && ok=1
import json, sys, threading, time, urllib.request
P, D, O = sys.argv[1:4]
def post(url, body, out):
    req = urllib.request.Request(url + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        out.append(json.load(r))
for k, n in enumerate((41, 42, 41)):
    ids = [0] + [(7 * i) % 900 + 3 for i in range(n - 1)]
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True},
            "bootstrap_host": "127.0.0.1", "bootstrap_port": 38998, "bootstrap_room": 1000 + k}
    got_p, got_d = [], []
    tp = threading.Thread(target=post, args=(P, body, got_p)); tp.start()
    post(D, body, got_d); tp.join(130)
    json.dump(got_d[0], open(f"{O}/pd_gen_{n}.json.{int(time.time() * 1000)}", "w"))
PY
  fi
fi
# the colocated reference: one plain server, same prompts
if wait_up $C/health_generate "$(left 20)"; then
  for n in 41 42; do
    ids=$(python3 -c "print([0]+[(7*i)%900+3 for i in range($n-1)])")
    curl -sf -m "$(left 10)" $C/generate -H "$J" -d "{\"input_ids\":$ids,\"sampling_params\":{\"max_new_tokens\":16,\"temperature\":0,\"ignore_eos\":true}}" \
      >"$W/colocated_$n.json" || echo "colocated n=$n failed"
  done
fi
stop_servers
python3 - "$W" <<'PY'
import glob, json, sys
o = sys.argv[1]
bad = 0
try:
    for n in (41, 42):
        runs = [json.load(open(f)) for f in sorted(glob.glob(f"{o}/pd_gen_{n}.json.*"), key=lambda f: int(f.rsplit(".", 1)[1]))]
        ref = json.load(open(f"{o}/colocated_{n}.json"))["output_ids"]
        eq = [r['output_ids'] == ref for r in runs]
        bad += 0 if eq and all(eq) else 1
        print(f"n={n}: PD == colocated {eq}, cached_tokens {[r['meta_info'].get('cached_tokens') for r in runs]}")
    if glob.glob(f"{o}/pd_chat.json"):
        m = json.load(open(f"{o}/pd_chat.json"))["choices"][0]["message"]
        print("chat keys:", sorted(k for k, v in m.items() if v), "reasoning chars:", len(m.get("reasoning_content") or ""))
except Exception as e:  # report, do not hide: the RESULT line says ok=0 where a request failed
    print("result parse failed:", e)
    bad += 1
sys.exit(1 if bad else 0)
PY
eq=$((1 - $?))
grep -h -m1 "sglang-dsv41 PD layout" "$OUT/prefill.log" "$OUT/decode.log" || echo "no PD layout lines"
[ $ok = 1 ] || { tail -40 "$OUT/prefill.log"; tail -40 "$OUT/decode.log"; }
result pd_1p1d router=$ROUTER up=$up ok=$ok equal=$eq
[ $ok = 1 ] && [ $eq = 1 ]

#!/usr/bin/env bash
# H200 (one GPU), one device call: (1) plain `python -m sglang.launch_server --model-path <tiny>`
# with NO flag at all (the plugin's declared defaults: dsv41 backend, page 2, SWA 0.1, parsers,
# decode graphs to 16), /get_server_info, greedy /generate twice (prefix hit), card chat request
# (reasoning_content split); (2) `pytest -m gpu` on the GPU files (TP files need 2 GPUs: left out).
# Run from the checkout root with `.gpu` carried. Every wait is capped; logs and results in $OUT.
# GPU_TESTS=0 runs the plain launch only.
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
BUDGET=560   # the whole call (not a knob)
gpu_setup
CK=/tmp/tiny; U=http://127.0.0.1:30000; J='Content-Type: application/json'
tiny_checkpoint $CK || exit 4
start_server "$OUT/plain_server.log" python3 -m sglang.launch_server --model-path $CK
up=0; S0=$SECONDS
wait_up $U/health_generate 240 "$SERVER_PID" && up=1
echo "plain server up=$up after $((SECONDS - S0)) s"
ok=0
if [ $up = 1 ]; then
  curl -sf -m 60 $U/get_server_info >"$OUT/info.json"
  G='{"input_ids":[0,17,401,93,250,11,12,13,14,15,16,17,18,19,20,21,22],"sampling_params":{"max_new_tokens":16,"temperature":0},"return_logprob":true}'
  curl -sf -m 60 $U/generate -H "$J" -d "$G" >"$OUT/gen1.json" &&
  curl -sf -m 60 $U/generate -H "$J" -d "$G" >"$OUT/gen2.json" &&
  curl -sf -m 60 $U/v1/chat/completions -H "$J" -d '{"model":"x","messages":[{"role":"user","content":"What is 17*19?"}],"max_tokens":48}' >"$OUT/chat.json" && ok=1
fi
stop_servers
python3 - "$OUT" <<'PY'
import json, sys
o = sys.argv[1]
try:
    i = json.load(open(f"{o}/info.json"))
    print("resolved:", {k: i.get(k) for k in ("attention_backend", "page_size", "swa_full_tokens_ratio", "reasoning_parser",
                                             "tool_call_parser", "sampling_backend", "cuda_graph_max_bs_decode", "device")})
    g1, g2 = (json.load(open(f"{o}/gen{n}.json")) for n in (1, 2))
    print("greedy equal on repeat:", g1["output_ids"] == g2["output_ids"], "cached_tokens 2nd:", g2["meta_info"].get("cached_tokens"))
    lp1 = [x[0] for x in g1["meta_info"]["output_token_logprobs"]]; lp2 = [x[0] for x in g2["meta_info"]["output_token_logprobs"]]
    print("max |dlogp| cold vs hit:", max(abs(a - b) for a, b in zip(lp1, lp2)))
    m = json.load(open(f"{o}/chat.json"))["choices"][0]["message"]
    print("chat keys:", sorted(k for k, v in m.items() if v), "reasoning chars:", len(m.get("reasoning_content") or ""))
except Exception as e:  # report, do not hide: the RESULT line below says ok=0
    print("result parse failed:", e)
PY
[ $ok = 1 ] || tail -60 "$OUT/plain_server.log"
grep -m2 -e "KV pool sizing" -e "DeepseekV41KVPool: global KV" "$OUT/plain_server.log" || echo "pool log lines: none"
result plain_launch up=$up ok=$ok
[ "${GPU_TESTS:-1}" = 1 ] || exit $((1 - ok))
timeout "$(left)" python3 -m pytest -m gpu -q -p no:cacheprovider tests/ \
  --deselect tests/test_runtime_tp_server.py --deselect tests/test_runtime_tp_cuda_graph_gpu.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -40
result gpu_tests rc="${PIPESTATUS[0]}"

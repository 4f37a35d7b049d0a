#!/usr/bin/env bash
# H200 (one GPU), one device call for branch runtime13 (every linear an SGLang linear layer with
# our FP8-tile / BF16 quant methods; embedding and LM head as SGLang's VocabParallelEmbedding /
# ParallelLMHead): (1) `pytest -m gpu` on tests/test_runtime_forward_gpu.py and
# tests/test_runtime_triton_backend.py (the numerics contract on the CUDA path); (2) plain
# `python -m sglang.launch_server --model-path <tiny>` with no flag, greedy /generate twice
# (equal, prefix hit) and a chat request. Run from the checkout root with `.gpu` carried.
# BUDGET caps the whole call (s); TESTS overrides the test files; every wait is capped; logs and
# results in $OUT.
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
: "${BUDGET:=290}"
gpu_setup
rc=0
for f in ${TESTS:-tests/test_runtime_forward_gpu.py tests/test_runtime_triton_backend.py}; do
  l=$(left 130); [ "$l" -gt 20 ] || { echo "RESULT $f not run: budget spent"; rc=1; continue; }
  name=$(basename "$f" .py)
  timeout -k 10 $l python3 -m pytest -m gpu -q -p no:cacheprovider -rf --tb=short "$f" >"$OUT/$name.log" 2>&1
  r=$?; [ $r = 0 ] || rc=1
  result "$f" rc=$r "$(tail -1 "$OUT/$name.log")"
  [ $r = 0 ] || grep -E "^(FAILED|ERROR|E )" "$OUT/$name.log" | head -20
done
CK=/tmp/tiny; U=http://127.0.0.1:30000; J='Content-Type: application/json'
tiny_checkpoint $CK 60 || exit 4
start_server "$OUT/plain_server.log" python3 -m sglang.launch_server --model-path $CK
up=0; S0=$SECONDS
wait_up $U/health_generate "$(left 25)" "$SERVER_PID" && up=1
echo "plain server up=$up after $((SECONDS - S0)) s"
ok=0
if [ $up = 1 ]; then
  G='{"input_ids":[0,17,401,93,250,11,12,13,14,15,16,17,18,19,20,21,22],"sampling_params":{"max_new_tokens":16,"temperature":0},"return_logprob":true}'
  curl -sf -m 20 $U/generate -H "$J" -d "$G" >"$OUT/gen1.json" &&
  curl -sf -m 20 $U/generate -H "$J" -d "$G" >"$OUT/gen2.json" &&
  curl -sf -m 20 $U/v1/chat/completions -H "$J" -d '{"model":"x","messages":[{"role":"user","content":"What is 17*19?"}],"max_tokens":32}' >"$OUT/chat.json" && ok=1
fi
stop_servers
python3 - "$OUT" <<'PY'
import json, sys
o = sys.argv[1]
try:
    g1, g2 = (json.load(open(f"{o}/gen{n}.json")) for n in (1, 2))
    print("greedy ids:", g1["output_ids"])
    print("greedy equal on repeat:", g1["output_ids"] == g2["output_ids"], "cached_tokens 2nd:", g2["meta_info"].get("cached_tokens"))
    m = json.load(open(f"{o}/chat.json"))["choices"][0]["message"]
    print("chat keys:", sorted(k for k, v in m.items() if v))
except Exception as e:  # reported, not hidden: the RESULT line says ok=0
    print("result parse failed:", e)
PY
[ $ok = 1 ] || { rc=1; tail -60 "$OUT/plain_server.log"; }
grep -m3 -e "sglang-dsv41: " "$OUT/plain_server.log" | cut -c1-300
result plain_launch up=$up ok=$ok
exit $rc

#!/usr/bin/env bash
# H200 (one GPU), one device call: HiCache L2 with the V4.1 pool (docs/hicache.md, issue 14).
# For each setting (write_through with io kernel + --hicache-ratio, and with io direct + --hicache-size):
# plain `python -m sglang.launch_server --model-path <tiny> --enable-hierarchical-cache ...` with a
# 512-token device pool; a long prompt cold, 6 other prompts that evict it, the long prompt again:
# report cached_tokens (device / host), greedy equality and max |dlogprob| vs the cold run.
# Run from the checkout root with `.gpu` carried. Every wait is capped; every server is killed.
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
gpu_setup
CK=/tmp/tiny; PORT=30000; U=http://127.0.0.1:$PORT
tiny_checkpoint $CK || exit 4
fails=0
run_setting() {  # name, flags...
  local name=$1; shift
  start_server "$OUT/server_$name.log" timeout 400 python3 -m sglang.launch_server --model-path $CK --port $PORT \
      --max-total-tokens 512 --swa-full-tokens-ratio 0.25 --enable-hierarchical-cache "$@"
  local up=0 S0=$SECONDS
  wait_up $U/health_generate 240 "$SERVER_PID" && up=1
  echo "[$name] server up=$up after $((SECONDS - S0)) s"
  local ok=0
  if [ $up = 1 ]; then
    timeout 240 python3 - "$U" "$OUT/result_$name.json" <<'PY' && ok=1
import json, random, sys, urllib.request
url, out = sys.argv[1], sys.argv[2]
def gen(ids, n=16):
    body = {"input_ids": ids, "return_logprob": True,
            "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
    req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())
rng = random.Random(1)
prompt = lambda n: [0] + [rng.randrange(3, 990) for _ in range(n)]
long = prompt(120)
cold = gen(long)
for _ in range(6):
    gen(prompt(120))
warm = gen(long)
lp = lambda o: [t[0] for t in o["meta_info"]["output_token_logprobs"]]
res = {"cached_tokens": warm["meta_info"]["cached_tokens"],
       "details": warm["meta_info"].get("cached_tokens_details"),
       "greedy_equal": warm["output_ids"] == cold["output_ids"],
       "max_dlogprob": max(abs(a - b) for a, b in zip(lp(warm), lp(cold)))}
json.dump(res, open(out, "w"))
print(res)
host = int((res["details"] or {}).get("host", 0))
sys.exit(0 if host > 0 and res["greedy_equal"] else 1)
PY
  fi
  stop_servers
  grep -m3 -e "sglang-dsv41 HiCache" -e "Attached hybrid pool stack" "$OUT/server_$name.log" || true
  [ $ok = 1 ] || { tail -60 "$OUT/server_$name.log"; fails=$((fails + 1)); }
  result "hicache_$name" up=$up ok=$ok
}
run_setting write_through --hicache-write-policy write_through --hicache-io-backend kernel --hicache-ratio 4
run_setting direct_size --hicache-write-policy write_through --hicache-io-backend direct --hicache-size 1
exit $fails

#!/usr/bin/env bash
# H200 (one GPU), one device call (issue 16, docs/dspark.md): first SGLang's sampled accept step
# against the oracle's chain rejection in distribution (tests/test_runtime_dspark_accept_gpu.py),
# then the tiny checkpoint served twice —
# plain greedy, then with `--speculative-algorithm DSPARK` (its bundled draft, γ = 5, 6 verify
# tokens) — and the greedy outputs compared for 64 new tokens at batch 1 and batch 8 (8 prompts in
# one /generate call). Reports per-request acceptance (meta_info spec_accept_length /
# spec_accept_rate) and SGLang's gauges (sglang:spec_accept_length / _rate, --enable-metrics).
#
# Usage (checkout root, `.gpu` carried): bash scripts/gpu/dspark.sh [graphs|nograph|both|adaptive]
#   graphs   (default) DSPARK with CUDA graphs (verify + draft graphs up to batch 8); if that server
#            does not come up, one eager retry (--disable-cuda-graph) when time is left;
#   nograph  DSPARK eager only (--disable-cuda-graph on both servers);
#   both     graphs, then eager (time permitting);
#   adaptive DSPARK with adaptive verification in CUDA graphs (SGLANG_RAGGED_VERIFY_MODE=compact,
#            a synthetic SPS table with steps/s ∝ 1/tokens, so low-confidence drafts are trimmed:
#            ragged verify lengths, `runtime/batch.static_ragged_verify_layout`); then graphs.
# DSPARK_EXTRA="..." adds server flags to the DSPARK server (e.g. SGLANG_RAGGED_VERIFY_MODE is an
# env var: export it before). Caps: checkpoint 120 s, each start 200 s, each request 90 s, metrics
# 15 s, each shutdown 15 s; the script stops starting servers after 420 s (whole call < 600 s).
# Outputs in $OUT (device limit: 8 files): summary.txt, <tag>_server.log per server, and
# dspark_outputs.tgz (requests, <tag>_b1.json / _b8.json, <tag>_metrics.txt, gpu.txt).
# Exit 0 only when a DSPARK run's every comparison is equal.
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
SUMMARY=$OUT/summary.txt
W=/tmp/dspark_work; rm -rf $W; mkdir -p $W
MODE=${1:-graphs}
gpu_setup
CK=/tmp/tiny; PORT=30000; U=http://127.0.0.1:$PORT; J='Content-Type: application/json'
tiny_checkpoint $CK || exit 4
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader >"$W/gpu.txt" 2>&1
# SGLang's sampled (chain / "block") rejection vs the oracle's, in distribution (no server)
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_runtime_dspark_accept_gpu.py 2>&1 | tail -3 \
  | sed 's/^/accept: /' | tee -a "$OUT/summary.txt"

python3 - "$W" <<'PY'
import json, sys, torch
g = torch.Generator().manual_seed(16)
prompts = [[0] + torch.randint(3, 990, (int(n),), generator=g).tolist() for n in torch.randint(12, 60, (8,), generator=g)]
sp = {"max_new_tokens": 64, "temperature": 0, "ignore_eos": True}
json.dump({"input_ids": prompts[0], "sampling_params": sp}, open(f"{sys.argv[1]}/req_b1.json", "w"))
json.dump({"input_ids": prompts, "sampling_params": sp}, open(f"{sys.argv[1]}/req_b8.json", "w"))
# the plain server also returns its top-2 logprobs: a greedy difference at a near-tie is numerics
json.dump({"input_ids": prompts, "sampling_params": sp, "return_logprob": True, "top_logprobs_num": 2},
          open(f"{sys.argv[1]}/req_b8_lp.json", "w"))
# adaptive verification: a cost table where a verify token always costs as much as the tokens before
tokens = [1, 2, 4, 8, 16, 32, 48, 64]
json.dump({"sample_batch_tokens": tokens, "sample_steps_per_sec": [1000.0 / t for t in tokens],
           "max_batch_tokens": 64}, open(f"{sys.argv[1]}/sps.json", "w"))
PY

serve() {  # $1 = tag, rest = extra server flags; writes $OUT/<tag>_b1.json, <tag>_b8.json; returns 0 when up
  local tag=$1; shift
  if [ $((SECONDS - T0)) -gt 420 ]; then echo "$tag: skipped (no time left)"; return 2; fi
  start_server "$OUT/${tag}_server.log" python3 -m sglang.launch_server --model-path $CK --port $PORT \
    --max-running-requests 8 --cuda-graph-max-bs 8 --enable-metrics --decode-log-interval 1 "$@"
  local up=0 s0=$SECONDS
  wait_up $U/health_generate 200 "$SERVER_PID" && up=1
  echo "$tag server up=$up after $((SECONDS - s0)) s" | tee -a "$OUT/summary.txt"
  if [ $up = 1 ]; then
    curl -sf -m 90 $U/generate -H "$J" -d @"$W/req_b1.json" >"$W/${tag}_b1.json" || echo "$tag b1: request failed"
    if [ "$tag" = plain ]; then
      curl -sf -m 90 $U/generate -H "$J" -d @"$W/req_b8_lp.json" >"$W/${tag}_b8.json" || echo "$tag b8: request failed"
    else
      curl -sf -m 90 $U/generate -H "$J" -d @"$W/req_b8.json" >"$W/${tag}_b8.json" || echo "$tag b8: request failed"
    fi
    curl -sf -m 15 $U/metrics | grep -E "^sglang:(spec_|num_running|gen_throughput)" >"$W/${tag}_metrics.txt"
  else
    grep -nE "Error|error|Traceback|sglang-dsv41" "$OUT/${tag}_server.log" | tail -30
    tail -25 "$OUT/${tag}_server.log"
  fi
  stop_servers
  [ $up = 1 ]
}

compare() {  # $1 = DSPARK tag; prints the comparison; exit status 0 when all equal
  python3 - "$W" "$1" <<'PY' | tee -a "$OUT/summary.txt"
import json, sys
o, tag = sys.argv[1], sys.argv[2]
ok = True
for b in ("b1", "b8"):
    try:
        p, d = (json.load(open(f"{o}/{t}_{b}.json")) for t in ("plain", tag))
    except Exception as e:
        print(f"{tag} {b}: missing output ({e})"); ok = False; continue
    p, d = (x if isinstance(x, list) else [x] for x in (p, d))
    eq = [a["output_ids"] == c["output_ids"] for a, c in zip(p, d)]
    n = [len(c["output_ids"]) for c in d]
    al = [round(c["meta_info"].get("spec_accept_length", 0.0), 2) for c in d]
    ar = [round(c["meta_info"].get("spec_accept_rate", 0.0), 2) for c in d]
    print(f"{tag} {b}: greedy equal {sum(eq)}/{len(eq)}, new tokens {n}, accept length {al}, accept rate {ar}")
    for i, (a, c) in enumerate(zip(p, d)):
        if a["output_ids"] != c["output_ids"]:
            k = next(j for j, (x, y) in enumerate(zip(a["output_ids"], c["output_ids"])) if x != y)
            top = a["meta_info"].get("output_top_logprobs")
            gap = (round(top[k][0][0] - top[k][1][0], 4) if top and len(top[k]) > 1 else None)
            print(f"  {b} request {i}: first difference at token {k} (plain {a['output_ids'][k]}, {tag} "
                  f"{c['output_ids'][k]}; plain top-2 logprob gap there {gap})")
    ok = ok and all(eq) and len(eq) == (1 if b == "b1" else 8) and all(k == 64 for k in n)
try:
    print(f"{tag} metrics:", " | ".join(l.strip() for l in open(f"{o}/{tag}_metrics.txt") if "spec_accept" in l))
except OSError:
    print(f"{tag} metrics: none")
print(f"RESULT {tag}_greedy_equal", int(ok))
sys.exit(0 if ok else 1)
PY
}

SPEC="--speculative-algorithm DSPARK --speculative-dspark-block-size 5 ${DSPARK_EXTRA:-}"
rc=1
if [ "$MODE" = adaptive ]; then
  serve plain
  if SGLANG_RAGGED_VERIFY_MODE=compact serve dspark_adaptive $SPEC --speculative-dspark-sps-table-path "$W/sps.json"; then
    compare dspark_adaptive && rc=0
    grep -m3 -E "ragged-verify scheduler enabled|SPS table" "$OUT/dspark_adaptive_server.log" | tee -a "$OUT/summary.txt"
  fi
  serve dspark $SPEC && compare dspark || rc=1
elif [ "$MODE" = nograph ]; then
  serve plain --disable-cuda-graph
  serve dspark_eager $SPEC --disable-cuda-graph && compare dspark_eager && rc=0
else
  serve plain
  if serve dspark $SPEC; then
    compare dspark && rc=0
    [ "$MODE" = both ] && serve dspark_eager $SPEC --disable-cuda-graph && compare dspark_eager || true
  else
    echo "DSPARK with CUDA graphs did not come up: eager retry" | tee -a "$OUT/summary.txt"
    serve dspark_eager $SPEC --disable-cuda-graph && compare dspark_eager && rc=0
  fi
fi
tar -czf "$OUT/dspark_outputs.tgz" -C $W . 2>/dev/null
result dspark rc=$rc mode=$MODE
exit $rc

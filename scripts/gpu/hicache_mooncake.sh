#!/usr/bin/env bash
# H200 (one GPU), one device call: HiCache L3 on a Mooncake store (docs/hicache.md "L3: the Mooncake
# store", issue 14). Runs tests/test_runtime_hicache_mooncake_server.py on the GPU (its servers pick
# CUDA when torch sees it): a local mooncake_master + mooncake_client over TCP; server A stores a long
# prompt as Mooncake objects; server B, started fresh on the same master, reloads it from L3 with
# tokens and logprobs equal to A's cold run; then the master goes down and B serves the prompt cold,
# equal, with the failed query warned and counted. Needs the Mooncake wheel in the environment
# (`pip install -e ".[pd-cuda]"`, libibverbs1); exits 5 naming what is missing.
# Run from the checkout root with `.gpu` carried. Every step is capped; the test stops what it starts.
set -uo pipefail
: "${OUT:=/tmp/out}"; mkdir -p "$OUT"
T0=$SECONDS
BUDGET=${BUDGET:-300}
source .gpu/bin/setup.sh || exit 3
export XDG_CACHE_HOME=/tmp/cache HF_HUB_OFFLINE=1 SGLANG_DSV41_PD_REQUIRED=1
python3 -c "import mooncake.store, mooncake, os; assert os.path.exists(os.path.join(os.path.dirname(mooncake.__file__), 'mooncake_client'))" \
    2>"$OUT/imports.log" || { tail -3 "$OUT/imports.log"
  echo "RESULT hicache_mooncake missing the Mooncake store (pip install -e '.[pd-cuda]'; apt-get install libibverbs1)"; exit 5; }
timeout -s INT -k 20 $((BUDGET - 20)) python3 -m pytest -q -p no:cacheprovider --basetemp=/tmp/hc_mc \
    tests/test_runtime_hicache_mooncake_server.py --durations=5 2>&1 | tail -25 | tee "$OUT/tests.txt"
for f in /tmp/hc_mc/mc_a0/server.log /tmp/hc_mc/mc_b0/server.log /tmp/hc_mc/mooncake0/master.log; do
  [ -f "$f" ] && grep -v "^Ignore import error" "$f" | tail -c 200000 > "$OUT/$(basename "$(dirname "$f")")_$(basename "$f")"
done
grep -q " 2 passed" "$OUT/tests.txt" && ! grep -q -e " failed" -e " error" "$OUT/tests.txt"; ok=$?
echo "RESULT hicache_mooncake ok=$((1 - ok)) at $((SECONDS - T0)) s"
exit $ok

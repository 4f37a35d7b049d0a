#!/usr/bin/env bash
# H200 (one GPU): HiCache L3 on a Mooncake store (docs/hicache.md "L3: the Mooncake store", issue
# 14). Runs tests/test_runtime_hicache_mooncake_server.py on the GPU (its servers pick CUDA when
# torch sees it): a local mooncake_master + mooncake_client over TCP; server A stores a long prompt
# as Mooncake objects; server B, started fresh on the same master, reloads it from L3 with tokens
# and logprobs equal to A's cold run; then the master goes down and B serves the prompt cold,
# equal, with the failed query warned and counted.
#
# The `.gpu` pd layer holds the Mooncake transfer engine only; the store (module, master and client
# binaries, ~18 MB packed) does not fit one call beside `.gpu`, so this takes TWO calls on one warm
# machine (it stays warm ~30 s after a call, /tmp with it):
#   CPU, once:  bash scripts/gpu/mooncake_store_pack.sh                 # -> .mcstore/ (git-ignored)
#   call 1:     bash scripts/gpu/hicache_mooncake.sh stage; source .gpu/bin/setup.sh   (seconds; setup returns 3)
#               carry [".mcstore", ".gpu/bin", ".gpu/site/pd-<hash>.tar.xz.part00"]
#   call 2:     bash scripts/gpu/hicache_mooncake.sh                   (≤ 300 s)
#               carry [".gpu/bin", ".gpu/site/base-<hash>.tar.xz.part00"]
# started within 30 s of call 1's return (the checkout plus a PD `.gpu` pass 64 MiB, so call 1 also stages
# the pd part in /tmp/gpu-parts; run in session 19 this way, docs/validation.md). Call 2 unpacks the staged store over /tmp/site and exits 5
# naming what is missing when it was not staged (or the machine was given back in between).
# Run from the checkout root. Every step is capped (BUDGET, default 290 s); the test stops what it
# starts. Pass: "RESULT hicache_mooncake_tests rc=0 pass" (pytest rc 0, both tests in tests.xml) and "RESULT hicache_mooncake ok=1".
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
BUDGET=${BUDGET:-290}
STAGE=/tmp/mcstore
if [ "${1:-}" = stage ]; then
  [ -f .mcstore/mooncake_store.tar.xz ] || { echo "RESULT hicache_mooncake_stage missing .mcstore/mooncake_store.tar.xz (run scripts/gpu/mooncake_store_pack.sh, carry .mcstore)"; exit 5; }
  mkdir -p $STAGE && cp .mcstore/mooncake_store.tar.xz $STAGE/ && echo "RESULT hicache_mooncake_stage ok: now call 2 (carry .gpu) within 30 s"
  exit $?
fi
gpu_setup
export SGLANG_DSV41_PD_REQUIRED=1
have_store() {
  python3 -c "import mooncake.store, mooncake, os; d = os.path.dirname(mooncake.__file__); assert all(os.path.exists(os.path.join(d, b)) for b in ('mooncake_master', 'mooncake_client')), 'no master/client binaries'; from mooncake.store import MooncakeDistributedStore" 2>/tmp/mc_imports.log
}
if ! have_store && [ -f $STAGE/mooncake_store.tar.xz ]; then
  site=$(python3 -c "import mooncake, os; print(os.path.dirname(os.path.dirname(mooncake.__file__)))")
  xz -dc $STAGE/mooncake_store.tar.xz | tar -x -C "$site" && echo "store unpacked into $site"
fi
have_store || { tail -3 /tmp/mc_imports.log
  echo "RESULT hicache_mooncake missing the Mooncake store (not staged: see this script's header for the two calls)"; exit 5; }
timeout -s INT -k 20 "$(left 20)" python3 -m pytest -q -p no:cacheprovider --basetemp=/tmp/hc_mc \
    --junitxml "$OUT/tests.xml" tests/test_runtime_hicache_mooncake_server.py --durations=5 2>&1 | tail -25 \
    | tee "$OUT/tests.txt"
trc=${PIPESTATUS[0]}
for f in /tmp/hc_mc/mc_a0/server.log /tmp/hc_mc/mc_b0/server.log /tmp/hc_mc/mooncake0/master.log; do
  [ -f "$f" ] && grep -v "^Ignore import error" "$f" | tail -c 200000 > "$OUT/$(basename "$(dirname "$f")")_$(basename "$f")"
done
tests_result hicache_mooncake_tests "$OUT/tests.xml" "$trc" 2; ok=$?     # rc 0 and both tests reported
result hicache_mooncake ok=$((ok == 0))
exit $ok

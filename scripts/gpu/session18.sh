#!/usr/bin/env bash
# H200 (one GPU), one device call (session 18; issues 14 and 21):
#   1. `pytest -m gpu tests/test_kernels_indexer.py`: the fused top-k with both threshold searches
#      (bisect, radix) equals the torch ranking bit for bit at Flash widths;
#   2. `topk_kernels.sh` (BUDGET 150): ours (bisect) against ours_radix and SGLang's v1 / v2;
#   3. `hicache_prefix_flash.sh` (HIT_LENGTHS empty, REPS 2, BUDGET 300): the Flash-width cold / GPU /
#      L2 / restart-L3 cases, now with the dummy weights' fixed seed (the restart server holds the same
#      weights, so the L3 hits must equal their cold runs).
# Run from the checkout root with `.gpu` carried: bash scripts/gpu/session18.sh
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
mkdir -p "$OUT/idx" "$OUT/topk" "$OUT/hic"
OUT=$OUT/idx BUDGET=120 TESTS=tests/test_kernels_indexer.py bash scripts/gpu/gpu_tests_subset.sh; echo "== idx rc=$?"
OUT=$OUT/topk BUDGET=150 bash scripts/gpu/topk_kernels.sh | tail -22; echo "== topk rc=${PIPESTATUS[0]}"
rm -f "$OUT"/topk/*.log "$OUT"/idx/*.log
OUT=$OUT/hic HIT_LENGTHS= REPS=2 BUDGET=300 MODE=flash bash scripts/gpu/hicache_prefix_flash.sh | tail -14
echo "== hic rc=${PIPESTATUS[0]}"

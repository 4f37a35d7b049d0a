#!/usr/bin/env bash
# H200 (one GPU), one device call (session 19; issue 21): the radix top-k on 32-bit keys.
#   1. `pytest -m gpu tests/test_kernels_indexer.py`: the fused top-k with both threshold searches
#      equals the torch ranking bit for bit at Flash widths (cap IDX_BUDGET s, default 110);
#   2. `topk_kernels.sh` (BUDGET TOPK_BUDGET, default 170): ours (radix, the default) against
#      ours_bisect, the radix kernel at 4 / 16 warps, and SGLang's v1 / v2 (raw and wrapped);
#   3. `decode_step.py --quick --no-decode --profile-prefill --prefill-variants default topk_bisect`:
#      one 8,192-token prefill of a Flash layer by component, the serving default against it with the
#      bisection search (what the top-k change is worth in a prefill), with what is left (≤ 560 s in all).
# Run from the checkout root with `.gpu` carried: bash scripts/gpu/session19.sh
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
: "${BUDGET:=560}" "${IDX_BUDGET:=110}" "${TOPK_BUDGET:=170}"
mkdir -p "$OUT/idx" "$OUT/topk" "$OUT/pre"
OUT=$OUT/idx BUDGET=$IDX_BUDGET TESTS=tests/test_kernels_indexer.py bash scripts/gpu/gpu_tests_subset.sh; echo "== idx rc=$?"
OUT=$OUT/topk BUDGET=$TOPK_BUDGET bash scripts/gpu/topk_kernels.sh | tail -22; echo "== topk rc=${PIPESTATUS[0]}"
rm -f "$OUT"/topk/*.log
gpu_setup
b=$(( $(left) - 20 ))
if [ "$b" -lt 60 ]; then
  result prefill "skipped: only $b s left"
else
  timeout -k 10 $((b + 10)) python3 benchmarks/decode_step.py --out "$OUT/pre" --quick --no-decode --batches 1 \
    --profile-prefill --prefill-variants default topk_bisect --budget-s "$b" 2>&1 | grep -v "^ " | tail -20
  result prefill rc="${PIPESTATUS[0]}"
fi
rm -f "$OUT"/pre/*.log "$OUT"/pre/*.png

#!/usr/bin/env bash
# H200 (one GPU), one device call (session 21; issue 21):
#   1. `pytest -m gpu tests/test_kernels_indexer.py -k flash_widths` (cap IDX_BUDGET s, default 120): the
#      default `SGLANG_DSV41_TOPK_SPLIT=auto` dispatch against the torch ranking at 64 x 128K and 1 x 256K,
#      written after session 20's last call;
#   2. benchmarks/decode_step.py --batches 1 8 64 256 --no-prefill --profile --profile-fp8 w8a8_f16: the
#      graphed step of one full-width Flash layer at N = 1 / 8 / 64 / 256 (256 last measured in session 4)
#      and its per-kernel list (step_profile's `kernels`), which picks the fusions.
# Run from the checkout root with `.gpu` carried: bash scripts/gpu/session21a.sh
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
: "${BUDGET:=560}" "${IDX_BUDGET:=120}"
mkdir -p "$OUT/idx" "$OUT/step"
OUT=$OUT/idx BUDGET=$IDX_BUDGET TESTS=tests/test_kernels_indexer.py PYTEST_K=flash_widths \
  bash scripts/gpu/gpu_tests_subset.sh
echo "== tests rc=$?"
rm -f "$OUT"/idx/compileall.log "$OUT"/idx/pip-editable.log
gpu_setup
b=$(( $(left) - 15 ))
if [ "$b" -gt 60 ]; then
  timeout -s INT -k 10 "$b" python3 benchmarks/decode_step.py --quick --batches 1 8 64 256 --no-prefill \
    --profile --profile-fp8 w8a8_f16 --budget-s $((b - 20)) --out "$OUT/step" 2>&1 | grep -v -i warn | tail -40
  result decode_step rc="${PIPESTATUS[0]}"
else
  result decode_step "skipped: $b s left"
fi

#!/usr/bin/env bash
# H200 / H100 (one GPU), one device call (after session 28; issue 21): the same-machine A/B of session 28's three
# glue cuts at decode — benchmarks/model_step.py (4 Flash-width layers, 8K context, side stream off / on) at
# N = 1 / 8 / 64, the archived tree before them (BASE) and this tree, in alternating order (base, new, base, new),
# one process each, so process-to-process spread shows next to the ratio.
# Make the base first (untracked; travels with the tree): git archive -o ab_base.tar af8f5a3 sglang_dsv41 kernels
# The base goes first on PYTHONPATH; model_step.py (a script in benchmarks/) then imports it, not the checkout's
# editable install — the check line runs from benchmarks/ for the same reason.
# JSONs in $OUT/model_step_{base,new}{1,2}; logs in $OUT/logs.tar.gz.
# Run from the checkout root with `.gpu` carried: bash scripts/gpu/session29b.sh
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
: "${BUDGET:=570}" "${STEP_S:=130}"
mkdir -p "$OUT/logs"
gpu_setup
base=/tmp/ab_base
rm -rf "$base" && mkdir -p "$base" && tar xf ab_base.tar -C "$base" && mv "$base/kernels" "$base/sglang_dsv41/kernels" || exit 4
(cd benchmarks && PYTHONPATH="$base:${PYTHONPATH:-}" python3 -c "import sglang_dsv41.runtime.attention as a; print('base:', a.__file__, 'memo' if hasattr(a, '_compressed_entries') else 'no memo')" 2>&1 | tail -1)
for i in 1 2; do
  model_step "base$i" "1 8 64" "$STEP_S" PYTHONPATH="$base:${PYTHONPATH:-}"
  model_step "new$i" "1 8 64" "$STEP_S"
done
find "$OUT" -name "*.png" -delete
(cd "$OUT" && tar czf logs.tar.gz logs 2>/dev/null; rm -rf logs)
ls -R "$OUT"

#!/usr/bin/env bash
# H100 / H200 (one GPU), on the machine session31a.sh / session31c.sh left warm (issue 21, session 31): the whole
# 4-layer model's decode step at N = 1 (benchmarks/model_step.py, 8K context, side stream off / on), session 29's
# tree (BASE, b43e89e) against this one, then this one with SGLANG_DSV41_BF16_GEMM=direct. Session 31 ran these
# lines as three calls (base + new in one, 177 s left; direct in the next; a second `whole` had too little budget
# and skipped). model_step needs ≈ 80 s for one batch size (a 24 s build, graph capture, 100 replays per mode):
# session31a/c's 52–65 s per process skipped every row.
# Make the base first (untracked; travels with the tree): git archive -o ab_base.tar b43e89e sglang_dsv41 kernels
# Run from the checkout root with `.gpu` carried: bash scripts/gpu/session31d.sh (N = 1 / 8 / 64 on a fresh machine:
# BUDGET=590 STEP_S=180 BATCHES="1 8 64")
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
: "${BUDGET:=300}" "${STEP_S:=88}" "${BATCHES:=1}"
mkdir -p "$OUT/logs"
gpu_setup
base=/tmp/ab_base
if [ ! -d "$base/sglang_dsv41/kernels" ]; then
  rm -rf "$base" && mkdir -p "$base" && tar xf ab_base.tar -C "$base" && mv "$base/kernels" "$base/sglang_dsv41/kernels" || exit 4
fi
model_step base1 "$BATCHES" "$STEP_S" PYTHONPATH="$base:${PYTHONPATH:-}"
model_step new1 "$BATCHES" "$STEP_S"
model_step direct1 "$BATCHES" "$STEP_S" SGLANG_DSV41_BF16_GEMM=direct
find "$OUT" -name "*.png" -delete
ls -R "$OUT"

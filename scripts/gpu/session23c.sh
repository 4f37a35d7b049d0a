#!/usr/bin/env bash
# H200 (one GPU), one device call (session 23; issue 21): what decides the decode attention's default after
# session23b.sh measured FlashMLA at decode 4.6x and the BF16-row gather 1.6x faster than the packed kernel at
# N = 256:
#   1. pytest -m gpu tests/test_runtime_triton_backend.py -k flashmla: the end-to-end contract (greedy
#      agreement, logit bound) of both FlashMLA opt-ins on the tiny checkpoint;
#   2. benchmarks/model_step.py (4 Flash-width layers, side stream off / on) with
#      SGLANG_DSV41_ATTN_DECODE=flashmla, then =gather: the whole model's step with each.
# Logs in $OUT/logs.tar.gz; JSONs in $OUT/model_step_{flashmla,gather}.
# Run from the checkout root with `.gpu` carried: bash scripts/gpu/session23c.sh
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
: "${BUDGET:=560}"
mkdir -p "$OUT/logs" "$OUT/tests"
gpu_setup
OUT=$OUT/tests BUDGET=150 TESTS=tests/test_runtime_triton_backend.py PYTEST_K=flashmla bash scripts/gpu/gpu_tests_subset.sh
echo "== flashmla contract tests rc=$?"
mv "$OUT"/tests/*.log "$OUT/logs/" 2>/dev/null; rmdir "$OUT/tests"
for choice in flashmla gather; do
  b=$(( $(left) - 10 ))
  [ "$b" -gt 90 ] || { echo "model_step $choice: skipped, $(left) s left"; continue; }
  SGLANG_DSV41_ATTN_DECODE=$choice timeout -s INT -k 10 "$b" python3 benchmarks/model_step.py --layers 4 \
    --batches 1 8 64 256 --context 8192 --cap-s 0.5 --budget-s $((b - 60)) --out "$OUT/model_step_$choice" \
    >"$OUT/logs/model_step_$choice.log" 2>&1
  result "model_step $choice" rc=$?
  grep '^{' "$OUT/logs/model_step_$choice.log"
done
(cd "$OUT" && tar czf logs.tar.gz logs 2>/dev/null; rm -rf logs)
ls -R "$OUT"

#!/usr/bin/env bash
# H200 / H100 (one GPU), one device call (after session 29; issue 21), most telling first:
#   1. pytest -m gpu: tests/test_kernels_fp8_fold.py (the fold tier and its quantised hand-off at Flash shapes:
#      wo_a → wo_b bits), tests/test_kernels_stacked_halves.py (the SwiGLU quantised for w2),
#      tests/test_kernels_mhc.py (the sublayer input's quantised copy) and tests/test_kernels_fp8_w8a8.py (its
#      split-K sum moved into `_last_chunk_sum`), TEST_S at most (the rest: session30b.sh);
#   2. benchmarks/model_step.py (4 Flash-width layers, 8K context, side stream off / on) at N = 1 / 8 / 16: the
#      tree before the hand-off (BASE, 418aded: w8a8_fold without it) and this tree, alternating (base, new,
#      base, new), one process each.
#      The new tree hands the fold tier quantised activations at four readers a layer (wo_b, w2, wq_a | wkv, w1 | w3).
# Make the base first (untracked; travels with the tree): git archive -o ab_base.tar 418aded sglang_dsv41 kernels
# JSONs in $OUT/model_step_{base,new}{1,2}; logs in $OUT/logs.tar.gz.
# Run from the checkout root with `.gpu` carried: bash scripts/gpu/session30a.sh
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
: "${BUDGET:=580}" "${TEST_S:=200}" "${STEP_S:=85}"
mkdir -p "$OUT/logs" "$OUT/tests"
gpu_setup
OUT=$OUT/tests BUDGET=$TEST_S TESTS="tests/test_kernels_fp8_fold.py tests/test_kernels_stacked_halves.py \
tests/test_kernels_mhc.py tests/test_kernels_fp8_w8a8.py" \
  bash scripts/gpu/gpu_tests_subset.sh
echo "== gpu tests rc=$?"
base=/tmp/ab_base
rm -rf "$base" && mkdir -p "$base" && tar xf ab_base.tar -C "$base" && mv "$base/kernels" "$base/sglang_dsv41/kernels" || exit 4
(cd benchmarks && PYTHONPATH="$base:${PYTHONPATH:-}" python3 -c "import sglang_dsv41.runtime.backend as b; print('base:', b.__file__, 'handoff' if hasattr(b.ComputeBackend, 'quantised_handoff') else 'no handoff')" 2>&1 | tail -1)
for i in 1 2; do
  model_step "base$i" "1 8 16" "$STEP_S" PYTHONPATH="$base:${PYTHONPATH:-}"
  model_step "new$i" "1 8 16" "$STEP_S"
done
mv "$OUT"/tests/*.log "$OUT/logs/" 2>/dev/null; rmdir "$OUT/tests" 2>/dev/null
find "$OUT" -name "*.png" -delete
(cd "$OUT" && tar czf logs.tar.gz logs 2>/dev/null; rm -rf logs)
ls -R "$OUT"

#!/usr/bin/env bash
# H100 / H200 (one GPU), one device call (issue 21, session 33), after session33a.sh:
#   1. the GPU tests of kernels/sparse_attention_prefill.py (now whole rows: one K = 512 product for the logits);
#   2. benchmarks/attention_prefill.py: the prefill attention alone at the Flash shape, 8,192 queries — the `bf16`
#      launch, `wide` under its plan and WIDE_CONFIGS, and (when ab_wide_halves.py is there: the kernel of 1519021,
#      dims in two halves, untracked, travels with the tree) that version as `wide_alt`;
#   3. the 8K prefill of Flash layer 2 by component, `default` then `wide` (decode_step.py --profile-prefill);
#   4. the end-to-end teacher-forced contract with the `wide` prefill on every eager batch.
# Logs in $OUT/logs.tar.gz. Run from the checkout root with `.gpu` carried: bash scripts/gpu/session33b.sh
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
: "${BUDGET:=585}" "${PREFILL_S:=170}" "${PREFILL_VARIANTS:=default wide}"
mkdir -p "$OUT/logs" "$OUT/tests"
gpu_setup
OUT=$OUT/tests BUDGET=$(left 480) TESTS="tests/test_kernels_sparse_attention_prefill.py" \
  bash scripts/gpu/gpu_tests_subset.sh
echo "== wide kernel tests rc=$?"
alt=()
[ -f ab_wide_halves.py ] && alt=(--alt-wide ab_wide_halves.py)
timeout -k 5 "$(cap 90)" python3 benchmarks/attention_prefill.py --out "$OUT" "${alt[@]}" >"$OUT/logs/attention_prefill.log" 2>&1
result attention_prefill rc=$?
tail -12 "$OUT/logs/attention_prefill.log"
b=$(cap "$PREFILL_S")
# shellcheck disable=SC2086
timeout -k 10 "$b" python3 benchmarks/decode_step.py --out "$OUT" --quick --no-decode --batches 1 \
  --profile-prefill --prefill-variants $PREFILL_VARIANTS --budget-s $((b - 30)) >"$OUT/logs/prefill.log" 2>&1
result prefill rc=$?
grep -v "^ " "$OUT/logs/prefill.log" | grep -v -i warn | grep -v "attention sweep" | tail -8
OUT=$OUT/tests BUDGET=$(left 5) PYTEST_K="prefill_opt_ins and wide" TESTS="tests/test_runtime_triton_backend.py" \
  bash scripts/gpu/gpu_tests_subset.sh
echo "== contract rc=$?"
pack_logs

#!/usr/bin/env bash
# H100 / H200 (one GPU), one device call (issue 21, session 33):
#   1. the GPU tests of the new prefill attention kernel (tests/test_kernels_sparse_attention_prefill.py: the
#      oracle at the Flash shape and the tiny one) and the mHC test changed in session 32 and never re-run
#      (tests/test_kernels_mhc.py -k bf16);
#   2. ONE process of benchmarks/decode_step.py --quick --no-decode --profile-prefill: one 8,192-token prefill of
#      Flash layer 2 by component for `default` and `wide` (SGLANG_DSV41_ATTN_PREFILL=wide: the workspace read by
#      kernels.sparse_attention_prefill), then `default` again (order effects), then the attention launch sweep;
#   3. the end-to-end teacher-forced contract with the `wide` prefill on every eager batch
#      (tests/test_runtime_triton_backend.py -k prefill_opt_ins: default and wide).
# Logs in $OUT/logs.tar.gz. Run from the checkout root with `.gpu` carried: bash scripts/gpu/session33a.sh
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
: "${BUDGET:=585}" "${PREFILL_S:=240}" "${PREFILL_VARIANTS:=default wide default}"
mkdir -p "$OUT/logs" "$OUT/tests"
gpu_setup
OUT=$OUT/tests BUDGET=$(left 420) TESTS="tests/test_kernels_sparse_attention_prefill.py" \
  bash scripts/gpu/gpu_tests_subset.sh
echo "== wide kernel tests rc=$?"
grep -h "of elements equal" "$OUT"/tests/*.log 2>/dev/null | head -4
OUT=$OUT/tests BUDGET=$(left 380) PYTEST_K="bf16" TESTS="tests/test_kernels_mhc.py" bash scripts/gpu/gpu_tests_subset.sh
echo "== mhc bf16 tests rc=$?"
b=$(cap "$PREFILL_S")
# shellcheck disable=SC2086
timeout -k 10 "$b" python3 benchmarks/decode_step.py --out "$OUT" --quick --no-decode --batches 1 \
  --profile-prefill --prefill-variants $PREFILL_VARIANTS --budget-s $((b - 30)) >"$OUT/logs/prefill.log" 2>&1
result prefill rc=$?
grep -v "^ " "$OUT/logs/prefill.log" | grep -v -i warn | tail -30
OUT=$OUT/tests BUDGET=$(left 5) PYTEST_K="prefill_opt_ins" TESTS="tests/test_runtime_triton_backend.py" \
  bash scripts/gpu/gpu_tests_subset.sh
echo "== contract rc=$?"
grep -hE "top-1|prefill workspace" "$OUT"/tests/*.log 2>/dev/null | head -6
pack_logs

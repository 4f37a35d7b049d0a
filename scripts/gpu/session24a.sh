#!/usr/bin/env bash
# H200 (one GPU), one device call (session 24; issue 21): the accuracy side of two decode changes.
#   1. pytest -m gpu: tests/test_kernels_bf16_linear.py (the BF16-weight kernel at Flash shapes: bound,
#      row bits within a tier, in-launch split-K sum) and tests/test_runtime_dense_ops_gpu.py (every
#      runtime linear within its bound with the new `triton` BF16 rows, the serving default);
#   2. the teacher-forced serving contracts of tests/test_runtime_triton_backend.py under the defaults
#      (BF16 products of < 129 rows on kernels/bf16_linear.py);
#   3. session23e.sh under SGLANG_DSV41_ATTN_DECODE=auto: the contracts with the BF16-row decode attention
#      as well, the gather-vs-packed equality, test_runtime_forward_gpu.py (refused for lack of device
#      time in session 23).
# Logs in $OUT/logs.tar.gz and $OUT/auto/logs.tar.gz.
# Run from the checkout root with `.gpu` carried: bash scripts/gpu/session24a.sh
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
: "${BUDGET:=570}" "${TEST_S:=150}" "${AUTO_S:=250}"
mkdir -p "$OUT/logs" "$OUT/tests" "$OUT/auto"
gpu_setup
OUT=$OUT/tests BUDGET=$TEST_S TESTS="tests/test_kernels_bf16_linear.py tests/test_runtime_dense_ops_gpu.py" \
  bash scripts/gpu/gpu_tests_subset.sh
echo "== bf16 kernel tests rc=$?"
grep -h "worst" "$OUT"/tests/*.log | head -30
timeout "$(cap 110)" python3 -m pytest -m gpu -q -s -p no:cacheprovider -rf --tb=short \
  -k "teacher_forced_contract and not flashmla" tests/test_runtime_triton_backend.py >"$OUT/logs/contract.log" 2>&1
result contract_default rc=$? "$(tail -1 "$OUT/logs/contract.log")"
grep -E "^(FAILED|E )|top-1 agreement" "$OUT/logs/contract.log" | head -12
b=$(( $(left) - 5 )); [ "$b" -lt "$AUTO_S" ] && AUTO_S=$b
OUT=$OUT/auto BUDGET=$AUTO_S SGLANG_DSV41_ATTN_DECODE=auto bash scripts/gpu/session23e.sh
result auto rc=$?
mv "$OUT"/tests/*.log "$OUT/logs/" 2>/dev/null; rmdir "$OUT/tests"
(cd "$OUT" && tar czf logs.tar.gz logs 2>/dev/null; rm -rf logs)
ls -R "$OUT"

#!/usr/bin/env bash
# H100 / H200 (one GPU), one device call (issue 21, session 33): `wide` as the serving default's prefill attention.
#   1. the CUDA forward's GPU tests (tests/test_runtime_forward_gpu.py: the scenario with every eager batch on the
#      prefill workspace, now read by kernels.sparse_attention_prefill) and the wide kernel's GPU tests;
#   2. the end-to-end teacher-forced contract with the prefill workspace on every eager batch: the default (`wide`)
#      and `bf16` (tests/test_runtime_triton_backend.py -k prefill_opt_ins);
#   3. the 8K prefill of Flash layer 2 by component: `default` (wide), `session32` (the workspace read by
#      sparse_attention), `default` again (decode_step.py --profile-prefill).
# Logs in $OUT/logs.tar.gz. Run from the checkout root with `.gpu` carried: bash scripts/gpu/session33c.sh
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
: "${BUDGET:=585}" "${PREFILL_S:=200}" "${PREFILL_VARIANTS:=default session32 default}"
mkdir -p "$OUT/logs" "$OUT/tests"
gpu_setup
OUT=$OUT/tests BUDGET=$(left 380) TESTS="tests/test_runtime_forward_gpu.py tests/test_kernels_sparse_attention_prefill.py" \
  bash scripts/gpu/gpu_tests_subset.sh
echo "== forward + wide kernel tests rc=$?"
OUT=$OUT/tests BUDGET=$(left 210) PYTEST_K="prefill_opt_ins" TESTS="tests/test_runtime_triton_backend.py" \
  bash scripts/gpu/gpu_tests_subset.sh
echo "== contract rc=$?"
b=$(cap "$PREFILL_S")
# shellcheck disable=SC2086
timeout -k 10 "$b" python3 benchmarks/decode_step.py --out "$OUT" --quick --no-decode --batches 1 \
  --profile-prefill --prefill-variants $PREFILL_VARIANTS --budget-s $((b - 30)) >"$OUT/logs/prefill.log" 2>&1
result prefill rc=$?
grep -v "^ " "$OUT/logs/prefill.log" | grep -v -i warn | tail -8
pack_logs

#!/usr/bin/env bash
# H100 / H200 (one GPU), one device call (issue 21, session 33): the indexer's prefill keys from a BF16 workspace
# (SGLANG_DSV41_INDEXER_PREFILL_KEYS=bf16, the default; decoded once per kv source and forward).
#   1. the CUDA forward's GPU tests (tests/test_runtime_forward_gpu.py: every eager batch on the workspaces);
#   2. the end-to-end teacher-forced contract with the workspaces on every eager batch (-k "prefill_opt_ins and default");
#   3. the 8K prefill of Flash layer 2 by component: `default`, `packed_keys` (the indexer on its packed keys).
# Logs in $OUT/logs.tar.gz. Run from the checkout root with `.gpu` carried: BUDGET=400 bash scripts/gpu/session33d.sh
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
: "${BUDGET:=585}" "${PREFILL_S:=130}" "${PREFILL_VARIANTS:=default packed_keys}"
mkdir -p "$OUT/logs" "$OUT/tests"
gpu_setup
b=$(cap "$PREFILL_S")
# shellcheck disable=SC2086
timeout -k 10 "$b" python3 benchmarks/decode_step.py --out "$OUT" --quick --no-decode --batches 1 \
  --profile-prefill --prefill-variants $PREFILL_VARIANTS --budget-s $((b - 30)) >"$OUT/logs/prefill.log" 2>&1
result prefill rc=$?
grep -v "^ " "$OUT/logs/prefill.log" | grep -v -i warn | tail -6
OUT=$OUT/tests BUDGET=$(left 75) TESTS="tests/test_runtime_forward_gpu.py" bash scripts/gpu/gpu_tests_subset.sh
echo "== forward tests rc=$?"
OUT=$OUT/tests BUDGET=$(left 5) PYTEST_K="prefill_opt_ins and default" TESTS="tests/test_runtime_triton_backend.py" \
  bash scripts/gpu/gpu_tests_subset.sh
echo "== contract rc=$?"
pack_logs

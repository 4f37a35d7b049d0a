#!/usr/bin/env bash
# H100 / H200 (one GPU), one short device call (issue 21, session 33): q and the attention output rotated in place
# (kernels.fused_elementwise.apply_rope_tail(in_place=True): only the rotated tail read and written).
#   1. the fused elementwise kernels' GPU cases (tests/test_kernels_fused_elementwise.py: the in-place rotation's bits);
#   2. the CUDA forward's GPU tests (tests/test_runtime_forward_gpu.py);
#   3. as the budget allows, the 8K prefill of Flash layer 2 by component (`default`).
# Logs in $OUT/logs.tar.gz. Run from the checkout root with `.gpu` carried: BUDGET=200 bash scripts/gpu/session33e.sh
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
: "${BUDGET:=585}"
mkdir -p "$OUT/logs" "$OUT/tests"
gpu_setup
OUT=$OUT/tests BUDGET=$(left 60) TESTS="tests/test_kernels_fused_elementwise.py tests/test_runtime_forward_gpu.py" \
  bash scripts/gpu/gpu_tests_subset.sh
echo "== elementwise + forward tests rc=$?"
b=$(cap 55)
if [ "$b" -gt 45 ]; then
  timeout -k 5 "$b" python3 benchmarks/decode_step.py --out "$OUT" --quick --no-decode --batches 1 \
    --profile-prefill --prefill-variants default --budget-s $((b - 15)) >"$OUT/logs/prefill.log" 2>&1
  result prefill rc=$?
  grep -v "^ " "$OUT/logs/prefill.log" | grep -v -i warn | grep "prefill default" | tail -2
fi
pack_logs

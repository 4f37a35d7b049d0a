#!/usr/bin/env bash
# H100 / H200 (one GPU), one device call (issue 21, session 34): the GPU tests of session 34's changes, then the
# 8K prefill of the tree before them against this tree, alternating:
#   1. pytest -m gpu: tests/test_kernels_fused_elementwise.py (the screened SwiGLU at 8,192 × 2,304: the exact
#      path's bits), tests/test_kernels_stacked_halves.py, tests/test_runtime_dense_ops_gpu.py (whole-rows BF16
#      operand used as is: the copied operand's bits), tests/test_kernels_fp8_w8a8.py (grouped wo_a written into its
#      output), tests/test_runtime_cuda_graph_gpu.py (its prefill-kernel assertion fixed), TEST_S at most;
#   2. benchmarks/decode_step.py --profile-prefill (variant `default`) for BASE (8ec6fb4, session 33's final tree)
#      and this tree, alternating (base, new, base, new), one process each: prefill_profile_{base,new}{1,2}.json.
# Make the base first (untracked; travels with the tree): git archive -o ab_base.tar 8ec6fb4 sglang_dsv41 kernels
# Run from the checkout root with `.gpu` carried: bash scripts/gpu/session34b.sh
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
: "${BUDGET:=585}" "${TEST_S:=260}" "${PREFILL_S:=70}"
mkdir -p "$OUT/logs" "$OUT/tests"
gpu_setup
OUT=$OUT/tests BUDGET=$TEST_S TESTS="tests/test_kernels_fused_elementwise.py tests/test_kernels_stacked_halves.py \
tests/test_runtime_dense_ops_gpu.py tests/test_kernels_fp8_w8a8.py tests/test_runtime_cuda_graph_gpu.py" \
  bash scripts/gpu/gpu_tests_subset.sh
echo "== gpu tests rc=$?"
base=/tmp/ab_base
rm -rf "$base" && mkdir -p "$base" && tar xf ab_base.tar -C "$base" && mv "$base/kernels" "$base/sglang_dsv41/kernels" || exit 4
prefill_ab() {  # label, then env assignments
  local label=$1 b; shift; b=$(cap "$PREFILL_S")
  mkdir -p "$OUT/$label"
  env "$@" timeout -k 10 "$b" python3 benchmarks/decode_step.py --out "$OUT/$label" --quick --no-decode --batches 1 \
    --profile-prefill --prefill-variants default --budget-s $((b > 40 ? b - 20 : 20)) >"$OUT/logs/prefill_$label.log" 2>&1
  result "prefill $label" rc=$?
  grep "^prefill " "$OUT/logs/prefill_$label.log" | tail -2
}
for i in 1 2; do
  prefill_ab "base$i" PYTHONPATH="$base:${PYTHONPATH:-}"
  prefill_ab "new$i"
done
pack_logs

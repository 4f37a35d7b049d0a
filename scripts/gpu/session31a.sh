#!/usr/bin/env bash
# H200 / H100 (one GPU), one device call (after session 30, which had no device; issue 21), most telling first:
#   1. pytest -m gpu: session 30's glue kernels at Flash shapes — tests/test_kernels_pair_state.py (ratio-2
#      pair latents + ring), tests/test_kernels_engram_rows.py (Engram rows + ring advance),
#      tests/test_kernels_indexer_tables.py (entry table + query tiles), tests/test_kernels_swa_window.py (SWA windows),
#      tests/test_kernels_fused_elementwise.py (`route_softplus` / `route_logits`: torch's sqrt and softplus bits;
#      RoPE into cache rows), session 31's tests/test_kernels_engram_gather.py (device-table lookups) and
#      tests/test_kernels_engram_gate.py (gate + residual update in one launch) — and
#      session 29's unrun hand-off cases (tests/test_kernels_fp8_fold.py,
#      tests/test_kernels_stacked_halves.py, tests/test_kernels_mhc.py), and the whole forward against the CPU
#      (tests/test_runtime_forward_gpu.py), TEST_S at most;
#   2. benchmarks/model_step.py (4 Flash-width layers, 8K context, side stream off / on) at N = 1 (one batch size needs
#      ≈ 80 s a process; session 31 ran this with 65 s and N = 1 / 8, and every row was skipped): the tree
#      before session 30 (BASE, b43e89e: session 29's default, quantised hand-off included) and this tree,
#      alternating (base, new, base, new), one process each. The new tree runs 192 fewer launches per 4-layer step on
#      the CPU census (benchmarks/decode_glue.py --pattern slice4).
# Make the base first (untracked; travels with the tree): git archive -o ab_base.tar b43e89e sglang_dsv41 kernels
# JSONs in $OUT/model_step_{base,new}{1,2}; logs in $OUT/logs.tar.gz. session31b.sh runs the rest.
# Run from the checkout root with `.gpu` carried: bash scripts/gpu/session31a.sh
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
: "${BUDGET:=580}" "${TEST_S:=250}" "${STEP_S:=80}"
mkdir -p "$OUT/logs" "$OUT/tests"
gpu_setup
OUT=$OUT/tests BUDGET=$TEST_S TESTS="tests/test_kernels_pair_state.py tests/test_kernels_engram_rows.py \
tests/test_kernels_indexer_tables.py tests/test_kernels_swa_window.py tests/test_kernels_fused_elementwise.py \
tests/test_kernels_fp8_fold.py tests/test_kernels_engram_gather.py tests/test_kernels_engram_gate.py \
tests/test_kernels_stacked_halves.py tests/test_kernels_mhc.py tests/test_runtime_forward_gpu.py" \
  bash scripts/gpu/gpu_tests_subset.sh
echo "== gpu tests rc=$?"
base=/tmp/ab_base
rm -rf "$base" && mkdir -p "$base" && tar xf ab_base.tar -C "$base" && mv "$base/kernels" "$base/sglang_dsv41/kernels" || exit 4
(cd benchmarks && PYTHONPATH="$base:${PYTHONPATH:-}" python3 -c "import sglang_dsv41.runtime.backend as b; print('base:', b.__file__, 'pair kernels' if hasattr(b.ComputeBackend, 'pair_latents') else 'torch pair state')" 2>&1 | tail -1)
for i in 1 2; do
  model_step "base$i" "1" "$STEP_S" PYTHONPATH="$base:${PYTHONPATH:-}"
  model_step "new$i" "1" "$STEP_S"
done
pack_logs

#!/usr/bin/env bash
# H200 (one GPU), one device call (session 27; issue 21): sessions 25-27's default changes in one call, when
# device time is short (it replaces session26.sh + session26b.sh); session 27's is the stacked wq_a | wkv
# product with its one-launch RMSNorm pair (runtime/stacked_linear.py, kernels/stacked_halves.py):
#   1. pytest -m gpu on the touched code, most telling first, until TEST_S is spent: the forward against the
#      CPU, CUDA-graph replay = eager, the MoE kernels (the routing plan's schedule against triton_kernels'),
#      the RoPE / elementwise kernels' BF16 outputs, the teacher-forced contracts, mHC, the side stream, the
#      MoE sublayer;
#   2. benchmarks/model_step.py (4 Flash-width layers, 8K context, side stream off / on) at N = 1 / 8 / 64,
#      the defaults, then MODEL_STEP_ACTIVATIONS=fp32 (activations in fp32 as before session 26): the
#      same-machine ratio of session 26's BF16 change at decode.
# JSONs in $OUT/model_step_{default,fp32}; logs in $OUT/logs.tar.gz.
# Run from the checkout root with `.gpu` carried: bash scripts/gpu/session27.sh
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
: "${BUDGET:=575}" "${TEST_S:=290}"
mkdir -p "$OUT/logs" "$OUT/tests"
gpu_setup
OUT=$OUT/tests BUDGET=$TEST_S \
  TESTS="tests/test_runtime_forward_gpu.py tests/test_runtime_cuda_graph_gpu.py tests/test_kernels_stacked_halves.py tests/test_kernels_moe_mxfp4.py \
tests/test_kernels_fused_elementwise.py tests/test_runtime_triton_backend.py tests/test_kernels_mhc.py \
tests/test_runtime_overlap_gpu.py tests/test_runtime_moe_ops.py" \
  bash scripts/gpu/gpu_tests_subset.sh
echo "== gpu tests rc=$?"
model_step default "1 8 64" 120
model_step fp32 "1 8 64" 120 MODEL_STEP_ACTIVATIONS=fp32
mv "$OUT"/tests/*.log "$OUT/logs/" 2>/dev/null; rmdir "$OUT/tests" 2>/dev/null
find "$OUT" -name "*.png" -delete
(cd "$OUT" && tar czf logs.tar.gz logs 2>/dev/null; rm -rf logs)
ls -R "$OUT"

#!/usr/bin/env bash
# H200 (one GPU), one device call (session 26; issue 21): session 26's default changes, never run on a GPU —
# activations held as BF16 where every reader takes BF16 (runtime/backend.py BF16_OUT) and the MoE tile
# schedule written by the routing plan's launch (kernels/moe_routing_plan.py):
#   1. pytest -m gpu on the touched code: the RoPE / mHC kernels' BF16 outputs, the routing plan against
#      triton_kernels' schedule, the forward against the CPU, CUDA-graph replay = eager, the side stream,
#      the MoE sublayer, the teacher-forced contracts (tests/test_runtime_triton_backend.py);
#   2. ONE process of benchmarks/decode_step.py --profile-prefill: one 8,192-token prefill of Flash layer 2 by
#      component, `default` against `fp32_activations` (the default with the activations in fp32 again,
#      benchmarks/prefill_profile.py VARIANTS): the same-run ratio of the BF16 change at prefill.
# The decode ratio is scripts/gpu/session26b.sh (next call, same warm machine).
# Logs in $OUT/logs.tar.gz. Run from the checkout root with `.gpu` carried: bash scripts/gpu/session26.sh
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
: "${BUDGET:=575}" "${TEST_S:=300}" "${PREFILL_S:=260}"
mkdir -p "$OUT/logs" "$OUT/tests"
gpu_setup
OUT=$OUT/tests BUDGET=$TEST_S \
  TESTS="tests/test_kernels_fused_elementwise.py tests/test_kernels_mhc.py tests/test_kernels_moe_mxfp4.py \
tests/test_runtime_forward_gpu.py tests/test_runtime_cuda_graph_gpu.py tests/test_runtime_overlap_gpu.py \
tests/test_runtime_moe_ops.py tests/test_runtime_triton_backend.py" \
  bash scripts/gpu/gpu_tests_subset.sh
echo "== gpu tests rc=$?"
b=$(( $(cap "$PREFILL_S") - 15 ))
if [ "$b" -gt 60 ]; then
  timeout $((b + 15)) python3 benchmarks/decode_step.py --out "$OUT" --quick --no-decode --batches 1 \
    --profile-prefill --prefill-variants default fp32_activations --budget-s "$b" >"$OUT/logs/prefill.log" 2>&1
  result prefill rc=$?
  grep -v "^ " "$OUT/logs/prefill.log" | grep -v -i warn | tail -24
else
  result prefill "skipped: $b s left"
fi
mv "$OUT"/tests/*.log "$OUT/logs/" 2>/dev/null; rmdir "$OUT/tests" 2>/dev/null
find "$OUT" -name "*.png" -delete
(cd "$OUT" && tar czf logs.tar.gz logs 2>/dev/null; rm -rf logs)
ls -R "$OUT"

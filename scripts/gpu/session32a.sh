#!/usr/bin/env bash
# H200 / H100 (one GPU), one device call (issue 21, session 32; session 22c's queue, never run, reordered so the
# timing comes first):
#   1. ONE process of benchmarks/decode_step.py --quick --no-decode --profile-prefill: one 8,192-token prefill of
#      Flash layer 2 by component for `default` (R held as BF16 since session 32), `fp32_residual` (R in fp32, the
#      default before), `flashmla` (the FlashMLA prefill opt-in, never timed) and `mhc_tc` (the mHC partial dots on
#      BF16 tensor cores, never timed) (benchmarks/prefill_profile.py VARIANTS; every variant's attention output and
#      selection compared with the first);
#   2. the FlashMLA prefill's GPU tests: the kernel against the Triton path at the Flash shape
#      (tests/test_runtime_attention_flashmla.py) and the end-to-end teacher-forced contract
#      (tests/test_runtime_triton_backend.py -k flashmla);
#   3. the CUDA forward with BF16 R against fp32 R (tests/test_runtime_forward_gpu.py -k bf16_residual), the mHC
#      GPU tests (tests/test_kernels_mhc.py: the `tc` partial dots, BF16 R == fp32 R bit for bit), then the CUDA
#      graph tests (tests/test_runtime_cuda_graph_gpu.py) as the budget allows.
# Logs in $OUT/logs.tar.gz. Run from the checkout root with `.gpu` carried: bash scripts/gpu/session32a.sh
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
: "${BUDGET:=585}" "${PREFILL_S:=300}" "${PREFILL_VARIANTS:=default fp32_residual flashmla mhc_tc}"
mkdir -p "$OUT/logs" "$OUT/tests"
gpu_setup
b=$(cap "$PREFILL_S")
# shellcheck disable=SC2086
timeout -k 10 "$b" python3 benchmarks/decode_step.py --out "$OUT" --quick --no-decode --batches 1 \
  --profile-prefill --prefill-variants $PREFILL_VARIANTS --budget-s $((b - 30)) >"$OUT/logs/prefill.log" 2>&1
result prefill rc=$?
grep -v "^ " "$OUT/logs/prefill.log" | grep -v -i warn | tail -30
OUT=$OUT/tests BUDGET=$(left 100) PYTEST_K="flashmla" \
  TESTS="tests/test_runtime_attention_flashmla.py tests/test_runtime_triton_backend.py" \
  bash scripts/gpu/gpu_tests_subset.sh
echo "== flashmla tests rc=$?"
grep -hE "top-1|FlashMLA" "$OUT"/tests/*.log 2>/dev/null | head -6
OUT=$OUT/tests BUDGET=$(left 60) PYTEST_K="bf16_residual" TESTS="tests/test_runtime_forward_gpu.py" \
  bash scripts/gpu/gpu_tests_subset.sh
echo "== forward with BF16 R rc=$?"
OUT=$OUT/tests BUDGET=$(left 40) TESTS="tests/test_kernels_mhc.py" bash scripts/gpu/gpu_tests_subset.sh
echo "== mhc tests rc=$?"
OUT=$OUT/tests BUDGET=$(left 5) TESTS="tests/test_runtime_cuda_graph_gpu.py" bash scripts/gpu/gpu_tests_subset.sh
echo "== graph tests rc=$?"
pack_logs

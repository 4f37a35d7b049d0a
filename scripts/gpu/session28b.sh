#!/usr/bin/env bash
# H200 (one GPU), one device call (session 28; issue 21), after session28a.sh:
#   1. pytest -m gpu on the files session 27's call did not reach (the Triton backend, mHC, the side stream,
#      the MoE sublayer), TEST_S at most;
#   2. benchmarks/model_step.py at N = 1 / 8 for two opt-ins never timed in the whole step, against the
#      default in the same call: SGLANG_DSV41_MHC_COEFF=registers (session 22) and
#      SGLANG_DSV41_MOE_DECODE_FLAGS=split_k=2 (session 25).
# JSONs in $OUT/model_step_<label>; logs in $OUT/logs.tar.gz.
# Run from the checkout root with `.gpu` carried: bash scripts/gpu/session28b.sh
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
: "${BUDGET:=570}" "${TEST_S:=300}"
mkdir -p "$OUT/logs" "$OUT/tests"
gpu_setup
OUT=$OUT/tests BUDGET=$TEST_S \
  TESTS="tests/test_runtime_triton_backend.py tests/test_kernels_mhc.py tests/test_runtime_overlap_gpu.py tests/test_runtime_moe_ops.py" \
  bash scripts/gpu/gpu_tests_subset.sh
echo "== gpu tests rc=$?"
model_step default "1 8" 85
model_step registers "1 8" 85 SGLANG_DSV41_MHC_COEFF=registers
model_step split2 "1 8" 85 SGLANG_DSV41_MOE_DECODE_FLAGS=split_k=2
mv "$OUT"/tests/*.log "$OUT/logs/" 2>/dev/null; rmdir "$OUT/tests" 2>/dev/null
find "$OUT" -name "*.png" -delete
(cd "$OUT" && tar czf logs.tar.gz logs 2>/dev/null; rm -rf logs)
ls -R "$OUT"

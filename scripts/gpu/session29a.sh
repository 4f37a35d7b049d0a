#!/usr/bin/env bash
# H200 / H100 (one GPU), one device call (after session 28; issue 21):
#   1. pytest -m gpu on what session 28 did not finish: cut 3's entry-index kernel (never on a GPU), the forward
#      against the CPU (cut off after 5 of 6), the FP8 GEMV tier's tests after their fix, the attention ops' GPU cases
#      (the attend memo), TEST_S at most;
#   2. benchmarks/model_step.py --profile of the default at N = 1 / 8 (stream_profile.py: exposed time per kernel;
#      a profiled process's timings are not an A/B — session29b.sh is).
# JSON in $OUT/model_step_profiled; logs in $OUT/logs.tar.gz.
# Run from the checkout root with `.gpu` carried: bash scripts/gpu/session29a.sh
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
: "${BUDGET:=560}" "${TEST_S:=380}"
mkdir -p "$OUT/logs" "$OUT/tests"
gpu_setup
OUT=$OUT/tests BUDGET=$TEST_S \
  TESTS="tests/test_kernels_entry_index.py tests/test_runtime_forward_gpu.py tests/test_kernels_fp8_gemv.py \
tests/test_runtime_attention_flashmla.py tests/test_kernels_entry_pack.py" \
  bash scripts/gpu/gpu_tests_subset.sh
echo "== gpu tests rc=$?"
MODEL_STEP_EXTRA=--profile model_step profiled "1 8" 150
mv "$OUT"/tests/*.log "$OUT/logs/" 2>/dev/null; rmdir "$OUT/tests" 2>/dev/null
find "$OUT" -name "*.png" -delete
(cd "$OUT" && tar czf logs.tar.gz logs 2>/dev/null; rm -rf logs)
ls -R "$OUT"

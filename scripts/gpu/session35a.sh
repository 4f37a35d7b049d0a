#!/usr/bin/env bash
# H100 / H200 (one GPU), one device call (issue 21; prepared in session 34, whose device time ran out): the
# contracts and timings two candidate defaults need —
#   1. the teacher-forced contract with the indexer's fp32 head sum on every eager batch
#      (tests/test_runtime_triton_backend.py -k "prefill_opt_ins", its `fp32_head_sum` case beside `default`
#      and `bf16`) and with the BF16-product opt-ins `triton` / `direct` (-k bf16_gemm_opt_in); the cases as run,
#      at b047551 — since session 35's defaults they are `fp64_head_sum` and `whole`;
#   2. the 8K prefill profile of `default` against `new` (= default + the fp32 head sum) in one process;
#   3. the whole model's decode step at N = 1 / 8 with SGLANG_DSV41_BF16_GEMM=direct against `whole` (the default
#      until session 35 made `direct` one; named explicitly since), STEP_S each (model_step needs ≈ 110 s for two
#      batch sizes cold, ≈ 30 s warm; below ≈ 70 s it measures nothing).
# Run from the checkout root with `.gpu` carried: bash scripts/gpu/session35a.sh. The second alternation, on the
# machine this call leaves warm: STEPS_ONLY=1 ROUND=2 BUDGET=300 bash scripts/gpu/session35a.sh
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
: "${BUDGET:=590}" "${STEP_S:=115}" "${ROUND:=1}" "${STEPS_ONLY:=0}"
mkdir -p "$OUT/logs" "$OUT/tests"
gpu_setup
if [ "$STEPS_ONLY" = 0 ]; then
  OUT=$OUT/tests BUDGET=$(left 330) PYTEST_K="prefill_opt_ins or bf16_gemm_opt_in" \
    TESTS="tests/test_runtime_triton_backend.py" bash scripts/gpu/gpu_tests_subset.sh
  echo "== contracts rc=$?"
  prefill_profile "default new" 100
fi
model_step "whole$ROUND" "1 8" "$STEP_S" SGLANG_DSV41_BF16_GEMM=whole
model_step "direct$ROUND" "1 8" "$STEP_S" SGLANG_DSV41_BF16_GEMM=direct
rm -f "$OUT/decode_step.json"
pack_logs

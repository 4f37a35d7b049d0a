#!/usr/bin/env bash
# H200 (one GPU), one device call (session 25; issue 21): split-K for the routed-expert GEMMs at decode
# (SGLANG_DSV41_MOE_DECODE_FLAGS=split_k=S, kernels/moe_mxfp4_flags.py: triton_kernels' MX refusal lifted):
#   1. pytest -m gpu tests/test_kernels_moe_mxfp4.py -k decode_flags (every flag set within the routed bound,
#      split_k=2 / 4 at T = 1 and split_k=2 at T = 8);
#   2. benchmarks/model_step.py at N = 1 / 2 / 4 / 8 / 16: the defaults, split_k=2, split_k=4.
# JSONs in $OUT/model_step_{default,split2,split4}; logs in $OUT/logs.tar.gz.
# Run from the checkout root with `.gpu` carried: bash scripts/gpu/session25b.sh
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
: "${BUDGET:=575}" "${TEST_S:=150}"
mkdir -p "$OUT/logs" "$OUT/tests"
gpu_setup
OUT=$OUT/tests BUDGET=$TEST_S PYTEST_K="decode_flags" TESTS="tests/test_kernels_moe_mxfp4.py" \
  bash scripts/gpu/gpu_tests_subset.sh
echo "== gpu tests rc=$?"
model_step default "1 2 4 8 16" 130 SGLANG_DSV41_MOE_DECODE_FLAGS=
model_step split2 "1 2 4 8 16" 130 SGLANG_DSV41_MOE_DECODE_FLAGS=split_k=2
model_step split4 "1 2 4 8 16" 130 SGLANG_DSV41_MOE_DECODE_FLAGS=split_k=4
mv "$OUT"/tests/*.log "$OUT/logs/" 2>/dev/null; rmdir "$OUT/tests"
find "$OUT" -name "*.png" -delete
(cd "$OUT" && tar czf logs.tar.gz logs 2>/dev/null; rm -rf logs)
ls -R "$OUT"

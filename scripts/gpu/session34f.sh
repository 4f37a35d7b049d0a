#!/usr/bin/env bash
# H100 / H200 (one GPU), one device call (issue 21, session 34):
#   1. pytest -m gpu tests/test_kernels_fused_elementwise.py: the screened SwiGLU with its correctly rounded
#      division (the exact path's bits at 8,192 × 2,304), RoPE's wide prefill programs (the narrow programs' bits),
#      RoPE in place, the Flash widths and graph capture;
#   2. the 8K prefill profile (`default`): the RoPE component with the wide programs;
#   3. benchmarks/mhc_tc_sweep.py: the `tc` mHC partial-dot launch shapes at 8,192 tokens.
# Run from the checkout root with `.gpu` carried: bash scripts/gpu/session34f.sh
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
: "${BUDGET:=330}"
mkdir -p "$OUT/logs" "$OUT/tests"
gpu_setup
OUT=$OUT/tests BUDGET=$(left 200) TESTS="tests/test_kernels_fused_elementwise.py" bash scripts/gpu/gpu_tests_subset.sh
echo "== gpu tests rc=$?"
timeout 60 python3 -m pytest -m gpu -q -s -p no:cacheprovider tests/test_kernels_fused_elementwise.py -k swiglu_screen 2>&1 \
  | grep "swiglu screen"
prefill_profile default 80
timeout -k 5 "$(cap 120)" python3 benchmarks/mhc_tc_sweep.py --out "$OUT" >"$OUT/logs/mhc_tc_sweep.log" 2>&1
result mhc_tc_sweep rc=$?
cat "$OUT/logs/mhc_tc_sweep.log" | tail -12
rm -f "$OUT/decode_step.json"
pack_logs

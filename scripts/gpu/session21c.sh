#!/usr/bin/env bash
# H200 (one GPU), one device call (session 21; issue 21): the merged mHC and FP8 changes on the GPU, then the
# graphed layer step with everything the session changed.
#   mhc     `pytest -m gpu tests/test_kernels_mhc.py` (cap 90 s): the one-launch `fused` coefficients (kernels/
#           mhc_decode.py) at Flash width, T 1..256: bound, counters back to zero, batch invariance, capture;
#   fp8     `pytest -m gpu` of tests/test_kernels_fp8_w8a8.py and tests/test_kernels_fp8_w8a8_out.py (cap 70 s):
#           the fp32 output in the GEMM's own stores, swap-AB;
#   router  `pytest -m gpu tests/test_runtime_moe_ops.py -k softplus` (cap 30 s);
#   mhcb    benchmarks/mhc_decode.py (cap 60 s): dot / rows / fused µs per T, `fit_fused_max_tokens`;
#   step    benchmarks/decode_step.py --quick --batches 1 8 64 256 --no-prefill --profile (cap 140 s);
#   contract `pytest -m gpu tests/test_runtime_triton_backend.py` with what is left (the serving path's
#           end-to-end contract: greedy agreement, top-1 and |Δlogit| against the reference).
# STEPS (default "mhc fp8 router mhcb step contract"). Run from the checkout root with `.gpu` carried:
# bash scripts/gpu/session21c.sh
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
: "${BUDGET:=590}" "${STEPS:=mhc fp8 router mhcb step contract}"
mkdir -p "$OUT/tests" "$OUT/mhc" "$OUT/step"
subset() {  # CAP TESTS [K]
  OUT=$OUT/tests BUDGET=$(cap "$1") TESTS=$2 PYTEST_K=${3:-} bash scripts/gpu/gpu_tests_subset.sh
  echo "== $2 rc=$?"
}
for step in $STEPS; do
  case $step in
    mhc) subset 90 tests/test_kernels_mhc.py ;;
    fp8) subset 70 "tests/test_kernels_fp8_w8a8.py tests/test_kernels_fp8_w8a8_out.py" ;;
    router) subset 30 tests/test_runtime_moe_ops.py softplus ;;
    mhcb) gpu_setup; t=$(cap 60)
          timeout -s INT -k 5 "$t" python3 benchmarks/mhc_decode.py --out "$OUT/mhc" 2>&1 | grep -v -i warn | tail -14
          result mhc_decode rc="${PIPESTATUS[0]}" ;;
    step) gpu_setup; t=$(cap 140)
          timeout -s INT -k 10 "$t" python3 benchmarks/decode_step.py --quick --batches 1 8 64 256 --no-prefill \
            --profile --profile-fp8 w8a8_f16 --budget-s $((t - 20)) --out "$OUT/step" 2>&1 | grep -v -i warn | tail -12
          result decode_step rc="${PIPESTATUS[0]}" ;;
    contract) subset "$(left 5)" tests/test_runtime_triton_backend.py ;;
    *) echo "unknown step $step" ;;
  esac
done
rm -f "$OUT"/tests/compileall.log "$OUT"/tests/pip-editable.log

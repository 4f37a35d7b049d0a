#!/usr/bin/env bash
# H200 (one GPU), one device call (session 22; issue 21):
#   1. benchmarks/fp8_w8a8.py --sweep: decode and mid-tier configurations per Flash weight shape
#      (SHAPE_CONFIGS suggestions for kernels/fp8_w8a8.py);
#   2. pytest -m gpu: the MXFP4 decode-flag candidates (split_k among them) within the routed bound,
#      sparse attention (split-merge grid over column blocks), mHC (register coefficient kernel), the
#      fused elementwise helpers (128-element programs at decode), the key gather and the FlashMLA
#      decode opt-in against the Triton kernel;
#   3. benchmarks/mhc_decode.py (rows / dot / fused / *_regcoef coefficient ops).
# The step itself (variants, profile) is session23b.sh (it replaced session22b.sh), a call of its own.
# Logs go into one archive ($OUT/logs.tar.gz); JSONs beside it.
# Run from the checkout root with `.gpu` carried: bash scripts/gpu/session22a.sh
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
: "${BUDGET:=540}" "${SWEEP_S:=178}" "${TEST_S:=240}"
mkdir -p "$OUT/fp8" "$OUT/tests" "$OUT/mhc" "$OUT/logs"
gpu_setup
timeout -s INT -k 10 "$(cap "$SWEEP_S")" python3 benchmarks/fp8_w8a8.py --sweep --jobs 12 --budget-s $((SWEEP_S - 28)) \
  --cap-s 0.02 --out "$OUT/fp8" >"$OUT/logs/fp8_sweep.log" 2>&1
result fp8_sweep rc=$?
grep -v -i warn "$OUT/logs/fp8_sweep.log" | tail -45
t_end=$(( SECONDS + TEST_S ))
OUT=$OUT/tests BUDGET=$(( TEST_S * 2 / 5 )) TESTS=tests/test_kernels_moe_mxfp4.py PYTEST_K=decode_flags \
  bash scripts/gpu/gpu_tests_subset.sh
echo "== moe flag tests rc=$?"
OUT=$OUT/tests BUDGET=$(( t_end - SECONDS )) \
  TESTS="tests/test_kernels_key_gather.py tests/test_kernels_sparse_attention.py tests/test_kernels_mhc.py tests/test_kernels_fused_elementwise.py" \
  bash scripts/gpu/gpu_tests_subset.sh
echo "== kernel tests rc=$?"
b=$(( $(left) - 8 ))
if [ "$b" -gt 20 ]; then
  timeout -s INT -k 5 "$b" python3 benchmarks/mhc_decode.py --out "$OUT/mhc" >"$OUT/logs/mhc_decode.log" 2>&1
  result mhc_decode rc=$?
  tail -15 "$OUT/logs/mhc_decode.log"
fi
mv "$OUT"/tests/*.log "$OUT/logs/" 2>/dev/null
(cd "$OUT" && tar czf logs.tar.gz logs tests fp8/*.png mhc/*.png 2>/dev/null; rm -rf logs tests)
find "$OUT" -name "*.png" -delete
ls -R "$OUT"

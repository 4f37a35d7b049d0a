#!/usr/bin/env bash
# H200 (one GPU), one device call (session 22; issue 21):
#   1. benchmarks/fp8_w8a8.py --sweep: decode and mid-tier configurations per Flash weight shape
#      (SHAPE_CONFIGS suggestions for kernels/fp8_w8a8.py);
#   2. pytest -m gpu: the MXFP4 decode-flag candidates (split_k among them) within the routed bound,
#      sparse attention (split-merge grid over column blocks), mHC (register coefficient kernel), the
#      fused elementwise helpers (128-element programs at decode);
#   3. decode_step.py --quick --batches 1 8 --variants --profile: the step after this session's changes,
#      the MoE flag sets as variants (KERNEL_VARIANTS_MOE_FLAGS), and the per-kernel profile;
#   4. benchmarks/mhc_decode.py (rows / dot / fused / *_regcoef coefficient ops).
# Logs go into one archive ($OUT/logs.tar.gz); JSONs beside it.
# Run from the checkout root with `.gpu` carried: bash scripts/gpu/session22a.sh
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
: "${BUDGET:=570}" "${SWEEP_S:=178}" "${TEST_S:=150}"
mkdir -p "$OUT/fp8" "$OUT/tests" "$OUT/step" "$OUT/mhc" "$OUT/logs"
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
  TESTS="tests/test_kernels_sparse_attention.py tests/test_kernels_mhc.py tests/test_kernels_fused_elementwise.py" \
  bash scripts/gpu/gpu_tests_subset.sh
echo "== kernel tests rc=$?"
b=$(( $(left) - 60 ))
if [ "$b" -gt 60 ]; then
  KERNEL_VARIANTS_MOE_FLAGS="split_k=2;split_k=4;block_k=256;num_stages=5" \
  timeout -s INT -k 10 "$b" python3 benchmarks/decode_step.py --quick --batches 1 8 --no-prefill --variants \
    --profile --profile-fp8 w8a8_f16 --budget-s $((b - 20)) --out "$OUT/step" >"$OUT/logs/decode_step.log" 2>&1
  result decode_step rc=$?
  grep -v -i warn "$OUT/logs/decode_step.log" | tail -30
else
  result decode_step "skipped: $b s left"
fi
b=$(( $(left) - 8 ))
if [ "$b" -gt 20 ]; then
  timeout -s INT -k 5 "$b" python3 benchmarks/mhc_decode.py --out "$OUT/mhc" >"$OUT/logs/mhc_decode.log" 2>&1
  result mhc_decode rc=$?
  tail -15 "$OUT/logs/mhc_decode.log"
fi
mv "$OUT"/tests/*.log "$OUT/logs/" 2>/dev/null
(cd "$OUT" && tar czf logs.tar.gz logs tests fp8/*.png step/*.png mhc/*.png 2>/dev/null; rm -rf logs tests)
find "$OUT" -name "*.png" -delete
ls -R "$OUT"

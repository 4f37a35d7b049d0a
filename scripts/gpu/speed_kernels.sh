#!/usr/bin/env bash
# H200 (one GPU), one device call (issue 21, branch speed): the W8A8 FP8 GEMM's GPU tests, its benchmark
# against today's W8A16 kernel and cuBLAS BF16, and the routed-expert benchmark (ours, Marlin, FlashInfer
# CUTLASS when its nvcc JIT build — started first, in the background, niced — finishes in time).
# Run from the checkout root with `.gpu` carried. Every step is capped; logs and results in $OUT.
# Knobs: STEPS (default "tests fp8 moe", run in that order), FP8_ARGS / MOE_ARGS (extra benchmark
# arguments), JIT=0 skips the FlashInfer build, BUDGET (s, default 540: the script ends by then),
# TEST_CAP / FP8_CAP / MOE_CAP (s, per step, each also bounded by what is left of BUDGET).
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
BUDGET=${BUDGET:-540}
gpu_setup
export CUDA_HOME=/usr/local/cuda PATH=/usr/local/cuda/bin:$PATH
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader
MARK=/tmp/flashinfer_moe_ready; JP=
objects() { find /tmp/cache /root/.cache -name '*.o' -path '*fused_moe_90*' 2>/dev/null | wc -l; }
if [ "${JIT:-1}" = 1 ]; then
  MAX_JOBS=10 nice -n 19 timeout "$(left 30)" python3 scripts/gpu/flashinfer_moe_jit.py $MARK >"$OUT/flashinfer_jit.log" 2>&1 & JP=$!
fi
for step in ${STEPS:-tests fp8 moe}; do
  case $step in
    tests) timeout "$(cap "${TEST_CAP:-150}")" python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_kernels_fp8_w8a8.py 2>&1 \
             | tee "$OUT/gpu_tests.log" | tail -15 ;;
    fp8) timeout "$(cap "${FP8_CAP:-200}")" python3 benchmarks/fp8_w8a8.py --out "$OUT" ${FP8_ARGS:-} 2>&1 \
             | tee "$OUT/fp8_w8a8.log" | tail -12 ;;
    moe) [ -n "$JP" ] && ! [ -e $MARK ] && echo "flashinfer JIT still building at $((SECONDS - T0)) s: $(objects) objects"
         timeout "$(cap "${MOE_CAP:-300}")" python3 benchmarks/moe_mxfp4.py --out "$OUT" --flashinfer-ready $MARK ${MOE_ARGS:-} 2>&1 \
             | tee "$OUT/moe_mxfp4.log" | tail -12 ;;
    *) echo "unknown step $step"; continue ;;
  esac
  result "$step" rc="${PIPESTATUS[0]}"
done
if [ -n "$JP" ]; then
  kill $JP 2>/dev/null
  echo "flashinfer JIT: marker=$(cat $MARK 2>/dev/null || echo none); objects built: $(objects) of" \
       "$(find /tmp/cache /root/.cache -name '*.ninja' -path '*fused_moe_90*' -exec grep -c '^build .*\.o:' {} + 2>/dev/null | head -1)"
  tail -5 "$OUT/flashinfer_jit.log"
fi
result "done"

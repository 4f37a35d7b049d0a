#!/usr/bin/env bash
# H200 (one GPU), one device call (session 23; issue 21): the GPU tests of every change not yet run on a
# GPU (sessions 22-23), then the whole model's decode step with the side stream off and on.
#   1. pytest -m gpu: the indexer (packed keys decoded by parity: every payload x scale byte, packed =
#      BF16-key scores at Flash shapes), the side stream (tests/test_runtime_overlap_gpu.py: eager and
#      graph replay bit-equal to inline), the key gather, sparse attention (split-merge grid), fused
#      elementwise (128-element programs), mHC (tc, registers), the MXFP4 decode-flag candidates;
#   2. benchmarks/model_step.py: 4 Flash-width layers, dummy weights, context 8K, batch 1 / 8 / 64 / 256,
#      SGLANG_DSV41_OVERLAP off and on (step us, bits equal).
# Logs in $OUT/logs.tar.gz; JSON in $OUT/model_step.
# Run from the checkout root with `.gpu` carried: bash scripts/gpu/session23a.sh
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
: "${BUDGET:=560}" "${TEST_S:=300}"
mkdir -p "$OUT/tests" "$OUT/model_step" "$OUT/logs"
gpu_setup
t_end=$(( SECONDS + TEST_S ))
OUT=$OUT/tests BUDGET=$(( TEST_S / 2 )) \
  TESTS="tests/test_kernels_indexer.py tests/test_runtime_overlap_gpu.py tests/test_kernels_key_gather.py tests/test_kernels_fused_elementwise.py" \
  bash scripts/gpu/gpu_tests_subset.sh
echo "== tests (indexer, overlap, gather, elementwise) rc=$?"
OUT=$OUT/tests BUDGET=$(( t_end - SECONDS )) \
  TESTS="tests/test_kernels_sparse_attention.py tests/test_kernels_mhc.py" bash scripts/gpu/gpu_tests_subset.sh
echo "== tests (attention, mhc) rc=$?"
b=$(( $(left) - 15 ))
if [ "$b" -gt 60 ]; then
  timeout -s INT -k 10 "$b" python3 benchmarks/model_step.py --layers 4 --batches 1 8 64 256 --context 8192 \
    --cap-s 0.5 --budget-s $((b - 60)) --out "$OUT/model_step" >"$OUT/logs/model_step.log" 2>&1
  result model_step rc=$?
  grep -v -i warn "$OUT/logs/model_step.log" | tail -8
fi
b=$(( $(left) - 8 ))
if [ "$b" -gt 40 ]; then
  OUT=$OUT/tests BUDGET=$b TESTS=tests/test_kernels_moe_mxfp4.py PYTEST_K=decode_flags bash scripts/gpu/gpu_tests_subset.sh
  echo "== moe flag tests rc=$?"
fi
mv "$OUT"/tests/*.log "$OUT/logs/" 2>/dev/null
(cd "$OUT" && tar czf logs.tar.gz logs tests 2>/dev/null; rm -rf logs tests)
ls -R "$OUT"

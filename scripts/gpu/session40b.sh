#!/usr/bin/env bash
# H100 / H200 (one GPU), one device call (issue 21, session 40): where an eager forward's host time goes.
# The tiny server's TTFT at concurrency 1 is 5× the tiny Llama's with the default prefill graphs (a 1K prompt
# is above every bucket and runs eagerly), so the host time of that eager forward is the gap.
# benchmarks/hit_extend.py on the tiny checkpoint, one request of 1,024 / 32 / 1 new tokens after no prefix,
# with --cprofile: per case the wall, host and GPU-busy ms, then one forward under cProfile (the functions
# and packages the host time goes to). Run from the checkout root with `.gpu` carried:
#   BUDGET=330 bash scripts/gpu/session40b.sh
# Then (TESTS=0 skips it) the GPU tests of the kernel modules session 40 split (kernels/fp8_w8a8_configs.py,
# kernels/sparse_attention_plan.py: code moved, so the compiled kernels must still pass).
# Results: $OUT/hit_extend.json, $OUT/summary.txt, $OUT/split_tests.xml.
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
BUDGET=${BUDGET:-330}; SUMMARY=$OUT/summary.txt
gpu_setup
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$SUMMARY"
tiny_checkpoint /tmp/tiny || exit 4
result checkpoint
timeout -s TERM -k 20 "$(left 15)" python3 benchmarks/hit_extend.py --model-path /tmp/tiny --prefixes 0 \
    --new-tokens 1024 32 1 --chunk 0 0 --reps 5 --cprofile --out "$OUT/hit_extend.json" 2>&1 \
    | grep -v -i warn | tail -60 | tee -a "$SUMMARY"
rc=${PIPESTATUS[0]}
result hit_extend rc=$rc
if [ "${TESTS:-1}" = 1 ]; then
  timeout -s INT -k 10 "$(cap 150)" python3 -m pytest -m gpu -q -p no:cacheprovider --junitxml "$OUT/split_tests.xml" \
    tests/test_kernels_fp8_w8a8.py tests/test_kernels_sparse_attention.py >"$OUT/split_tests.log" 2>&1
  tests_result split_kernel_gpu_tests "$OUT/split_tests.xml" $?
  tail -3 "$OUT/split_tests.log" | tee -a "$SUMMARY"
fi
exit $rc

#!/usr/bin/env bash
# H100 or H200, device calls on one warm machine (issue 21, session 44). Run from the checkout root with `.gpu`
# carried:
#   STEPS="attn tests" BUDGET=480 bash scripts/gpu/session44.sh
#   STEPS="tests width profile" BUDGET=500 bash scripts/gpu/session44.sh
#   TESTS="tests/test_kernels_indexer.py tests/test_runtime_cuda_graph_gpu.py" STEPS="tests width profile" \
#     BUDGET=420 bash scripts/gpu/session44.sh
# Steps (STEPS, in this order by default):
#   attn     benchmarks/attention_prefill.py at the 8K Flash prefill shape: the `wide` kernel as served, its
#            launch configurations, and P·V in one product (`wide_pv_bf16`: P rounded to BF16, FlashMLA's
#            numerics, a bound; `wide_pv_fp16`: P and the key tile in FP16; `wide_fp16_rows`: q and the rows
#            given as FP16)
#   tests    the GPU tests of the changed kernels: the indexer and its tables (kernel cases compiled: the unfilled scores and tables,
#            the bounded rankings), the prefill attention (the fp16 P·V at the Flash shape) and decode graph
#            replay == eager (static layouts now leave the scores past visibility unwritten)
#   width    session43.sh's `width` step: benchmarks/model_step.py, 4 Flash-width layers, requests of 8K tokens,
#            N = 1 / 64 / 256, tables 8K / 64K / 256K / 1M wide (the 1M / 8K ratio against session 43's)
#   profile  session43.sh's `profile` step: the same at N = 1 / 256, tables 8K and 1M, each graph's replays traced
# TESTS overrides the test files. Results: $OUT/summary.txt, $OUT/tests.xml, $OUT/attn/attention_prefill.json, $OUT/model_step_*/model_step.json.
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
BUDGET=${BUDGET:-480}; SUMMARY=$OUT/summary.txt
gpu_start
for step in ${STEPS:-attn tests}; do
  case $step in
    attn)
      timeout -s INT -k 10 "$(cap 150)" python3 benchmarks/attention_prefill.py --out "$OUT/attn" \
        >"$OUT/logs/attn.log" 2>&1
      result attn rc=$?
      grep -E "^(bf16|wide)" "$OUT/logs/attn.log" | cut -c1-200 | tee -a "$SUMMARY" ;;
    tests)
      timeout -s INT -k 10 "$(cap 300)" python3 -m pytest -m gpu -q -p no:cacheprovider --junitxml "$OUT/tests.xml" \
        ${TESTS:-tests/test_kernels_indexer.py tests/test_kernels_indexer_tables.py \
        tests/test_kernels_sparse_attention_prefill.py tests/test_runtime_cuda_graph_gpu.py} >"$OUT/logs/tests.log" 2>&1
      tests_result gpu_tests "$OUT/tests.xml" $?
      grep -E "passed|failed|Error" "$OUT/logs/tests.log" | tail -6 | cut -c1-300 | tee -a "$SUMMARY" ;;
    width|profile)    # session 43's steps (bounded rankings, its default) on this checkout's code
      STEPS=$step BUDGET=$(left 5) bash "$(dirname "$0")/session43.sh" ;;
    *) echo "unknown step $step" ;;
  esac
done
find "$OUT" -name "*.png" -delete
result done

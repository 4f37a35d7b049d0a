#!/usr/bin/env bash
# H100 or H200, two device calls on one warm machine (issue 21, session 43): the GPU tests of session 42's final
# code and of the bounded rankings, and what the served context length costs a decode step. Run from the
# checkout root with `.gpu` carried:
#   STEPS=tests BUDGET=290 bash scripts/gpu/session43.sh
#   STEPS="width_off width" BUDGET=440 bash scripts/gpu/session43.sh
# Steps (STEPS, in this order by default):
#   tests      the GPU tests of the code session 42 changed last (`_decoded_rows` takes the part's name: the
#              entry decode, the prefill graph server with 512 / 1,024 buckets against eager, the GPU forward,
#              the FlashMLA inputs) and of session 43's bounded rankings (`select_topk(lengths=)` at a 1M
#              served context, the indexer's kernels, decode graph replay == eager)
#   width      benchmarks/model_step.py, 4 Flash-width layers, requests of 8K tokens, side stream on, at N = 1 /
#              64 / 256 with request-to-token tables 8K, 64K, 256K and 1M wide: the static decode layout's bound
#              is the served --context-length (Flash's default is 1M), and the indexer's score rows, rankings
#              and entry tables are sized by it (docs/runtime.md "CUDA-graph padding"); the peak memory of each
#              case. `width_off`: the same with SGLANG_DSV41_TOPK_BOUNDED=off (the rankings read the
#              static width, as before session 43)
#   profile    the same model at N = 1 / 256, tables 8K and 1M wide, each graph's replays traced
#              (`--profile`: exposed time per kernel): what still scales with the served context
#              (third call: STEPS=profile BUDGET=250)
# Results: $OUT/summary.txt, $OUT/tests.xml, $OUT/model_step_{width,width_off,profile}/model_step.json, $OUT/logs/.
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
BUDGET=${BUDGET:-480}; SUMMARY=$OUT/summary.txt
gpu_start
for step in ${STEPS:-tests width}; do
  case $step in
    tests)
      timeout -s INT -k 10 "$(cap 270)" python3 -m pytest -m gpu -q -p no:cacheprovider --junitxml "$OUT/tests.xml" \
        tests/test_kernels_entry_decode.py tests/test_runtime_prefill_graph_server_gpu.py \
        tests/test_runtime_forward_gpu.py tests/test_runtime_attention_flashmla.py tests/test_kernels_indexer.py \
        tests/test_runtime_cuda_graph_gpu.py >"$OUT/logs/tests.log" 2>&1
      tests_result gpu_tests "$OUT/tests.xml" $?
      grep -E "passed|failed|Error" "$OUT/logs/tests.log" | tail -6 | cut -c1-300 | tee -a "$SUMMARY" ;;
    width|width_off)
      bounded=on; [ "$step" = width_off ] && bounded=off
      MODEL_STEP_EXTRA="--modes on --table-width ${WIDTHS:-8192 65536 262144 1048576}" \
        model_step "$step" "${WIDTH_BATCHES:-1 64 256}" "${CAP_WIDTH:-200}" SGLANG_DSV41_TOPK_BOUNDED=$bounded \
        | cut -c1-400 | tee -a "$SUMMARY" ;;
    profile)
      MODEL_STEP_EXTRA="--modes on --profile --table-width 8192 1048576" \
        model_step profile "${PROFILE_BATCHES:-1 256}" "${CAP_PROFILE:-200}" | cut -c1-600 | tee -a "$SUMMARY" ;;
    *) echo "unknown step $step" ;;
  esac
done
find "$OUT" -name "*.png" -delete
result done

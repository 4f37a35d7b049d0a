#!/usr/bin/env bash
# H100 / H200 (one GPU), one device call (issue 21, session 37: split-KV for the `wide` attention kernel at
# decode). Run from the checkout root with `.gpu` carried:
#   BUDGET=590 bash scripts/gpu/session37.sh
# Steps (STEPS, in this order by default):
#   tests     the wide kernel's GPU tests (its decode splits included)
#   ops       the GPU tests of the modules that use the attention ops (session 38 moved the CPU ops out of
#             runtime/attention_ops.py; the CUDA side changed only imports)
#   bench     benchmarks/attention_decode.py: the serving decode kernel against `wide` with key splits at
#             BATCHES (default 1 8 16 64 256), each output checked against the oracle first
#   contract  the teacher-forced contract with SGLANG_DSV41_ATTN_DECODE=wide
#   step      the whole 4-layer model's decode step at STEP_BATCHES (default 1 8 64) with the serving default
#             (`auto`) and with `wide`, STEP_S each
# Results: $OUT/summary.txt, $OUT/attention_decode.json / .png, $OUT/model_step_{auto,wide}/, $OUT/*.xml,
# $OUT/logs.tar.gz.
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
BUDGET=${BUDGET:-590}; SUMMARY=$OUT/summary.txt; STEP_S=${STEP_S:-130}
mkdir -p "$OUT/logs" "$OUT/tests"
gpu_setup
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader | tee "$SUMMARY"
for step in ${STEPS:-tests bench contract step}; do
  case $step in
    tests)
      timeout -s INT -k 10 "$(cap 120)" python3 -m pytest -m gpu -q -p no:cacheprovider --junitxml "$OUT/wide_tests.xml" \
        tests/test_kernels_sparse_attention_prefill.py >"$OUT/tests/wide_tests.log" 2>&1
      tests_result wide_attention_gpu_tests "$OUT/wide_tests.xml" $? ;;
    ops)
      timeout -s INT -k 10 "$(cap 180)" python3 -m pytest -m gpu -q -p no:cacheprovider --junitxml "$OUT/ops_tests.xml" \
        tests/test_runtime_forward_gpu.py tests/test_kernels_key_gather.py tests/test_runtime_attention_flashmla.py \
        tests/test_runtime_cuda_graph_gpu.py >"$OUT/tests/ops_tests.log" 2>&1
      tests_result attention_ops_gpu_tests "$OUT/ops_tests.xml" $? ;;
    bench)
      # shellcheck disable=SC2086
      timeout -k 10 "$(cap 200)" python3 benchmarks/attention_decode.py --out "$OUT" --batches ${BATCHES:-1 8 16 64 256} \
        --splits 1 2 5 10 >"$OUT/logs/bench.log" 2>&1
      result attention_decode rc=$?
      grep "^N=" "$OUT/logs/bench.log" | tee -a "$SUMMARY" ;;
    contract)
      timeout -s INT -k 10 "$(cap 150)" python3 -m pytest -m gpu -q -s -p no:cacheprovider --junitxml "$OUT/contract.xml" \
        tests/test_runtime_triton_backend.py -k "wide_decode" >"$OUT/tests/contract.log" 2>&1
      tests_result wide_decode_contract "$OUT/contract.xml" $? 1
      grep -i "top-1\|top1\|CUDA w8a8" "$OUT/tests/contract.log" | head -5 | tee -a "$SUMMARY" ;;
    step)
      model_step auto "${STEP_BATCHES:-1 8 64}" "$STEP_S" SGLANG_DSV41_ATTN_DECODE=auto
      model_step wide "${STEP_BATCHES:-1 8 64}" "$STEP_S" SGLANG_DSV41_ATTN_DECODE=wide ;;
    *) echo "unknown step $step" ;;
  esac
done
rm -f "$OUT/decode_step.json"
pack_logs
result done

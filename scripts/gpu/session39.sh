#!/usr/bin/env bash
# H100 / H200 (one GPU), one device call (issue 21, session 39: the `wide` kernel as the serving decode for
# 2–256 queries, its decode plan without a second wave). Run from the checkout root with `.gpu` carried:
#   BUDGET=500 bash scripts/gpu/session39.sh
# Steps (STEPS, in this order by default):
#   tests     the wide kernel's GPU tests (the decode plan's splits)
#   contract  the teacher-forced contract of the serving default (w8a8_fold; `auto` decode) and of `wide`
#   step      the 4-layer model's decode step at STEP_BATCHES (default 1 8 64): `auto` (now `wide` from 2
#             queries) against `gather` (the `auto` of sessions 24–38), STEP_S each
#   bench     benchmarks/attention_decode.py at BATCHES (default 1 2 4 8 16 32 64 128 256), no fixed splits
#   ops       the GPU tests of the forward and the CUDA graphs (the serving default's decode changed)
# Results: $OUT/summary.txt, $OUT/attention_decode.json / .png, $OUT/model_step_{auto,gather}/, $OUT/*.xml,
# $OUT/logs.tar.gz.
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
BUDGET=${BUDGET:-500}; SUMMARY=$OUT/summary.txt; STEP_S=${STEP_S:-70}
mkdir -p "$OUT/logs" "$OUT/tests"
gpu_setup
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader | tee "$SUMMARY"
for step in ${STEPS:-tests contract step bench ops}; do
  case $step in
    tests)
      timeout -s INT -k 10 "$(cap 90)" python3 -m pytest -m gpu -q -p no:cacheprovider --junitxml "$OUT/wide_tests.xml" \
        tests/test_kernels_sparse_attention_prefill.py >"$OUT/tests/wide_tests.log" 2>&1
      tests_result wide_attention_gpu_tests "$OUT/wide_tests.xml" $? ;;
    contract)
      timeout -s INT -k 10 "$(cap 120)" python3 -m pytest -m gpu -q -s -p no:cacheprovider --junitxml "$OUT/contract.xml" \
        "tests/test_runtime_triton_backend.py::test_gpu_teacher_forced_contract[w8a8_fold]" \
        tests/test_runtime_triton_backend.py::test_gpu_teacher_forced_contract_with_the_wide_decode \
        >"$OUT/tests/contract.log" 2>&1
      tests_result contracts "$OUT/contract.xml" $? 2
      grep -i "top-1" "$OUT/tests/contract.log" | head -5 | tee -a "$SUMMARY" ;;
    step)
      model_step auto "${STEP_BATCHES:-1 8 64}" "$STEP_S" SGLANG_DSV41_ATTN_DECODE=auto
      model_step gather "${STEP_BATCHES:-1 8 64}" "$STEP_S" SGLANG_DSV41_ATTN_DECODE=gather ;;
    bench)
      # shellcheck disable=SC2086
      timeout -k 10 "$(cap 90)" python3 benchmarks/attention_decode.py --out "$OUT" \
        --batches ${BATCHES:-1 2 4 8 16 32 64 128 256} --splits >"$OUT/logs/bench.log" 2>&1
      result attention_decode rc=$?
      grep "^N=" "$OUT/logs/bench.log" | tee -a "$SUMMARY" ;;
    ops)
      timeout -s INT -k 10 "$(cap 180)" python3 -m pytest -m gpu -q -p no:cacheprovider --junitxml "$OUT/ops_tests.xml" \
        tests/test_runtime_forward_gpu.py tests/test_runtime_cuda_graph_gpu.py >"$OUT/tests/ops_tests.log" 2>&1
      tests_result forward_and_graph_gpu_tests "$OUT/ops_tests.xml" $? ;;
    *) echo "unknown step $step" ;;
  esac
done
rm -f "$OUT/decode_step.json"
pack_logs
result done

#!/usr/bin/env bash
# H100 or H200, device calls on one warm machine (issue 21, session 45). Run from the checkout root with `.gpu`
# carried:
#   STEPS="attn tests" BUDGET=540 bash scripts/gpu/session45.sh
#   STEPS="contract prefill" BUDGET=560 bash scripts/gpu/session45.sh    (when `heads` wins the attention timing)
#   STEPS="width profile" BUDGET=560 bash scripts/gpu/session45.sh
# Steps (STEPS, in this order by default):
#   attn     benchmarks/attention_prefill.py at the 8K Flash prefill shape: the keys-layout kernel as served
#            (`wide`, now one loop over both key lists), the heads layout (`heads*`: the split P·V over
#            duplicated rows, as two products, P in BF16) and, with ALT (a file: e.g. `git show
#            8895f06:kernels/sparse_attention_prefill.py > ALT` before the call), that version as `wide_alt`
#            (ATTN_ONLY: the candidates timed, besides `bf16`, the reference)
#   tests    the GPU tests of the prefill attention (both layouts), decode graph replay == eager, the prefill
#            graph server and the GPU forward (the single-loop kernel serves decode; 525352c's entry tables)
#   contract the end-to-end teacher-forced contract (tiny checkpoint) with SGLANG_DSV41_ATTN_PREFILL=heads, and the default
#   prefill  one 8K prefill of Flash layer 2 by component (decode_step.py --profile-prefill): PREFILL_VARIANTS
#            (default: default, heads, default)
#   width    session43.sh's `width` step (the 1M / 8K decode-step ratio with the span skip of 7f1d34b)
#   profile  session43.sh's `profile` step
# Results: $OUT/summary.txt, $OUT/tests.xml, $OUT/attn/attention_prefill.json, $OUT/model_step_*/model_step.json.
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
BUDGET=${BUDGET:-540}; SUMMARY=$OUT/summary.txt
gpu_start
for step in ${STEPS:-attn tests}; do
  case $step in
    attn)
      alt=(); [ -n "${ALT:-}" ] && [ -f "$ALT" ] && alt=(--alt-wide "$ALT")
      only=(--only)
      for c in ${ATTN_ONLY:-wide wide_alt wide_pv_bf16 heads heads_s3 heads_split2 heads_pv_bf16 heads_k16_s5 heads_k16_s7 heads_pv_bf16_k16_s5 heads_pv_bf16_k32_s5}; do
        [ "$c" = wide_alt ] && [ ${#alt[@]} -eq 0 ] || only+=("$c")
      done
      timeout -s INT -k 10 "$(cap 200)" python3 benchmarks/attention_prefill.py --out "$OUT/attn" "${alt[@]}" "${only[@]}" \
        >"$OUT/logs/attn.log" 2>&1
      result attn rc=$?
      grep -E "^(bf16|wide|heads)" "$OUT/logs/attn.log" | cut -c1-200 | tee -a "$SUMMARY" ;;
    tests)
      timeout -s INT -k 10 "$(cap 330)" python3 -m pytest -m gpu -q -s -p no:cacheprovider --junitxml "$OUT/tests.xml" \
        ${TESTS:-tests/test_kernels_sparse_attention_prefill.py tests/test_runtime_cuda_graph_gpu.py \
        tests/test_runtime_prefill_graph_server_gpu.py tests/test_runtime_forward_gpu.py} >"$OUT/logs/tests.log" 2>&1
      tests_result gpu_tests "$OUT/tests.xml" $?
      grep -E "passed|failed|Error|of elements equal" "$OUT/logs/tests.log" | tail -12 | cut -c1-300 | tee -a "$SUMMARY" ;;
    contract)   # the end-to-end teacher-forced contract with the heads layout on every eager batch (and the default)
      timeout -s INT -k 10 "$(cap 240)" python3 -m pytest -m gpu -q -s -p no:cacheprovider \
        tests/test_runtime_triton_backend.py -k "prefill_opt_ins and (default or heads)" >"$OUT/logs/contract.log" 2>&1
      result contract rc=$?
      grep -E "passed|failed|top-1|prefill workspace" "$OUT/logs/contract.log" | tail -8 | cut -c1-300 | tee -a "$SUMMARY" ;;
    prefill)    # one 8K prefill of Flash layer 2 by component: the default, the heads layout, the default again
      b=$(cap 240)
      timeout -k 10 "$b" python3 benchmarks/decode_step.py --out "$OUT/prefill" --quick --no-decode --batches 1 \
        --profile-prefill --prefill-variants ${PREFILL_VARIANTS:-default heads default} --budget-s $((b - 30)) >"$OUT/logs/prefill.log" 2>&1
      result prefill rc=$?
      grep -v "^ " "$OUT/logs/prefill.log" | grep -v -i warn | tail -12 | cut -c1-300 | tee -a "$SUMMARY" ;;
    width|profile)
      STEPS=$step BUDGET=$(left 5) bash "$(dirname "$0")/session43.sh" ;;
    *) echo "unknown step $step" ;;
  esac
done
find "$OUT" -name "*.png" -delete
result done

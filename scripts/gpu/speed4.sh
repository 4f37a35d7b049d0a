#!/usr/bin/env bash
# H200 (one GPU), one device call (issue 21, branch speed4): the decode step of one full-width Flash
# layer at N = 1 / 8 / 64 — where its graphed time goes, and the session-11 kernel choices old vs new.
#   1. tests: `pytest -m gpu` of the new choices' GPU tests — attention split-KV decode plan at the Flash
#      shape (oracle bound + packed == BF16 path; SGLANG_DSV41_ATTN_SPLITS=decode), the split-KV graph test,
#      the fp32/fp64 indexer head sums within the bound (SGLANG_DSV41_INDEXER_HEAD_SUM), the one-launch top-k
#      equal to the torch ranking (SGLANG_DSV41_INDEXER_TOPK=fused); the MoE decode
#      launch-flag candidates' bound test (tests/test_kernels_moe_mxfp4.py -k decode_flags, 8 GEMM compiles) is
#      left to the run that flips SGLANG_DSV41_MOE_DECODE_FLAGS: here the variants compare them with the default;
#   2. decode: ONE process of benchmarks/decode_step.py --quick --batches 1 8 64 (0.5 s caps, no prefill):
#      the step's components and graphed step on the defaults (w8a8_f16 FP8 linears), then --variants
#      (benchmarks/kernel_variants.py: each choice old → new as a CUDA-graph replay with its agreement, and the
#      whole step default → new), then --profile (benchmarks/step_profile.py: the graphed step by component —
#      dense linears by name, attention, indexer, compressor, experts, mHC, norms, launch gaps — for
#      `w8a8_f16` and `tiered`, JSON + PNG);
#   3. $OUT/speed4.json: test counts + failures, per N the variants' µs and agreements, per (mode, N) the
#      profile's components, span, gaps and CUDA-event wall, and the decode rows' graphed step. The logs and
#      the junit file end in $OUT/logs.tar.gz (7 files come back: the device call returns at most 8).
# Run from the checkout root with `.gpu` carried. Every step is capped; the script ends within BUDGET
# (s, default 300). Knobs: STEPS (default "tests decode"), TEST_CAP (75), DECODE_ARGS (extra decode_step.py
# arguments, e.g. "--profile-fp8 w8a8_f16" to profile the default only), KERNEL_VARIANTS_MOE_FLAGS ("none"
# skips the MoE flag sets, whose 8 GEMM compiles are the variants' largest cost on a fresh machine).
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
BUDGET=${BUDGET:-300}
gpu_setup
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader
for step in ${STEPS:-tests decode}; do
  case $step in
    tests) t=$(cap "${TEST_CAP:-75}")
           timeout -s INT -k 15 "$t" python3 -m pytest -m gpu -q -s -p no:cacheprovider --junitxml "$OUT/gpu_tests.xml" \
             tests/test_kernels_sparse_attention.py tests/test_kernels_indexer.py tests/test_kernels_moe_mxfp4.py \
             -k "decode_plan or cuda_graph_replay or scores_within_bound or fused_topk" 2>&1 | tee "$OUT/gpu_tests.log" | tail -12 ;;
    decode) b=$(( $(left) - 20 )); [ "$b" -lt 60 ] && { echo "decode: only $b s left, skipped"; continue; }
           timeout $((b + 15)) python3 benchmarks/decode_step.py --out "$OUT" --quick --batches 1 8 64 --variants --profile \
             --budget-s "$b" ${DECODE_ARGS:-} 2>&1 | tee "$OUT/decode_step.log" | grep -v "^ " | tail -24 ;;
    *) echo "unknown step $step"; continue ;;
  esac
  r=${PIPESTATUS[0]}
  if [ "$step" = tests ]; then TESTS_RC=$r; tests_result tests "$OUT/gpu_tests.xml" "$r"; else result "$step" rc="$r"; fi
done
timeout 15 python3 scripts/gpu/speed4_summary.py "$OUT" "${TESTS_RC:-}"
# at most 8 files come back from $OUT: the logs and the junit file travel as one archive
(cd "$OUT" && tar czf logs.tar.gz $(ls gpu_tests.log gpu_tests.xml decode_step.log 2>/dev/null) \
   && rm -f gpu_tests.log gpu_tests.xml decode_step.log)
echo "files in \$OUT: $(ls "$OUT" | tr '\n' ' ') ($(ls "$OUT" | wc -l) of at most 8)"
result "done"

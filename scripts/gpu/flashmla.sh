#!/usr/bin/env bash
# H200 (one GPU), one device call (issue 21, branch flashmla): the opt-in SGLANG_DSV41_ATTN_PREFILL=flashmla —
# the BF16 prefill workspace read by ONE sgl_kernel.flash_mla.flash_mla_sparse_fwd launch over
# [SWA block | workspace] (sglang_dsv41/runtime/attention_flashmla.py) instead of our Triton kernel.
#   1. tests: `pytest -m gpu` of tests/test_runtime_attention_flashmla.py (the real kernel against the Triton
#      workspace kernel at the Flash shape: 8,192 queries × 64 heads × 512, window 128, top-512 of 2,048, within
#      attention_flashmla.flashmla_bound — with and without topk_length; prints max |Δ|, Δ/bound and Δ in
#      output-scale ulps) and of tests/test_runtime_triton_backend.py -k "flashmla or prefill_opt_ins" (the
#      teacher-forced end-to-end contract with the opt-in: the tiny model planned `padded`, every eager batch
#      one FlashMLA launch; the serving default's contract beside it);
#   2. prefill: ONE process of benchmarks/decode_step.py --quick --no-decode --profile-prefill (one 8,192-token
#      prefill of Flash layer 2 by component, benchmarks/prefill_profile.py) for `default` (the Triton workspace
#      path) and `flashmla`; flashmla's attention output against default's (scale ulps) and its selection;
#   3. $OUT/flashmla.json (scripts/gpu/flashmla_summary.py): tests, per variant tokens/s, walls, components,
#      the attention kernels by name, and `checks`. Everything also in $OUT/all.tgz.
# A pass: `checks` all true — GPU tests pass (pytest rc 0, every collected test reported: junit_verdict.py); both variants profiled; flashmla's attention device ms below
# default's; the same indexer selection. The tokens/s of `flashmla` against the 400k target and default's
# (≈ 194k) is the measurement (docs/performance.md), not a pass condition.
# Run from the checkout root with `.gpu` carried. Every step is capped; the script ends within BUDGET
# (s, default 300). Knobs: STEPS (default "tests prefill"), TEST_CAP (150), PREFILL_VARIANTS, DECODE_ARGS.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
: "${BUDGET:=300}"
gpu_setup
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader
for step in ${STEPS:-tests prefill}; do
  case $step in
    tests) t=$(cap "${TEST_CAP:-150}")
           timeout -s INT -k 15 "$t" python3 -m pytest -m gpu -q -s -p no:cacheprovider --junitxml "$OUT/gpu_tests.xml" \
             tests/test_runtime_attention_flashmla.py tests/test_runtime_triton_backend.py \
             -k "flashmla or prefill_opt_ins" \
             2>&1 | tee "$OUT/gpu_tests.log" | grep -v "^ " | tail -20 ;;
    prefill) b=$(( $(left) - 25 )); [ "$b" -lt 60 ] && { echo "prefill: only $b s left, skipped"; continue; }
           timeout $((b + 15)) python3 benchmarks/decode_step.py --out "$OUT" --quick --no-decode --batches 1 \
             --profile-prefill --prefill-variants ${PREFILL_VARIANTS:-default flashmla} \
             --budget-s "$b" ${DECODE_ARGS:-} 2>&1 | tee "$OUT/decode_step.log" | grep -v "^ " | tail -24 ;;
    *) echo "unknown step $step"; continue ;;
  esac
  r=${PIPESTATUS[0]}
  if [ "$step" = tests ]; then TESTS_RC=$r; tests_result tests "$OUT/gpu_tests.xml" "$r"; else result "$step" rc="$r"; fi
done
timeout 15 python3 scripts/gpu/flashmla_summary.py "$OUT" "${TESTS_RC:-}"
(cd "$OUT" && tar czf all.tgz $(ls gpu_tests.log gpu_tests.xml decode_step.log decode_step.json decode_step.png \
   prefill_profile.json prefill_profile.png flashmla.json 2>/dev/null) \
   && rm -f gpu_tests.log gpu_tests.xml decode_step.log decode_step.png)
echo "files in \$OUT: $(ls "$OUT" | tr '\n' ' ') ($(ls "$OUT" | wc -l) of at most 8)"
echo "RESULT done at $((SECONDS - T0)) s"

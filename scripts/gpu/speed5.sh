#!/usr/bin/env bash
# H200 (one GPU), one device call (issue 21, branch speed5): where one 8K prefill of a full-width Flash layer
# spends its time, and the session-12 prefill changes old vs new.
#   1. tests: `pytest -m gpu` of what the changes touch — RoPE + BF16 rounding in one launch at Flash widths
#      (now the Triton backend's bf16_rope_tail), packed FP4 entries == the BF16-row attention path at the
#      Flash shape up to n = 2048 queries (the BF16 workspace's basis), the CUDA forward without float64, the
#      teacher-forced end-to-end contract with the prefill opt-ins (SGLANG_DSV41_ATTN_PREFILL=bf16 +
#      SGLANG_DSV41_BF16_GEMM=whole), the runtime's per-sublayer kernel tests on identical inputs and its
#      batch-invariance test (chunked / batched / prefix == alone);
#   2. prefill: ONE process of benchmarks/decode_step.py --quick --no-decode --profile-prefill: one 8,192-token
#      prefill of layer 2 (benchmarks/prefill_profile.py) by component — FP8 GEMMs by weight (GEMM / operand
#      passes), BF16 linears, attention, indexer scores / top-k / query, compressor, router, MXFP4 experts /
#      routing plan / combine, shared expert, mHC, norms, RoPE, elementwise, glue — for the variants
#      `before` (session 11: RoPE and its rounding as two launches), `default` (now), `new` (every prefill
#      opt-in), then each opt-in alone; tokens/s from CUDA-event walls per part; each variant's attention output
#      and indexer selection against the first variant's;
#   3. $OUT/speed5.json (scripts/gpu/speed5_summary.py): tests, per variant tokens/s, walls, components,
#      linears, top kernels, agreement, and `checks`. Everything (logs, junit, JSONs, PNG) also in $OUT/all.tgz.
# A pass: `checks` all true — GPU tests pass; every variant profiled; the workspace attention within 2 BF16
# ulps of the output scale of the packed path; the fused top-k the same selection; the fp32 head sum ≥ 99 %
# selection overlap. The numbers (tokens/s per variant, components) go to docs/performance.md.
# Run from the checkout root with `.gpu` carried. Every step is capped; the script ends within BUDGET
# (s, default 300). Knobs: STEPS (default "tests prefill"), TEST_CAP (120; the files run most important first), PREFILL_VARIANTS (names of
# benchmarks/prefill_profile.py VARIANTS; default all), DECODE_ARGS (extra decode_step.py arguments).
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
BUDGET=${BUDGET:-300}
gpu_setup
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader
for step in ${STEPS:-tests prefill}; do
  case $step in
    tests) t=$(cap "${TEST_CAP:-120}")
           timeout -s INT -k 15 "$t" python3 -m pytest -m gpu -q -s -p no:cacheprovider --junitxml "$OUT/gpu_tests.xml" \
             tests/test_runtime_triton_backend.py tests/test_kernels_sparse_attention.py \
             tests/test_kernels_fused_elementwise.py tests/test_runtime_forward_gpu.py \
             -k "flash_widths or packed_flash_within or prefill_opt_ins or no_float64 or identical_inputs or each_request_alone" \
             2>&1 | tee "$OUT/gpu_tests.log" | tail -14 ;;
    prefill) b=$(( $(left) - 25 )); [ "$b" -lt 60 ] && { echo "prefill: only $b s left, skipped"; continue; }
           timeout $((b + 15)) python3 benchmarks/decode_step.py --out "$OUT" --quick --no-decode --batches 1 \
             --profile-prefill ${PREFILL_VARIANTS:+--prefill-variants $PREFILL_VARIANTS} --budget-s "$b" \
             ${DECODE_ARGS:-} 2>&1 | tee "$OUT/decode_step.log" | grep -v "^ " | tail -24 ;;
    *) echo "unknown step $step"; continue ;;
  esac
  r=${PIPESTATUS[0]}
  if [ "$step" = tests ]; then TESTS_RC=$r; tests_result tests "$OUT/gpu_tests.xml" "$r"; else result "$step" rc="$r"; fi
done
timeout 15 python3 scripts/gpu/speed5_summary.py "$OUT" "${TESTS_RC:-}"
# everything in one archive; the summary, the profile JSON and its PNG also stay beside it (≤ 8 files back)
(cd "$OUT" && tar czf all.tgz $(ls gpu_tests.log gpu_tests.xml decode_step.log decode_step.json decode_step.png \
   prefill_profile.json prefill_profile.png speed5.json 2>/dev/null) \
   && rm -f gpu_tests.log gpu_tests.xml decode_step.log decode_step.png)
echo "files in \$OUT: $(ls "$OUT" | tr '\n' ' ') ($(ls "$OUT" | wc -l) of at most 8)"
result "done"

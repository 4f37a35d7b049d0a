#!/usr/bin/env bash
# H200 (one GPU), one device call (session 23; issue 21): the fused-elementwise GPU tests (cut by session23a.sh's
# budget), then benchmarks/decode_step.py --quick --batches
# 1 8 64 256 --variants --profile: the graphed step of one full-width Flash layer after session 22's
# changes, each kernel choice as a variant (attention `flashmla_decode` = SGLANG_DSV41_ATTN_DECODE=flashmla
# at every N; the MoE flag sets of KERNEL_VARIANTS_MOE_FLAGS at N <= 16), and the
# per-kernel profile of the serving default. split_k is left out: triton_kernels refuses it for MX weights
# ("cannot enforce split_k=True", session23a.sh). Logs in $OUT/logs.tar.gz, JSONs in $OUT/step.
# Run from the checkout root with `.gpu` carried: bash scripts/gpu/session23b.sh
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
: "${BUDGET:=540}" "${BATCHES:=1 8 64 256}"
mkdir -p "$OUT/step" "$OUT/logs" "$OUT/tests"
gpu_setup
OUT=$OUT/tests BUDGET=110 TESTS=tests/test_kernels_fused_elementwise.py bash scripts/gpu/gpu_tests_subset.sh
echo "== elementwise tests rc=$?"
mv "$OUT"/tests/*.log "$OUT/logs/" 2>/dev/null; rmdir "$OUT/tests"
b=$(( $(left) - 20 ))
# shellcheck disable=SC2086
KERNEL_VARIANTS_MOE_FLAGS="block_k=256;num_stages=5" \
timeout -s INT -k 10 "$b" python3 benchmarks/decode_step.py --quick --batches $BATCHES --no-prefill --variants \
  --profile --profile-fp8 w8a8_f16 --budget-s $((b - 20)) --out "$OUT/step" >"$OUT/logs/decode_step.log" 2>&1
result decode_step rc=$?
grep -v -i warn "$OUT/logs/decode_step.log" | tail -20
[ -f "$OUT/step/decode_step_variants.json" ] &&
  python3 benchmarks/variants_table.py "$OUT/step/decode_step_variants.json" | tee "$OUT/step/variants.md"
(cd "$OUT" && tar czf logs.tar.gz logs step/*.png 2>/dev/null; rm -rf logs)
find "$OUT" -name "*.png" -delete
ls -R "$OUT"

#!/usr/bin/env bash
# H200 (one GPU), one device call (session 19; issue 21): the radix top-k's warp choice, then the tiny
# server against the tiny Llama.
#   1. `pytest -m gpu tests/test_kernels_indexer.py` (cap IDX_BUDGET s, default 100): the fused top-k
#      with `radix_warps`' launches equals the torch ranking bit for bit at Flash widths;
#   2. `tiny_vs_llama.sh` with what is left, STEPS default "tiny_b1k llama8 tiny": TTFT / ITL /
#      output tokens/s of the tiny checkpoint (prefill buckets to 1,024, then the default ≤ 256) and the
#      8-layer stock-SGLang Llama, one client, concurrency 1 / 16 / 64.
# Run from the checkout root with `.gpu` carried: bash scripts/gpu/session19b.sh
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
: "${BUDGET:=585}" "${IDX_BUDGET:=100}" "${STEPS:=tiny_b1k llama8 tiny}"
mkdir -p "$OUT/idx" "$OUT/tl"
OUT=$OUT/idx BUDGET=$IDX_BUDGET TESTS=tests/test_kernels_indexer.py bash scripts/gpu/gpu_tests_subset.sh; echo "== idx rc=$?"
rm -f "$OUT"/idx/compileall.log "$OUT"/idx/pip-editable.log
OUT=$OUT/tl BUDGET=$(left 5) STEPS=$STEPS bash scripts/gpu/tiny_vs_llama.sh 2>&1 | tail -30; echo "== tl rc=${PIPESTATUS[0]}"

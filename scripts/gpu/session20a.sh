#!/usr/bin/env bash
# H200 (one GPU), one device call (session 20; issue 21): the top-k changes of session 19 on the GPU, then
# the staging of the base runtime part for the next call's runtime with SGLang's V4 extras (.gpu_v4).
#   1. `pytest -m gpu` on TESTS (default the indexer tests, which hold the two-stage split top-k, the
#      bisection kernel's 32-bit write pass and the one-reduction chunk count, then the decode-graph tests)
#      within IDX_BUDGET s (default 200);
#   2. benchmarks/topk_kernels.py --methods ours ours_radix_w16 ours_split --cases decode hit: decides
#      SGLANG_DSV41_TOPK_SPLIT's default (flip when ours_split is > 20 % faster at N <= 64, E >= 16K);
#   3. copies .gpu/site/base-*.part* to /tmp/gpu-parts, so a call within ~30 s carrying .gpu_v4/bin and
#      .gpu_v4/site/extra-*.part* finds every part (shared/gpu/build.sh stages parts the same way).
# Run from the checkout root with `.gpu` carried: bash scripts/gpu/session20a.sh
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
: "${BUDGET:=330}" "${IDX_BUDGET:=200}"
: "${TESTS:=tests/test_kernels_indexer.py tests/test_runtime_cuda_graph_gpu.py}"
mkdir -p "$OUT/idx" "$OUT/topk"
OUT=$OUT/idx BUDGET=$IDX_BUDGET TESTS=$TESTS bash scripts/gpu/gpu_tests_subset.sh; echo "== tests rc=$?"
rm -f "$OUT"/idx/compileall.log "$OUT"/idx/pip-editable.log
gpu_setup
b=$(( $(left) - 25 ))
if [ "$b" -gt 40 ]; then
  timeout -s INT -k 10 "$b" python3 benchmarks/topk_kernels.py --out "$OUT/topk" --budget-s $((b - 20)) \
    --methods ours ours_radix_w16 ours_split --cases decode hit 2>&1 | grep -v -i warn | tail -12
  result topk_bench rc="${PIPESTATUS[0]}"
else
  result topk_bench "skipped: $b s left"
fi
mkdir -p /tmp/gpu-parts && cp -f .gpu/site/base-*.tar.xz.part* /tmp/gpu-parts/ && result staged "$(ls /tmp/gpu-parts)"

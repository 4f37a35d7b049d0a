#!/usr/bin/env bash
# H200 (one GPU), one device call (session 20; issue 21):
#   1. `pytest -m gpu tests/test_runtime_cuda_graph_gpu.py` (cap GRAPH_BUDGET s, default 130): replay ==
#      eager with the write sink (entry 0, kv_layout.write_entries) left out of the cache comparison;
#   2. benchmarks/topk_kernels.py --cases long --methods ours_torch ours_split: decode rows wider than the
#      fused kernel's 64K columns, the torch ranking against the two-stage split (N 1 / 8 / 64 × E 128K /
#      256K, N 1 × 1M). Session 20 ran it as `--methods ours ours_split`, when `ours` was the torch path
#      there; since SGLANG_DSV41_TOPK_SPLIT=auto `ours` is the split up to 256K, so the torch path is named.
# Run from the checkout root with `.gpu` carried: bash scripts/gpu/session20b.sh
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
: "${BUDGET:=280}" "${GRAPH_BUDGET:=130}"
mkdir -p "$OUT/graph" "$OUT/topk"
OUT=$OUT/graph BUDGET=$GRAPH_BUDGET TESTS=tests/test_runtime_cuda_graph_gpu.py bash scripts/gpu/gpu_tests_subset.sh
echo "== graph tests rc=$?"
rm -f "$OUT"/graph/compileall.log "$OUT"/graph/pip-editable.log
gpu_setup
b=$(( $(left) - 10 ))
if [ "$b" -gt 30 ]; then
  timeout -s INT -k 10 "$b" python3 benchmarks/topk_kernels.py --out "$OUT/topk" --budget-s $((b - 15)) \
    --methods ours_torch ours_split --cases long 2>&1 | grep -v -i warn | tail -10
  result topk_long rc="${PIPESTATUS[0]}"
else
  result topk_long "skipped: $b s left"
fi

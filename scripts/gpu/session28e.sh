#!/usr/bin/env bash
# H100 / H200 (one GPU), one device call (session 28; issue 21): session 28's two default changes — the compressed
# entry indices and the decode's gathered rows made once per selection / kv source and forward (attend memo), and
# the packed entries encoded and written in one launch (kernels/entry_pack.py) —
#   1. pytest -m gpu: the entry_pack kernel against the torch encoder, the forward against the CPU, graph replay;
#   2. benchmarks/model_step.py at N = 1 / 8 (side stream off / on): the tree before them (BASE, a package tree
#      made by `git archive af8f5a3 sglang_dsv41 kernels`, carried as ab_base.tar, first on PYTHONPATH) and this
#      tree, one process each on one machine: the same-run ratio.
# Make the base first: git archive -o ab_base.tar af8f5a3 sglang_dsv41 kernels (untracked; travels with the tree).
# Run from the checkout root with `.gpu` carried: bash scripts/gpu/session28e.sh
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
: "${BUDGET:=340}" "${TEST_S:=130}"
mkdir -p "$OUT/logs" "$OUT/tests"
gpu_setup
OUT=$OUT/tests BUDGET=$TEST_S \
  TESTS="tests/test_kernels_entry_pack.py tests/test_runtime_forward_gpu.py tests/test_runtime_cuda_graph_gpu.py" \
  bash scripts/gpu/gpu_tests_subset.sh
echo "== gpu tests rc=$?"
base=/tmp/ab_base
rm -rf "$base" && mkdir -p "$base" && tar xf ab_base.tar -C "$base" && mv "$base/kernels" "$base/sglang_dsv41/kernels"
# the check runs from benchmarks/ as model_step.py does (python3 -c from the root would put the checkout first)
(cd benchmarks && PYTHONPATH="$base:${PYTHONPATH:-}" python3 -c "import sglang_dsv41.runtime.attention as a; print('base:', a.__file__, 'memo' if hasattr(a, '_compressed_entries') else 'no memo')" 2>&1 | tail -1)
model_step base "1 8" 95 PYTHONPATH="$base:${PYTHONPATH:-}"
model_step new "1 8" 95
mv "$OUT"/tests/*.log "$OUT/logs/" 2>/dev/null; rmdir "$OUT/tests" 2>/dev/null
find "$OUT" -name "*.png" -delete
(cd "$OUT" && tar czf logs.tar.gz logs 2>/dev/null; rm -rf logs)
ls -R "$OUT"

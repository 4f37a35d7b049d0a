#!/usr/bin/env bash
# H100 / H200 (one GPU), one device call (issue 21; prepared in session 33, whose device time ran out): the GPU tests
# of session 33's last change (q and the attention output rotated in place) that did not run or were cut:
#   1. tests/test_kernels_fused_elementwise.py -m gpu (the in-place rotation at the Flash shape; the graph-capture
#      case with route_select from its own module);
#   2. tests/test_runtime_forward_gpu.py (cut at 4 of 8 in session 33) and tests/test_runtime_cuda_graph_gpu.py
#      (decode graphs replay the in-place rotation);
#   3. the contract with the workspaces (-k "prefill_opt_ins and default"), then the 8K prefill profile (`default`);
#   4. (session 34) tests/test_kernels_indexer.py -m gpu with the BF16-key prefill tiling (block_j 32) and
#      benchmarks/indexer_prefill.py (the new default tiling as `bf16_fp64` beside the others).
# Logs in $OUT/logs.tar.gz. Run from the checkout root with `.gpu` carried: bash scripts/gpu/session34a.sh
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
: "${BUDGET:=585}"
mkdir -p "$OUT/logs" "$OUT/tests"
gpu_setup
OUT=$OUT/tests BUDGET=$(left 230) TESTS="tests/test_kernels_fused_elementwise.py tests/test_runtime_forward_gpu.py \
tests/test_runtime_cuda_graph_gpu.py tests/test_kernels_indexer.py" bash scripts/gpu/gpu_tests_subset.sh
echo "== gpu tests rc=$?"
OUT=$OUT/tests BUDGET=$(left 150) PYTEST_K="prefill_opt_ins and default" TESTS="tests/test_runtime_triton_backend.py" \
  bash scripts/gpu/gpu_tests_subset.sh
echo "== contract rc=$?"
prefill_profile default 110
timeout -k 5 "$(cap 40)" python3 benchmarks/indexer_prefill.py --out "$OUT" >"$OUT/logs/indexer_prefill.log" 2>&1
result indexer_prefill rc=$?
pack_logs

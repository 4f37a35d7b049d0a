#!/usr/bin/env bash
# H200 (one GPU), one device call: the GPU tests of the split global KV (latent rows + index-key
# rows, branch rows2): both packed kernels, the runtime forward / CUDA graphs against the CPU path,
# and the tiny server (pool log lines, greedy). Run from the checkout root with `.gpu` carried.
# Every step is capped; logs in $OUT. BUDGET (s, default 560): the script ends by then.
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
BUDGET=${BUDGET:-560}
gpu_setup
run() { local name=$1 c=$2; shift 2; timeout "$(cap "$c")" python3 -m pytest -q -p no:cacheprovider "$@" 2>&1 \
          | tee "$OUT/$name.log" | tail -6; }
run kernels 200 -m gpu tests/test_kernels_sparse_attention.py tests/test_kernels_indexer.py
run runtime 200 -m gpu tests/test_runtime_forward_gpu.py tests/test_runtime_cuda_graph_gpu.py
run server 200 tests/test_runtime_server.py -k "v41_pool or greedy"
echo "done after $((SECONDS - T0)) s"

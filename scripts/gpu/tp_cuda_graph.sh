#!/usr/bin/env bash
# nvidia-h200-x2 (two GPUs of one host), one device call: issue 13's TP > 1 decode CUDA-graph gate,
# `pytest -m gpu -s tests/test_runtime_tp_cuda_graph_gpu.py` (TP 2 over NCCL: capture + replay ==
# eager bit for bit per rank, TP 2 vs TP 1 within GPU_LOGPROB_BOUND; prints max |Δ logit| / |Δ log p|
# for docs/validation.md). TESTS adds files (e.g. tests/test_runtime_tp_server.py). Run from the
# checkout root with `.gpu` carried; BUDGET caps the call (s, default 280); log + junit in $OUT.
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
: "${BUDGET:=280}"
gpu_setup
n=$(nvidia-smi -L | wc -l); [ "$n" -ge 2 ] || { echo "RESULT needs 2 GPUs, found $n"; exit 2; }
timeout -s INT -k 15 "$BUDGET" python3 -m pytest -m gpu -q -s -p no:cacheprovider -rf --tb=short \
  --junitxml "$OUT/tp_cuda_graph.xml" tests/test_runtime_tp_cuda_graph_gpu.py ${TESTS:-} 2>&1 | tee "$OUT/tp_cuda_graph.log" | tail -25
tests_result tp_cuda_graph "$OUT/tp_cuda_graph.xml" "${PIPESTATUS[0]}"

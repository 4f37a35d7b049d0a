#!/usr/bin/env bash
# H200 (one GPU), one device call (docs/prefill_graphs.md "GPU experiment"): can the static extend
# forward (runtime/batch.static_extend_layout, not yet wired into the server) be captured in one CUDA
# graph on the real kernels, does its replay agree with the eager extend, and what does it save?
# benchmarks/prefill_graph_probe.py on the tiny checkpoint, serving mode, stand-alone caches
# (hit_extend.make_case), req_to_token width 65,536 (the static indexer width), one request + 2
# zero-length request slots (the full runner's unused slots), cases
# (prefix, new tokens, bucket): (0, 32, 32) (0, 32, 64) (8192, 32, 32) (32768, 32, 32) (0, 256, 256).
# Per case: eager wall / host ms, capture s, replay wall / host / GPU ms, max |Δlogit| of the live
# rows, bits equal, greedy equal.
# Run from the checkout root with `.gpu` carried:
#   bash scripts/gpu/prefill_graph.sh
# Results: $OUT/prefill_graph.json, $OUT/summary.txt. rc = the probe's (0: every case captured and
# greedy-equal). A pass: no CAPTURE FAILED line; greedy True everywhere (bits may differ only where
# bucket > N: padded rows change the GEMM row tiers, the decode graphs' serving-mode caveat);
# replay wall ≈ replay GPU ms (a few ms) against eager wall of 60–120 ms at N = 32 (session 16).
# A CAPTURE FAILED line names the op that cannot be captured: the next step of docs/prefill_graphs.md.
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
BUDGET=${BUDGET:-290}
gpu_setup
SUMMARY=$OUT/summary.txt
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader 2>&1 | sed 's/^/gpu: /' | tee "$SUMMARY"
tiny_checkpoint /tmp/tiny || exit 4
result checkpoint
timeout -s TERM -k 20 "$(left 25)" python3 benchmarks/prefill_graph_probe.py --model-path /tmp/tiny \
    --table-width 65536 --reps 10 --out "$OUT/prefill_graph.json" 2>&1 | grep -v -i warn | tail -30 | tee -a "$SUMMARY"
rc=${PIPESTATUS[0]}
result prefill_graph rc=$rc
exit $rc

#!/usr/bin/env bash
# H200 (one GPU), one device call (issues 14 and 21; docs/hicache.md "What a hit costs"): what one
# 32-token extend over a long prefix costs in the model forward alone — no server, no HTTP, no
# scheduler. benchmarks/hit_extend.py on the tiny checkpoint, serving mode (deterministic off, the
# CUDA kernels), stand-alone caches with random packed rows:
#   * N = 32 new tokens after prefixes 0 / 1,024 / 8,192 / 32,768, then 20,480 (a width class already
#     built: its first forward should cost what the others do — no kernel build per request length);
#   * N = 1 (an eager decode step) after the same prefixes: under SGLang's overlap scheduler a
#     prefill's first token leaves only after the next batch (the first decode step) was launched, so
#     with --disable-cuda-graph a hit's TTFT ≈ host_ms(N = 32) + host_ms(N = 1) + HTTP/scheduler;
#   * N = 8,192 after 24,576 (the 4th 8K chunk of a cold 32K prompt);
#   * the 32K-prefix case again with SGLANG_DSV41_INDEXER_TOPK=torch.
# Per case: first forward (builds), median wall, host time to return, GPU busy (torch.profiler),
# kernel launches, aten ops, host syncs by site, top kernels.
# Run from the checkout root with `.gpu` carried:
#   bash scripts/gpu/hit_extend.sh
# Results: $OUT/hit_extend.json, $OUT/summary.txt. rc = the benchmark's. How to read it:
#   wall(32K) − wall(0) at N = 32 is the context-proportional cost of a hit's forward; if gpu_busy
#   is far below wall the forward is host-bound (launches / syncs), else the top kernels name it;
#   first − wall of the 20,480 case ≈ 0 shows no build per length. A pass for docs/hicache.md's
#   diagnosis: wall(32K) − wall(0) at N = 32 is a few ms, and host_ms(32K, 32) + host_ms(32K, 1)
#   is most of session 14's 204 ms hit TTFT.
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
BUDGET=${BUDGET:-290}
gpu_setup
SUMMARY=$OUT/summary.txt
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader 2>&1 | sed 's/^/gpu: /' | tee "$SUMMARY"
tiny_checkpoint /tmp/tiny || exit 4
result checkpoint
timeout -s TERM -k 20 "$(left 25)" python3 benchmarks/hit_extend.py --model-path /tmp/tiny \
    --prefixes 0 1024 8192 32768 20480 --new-tokens 32 1 --chunk 24576 8192 --reps 5 --topk-variants \
    --out "$OUT/hit_extend.json" 2>&1 | grep -v -i warn | tail -30 | tee -a "$SUMMARY"
rc=${PIPESTATUS[0]}
result hit_extend rc=$rc
exit $rc

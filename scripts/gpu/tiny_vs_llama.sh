#!/usr/bin/env bash
# H200 (one GPU), one device call (issue 21 item 4, "the framework and launch overhead"): the tiny V4.1
# checkpoint served by plain `python -m sglang.launch_server` against a stock-SGLang Llama of the same
# widths and layer count (8; benchmarks/tiny_llama.py: same hidden size, heads, head dim, vocabulary,
# tokenizer), driven by the same client (benchmarks/serving_e2e.py client: random ids in [3, 990),
# IN_LEN in / OUT_LEN out, concurrency 1 / 16 / 64): output tokens/s, TTFT and ITL, and their ratios.
# Labels, in this order (STEPS): `tiny` (the CUDA defaults: decode graphs, prefill graphs up to 256
# tokens), `llama8`, `tiny_eager` (the same with --disable-prefill-cuda-graph); on request (STEPS) `tiny_b1k`
# (prefill buckets up to 1,024 tokens, so a 1K prompt alone is one replay), `tiny_b2k` (buckets up to 2,048), `tiny_c1k` / `tiny_c2k` (buckets up
# to 1,024 / 2,048 and --chunked-prefill-size the same: no prefill batch exceeds the largest bucket, and one of
# 1K prompts holds at most size / 512 requests, the runner's slots, so it replays). Every server gets
# --cuda-graph-max-bs $MAX_BS (64) and --max-running-requests 64, so decode at concurrency 64 is
# graphed on both sides, and the torch sampler (ours declares it: flashinfer's JIT-compiles for minutes on a
# fresh machine); the Llama keeps SGLang's own prefill-graph default and runs the Triton attention backend
# (the GPU runtime's sgl_kernel has no FA3 flash_ops, ../shared/gpu/README.md). Ours logs its capture times.
# Run from the checkout root with `.gpu` carried:
#   BUDGET=560 bash scripts/gpu/tiny_vs_llama.sh
# Results: $OUT/tiny_vs_llama.json/.png (report), $OUT/e2e/<label>.json and <label>_server.log,
# $OUT/summary.txt. A pass for the issue's target: TTFT ratio tiny/llama8 ≤ 3 and ITL ratio ≤ 2 at
# every concurrency.
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
BUDGET=${BUDGET:-560}; SUMMARY=$OUT/summary.txt
gpu_setup
mkdir -p "$OUT/e2e"
STEPS=${STEPS:-tiny llama8 tiny_eager}; IN_LEN=${IN_LEN:-1024}; OUT_LEN=${OUT_LEN:-256}; MAX_BS=${MAX_BS:-64}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader 2>&1 | sed 's/^/gpu: /' | tee "$SUMMARY"
tiny_checkpoint /tmp/tiny || exit 4
timeout "$(cap 60)" python3 benchmarks/tiny_llama.py --like /tmp/tiny --out /tmp/llama8 >/dev/null 2>&1 || exit 4
result checkpoints
CLIENT=(python3 benchmarks/serving_e2e.py client --out-dir "$OUT/e2e" --input-len "$IN_LEN" --output-len "$OUT_LEN"
        --rounds 2 --id-range 3 990 --concurrency 1 16 64)
COMMON=(--context-length 4096 --max-running-requests 64 --cuda-graph-max-bs "$MAX_BS" --random-seed 0)
ran=0
for step in $STEPS; do
  [ "$(left)" -lt 60 ] && { result "$step: skipped, $(left) s left"; continue; }
  b=$(( $(left) - 20 ))
  case $step in
    tiny) argv=(python3 -m sglang.launch_server --model-path /tmp/tiny "${COMMON[@]}") ;;
    tiny_b1k|tiny_b2k) argv=(python3 -m sglang.launch_server --model-path /tmp/tiny "${COMMON[@]}"
                    --cuda-graph-bs-prefill 4 8 16 32 64 128 256 512 1024 $([ "$step" = tiny_b2k ] && echo 2048)) ;;
    tiny_c1k|tiny_c2k) n=${step#tiny_c}; n=$(( ${n%k} * 1024 ))
                    argv=(python3 -m sglang.launch_server --model-path /tmp/tiny "${COMMON[@]}" --chunked-prefill-size "$n"
                          --cuda-graph-bs-prefill 4 8 16 32 64 128 256 512 1024 $([ "$n" = 2048 ] && echo 2048)) ;;
    tiny_eager) argv=(python3 -m sglang.launch_server --model-path /tmp/tiny "${COMMON[@]}" --disable-prefill-cuda-graph) ;;
    llama8) argv=(python3 -m sglang.launch_server --model-path /tmp/llama8 "${COMMON[@]}" --sampling-backend pytorch
                  --attention-backend triton) ;;
    *) echo "unknown step $step"; continue ;;
  esac
  [ "$step" = tiny_eager ] || b=$(( b > 240 ? 240 : b ))
  timeout $((b + 10)) "${CLIENT[@]}" --label "$step" --budget-s "$b" --startup-s 180 -- "${argv[@]}"
  result "$step" rc=$?; ran=1
  graph_summary "$step" "$OUT/e2e/${step}_server.log"
done
if [ $ran = 1 ]; then
  timeout 60 python3 benchmarks/serving_e2e.py report "$OUT/e2e" --out "$OUT/tiny_vs_llama.json" | tail -40 | tee -a "$SUMMARY"
fi
result done

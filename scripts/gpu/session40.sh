#!/usr/bin/env bash
# H200 (or H100), one device call (issue 21, session 40): why the routed-expert GEMMs stream ≈ 3.1 of the
# H200's 4.26 TB/s at decode. Run from the checkout root with `.gpu` carried:
#   BUDGET=420 bash scripts/gpu/session40.sh
# Steps (STEPS, in this order by default):
#   control   benchmarks/moe.py, MXFP4 against the same GEMMs on BF16 weights (no upcast) at N = 64 and 8:
#             BF16 streaming well above MXFP4's rate means the upcast, not the memory, limits the kernel
#   flags     benchmarks/moe_prefill_flags.py at 64 tokens (a decode batch; > 16 tokens take the prefill
#             flags): triton_kernels' own launch against stages, block_k and split-K, L2 flushed
# Results: $OUT/summary.txt, $OUT/moe.json / .png, $OUT/moe_prefill_flags.json, $OUT/logs/.
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
BUDGET=${BUDGET:-420}; SUMMARY=$OUT/summary.txt
mkdir -p "$OUT/logs"
gpu_setup
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader | tee "$SUMMARY"
for step in ${STEPS:-control flags}; do
  case $step in
    control)
      timeout -k 10 "$(cap 200)" python3 benchmarks/moe.py --out "$OUT" --budget-s 140 \
        --candidates mxfp4 bf16 --tokens 64 8 >"$OUT/logs/moe.log" 2>&1
      result moe_control rc=$?
      grep -i "share\|GB/s\|copy" "$OUT/logs/moe.log" | tail -12 | tee -a "$SUMMARY" ;;
    flags)
      timeout -k 10 "$(cap 200)" python3 benchmarks/moe_prefill_flags.py --tokens 64 --cap-s 0.5 --out "$OUT" \
        --flag-sets "" num_stages=2 num_stages=5 block_k=256 split_k=2 epilogue_subtile=1 \
        >"$OUT/logs/moe_flags.log" 2>&1
      result moe_flags rc=$?
      grep -v "^ *$" "$OUT/logs/moe_flags.log" | tail -8 | cut -c1-400 | tee -a "$SUMMARY" ;;
    *) echo "unknown step $step" ;;
  esac
done
pack_logs
result done

#!/usr/bin/env bash
# H100 or H200, one device call (issue 21, session 42): why a 1K-token prefill of a Flash layer runs at
# ≈ 100k tokens/s against ≈ 300k at 8K (prefill_short.sh, session 42: 5.3 ms of device time in a 9.5 ms
# chained wall, 3.1 ms of it the routed experts). Run from the checkout root with `.gpu` carried:
#   BUDGET=300 bash scripts/gpu/session42.sh
# Steps (STEPS, in this order by default):
#   moe1k    benchmarks/moe_prefill_flags.py at 1,024 tokens (16 rows an expert; triton_kernels picks 32-row
#            tiles): its own launch against block_m, stages, block_k and subtile constraints, L2 flushed
#   host1k   one Flash layer's 1,024-token prefill (decode_step.py --profile-prefill, the serving default):
#            the device profile as prefill_short.sh, plus the host side (the chained launches' own time and
#            one chained pass under cProfile: benchmarks/host_profile.py)
# Results: $OUT/summary.txt, $OUT/moe_prefill_flags.json, $OUT/prefill_1024/prefill_profile.json, $OUT/logs/.
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
BUDGET=${BUDGET:-300}; SUMMARY=$OUT/summary.txt
gpu_start
for step in ${STEPS:-moe1k host1k}; do
  case $step in
    moe1k)
      timeout -k 10 "$(cap 130)" python3 benchmarks/moe_prefill_flags.py --tokens 1024 --cap-s 0.5 --out "$OUT" \
        --flag-sets "" block_m=16 block_m=64 num_stages=2 num_stages=4 block_k=256 epilogue_subtile=1 \
        >"$OUT/logs/moe1k.log" 2>&1
      result moe1k rc=$?
      grep -v "^ *$" "$OUT/logs/moe1k.log" | tail -10 | cut -c1-400 | tee -a "$SUMMARY" ;;
    host1k)
      prefill_host "${CAP_EACH:-150}" 1024 ;;
    *) echo "unknown step $step" ;;
  esac
done
find "$OUT" -name "*.png" -delete
result done

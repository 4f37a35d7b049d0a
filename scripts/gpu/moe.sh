#!/usr/bin/env bash
# H200 (one GPU), one device call, < 8 min (issue 21, branch speed2):
#   1. benchmarks/moe.py: routed experts at Flash widths (dummy weights), ours (matmul_ogs MXFP4) against
#      SGLang 0.5.17's shipped MXFP4 MoE kernels (Marlin; FlashInfer CUTLASS W4A16 only if its SM90
#      module is already built: FlashInfer JIT is disabled, the JSON records the module's state) at
#      N = 1/8/64/256/4096: µs per call (eager + CUDA graph), expert bytes, roofline ratio at 4.8 TB/s,
#      accuracy vs reference.moe at N = 8. Each candidate fails alone (error entry in the JSON).
#   2. `pytest -m gpu` on the kernels made float64-free on this branch (fused elementwise, indexer, MoE
#      combine) with what is left of BUDGET.
# Results: $OUT/moe.json, $OUT/moe.png, $OUT/moe.log, $OUT/gpu_tests.{log,xml}.
# Run from the checkout root with `.gpu` carried. Knobs: STEPS (default "moe tests"), BUDGET (s, default
# 450: the script ends by then), MOE_BUDGET (s, default 330, the benchmark's own timing budget),
# MOE_ARGS (extra benchmark arguments, e.g. "--with-bf16" or "--tokens 1 8"), TESTS (test file list).
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
BUDGET=${BUDGET:-450}
gpu_setup
export FLASHINFER_DISABLE_JIT=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader
: "${TESTS:=tests/test_kernels_fused_elementwise.py tests/test_kernels_indexer.py tests/test_kernels_moe_mxfp4.py}"
for step in ${STEPS:-moe tests}; do
  case $step in
    moe) b=${MOE_BUDGET:-330}; l=$(left 60); [ "$b" -gt "$l" ] && b=$l
         [ "$b" -lt 60 ] && { echo "moe: only $b s left, skipped"; continue; }
         timeout -k 10 $((b + 50)) python3 benchmarks/moe.py --out "$OUT" --budget-s "$b" ${MOE_ARGS:-} 2>&1 \
           | tee "$OUT/moe.log" | tail -30 ;;
    tests) t=$(left 15); [ "$t" -lt 30 ] && { echo "tests: only $t s left, skipped"; continue; }
           timeout -s INT -k 10 $t python3 -m pytest -m gpu -q -p no:cacheprovider \
             --junitxml "$OUT/gpu_tests.xml" $TESTS 2>&1 | tee "$OUT/gpu_tests.log" | tail -20 ;;
    *) echo "unknown step $step"; continue ;;
  esac
  r=${PIPESTATUS[0]}
  if [ "$step" = tests ]; then tests_result tests "$OUT/gpu_tests.xml" "$r"; else result "$step" rc="$r"; fi
done
result "done"

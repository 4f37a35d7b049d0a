#!/usr/bin/env bash
# H200 (one GPU), one device call (issue 21, branch topk): the indexer top-k through SGLang 0.5.17's JIT
# radix top-k (`kernels.topk_sglang`, not wired into serving) against ours (`select_topk`, fused Triton).
#   0. jit: SGLang's three modules (v1 for k 512 and 1024, v2) nvcc-built into TVM_FFI_CACHE_DIR at once,
#      one process each (cap JIT_CAP s, default 150), each one's first call (the build) in the summary;
#   1. tests: `pytest -m gpu tests/test_kernels_topk_sglang.py` (cap TEST_CAP s, default 150) —
#      the wrapper's selections equal torch.topk's and ours as sets on every row where no tie straddles
#      the k-th score, rows with fewer valid columns than k included, ascending, −1 padded;
#   2. bench: benchmarks/topk_kernels.py with what is left — decode (1 / 8 / 64 rows × 8K / 32K / 64K),
#      hit extends (32 × 16K / 32K), prefill chunks (8,192 × 4K / 8K / 16K, causal lengths), top-512:
#      median µs of ours, the SGLang wrappers v1 / v2 and their raw kernels, first-call (JIT) ms, and the
#      rows equal to ours exactly / up to ties.
# Run from the checkout root with `.gpu` carried:
#   bash scripts/gpu/topk_kernels.sh
# Results in $OUT: summary.txt, topk_tests.log, gpu_tests.xml, topk_bench.log, topk_kernels.json,
# topk_kernels.png. A pass: "RESULT tests rc=0 pass" and "RESULT bench rc=0" (no errors in the JSON).
# Every step is capped; the script ends within BUDGET (s, default 290).
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
: "${BUDGET:=290}" "${JIT_CAP:=150}" "${TEST_CAP:=150}" "${BENCH_ARGS:=}"
gpu_setup
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export PATH=$CUDA_HOME/bin:$PATH TVM_FFI_CACHE_DIR=${TVM_FFI_CACHE_DIR:-/tmp/cache/tvm-ffi}
unset SGLANG_DSV41_INDEXER_TOPK
SUMMARY=$OUT/summary.txt
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader 2>&1 | sed 's/^/gpu: /' | tee "$SUMMARY"

jit_cap=$(cap "$JIT_CAP"); jd=$(mktemp -d)
for k in 512 1024 100; do
  timeout -k 5 "$jit_cap" python3 -c "import time, torch
from sglang_dsv41.kernels.topk_sglang import choose_variant, select_topk_sglang, sglang_topk_module
sglang_topk_module(); x = torch.randn(1, 4096, device='cuda'); torch.cuda.synchronize(); t = time.perf_counter()
select_topk_sglang(x, $k); torch.cuda.synchronize()
print(f'jit {choose_variant($k)} k=$k: first call {time.perf_counter() - t:.1f} s (the build when cold)')" >"$jd/$k.log" 2>&1 &
done
wait
for k in 512 1024 100; do tail -2 "$jd/$k.log"; done | tee -a "$SUMMARY"
result jit

timeout -s INT -k 5 "$(cap "$TEST_CAP")" python3 -m pytest -m gpu -q -p no:cacheprovider -rf --tb=short \
  --durations=10 --junitxml "$OUT/gpu_tests.xml" tests/test_kernels_topk_sglang.py >"$OUT/topk_tests.log" 2>&1
trc=$?
grep -E "^(FAILED|ERROR)" "$OUT/topk_tests.log" | head -10
tail -6 "$OUT/topk_tests.log"
tests_result tests "$OUT/gpu_tests.xml" "$trc"; tpass=$?

b=$(( $(left) - 15 ))
if [ "$b" -lt 40 ]; then
  result bench "skipped: only $b s left"; brc=1
else
  # shellcheck disable=SC2086
  timeout -s INT -k 10 "$b" python3 benchmarks/topk_kernels.py --out "$OUT" --budget-s $((b - 35)) $BENCH_ARGS 2>&1 \
    | grep -v -i warn | tee "$OUT/topk_bench.log" | tail -25
  brc=${PIPESTATUS[0]}
  result bench rc="$brc"
fi
[ "$tpass" = 0 ] && [ "$brc" = 0 ]

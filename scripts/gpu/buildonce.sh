#!/usr/bin/env bash
# H200 (one GPU), one device call (issues 14 and 21, branch buildonce): the indexer kernels without a
# build per request length (kernels/indexer.py j_steps a runtime argument; kernels/topk_select.py
# resident widths 1,024 / 8,192 instead of the row's next power of two).
#   1. tests (cap TEST_CAP s, default 170): tests/test_kernels_indexer.py, compiled on CUDA (gpu-marked
#      Flash-shape checks included), junit verdict;
#   2. benchmarks/topk_widths.py (cap 60 s): the fixed widths against next-power-of-two ones, µs and
#      bit equality, N = 1 … 512, E = 64 … 8,192;
#   3. benchmarks/hit_extend.py as scripts/gpu/hit_extend.sh: `first − wall` of the 20,480 case should
#      now be ≈ 0 (it was 3,023 ms on main, session 16's first call).
# Run from the checkout root with `.gpu` carried: BUDGET=400 bash scripts/gpu/buildonce.sh
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
BUDGET=${BUDGET:-400}
gpu_setup
SUMMARY=$OUT/summary.txt
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader 2>&1 | sed 's/^/gpu: /' | tee "$SUMMARY"
timeout -s TERM -k 10 "$(cap "${TEST_CAP:-170}")" python3 -m pytest -q -p no:cacheprovider -rf --tb=short \
    --junitxml="$OUT/indexer_junit.xml" tests/test_kernels_indexer.py >"$OUT/indexer_tests.log" 2>&1
rc=$?; tail -5 "$OUT/indexer_tests.log" | tee -a "$SUMMARY"
tests_result indexer_tests "$OUT/indexer_junit.xml" $rc
timeout -s TERM -k 10 "$(cap 60)" python3 benchmarks/topk_widths.py --out "$OUT" 2>&1 | tee -a "$SUMMARY"
result topk_widths rc=${PIPESTATUS[0]}
tiny_checkpoint /tmp/tiny || exit 4
timeout -s TERM -k 20 "$(left 25)" python3 benchmarks/hit_extend.py --model-path /tmp/tiny \
    --prefixes 0 1024 8192 32768 20480 --new-tokens 32 1 --chunk 24576 8192 --reps 5 --topk-variants \
    --out "$OUT/hit_extend.json" 2>&1 | grep -v -i warn | tail -30 | tee -a "$SUMMARY"
result hit_extend rc=${PIPESTATUS[0]}

#!/usr/bin/env bash
# H100 / H200 (one GPU), one device call per mode (issue 21, session 37: split-KV for the `wide` attention kernel
# at decode). Run from the checkout root with `.gpu` carried:
#   bash scripts/gpu/session37.sh attn    the wide kernel's GPU tests (its decode splits included), then
#                                         benchmarks/attention_decode.py: the serving decode kernel against `wide`
#                                         with key splits, N = 1 … 256, each output checked against the oracle
# Results: $OUT/summary.txt, $OUT/attention_decode.json / .png, $OUT/tests.{log,xml}.
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
MODE=${1:?usage: session37.sh attn}
BUDGET=${BUDGET:-420}; SUMMARY=$OUT/summary.txt
gpu_setup
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader | tee "$SUMMARY"
case $MODE in
  attn)
    timeout -s INT -k 10 "$(cap 150)" python3 -m pytest -m gpu -q -p no:cacheprovider --junitxml "$OUT/tests.xml" \
      tests/test_kernels_sparse_attention_prefill.py 2>&1 | tee "$OUT/tests.log" | tail -8
    tests_result wide_attention_gpu_tests "$OUT/tests.xml" "${PIPESTATUS[0]}"
    timeout -k 10 "$(cap 300)" python3 benchmarks/attention_decode.py --out "$OUT" 2>&1 | tee "$OUT/bench.log" | tail -60
    result attention_decode rc="${PIPESTATUS[0]}" ;;
  *) echo "unknown mode $MODE"; exit 2 ;;
esac
result done

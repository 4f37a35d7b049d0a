#!/usr/bin/env bash
# H200 (one GPU), one device call (session 24; issue 21): the session's final defaults — BF16 rows on cuBLAS
# (`whole`, kernels/bf16_linear.py measured no faster), decode attention `auto` (BF16 rows up to 256 queries)
# and the FP8 SHAPE_CONFIGS from session24b.sh's sweep:
#   1. pytest -m gpu tests/test_kernels_fp8_w8a8.py (Flash shapes within the bound at every row tier with the
#      shape configurations, split-K == one program, a row's bits within a tier, graph replay);
#   2. pytest -m gpu tests/test_runtime_cuda_graph_gpu.py tests/test_runtime_forward_gpu.py (replay == eager,
#      the forward under the defaults);
#   3. benchmarks/model_step.py under the defaults (side stream off / on).
# JSON in $OUT/model_step_final; logs in $OUT/logs.tar.gz.
# Run from the checkout root with `.gpu` carried: bash scripts/gpu/session24c.sh
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
: "${BUDGET:=330}" "${TEST_S:=190}"
mkdir -p "$OUT/logs" "$OUT/tests"
gpu_setup
OUT=$OUT/tests BUDGET=$TEST_S \
  TESTS="tests/test_kernels_fp8_w8a8.py tests/test_runtime_cuda_graph_gpu.py tests/test_runtime_forward_gpu.py" \
  bash scripts/gpu/gpu_tests_subset.sh
echo "== gpu tests rc=$?"
b=$(( $(left) - 10 ))
if [ "$b" -gt 70 ]; then
  timeout -s INT -k 10 "$b" python3 benchmarks/model_step.py --layers 4 --batches 1 8 64 256 --context 8192 \
    --cap-s 0.5 --budget-s $((b - 40)) --out "$OUT/model_step_final" >"$OUT/logs/model_step_final.log" 2>&1
  result "model_step final" rc=$?
  grep '^{' "$OUT/logs/model_step_final.log"
fi
mv "$OUT"/tests/*.log "$OUT/logs/" 2>/dev/null; rmdir "$OUT/tests"
(cd "$OUT" && tar czf logs.tar.gz logs 2>/dev/null; rm -rf logs)
find "$OUT" -name "*.png" -delete
ls -R "$OUT"

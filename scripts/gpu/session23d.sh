#!/usr/bin/env bash
# H200 (one GPU), one device call (session 23; issue 21): the runtime's GPU tests under the session's new
# serving defaults (side stream on; decode attention `auto` = FlashMLA for 2..256 queries): CUDA-graph
# replay = eager, greedy agreement with the reference, the side stream, the Triton backend contracts,
# DSpark verify / retract, the FlashMLA opt-ins; then benchmarks/model_step.py with the defaults (its `off`
# column = side stream off, FlashMLA decode on).
# Logs in $OUT/logs.tar.gz; JSON in $OUT/model_step.
# Run from the checkout root with `.gpu` carried: bash scripts/gpu/session23d.sh
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
: "${BUDGET:=570}" "${TEST_S:=420}"
mkdir -p "$OUT/logs" "$OUT/tests" "$OUT/model_step"
gpu_setup
OUT=$OUT/tests BUDGET=$TEST_S TESTS="tests/test_runtime_cuda_graph_gpu.py tests/test_runtime_forward_gpu.py \
tests/test_runtime_overlap_gpu.py tests/test_runtime_triton_backend.py tests/test_runtime_dspark_accept_gpu.py \
tests/test_runtime_dspark_retract_gpu.py tests/test_runtime_attention_flashmla.py" bash scripts/gpu/gpu_tests_subset.sh
echo "== runtime GPU tests rc=$?"
mv "$OUT"/tests/*.log "$OUT/logs/" 2>/dev/null; rmdir "$OUT/tests"
b=$(( $(left) - 10 ))
if [ "$b" -gt 90 ]; then
  timeout -s INT -k 10 "$b" python3 benchmarks/model_step.py --layers 4 --batches 1 8 64 256 --context 8192 \
    --cap-s 0.5 --budget-s $((b - 60)) --out "$OUT/model_step" >"$OUT/logs/model_step.log" 2>&1
  result model_step rc=$?
  grep '^{' "$OUT/logs/model_step.log"
fi
(cd "$OUT" && tar czf logs.tar.gz logs 2>/dev/null; rm -rf logs)
ls -R "$OUT"

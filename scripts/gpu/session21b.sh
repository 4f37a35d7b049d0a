#!/usr/bin/env bash
# H200 (one GPU), one device call (session 21; issue 21): the session's kernel choices on the GPU.
#   tests   `pytest -m gpu` (cap TEST_BUDGET s, default 230) on what the session touched: K_TESTS with
#           `-k "$K_SELECT"` (the decode attention plan, 16 heads per program up to 8 queries, against the
#           oracle and the packed path; the one-kernel router softplus), then TESTS whole (the BF16
#           products' padded row block, the decode-graph replay == eager tests, the Triton backend's
#           end-to-end contract);
#   attn    benchmarks/sparse_attention.py --sweep --batches 8 64 256 (cap ATTN_CAP s, default 200): the
#           packed path under the runtime's decode plan and alternative block shapes;
#   engram  benchmarks/engram_gather.py (cap 90 s): host (UVA) against device Engram gathers per token count;
#   step    benchmarks/decode_step.py --quick --batches 1 8 64 256 --no-prefill --profile (cap STEP_CAP s,
#           default 170): the graphed layer step and its kernel list.
# STEPS (default "tests attn engram step") picks and orders them. Run from the checkout root with `.gpu`
# carried: bash scripts/gpu/session21b.sh
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
: "${BUDGET:=590}" "${TEST_BUDGET:=230}" "${ATTN_CAP:=200}" "${STEP_CAP:=170}" "${STEPS:=tests attn engram step}"
: "${TESTS:=tests/test_runtime_dense_ops_gpu.py tests/test_runtime_cuda_graph_gpu.py tests/test_runtime_triton_backend.py}"
: "${K_TESTS:=tests/test_kernels_sparse_attention.py tests/test_runtime_moe_ops.py}" "${K_SELECT:=decode_plan or softplus}"
mkdir -p "$OUT/tests" "$OUT/attn" "$OUT/engram" "$OUT/step"
for step in $STEPS; do
  case $step in
    tests) OUT=$OUT/tests BUDGET=$(cap 60) TESTS=$K_TESTS PYTEST_K=$K_SELECT bash scripts/gpu/gpu_tests_subset.sh
           echo "== selected tests rc=$?"
           OUT=$OUT/tests BUDGET=$(cap $((TEST_BUDGET - 60))) TESTS=$TESTS bash scripts/gpu/gpu_tests_subset.sh
           echo "== tests rc=$?"; rm -f "$OUT"/tests/compileall.log "$OUT"/tests/pip-editable.log ;;
    attn)  gpu_setup; t=$(cap "$ATTN_CAP")
           timeout -s INT -k 10 "$t" python3 benchmarks/sparse_attention.py --sweep --batches 8 64 256 \
             --out "$OUT/attn" 2>&1 | grep -v -i warn | tail -12
           result attn_sweep rc="${PIPESTATUS[0]}" ;;
    engram) gpu_setup; t=$(cap 90)
           timeout -s INT -k 10 "$t" python3 benchmarks/engram_gather.py --out "$OUT/engram" 2>&1 | grep -v -i warn | tail -10
           result engram_gather rc="${PIPESTATUS[0]}" ;;
    step)  gpu_setup; t=$(cap "$STEP_CAP")
           timeout -s INT -k 10 "$t" python3 benchmarks/decode_step.py --quick --batches 1 8 64 256 --no-prefill \
             --profile --profile-fp8 w8a8_f16 --budget-s $((t - 20)) --out "$OUT/step" 2>&1 | grep -v -i warn | tail -12
           result decode_step rc="${PIPESTATUS[0]}" ;;
    *) echo "unknown step $step" ;;
  esac
done

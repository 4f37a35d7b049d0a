#!/usr/bin/env bash
# H200, one device call: `pytest -m gpu` on the files named in TESTS (default: the DSpark GPU files
# and the files after them in the suite's order, which session 10's full run did not reach), with
# full tracebacks, each file's log under $OUT. BUDGET caps the whole call (s); PYTEST_K, when set,
# is passed as `-k` to every file. Run from the checkout root with `.gpu` carried.
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
: "${BUDGET:=330}"
gpu_setup
: "${TESTS:=tests/test_runtime_dspark_accept_gpu.py tests/test_runtime_dspark_server_gpu.py tests/test_runtime_engram_host.py tests/test_runtime_engram_table.py tests/test_runtime_forward_gpu.py tests/test_runtime_moe_ops.py tests/test_runtime_triton_backend.py tests/test_vision_gpu.py}"
rc=0
for f in $TESTS; do
  l=$(left)
  [ "$l" -gt 20 ] || { echo "RESULT $f not run: budget spent"; rc=1; continue; }
  name=$(basename "$f" .py)
  timeout "$l" python3 -m pytest -m gpu -q -p no:cacheprovider -rf --tb=short ${PYTEST_K:+-k "$PYTEST_K"} "$f" >"$OUT/$name.log" 2>&1
  r=$?; [ $r = 0 ] || rc=1
  result "$f" rc=$r "$(tail -1 "$OUT/$name.log")"
  [ $r = 0 ] || grep -E "^(FAILED|ERROR|E )" "$OUT/$name.log" | head -20
done
exit $rc

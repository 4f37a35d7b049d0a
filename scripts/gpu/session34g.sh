#!/usr/bin/env bash
# H100 / H200 (one GPU), one device call (issue 21, session 34): the `tc` mHC partial dots at 4 warps —
#   1. pytest -m gpu tests/test_kernels_mhc.py (the kernels against the reference at Flash shapes, `tc` included);
#   2. the 8K prefill profile (`default`) with the RoPE programs back to the decode-sized ones.
# Run from the checkout root with `.gpu` carried: bash scripts/gpu/session34g.sh
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
: "${BUDGET:=300}"
mkdir -p "$OUT/logs" "$OUT/tests"
gpu_setup
OUT=$OUT/tests BUDGET=$(left 90) TESTS="tests/test_kernels_mhc.py" bash scripts/gpu/gpu_tests_subset.sh
echo "== gpu tests rc=$?"
prefill_profile default 80
pack_logs

#!/usr/bin/env bash
# H200 / H100 (one GPU), one short device call (session 29; issue 21): the quantised hand-off of the fold tier
# (`wo_a` → `wo_b`, the shared expert's SwiGLU → `w2`) on sm_90 hardware — pytest -m gpu on
# tests/test_kernels_fp8_fold.py (with its Flash-shape hand-off case) and tests/test_kernels_stacked_halves.py
# (the SwiGLU quantised for w2 at 2304 columns). Logs in $OUT/logs.tar.gz.
# Run from the checkout root with `.gpu` carried: bash scripts/gpu/session29f.sh
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
: "${BUDGET:=110}"
mkdir -p "$OUT/logs" "$OUT/tests"
gpu_setup
OUT=$OUT/tests BUDGET=$(left 5) TESTS="tests/test_kernels_fp8_fold.py tests/test_kernels_stacked_halves.py" \
  bash scripts/gpu/gpu_tests_subset.sh
echo "== gpu tests rc=$?"
mv "$OUT"/tests/*.log "$OUT/logs/" 2>/dev/null; rmdir "$OUT/tests" 2>/dev/null
(cd "$OUT" && tar czf logs.tar.gz logs 2>/dev/null; rm -rf logs)
ls -R "$OUT"

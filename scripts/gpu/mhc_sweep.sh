#!/usr/bin/env bash
# H200 (one GPU), one device call (issue 21, branch mhcsel): the mHC coefficient kernel by token count.
#   1. tests (one pytest process, cap TEST_CAP s, default 190): `pytest -m gpu` of tests/test_kernels_mhc.py
#      (bounds, batch invariance, both partial-dot kernels, `auto` dispatch at T = 1 / 7 / MIX_DOT_MIN_TOKENS,
#      dot vs rows bits printed as "[mhc dot vs rows]", CUDA-graph capture of `auto` on both sides of the
#      threshold) and of tests/test_runtime_forward_gpu.py's deterministic bit-for-bit batch invariance (one mHC
#      kernel) and serving-default contract (`auto`);
#   2. sweep (cap MHC_CAP s, default 60): benchmarks/mhc_mix.py — hc_coefficients `dot` / `rows` at T = 1, 2, 4,
#      …, 2,048, 8,192 (Flash width, do_bench µs), what `auto` runs, `fit.fit_dot_min_tokens`;
#   3. $OUT/mhc_sweep.json (scripts/gpu/mhc_sweep_summary.py): the test verdict, the sweep, `checks`.
# A pass: "RESULT tests rc=0 pass" and every entry of `checks` true — gpu_tests_pass (pytest rc 0 and every
# collected test reported, none failed: scripts/gpu/junit_verdict.py), mhc_auto_within_slack_of_best (`auto` within
# 5 % of the faster kernel at every swept T), mhc_dot_close_to_rows (≤ 2 × COEFFICIENT_BOUND). If the first
# fails, `fit.fit_dot_min_tokens` is the value for mhc_ops.MIX_DOT_MIN_TOKENS (docs/performance.md, "mHC kernel
# by token count"). Run from the checkout root with `.gpu` carried: `bash scripts/gpu/mhc_sweep.sh`. Every step
# is capped; the script ends within BUDGET (s, default 290): ≤ 10 s set-up + 190 + 10 s kill grace + 60 + 15 s
# summary. STEPS (default "tests sweep") runs a part alone. Files back: mhc_tests.log, gpu_tests.xml,
# mhc_mix.json, mhc_sweep.json.
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
: "${BUDGET:=290}" "${TEST_CAP:=190}" "${MHC_CAP:=60}" "${STEPS:=tests sweep}"
gpu_setup
unset SGLANG_DSV41_MHC_MIX
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader
for step in $STEPS; do
  case $step in
    tests) t=$(cap "$TEST_CAP")
           timeout -s INT -k 10 "$t" python3 -m pytest -m gpu -q -s -p no:cacheprovider -rf --tb=short --durations=10 \
             --junitxml "$OUT/gpu_tests.xml" tests/test_kernels_mhc.py tests/test_runtime_forward_gpu.py \
             -k "test_kernels_mhc or equal_each_request_alone or serving_default_batches" >"$OUT/mhc_tests.log" 2>&1
           TESTS_RC=$?
           grep -E "^\[mhc dot vs rows\]|^(FAILED|ERROR)" "$OUT/mhc_tests.log" | head -20
           tail -14 "$OUT/mhc_tests.log"
           tests_result tests "$OUT/gpu_tests.xml" "$TESTS_RC" ;;
    sweep) t=$(cap "$MHC_CAP")
           timeout "$t" python3 benchmarks/mhc_mix.py --out "$OUT" 2>&1 | tail -16
           result sweep rc="${PIPESTATUS[0]}" ;;
    *) echo "unknown step $step" ;;
  esac
done
timeout 15 python3 scripts/gpu/mhc_sweep_summary.py "$OUT" "${TESTS_RC:-}"
echo "files in \$OUT: $(ls "$OUT" | tr '\n' ' ') ($(ls "$OUT" | wc -l) of at most 8)"
result "done"

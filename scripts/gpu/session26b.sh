#!/usr/bin/env bash
# H200 (one GPU), one device call (session 26; issue 21), after session26.sh on the same warm machine: the
# whole model's decode step (benchmarks/model_step.py, 4 Flash-width layers, 8K context, side stream off /
# on) at N = 1 / 8 / 64 / 256 under the defaults, then with MODEL_STEP_ACTIVATIONS=fp32 (the activations in
# fp32 as before session 26, `prefill_profile.Fp32Activations`): session 26's BF16 change at decode, two
# processes on one machine. JSONs in $OUT/model_step_{default,fp32}; logs in $OUT/logs.tar.gz.
# Run from the checkout root with `.gpu` carried: bash scripts/gpu/session26b.sh
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
: "${BUDGET:=575}" "${STEP_S:=270}"
mkdir -p "$OUT/logs"
gpu_setup
model_step default "1 8 64 256" "$STEP_S"
model_step fp32 "1 8 64 256" "$STEP_S" MODEL_STEP_ACTIVATIONS=fp32
find "$OUT" -name "*.png" -delete
(cd "$OUT" && tar czf logs.tar.gz logs 2>/dev/null; rm -rf logs)
ls -R "$OUT"

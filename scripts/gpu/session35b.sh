#!/usr/bin/env bash
# H100 / H200 (one GPU), one device call (issue 21, session 35): the whole model's decode step at N = 64 / 256 with
# SGLANG_DSV41_BF16_GEMM=direct against `whole` (the default then; named explicitly since session 35), alternating (session35a.sh covered N = 1 / 8).
# Run from the checkout root with `.gpu` carried: bash scripts/gpu/session35b.sh
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
: "${BUDGET:=400}" "${STEP_S:=95}"
mkdir -p "$OUT/logs"
gpu_setup
model_step "whole1" "64 256" "$STEP_S" SGLANG_DSV41_BF16_GEMM=whole
model_step "direct1" "64 256" "$STEP_S" SGLANG_DSV41_BF16_GEMM=direct
model_step "whole2" "64 256" "$STEP_S" SGLANG_DSV41_BF16_GEMM=whole
model_step "direct2" "64 256" "$STEP_S" SGLANG_DSV41_BF16_GEMM=direct
rm -f "$OUT/decode_step.json"
pack_logs

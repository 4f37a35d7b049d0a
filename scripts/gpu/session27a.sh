#!/usr/bin/env bash
# H200 (one GPU), one device call (session 27; issue 21), after session26.sh: the whole model's decode step
# (benchmarks/model_step.py, 4 Flash-width layers, 8K context, side stream off / on), one process per setting
# on one machine, so every ratio is same-run:
#   default  the serving defaults (session 26's BF16 activations included)      N = 1 / 8 / 64 / 256
#   fp32     MODEL_STEP_ACTIVATIONS=fp32 (activations in fp32, as before 26)    N = 1 / 8 / 64 / 256
#   registers  SGLANG_DSV41_MHC_COEFF=registers (session 22's opt-in)            N = 1 / 8 / 64
#   gemv     SGLANG_DSV41_FP8_GEMM=w8a8_gemv (session 25's opt-in)               N = 1 / 2 / 4 / 8
#   split2   SGLANG_DSV41_MOE_DECODE_FLAGS=split_k=2 (session 25's opt-in)       N = 1 / 8
# It replaces session26b.sh and the model_step parts of session25a/b/c.sh within one call's budget.
# JSONs in $OUT/model_step_<label>; logs in $OUT/logs.tar.gz.
# Run from the checkout root with `.gpu` carried: bash scripts/gpu/session27a.sh
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
: "${BUDGET:=575}"
mkdir -p "$OUT/logs"
gpu_setup
model_step default "1 8 64 256" 130
model_step fp32 "1 8 64 256" 130 MODEL_STEP_ACTIVATIONS=fp32
model_step registers "1 8 64" 100 SGLANG_DSV41_MHC_COEFF=registers
model_step gemv "1 2 4 8" 100 SGLANG_DSV41_FP8_GEMM=w8a8_gemv
model_step split2 "1 8" 80 SGLANG_DSV41_MOE_DECODE_FLAGS=split_k=2
find "$OUT" -name "*.png" -delete
(cd "$OUT" && tar czf logs.tar.gz logs 2>/dev/null; rm -rf logs)
ls -R "$OUT"

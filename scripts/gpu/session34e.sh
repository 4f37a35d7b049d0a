#!/usr/bin/env bash
# H100 / H200 (one GPU), one device call (issue 21, session 34): the routed-expert GEMMs at the 8K Flash prefill
# under triton_kernels' launch constraints (benchmarks/moe_prefill_flags.py: time, chosen flags, bits against
# the default per flag set) — whether an SGLANG_DSV41_MOE_PREFILL_FLAGS value beats triton_kernels' own choice.
# Run from the checkout root with `.gpu` carried: bash scripts/gpu/session34e.sh
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
: "${BUDGET:=330}"
gpu_setup
timeout -k 5 "$(cap 300)" python3 benchmarks/moe_prefill_flags.py --out "$OUT"   # session 34 ran it with --reps 10 (its CLI then)
result moe_prefill_flags rc=$?

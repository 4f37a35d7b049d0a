#!/usr/bin/env bash
# H100 / H200 (one GPU), one device call (issue 21, session 35): the whole model's graphed decode step at N = 8 / 64
# with session 35's defaults under the profiler (`model_step.py --profile`: kernels per replay, busy and exposed
# time by kernel name), for the N = 8 / 64 gaps to the targets.
# Run from the checkout root with `.gpu` carried: bash scripts/gpu/session35d.sh
set -uo pipefail
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
: "${BUDGET:=300}"
mkdir -p "$OUT/logs"
gpu_setup
MODEL_STEP_EXTRA=--profile model_step "profiled" "8 64" "$(left 15)"
rm -f "$OUT/decode_step.json"
pack_logs

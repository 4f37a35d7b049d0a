#!/usr/bin/env bash
# mi325x-tp4
# 4 × MI325X (gfx942), tensor parallel 4 with Engram tables in pinned host memory (the card's
# MI325X default). gfx942 has no FP4 MFMA, so the MXFP4 experts run through the Triton MoE
# runner, and piecewise graph capture segfaults there: only full decode CUDA graphs are
# captured, prefill runs eagerly (the card's FULL_DECODE_ONLY). SWA bounded replay off on ROCm.
# Generated from configs/mi325x-tp4.yaml by `python -m sglang_dsv41.deploy.cookbook`: edit the config,
# then regenerate. Arguments go to `sglang-dsv41 launch` (--dry-run, --model-path DIR,
# --set KEY=VALUE, -- extra SGLang flags).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec sglang-dsv41 launch --config "$here/../configs/mi325x-tp4.yaml" "$@"

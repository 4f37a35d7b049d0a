#!/usr/bin/env bash
# mi355x-tp4
# 4 × MI355X, tensor parallel 4 with the Engram tables resident on the GPUs (the card's "For TP4
# ... keep the tables resident": 47.2 GiB per rank). Scheduler limits of the card's MI355X
# benchmark server: 128 running requests, 16384-token prefill budget. AITER MoE runner; SWA
# bounded replay off on ROCm.
# Generated from configs/mi355x-tp4.yaml by `python -m sglang_dsv41.deploy.cookbook`: edit the config,
# then regenerate. Arguments go to `sglang-dsv41 launch` (--dry-run, --model-path DIR,
# --set KEY=VALUE, -- extra SGLang flags).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec sglang-dsv41 launch --config "$here/../configs/mi355x-tp4.yaml" "$@"

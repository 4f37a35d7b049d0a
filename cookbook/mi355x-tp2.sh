#!/usr/bin/env bash
# mi355x-tp2
# 2 × MI355X, tensor parallel 2 with Engram tables in pinned host memory (the card's MI355X
# default). TP2 halves the GPUs per server and so doubles the servers per node. AITER MoE
# runner; SWA bounded replay stays off on ROCm (the card's --no-swa-bounded-replay).
# Generated from configs/mi355x-tp2.yaml by `python -m sglang_dsv41.deploy.cookbook`: edit the config,
# then regenerate. Arguments go to `sglang-dsv41 launch` (--dry-run, --model-path DIR,
# --set KEY=VALUE, -- extra SGLang flags).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec sglang-dsv41 launch --config "$here/../configs/mi355x-tp2.yaml" "$@"

#!/usr/bin/env bash
# h200-tp8
# 8 × H200 (one node), tensor parallel 8, Engram tables resident on the GPUs (rows split over
# the 8 ranks, 23.6 GiB each). The card: one 8-GPU H200 node holds the whole checkpoint "with
# room for KV cache".
# Generated from configs/h200-tp8.yaml by `python -m sglang_dsv41.deploy.cookbook`: edit the config,
# then regenerate. Arguments go to `sglang-dsv41 launch` (--dry-run, --model-path DIR,
# --set KEY=VALUE, -- extra SGLang flags).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec sglang-dsv41 launch --config "$here/../configs/h200-tp8.yaml" "$@"

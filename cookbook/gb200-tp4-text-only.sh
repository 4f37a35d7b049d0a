#!/usr/bin/env bash
# gb200-tp4-text-only
# One GB200 NVL4 tray (4 GPUs), tensor parallel 4, text only (no vision tower: its VRAM goes to
# KV cache) — the card's verified GB200 TP4 run was text-only. Engram tables in host memory,
# which NVLink-C2C makes cheap on GB-series systems (launch blog).
# Generated from configs/gb200-tp4-text-only.yaml by `python -m sglang_dsv41.deploy.cookbook`: edit the config,
# then regenerate. Arguments go to `sglang-dsv41 launch` (--dry-run, --model-path DIR,
# --set KEY=VALUE, -- extra SGLang flags).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec sglang-dsv41 launch --config "$here/../configs/gb200-tp4-text-only.yaml" "$@"

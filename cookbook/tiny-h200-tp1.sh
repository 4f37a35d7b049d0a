#!/usr/bin/env bash
# tiny-h200-tp1
# The tiny random-weight checkpoint (spec model.md §7; `sglang-dsv41 make-checkpoint tiny`) on 1
# H200, tensor parallel 1. It exercises every code path (both compression ratios, Engram,
# vision, DSpark weights) at ~1.6M parameters, so a small memory share suffices.
# Generated from configs/tiny-h200-tp1.yaml by `python -m sglang_dsv41.deploy.cookbook`: edit the config,
# then regenerate. Arguments go to `sglang-dsv41 launch` (--dry-run, --model-path DIR,
# --set KEY=VALUE, -- extra SGLang flags).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec sglang-dsv41 launch --config "$here/../configs/tiny-h200-tp1.yaml" "$@"

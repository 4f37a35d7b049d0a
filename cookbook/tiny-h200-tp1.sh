#!/usr/bin/env bash
# tiny-h200-tp1
# The tiny random-weight checkpoint (spec model.md §7) on 1 H200, tensor parallel 1, served by
# the runtime (text and images; decode CUDA graphs through the plugin's dsv41 attention backend,
# pytorch sampler — flags added by `sglang-dsv41 launch`). It exercises every text code path
# (both compression ratios, Engram) at ~1.6M parameters, so a small memory share suffices.
# Generated from configs/tiny-h200-tp1.yaml by `python -m sglang_dsv41.deploy.cookbook`: edit the config,
# then regenerate. Arguments go to `sglang-dsv41 launch` (--dry-run, --model-path DIR,
# --set KEY=VALUE, -- extra SGLang flags).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec sglang-dsv41 launch --config "$here/../configs/tiny-h200-tp1.yaml" "$@"

#!/usr/bin/env bash
# tiny-h200-tp2
# The tiny random-weight checkpoint (spec model.md §7) on 2 H200, tensor parallel 2, served by
# the torch-path runtime (text and images): each rank holds one of the tiny model's 2 attention
# output groups and half of the routed experts, bit-identical to TP 1
# (runtime/tensor_parallel.py). `sglang-dsv41 launch` makes the checkpoint on first use and adds
# the runtime's flags. Loopback only.
# Generated from configs/tiny-h200-tp2.yaml by `python -m sglang_dsv41.deploy.cookbook`: edit the config,
# then regenerate. Arguments go to `sglang-dsv41 launch` (--dry-run, --model-path DIR,
# --set KEY=VALUE, -- extra SGLang flags).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec sglang-dsv41 launch --config "$here/../configs/tiny-h200-tp2.yaml" "$@"

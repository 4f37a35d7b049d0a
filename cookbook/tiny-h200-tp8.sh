#!/usr/bin/env bash
# tiny-h200-tp8
# The tiny-tp8 random-weight checkpoint (the tiny model of spec model.md §7 with 8 attention
# heads in 8 output groups; presets.tiny_tp8_config_dict) on 8 H200, tensor parallel 8, served
# by the torch-path runtime (text and images): each rank holds 1 of the 8 output groups (one
# head each) and 1 of the 8 routed experts (the runtime's TP is also its expert parallelism) and
# a block of each Engram table's rows, bit-identical to TP 1 on CPU
# (runtime/tensor_parallel.py). `sglang-dsv41 launch` makes the checkpoint on first use and adds
# the runtime's flags. Loopback only. Issue 6: run it as docs/deploy.md describes.
# Generated from configs/tiny-h200-tp8.yaml by `python -m sglang_dsv41.deploy.cookbook`: edit the config,
# then regenerate. Arguments go to `sglang-dsv41 launch` (--dry-run, --model-path DIR,
# --set KEY=VALUE, -- extra SGLang flags).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec sglang-dsv41 launch --config "$here/../configs/tiny-h200-tp8.yaml" "$@"

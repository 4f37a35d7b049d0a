#!/usr/bin/env bash
# gb200-tp2
# 2 × GB200, tensor parallel 2 with Engram tables in pinned host memory (the card's Blackwell
# "Tensor Parallel" arm). FP8 KV cache; 128 running requests (the card's shared Blackwell --max-
# num-seqs). For high interactivity the card suggests TP4.
# Generated from configs/gb200-tp2.yaml by `python -m sglang_dsv41.deploy.cookbook`: edit the config,
# then regenerate. Arguments go to `sglang-dsv41 launch` (--dry-run, --model-path DIR,
# --set KEY=VALUE, -- extra SGLang flags).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec sglang-dsv41 launch --config "$here/../configs/gb200-tp2.yaml" "$@"

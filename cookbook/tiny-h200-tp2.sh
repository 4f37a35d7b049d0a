#!/usr/bin/env bash
# tiny-h200-tp2
# The tiny random-weight checkpoint (spec model.md §7) on 2 H200, tensor parallel 2. NOT
# SERVABLE YET: the runtime supports TP1 only for now (the torch path holds every weight on one
# device), so `sglang-dsv41 launch` refuses this config (exit 3) and `--dry-run` says why; it is
# kept so the TP2 target is planned and its command pinned until the runtime shards.
# Generated from configs/tiny-h200-tp2.yaml by `python -m sglang_dsv41.deploy.cookbook`: edit the config,
# then regenerate. Arguments go to `sglang-dsv41 launch` (--dry-run, --model-path DIR,
# --set KEY=VALUE, -- extra SGLang flags).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec sglang-dsv41 launch --config "$here/../configs/tiny-h200-tp2.yaml" "$@"

#!/usr/bin/env bash
# h200-tp4
# 4 × H200, tensor parallel 4, Engram tables in pinned host memory (the card's H200 default:
# "TP4 with Engram CPU offload"), layout per_rank: each rank pins its own quarter of the rows,
# so a server holds one copy of the tables on the host, and lookups all-reduce. Hopper has only
# the v4 KV layout upstream (1632.5 B/token of global KV).
# Generated from configs/h200-tp4.yaml by `python -m sglang_dsv41.deploy.cookbook`: edit the config,
# then regenerate. Arguments go to `sglang-dsv41 launch` (--dry-run, --model-path DIR,
# --set KEY=VALUE, -- extra SGLang flags).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec sglang-dsv41 launch --config "$here/../configs/h200-tp4.yaml" "$@"

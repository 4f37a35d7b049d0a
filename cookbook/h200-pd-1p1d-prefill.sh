#!/usr/bin/env bash
# h200-pd-1p1d (prefill)
# Prefill/decode disaggregation, 1P1D on one 8-GPU H200 node: prefill on GPUs 0-3 and decode on
# GPUs 4-7 (TP4 each, the card's "on 8-GPU nodes" layout at H200's TP4), KV over Mooncake, the
# router on port 8000. Engram tables in host memory, one copy per server (two per node).
# Generated from configs/h200-pd-1p1d.yaml by `python -m sglang_dsv41.deploy.cookbook`: edit the config,
# then regenerate. Arguments go to `sglang-dsv41 launch` (--dry-run, --model-path DIR,
# --set KEY=VALUE, -- extra SGLang flags).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec sglang-dsv41 launch --config "$here/../configs/h200-pd-1p1d.yaml" --role prefill "$@"

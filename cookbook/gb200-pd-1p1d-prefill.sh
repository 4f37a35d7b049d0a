#!/usr/bin/env bash
# gb200-pd-1p1d (prefill)
# Prefill/decode disaggregation, 1P1D on GB200 NVL4 — the card's verified layout: one tray (4
# GPUs, TP4) per role, KV handed over through NIXL, a router in front, text only, both pools
# capped at 32 running requests. Set pd.*.url_host to the two trays' addresses. With DSpark on,
# it must run in both pools (one speculative section serves both roles here).
# Generated from configs/gb200-pd-1p1d.yaml by `python -m sglang_dsv41.deploy.cookbook`: edit the config,
# then regenerate. Arguments go to `sglang-dsv41 launch` (--dry-run, --model-path DIR,
# --set KEY=VALUE, -- extra SGLang flags).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec sglang-dsv41 launch --config "$here/../configs/gb200-pd-1p1d.yaml" --role prefill "$@"

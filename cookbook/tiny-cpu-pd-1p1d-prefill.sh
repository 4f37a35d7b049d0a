#!/usr/bin/env bash
# tiny-cpu-pd-1p1d (prefill)
# Prefill/decode disaggregation of the tiny random-weight checkpoint on SGLang's CPU engine: a
# prefill and a decode server on this host, KV and state over Mooncake's TCP transport, the
# router in front on port 30000 (docs/pd.md). Needs `pip install -e ".[pd]"` and libibverbs1.
# `sglang-dsv41 launch --config configs/tiny-cpu-pd-1p1d.yaml` runs all three (`--role` one).
# Generated from configs/tiny-cpu-pd-1p1d.yaml by `python -m sglang_dsv41.deploy.cookbook`: edit the config,
# then regenerate. Arguments go to `sglang-dsv41 launch` (--dry-run, --model-path DIR,
# --set KEY=VALUE, -- extra SGLang flags).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec sglang-dsv41 launch --config "$here/../configs/tiny-cpu-pd-1p1d.yaml" --role prefill "$@"

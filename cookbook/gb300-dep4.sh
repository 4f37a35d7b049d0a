#!/usr/bin/env bash
# gb300-dep4
# 4 × GB300, data + expert parallel 4 (DEP4: DP attention over 4 ranks, experts split over 4
# ranks, MegaMoE all-to-all — the card's deep_gemm_mega_moe). Engram rows stay on the GPUs and
# are looked up across DP ranks (the card's embedding_across_dp). FP4 (v41) KV layout as
# FlashMLA MegaAttention uses when attention is not tensor-parallel. Prefill chunk 4096 keeps
# MegaMoE's per-rank buffer at 1024 tokens.
# Generated from configs/gb300-dep4.yaml by `python -m sglang_dsv41.deploy.cookbook`: edit the config,
# then regenerate. Arguments go to `sglang-dsv41 launch` (--dry-run, --model-path DIR,
# --set KEY=VALUE, -- extra SGLang flags).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec sglang-dsv41 launch --config "$here/../configs/gb300-dep4.yaml" "$@"

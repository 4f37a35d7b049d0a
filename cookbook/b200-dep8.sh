#!/usr/bin/env bash
# b200-dep8
# 8 × B200, data + expert parallel 8 (DEP8: DP attention over 8 ranks, experts split over 8
# ranks, MegaMoE all-to-all — the card's deep_gemm_mega_moe). Engram rows stay on the GPUs and
# are looked up across DP ranks (the card's embedding_across_dp). FP4 (v41) KV layout as
# FlashMLA MegaAttention uses when attention is not tensor-parallel. Prefill chunk 8192 keeps
# MegaMoE's per-rank buffer at 1024 tokens.
# Generated from configs/b200-dep8.yaml by `python -m sglang_dsv41.deploy.cookbook`: edit the config,
# then regenerate. Arguments go to `sglang-dsv41 launch` (--dry-run, --model-path DIR,
# --set KEY=VALUE, -- extra SGLang flags).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec sglang-dsv41 launch --config "$here/../configs/b200-dep8.yaml" "$@"

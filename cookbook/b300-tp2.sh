#!/usr/bin/env bash
# b300-tp2
# 2 × B300, tensor parallel 2 with Engram tables in pinned host memory (the card's Blackwell
# "Tensor Parallel" arm). FP8 KV cache; B300's exact-GPU override keeps 256 running requests and
# an 8192-token prefill budget (the card's --max-num-seqs 256 / --max-num-batched-tokens 8192;
# its capture size 8190 counts tokens, SGLang's graph batch counts requests, so graphs cover the
# 256 requests). For high interactivity the card suggests TP4.
# Generated from configs/b300-tp2.yaml by `python -m sglang_dsv41.deploy.cookbook`: edit the config,
# then regenerate. Arguments go to `sglang-dsv41 launch` (--dry-run, --model-path DIR,
# --set KEY=VALUE, -- extra SGLang flags).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec sglang-dsv41 launch --config "$here/../configs/b300-tp2.yaml" "$@"

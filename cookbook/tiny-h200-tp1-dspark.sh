#!/usr/bin/env bash
# tiny-h200-tp1-dspark
# tiny-h200-tp1 with DSpark speculative decoding: the tiny checkpoint bundles a 3-stage drafter
# (5-token blocks), verified adaptively (NVIDIA default; SGLang's compact ragged verify, here
# without a profiled SPS table, so every draft is verified) — the deployment form of what
# scripts/gpu/dspark.sh serves (docs/dspark.md).
# Generated from configs/tiny-h200-tp1-dspark.yaml by `python -m sglang_dsv41.deploy.cookbook`: edit the config,
# then regenerate. Arguments go to `sglang-dsv41 launch` (--dry-run, --model-path DIR,
# --set KEY=VALUE, -- extra SGLang flags).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec sglang-dsv41 launch --config "$here/../configs/tiny-h200-tp1-dspark.yaml" "$@"

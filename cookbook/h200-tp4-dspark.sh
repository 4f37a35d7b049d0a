#!/usr/bin/env bash
# h200-tp4-dspark
# h200-tp4 with DSpark speculative decoding (5-token blocks, the only speculative method for
# V4.1). The drafter adds ~14B parameters (7.4 GiB stored) to the load.
# Generated from configs/h200-tp4-dspark.yaml by `python -m sglang_dsv41.deploy.cookbook`: edit the config,
# then regenerate. Arguments go to `sglang-dsv41 launch` (--dry-run, --model-path DIR,
# --set KEY=VALUE, -- extra SGLang flags).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec sglang-dsv41 launch --config "$here/../configs/h200-tp4-dspark.yaml" "$@"

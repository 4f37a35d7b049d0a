#!/usr/bin/env bash
# tiny-cpu
# The tiny random-weight checkpoint on SGLang's CPU engine (no GPU; spec cpu.md §3): bounded KV
# pool, sleep when idle, loopback only. The planner budgets the KV pool from 5% of
# hardware.host_mem_gib.
# Generated from configs/tiny-cpu.yaml by `python -m sglang_dsv41.deploy.cookbook`: edit the config,
# then regenerate. Arguments go to `sglang-dsv41 launch` (--dry-run, --model-path DIR,
# --set KEY=VALUE, -- extra SGLang flags).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec sglang-dsv41 launch --config "$here/../configs/tiny-cpu.yaml" "$@"

#!/usr/bin/env bash
# tiny-cpu
# The tiny random-weight checkpoint (spec model.md §7) on SGLang's CPU engine (no GPU; spec
# cpu.md §3), served by the torch-path runtime (text and images, TP 1). `sglang-dsv41 launch`
# makes the checkpoint on first use, prepares the CPU environment (runtime/cpu_env.py) and adds
# the runtime's flags (torch_native attention, sleep when idle). Loopback only, bounded KV pool;
# the planner budgets it from 5% of hardware.host_mem_gib.
# Generated from configs/tiny-cpu.yaml by `python -m sglang_dsv41.deploy.cookbook`: edit the config,
# then regenerate. Arguments go to `sglang-dsv41 launch` (--dry-run, --model-path DIR,
# --set KEY=VALUE, -- extra SGLang flags).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec sglang-dsv41 launch --config "$here/../configs/tiny-cpu.yaml" "$@"

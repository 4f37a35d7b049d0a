"""`sglang-dsv41 plan`: will this deployment fit, and with how much KV cache?

The command line of the planner: reads the deployment config (with `--gpus` rescaling and `--set`
overrides), the checkpoint's config.json or the preset the config names, builds the plan
(`plan.make_plan`) and prints it as text (`plan_report.render`) or JSON. Exit status: 0 fits and
launches, 1 does not fit or `launch` refuses an option, 2 bad input.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ..config import ConfigError
from .plan import make_plan, model_config_for
from .plan_report import render
from .schema import DeployConfigError, apply_override, config_from_dict, raw_config


def _scale_parallel(data: dict[str, Any], gpus: int) -> None:
    """`--gpus N`: the same layout on N GPUs (tp = N; DP/EP that spanned tp keep spanning it)."""
    par = data.setdefault("parallel", {})
    old = par.get("tp", 1)
    for key in ("dp_attention", "ep"):
        if par.get(key, 1) == old and old > 1:
            par[key] = gpus
    par["tp"] = gpus
    data.setdefault("hardware", {})["gpus"] = gpus


def cli(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="sglang-dsv41 plan", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="deployment config (configs/*.yaml)")
    ap.add_argument("--checkpoint", help="checkpoint directory: take the architecture from its config.json")
    ap.add_argument("--gpus", type=int, help="GPUs per server (rescales tp, and DP/EP where they span tp)")
    ap.add_argument("--gpu-mem", type=float, help="GiB of memory per GPU")
    ap.add_argument("--mem-fraction", type=float, help="SGLang mem_fraction_static (weights + KV share)")
    ap.add_argument("--context", type=int, help="tokens per request (default: serving.context_length or the model's)")
    ap.add_argument("--batch", type=int, default=1, help="concurrent requests of --context tokens (default 1)")
    ap.add_argument("--hicache-ratio", type=float, help="HiCache host tier (L2) = this × the device pool, per rank")
    ap.add_argument("--hicache-size", type=float, help="HiCache host tier (L2) in GB per rank (overrides the ratio)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    a = ap.parse_args(argv)
    try:
        data = raw_config(a.config)
        if a.gpus is not None:
            _scale_parallel(data, a.gpus)
        for s in a.set:
            apply_override(data, s)
        dc = config_from_dict(data, a.config)
        cfg, src = model_config_for(dc, a.checkpoint)
    except (DeployConfigError, ConfigError, FileNotFoundError, ValueError) as e:
        print(f"sglang-dsv41 plan: {e}", file=sys.stderr)
        return 2
    if a.batch < 1 or (a.context is not None and a.context < 1):
        print("sglang-dsv41 plan: --batch and --context must be ≥ 1", file=sys.stderr)
        return 2
    try:
        p = make_plan(dc, cfg, src, gpu_mem=a.gpu_mem, mem_fraction=a.mem_fraction, context=a.context, batch=a.batch,
                      hicache_ratio=a.hicache_ratio, hicache_size=a.hicache_size)
    except ValueError as e:
        print(f"sglang-dsv41 plan: {e}", file=sys.stderr)
        return 2
    print(json.dumps(p.to_dict(), indent=2) if a.json else render(p, a.config))
    return 0 if p.verdict()[0] and not p.launch_refusals else 1

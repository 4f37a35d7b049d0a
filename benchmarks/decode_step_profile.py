"""Where the time of one decode step of a full-width Flash layer goes, by GPU kernel (issue 3).

`benchmarks/decode_step.py` times the step (eager and as a CUDA graph); this script answers the
next question — which kernels the graphed step spends its time in — so the next optimisation
is chosen by measurement. It builds the same layer and caches (`decode_step.build_layer`,
`make_caches`, `step_components`), runs the step's parts (`decode_step.STEP_PARTS`) once eagerly
under `torch.profiler` (CUDA activity) after a warm-up, and writes
`benchmarks/results/decode_step_profile.json`: per batch size, the summed device time of every
kernel name (top 30), the total device-busy time, the number of kernel launches, and the
`torch` part's share. Kernel device times are the same inside a CUDA graph; the graph removes
the launch gaps between them, so `device_busy_us` is what a graph replay of these kernels costs
at least. CUDA only; every stage is bounded by the batch list (no timing loops).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
TOP_KERNELS = 30


def _decode_step_module():
    spec = importlib.util.spec_from_file_location("bench_decode_step", HERE / "decode_step.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def kernel_table(events) -> tuple[dict[str, float], int]:
    """{kernel name: summed device µs} and the launch count from profiler key averages."""
    per_name: dict[str, float] = defaultdict(float)
    launches = 0
    for e in events:
        device_us = getattr(e, "self_device_time_total", None)
        if device_us is None:
            device_us = getattr(e, "self_cuda_time_total", 0.0)
        if device_us > 0 and e.device_type == torch.autograd.DeviceType.CUDA:
            per_name[e.key] += float(device_us)
            launches += int(e.count)
    return dict(per_name), launches


def profile_point(ds, layer, caches, N: int, context: int) -> dict:
    dev = torch.device("cuda")
    errors: list[str] = []
    positions = torch.full((N,), context - 1, dtype=torch.long, device=dev)
    comps, meta = ds.step_components(layer, caches, torch.arange(N, device=dev), positions, errors)
    parts = [c for c in ds.STEP_PARTS if c in comps]
    for fn in (comps[c] for c in parts):         # warm-up: compile and autotune outside the trace
        fn()
    torch.cuda.synchronize()
    by_part: dict[str, dict] = {}
    for part in parts:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            comps[part]()
            torch.cuda.synchronize()
        table, launches = kernel_table(prof.key_averages())
        by_part[part] = dict(device_busy_us=sum(table.values()), launches=launches,
                             top=sorted(table.items(), key=lambda kv: -kv[1])[:TOP_KERNELS])
    total = sum(p["device_busy_us"] for p in by_part.values())
    return dict(tokens=N, meta=meta, errors=errors, parts=by_part, device_busy_us=total,
                launches=sum(p["launches"] for p in by_part.values()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--layer", type=int, default=2)
    ap.add_argument("--out", type=Path, default=HERE / "results")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/decode_step_profile.py needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = False
    ds = _decode_step_module()
    t0 = time.perf_counter()
    cfg = ds.DeepseekV41Config.from_dict(ds.flash_config_dict())
    layer = ds.build_layer(cfg, args.layer, torch.device("cuda"))
    caches = ds.make_caches(layer, max(args.batches), args.context, torch.device("cuda"))
    rows = [profile_point(ds, layer, caches, N, args.context) for N in args.batches]
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "decode_step_profile.json"
    path.write_text(json.dumps(dict(device=torch.cuda.get_device_name(), layer=args.layer, context=args.context,
                                    rows=rows, wall_s=time.perf_counter() - t0), indent=1))
    for r in rows:
        shares = ", ".join(f"{k} {v['device_busy_us']:.0f} µs/{v['launches']} launches" for k, v in r["parts"].items())
        print(f"N={r['tokens']}: device busy {r['device_busy_us']:.0f} µs, {r['launches']} launches ({shares})")
        for name, us in r["parts"].get("torch", {}).get("top", [])[:8]:
            print(f"    torch part: {us:8.1f} µs  {name[:100]}")
    print(f"wrote {path}")
    return 1 if any(r["errors"] for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())

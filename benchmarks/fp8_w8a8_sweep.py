"""`benchmarks/fp8_w8a8.py --sweep`: W8A8 GEMM configurations of the decode (M ≤ 16) and mid
(tier limit 256; M ≤ 128 below the prefill form) row tiers, per FP8 dense weight of one Flash layer (`wo_a` grouped, act_quant False).

Each weight alone is timed (`step_timing.measure`: CUDA events, 256 MB L2 flush before every call)
with every candidate of a tier (`CANDIDATES` plus the tier's current configuration, label
`current`) at each M of the tier (`TIER_ROWS`), called as the runtime calls it: split-K counters,
fp32 output. The kernels are compiled first by `--jobs` worker processes (Triton's disk cache),
and timing stops at `--budget-s` (what was left is listed under `skipped`). A configuration is
a per-(tier, weight shape) choice (`kernels.fp8_w8a8.SHAPE_CONFIGS`), so the score of a
candidate for a weight is its µs summed over the tier's rows. Writes `fp8_w8a8_sweep.json`: every
point (µs, GB/s, fraction of the copy bandwidth), the best candidate per weight and tier, the best
single candidate per tier, and the SHAPE_CONFIGS entries that would beat `current`.
"""
from __future__ import annotations

import argparse
import concurrent.futures as futures
import json
import multiprocessing
import time

import torch

#: row-tier limit (`kernels.fp8_w8a8.ROW_TIERS`, the key of SHAPE_CONFIGS) → the M timed in it
TIER_ROWS = {16: (1, 4, 8, 16), 256: (32, 64)}
#: label → (tier limit, W8A8Config fields: block_m, block_n, sub_blocks, warps, stages, fused_quant, split_k,
#: fp8_mma, target_programs, swap_ab). `sw` = swap_ab (BLOCK_N weight rows on the MMA's M side).
CANDIDATES: dict[str, tuple[int, tuple]] = {
    "m16_n64_s4_w4_p4_t1056": (16, (16, 64, 4, 4, 4, True, True, False, 1056, False)),
    "m16_n64_s8_w4_p3_t1056": (16, (16, 64, 8, 4, 3, True, True, False, 1056, False)),
    "m16_n64_s4_w4_p3_t2112": (16, (16, 64, 4, 4, 3, True, True, False, 2112, False)),
    "m16_n128_s4_w4_p3_t1056": (16, (16, 128, 4, 4, 3, True, True, False, 1056, False)),
    "m16_n128_s2_w4_p4_t2112": (16, (16, 128, 2, 4, 4, True, True, False, 2112, False)),
    "m16_n128_s4_w8_p3_t2112": (16, (16, 128, 4, 8, 3, True, True, False, 2112, False)),
    "m16_n256_s2_w8_p3_t2112": (16, (16, 256, 2, 8, 3, True, True, False, 2112, False)),
    "sw_m16_n64_s4_w4_p3_t1056": (16, (16, 64, 4, 4, 3, True, True, False, 1056, True)),
    "sw_m16_n64_s4_w4_p4_t1056": (16, (16, 64, 4, 4, 4, True, True, False, 1056, True)),
    "sw_m16_n64_s8_w4_p3_t1056": (16, (16, 64, 8, 4, 3, True, True, False, 1056, True)),
    "sw_m16_n64_s4_w4_p3_t2112": (16, (16, 64, 4, 4, 3, True, True, False, 2112, True)),
    "sw_m16_n64_s4_w4_p3_t528": (16, (16, 64, 4, 4, 3, True, True, False, 528, True)),
    "sw_m16_n128_s4_w4_p3_t2112": (16, (16, 128, 4, 4, 3, True, True, False, 2112, True)),
    "sw_m16_n128_s4_w4_p4_t2112": (16, (16, 128, 4, 4, 4, True, True, False, 2112, True)),
    "sw_m16_n128_s2_w4_p5_t2112": (16, (16, 128, 2, 4, 5, True, True, False, 2112, True)),
    "sw_m16_n128_s4_w8_p3_t2112": (16, (16, 128, 4, 8, 3, True, True, False, 2112, True)),
    "sw_m16_n128_s8_w4_p3_t1056": (16, (16, 128, 8, 4, 3, True, True, False, 1056, True)),
    "sw_m16_n128_s4_w4_p3_t4224": (16, (16, 128, 4, 4, 3, True, True, False, 4224, True)),
    "sw_m16_n256_s4_w8_p3_t2112": (16, (16, 256, 4, 8, 3, True, True, False, 2112, True)),
    "sw_m16_n32_s8_w4_p3_t1056": (16, (16, 32, 8, 4, 3, True, True, False, 1056, True)),
    "m64_n128_s1_w4_p4_t1056": (256, (64, 128, 1, 4, 4, True, True, False, 1056, False)),
    "m64_n128_s2_w4_p3_t528": (256, (64, 128, 2, 4, 3, True, True, False, 528, False)),
    "m64_n64_s2_w4_p4_t1056": (256, (64, 64, 2, 4, 4, True, True, False, 1056, False)),
    "m64_n256_s1_w8_p3_t528": (256, (64, 256, 1, 8, 3, True, True, False, 528, False)),
    "m32_n128_s2_w4_p3_t1056": (256, (32, 128, 2, 4, 3, True, True, False, 1056, False)),
    "sw_m64_n128_s2_w4_p3_t1056": (256, (64, 128, 2, 4, 3, True, True, False, 1056, True)),
    "sw_m32_n128_s4_w4_p3_t2112": (256, (32, 128, 4, 4, 3, True, True, False, 2112, True)),
    "sw_m64_n128_s2_w8_p3_t2112": (256, (64, 128, 2, 8, 3, True, True, False, 2112, True)),
    "sw_m64_n64_s4_w4_p3_t1056": (256, (64, 64, 4, 4, 3, True, True, False, 1056, True)),
}
CURRENT = "current"


def tier_candidates(W, tier: int) -> dict:
    """label → W8A8Config of the tier: `current` (the tier's configuration today) first."""
    current = dict(W.ROW_TIERS)[tier]
    return {CURRENT: current} | {k: W.W8A8Config(*v) for k, (t, v) in CANDIDATES.items() if t == tier}


def make_weights(W, shapes: list, dev: torch.device) -> list:
    from fp8_w8a8 import random_fp8

    g = torch.Generator(device=dev).manual_seed(0)
    return [(name, n, k, groups, *random_fp8(n, k, g, dev), W.split_k_counters(n, dev)) for name, n, k, groups in shapes]


def call(W, weight: tuple, x: torch.Tensor, cfg):
    _, _, _, groups, v, s, c = weight
    return W.fp8_w8a8_linear(x, v, s, groups=groups, act_quant=groups == 1, config=cfg, counters=c,
                             out_dtype=torch.float32)


def inputs(weights: list, m: int, dev: torch.device) -> list[torch.Tensor]:
    g = torch.Generator(device=dev).manual_seed(m)
    return [torch.randn(m, groups * k, generator=g, device=dev).to(torch.bfloat16) for _, _, k, groups, *_ in weights]


_WORKER_WEIGHTS: dict[int, list] = {}


def _compile_worker(layer: int, tier: int, labels: list[str]) -> list[str]:
    """Runs each candidate once at every M of its tier (fills Triton's disk cache); returns errors."""
    from sglang_dsv41.kernels import fp8_w8a8 as W
    from fp8_w8a8 import layer_shapes

    dev = torch.device("cuda")
    if layer not in _WORKER_WEIGHTS:                  # one set per worker process, reused across tasks
        _WORKER_WEIGHTS[layer] = make_weights(W, layer_shapes(layer), dev)
    weights = _WORKER_WEIGHTS[layer]
    cfgs = tier_candidates(W, tier)
    errors = []
    for m in TIER_ROWS[tier]:
        xs = inputs(weights, m, dev)
        for label in labels:
            for w, x in zip(weights, xs):
                try:
                    call(W, w, x, cfgs[label])
                except Exception as exc:
                    errors.append(f"compile {label} {w[0]} M={m}: {type(exc).__name__}: {exc}"[:300])
    torch.cuda.synchronize()
    return errors


def precompile(layer: int, jobs: int) -> list[str]:
    """Compile every (tier, candidate) in `jobs` spawned processes; errors are reported, not fatal."""
    from sglang_dsv41.kernels import fp8_w8a8 as W

    work = [(tier, label) for tier in TIER_ROWS for label in tier_candidates(W, tier)]
    errors: list[str] = []
    try:
        with futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            done = [pool.submit(_compile_worker, layer, tier, [label]) for tier, label in work]
            for f in done:
                errors += f.result()
    except Exception as exc:          # the timing loop then compiles in-process
        errors.append(f"precompile pool: {type(exc).__name__}: {exc}"[:300])
    return errors


def summarise(points: list[dict], weights: list[str]) -> dict:
    """Per tier: the best candidate per weight (µs summed over the tier's rows, complete rows only)
    against `current`, and the best single candidate over all weights."""
    out: dict = {}
    for tier, rows in TIER_ROWS.items():
        sums: dict[tuple[str, str], float] = {}
        counts: dict[tuple[str, str], int] = {}
        for p in points:
            if p["tier"] == tier:
                key = (p["weight"], p["label"])
                sums[key] = sums.get(key, 0.0) + p["us"]
                counts[key] = counts.get(key, 0) + 1
        full = {key: us for key, us in sums.items() if counts[key] == len(rows)}
        per_weight = {}
        for w in weights:
            mine = {label: us for (ww, label), us in full.items() if ww == w}
            if mine:
                best = min(mine, key=mine.get)
                per_weight[w] = dict(best=best, us_sum=mine[best], current_us_sum=mine.get(CURRENT))
        labels = {label for _, label in full}
        totals = {lab: sum(full[(w, lab)] for w in weights) for lab in labels if all((w, lab) in full for w in weights)}
        best_tier = min(totals, key=totals.get) if totals else None
        out[str(tier)] = dict(per_weight=per_weight, best_single=best_tier, totals_us=totals,
                              per_weight_best_total_us=sum(v["us_sum"] for v in per_weight.values()))
    return out


def run_sweep(args: argparse.Namespace, dev: torch.device, copy_gbs: float, shapes: list | None = None) -> int:
    """The sweep (module doc) over `shapes` (default: the layer's); returns 1 when a point failed."""
    from sglang_dsv41.kernels import fp8_w8a8 as W
    from fp8_w8a8 import layer_shapes
    from step_timing import measure

    t0 = time.perf_counter()
    shapes = shapes or layer_shapes(args.layer)
    errors = precompile(args.layer, args.jobs) if args.jobs > 0 and dev.type == "cuda" else []
    compile_s = time.perf_counter() - t0
    weights = make_weights(W, shapes, dev)
    points, skipped = [], []
    for tier, rows in TIER_ROWS.items():
        cfgs = tier_candidates(W, tier)
        for m in rows:
            xs = inputs(weights, m, dev)
            for label, cfg in cfgs.items():
                if time.perf_counter() - t0 > args.budget_s:
                    skipped.append(f"tier {tier} M={m} {label}")
                    continue
                for w, x in zip(weights, xs):
                    name, n, k = w[:3]
                    try:
                        us = measure(lambda: call(W, w, x, cfg), args.cap_s, dev)["median_us"]
                    except Exception as exc:
                        errors.append(f"{label} {name} M={m}: {type(exc).__name__}: {exc}"[:300])
                        continue
                    gbs = W.weight_bytes(n, k) / us / 1e3
                    points.append(dict(tier=tier, rows=m, weight=name, label=label, us=us, gbs=gbs,
                                       fraction_of_copy=gbs / copy_gbs))
    names = [name for name, *_ in shapes]
    summary = summarise(points, names)
    suggestions = shape_config_suggestions(W, summary, shapes, args.min_gain)
    report(summary, suggestions)
    args.out.mkdir(parents=True, exist_ok=True)
    all_cfgs = {f"{tier}:{label}": cfg.__dict__ for tier in TIER_ROWS for label, cfg in tier_candidates(W, tier).items()}
    result = dict(device=torch.cuda.get_device_name() if dev.type == "cuda" else str(dev), layer=args.layer,
                  shapes=shapes, copy_gbs=copy_gbs, tier_rows=TIER_ROWS, candidates=all_cfgs, points=points,
                  summary=summary, shape_configs=suggestions, skipped=skipped, errors=errors,
                  compile_s=compile_s, total_s=time.perf_counter() - t0,
                  timing="step_timing.measure median per weight alone, 256 MB L2 flush per call, fp32 out + counters",
                  when=time.strftime("%F %T"))
    (args.out / "fp8_w8a8_sweep.json").write_text(json.dumps(result, indent=1))
    return 1 if errors else 0


def shape_config_suggestions(W, summary: dict, shapes: list, min_gain: float) -> list[str]:
    """`SHAPE_CONFIGS` lines for the weights whose best candidate beats `current` by more than
    `min_gain` (a fraction) in the tier."""
    lines = []
    for tier, s in summary.items():
        cfgs = tier_candidates(W, int(tier))
        for name, n, k, groups in shapes:
            best = s["per_weight"].get(name)
            if not best or best["best"] == CURRENT or not best["current_us_sum"]:
                continue
            if best["us_sum"] < (1 - min_gain) * best["current_us_sum"]:
                c = cfgs[best["best"]]
                lines.append(f"({tier}, {n}, {k}, {groups}): W8A8Config({c.block_m}, "
                             f"{c.block_n}, {c.sub_blocks}, {c.num_warps}, {c.num_stages}, fused_quant=True, "
                             f"split_k=True, target_programs={c.target_programs}, swap_ab={c.swap_ab}),  "
                             f"# {name} {best['current_us_sum']:.1f} → {best['us_sum']:.1f} µs")
    return lines


def report(summary: dict, suggestions: list[str]) -> None:
    for tier, s in summary.items():
        print(f"tier M ≤ {tier} (µs summed over M = {TIER_ROWS[int(tier)]}):", flush=True)
        for name, b in s["per_weight"].items():
            cur = b["current_us_sum"]
            print(f"  {name}: best {b['best']} {b['us_sum']:.1f}  current {cur if cur is None else round(cur, 1)}")
        if s["best_single"]:
            print(f"  best single: {s['best_single']} {s['totals_us'][s['best_single']]:.1f} µs; current "
                  f"{s['totals_us'].get(CURRENT, float('nan')):.1f}; per-weight best {s['per_weight_best_total_us']:.1f}")
    print("SHAPE_CONFIGS suggestions:\n  " + "\n  ".join(suggestions or ["(none)"]), flush=True)

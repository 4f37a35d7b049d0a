"""Dense FP8 linears of one full-width Flash layer: the W8A8 GEMM (`kernels.fp8_w8a8`) against
today's W8A16 kernel (`kernels.fp8_linear`) and cuBLAS BF16 on dequantised copies (issue 21).

What it times, for M ∈ {1, 8, 64, 256, 8192} rows: every FP8-stored dense weight of Flash layer
`--layer` (shapes from `names.tensor_inventory`; `wo_a` as its 8 groups), random E4M3 values with
power-of-two tile scales, multiplied in sequence — one "layer pass" — by

* `w8a8`: `fp8_w8a8_linear` as the runtime calls it — the Triton kernel with its row-tier
  configuration (`config_for_rows`) and the weight's split-K counters (the chunk sum inside the GEMM
  launch) below `BF16_GEMM_MIN_ROWS` rows, the prefill form (dequantise + cuBLAS BF16) from there; `wo_a` grouped in one GEMM launch; `w8a8_bf16_gemm`: the prefill form
  at every M; `w8a8_<label>`: the Triton kernel with a fixed configuration of `ALTERNATIVES`
  (`w8a8_s7_*`: session 7's row tiers, for old-vs-new in one run);
* `fp8_linear`: today's runtime kernel (W8A16, BF16 activations, fp32 out; `wo_a` as 8 group calls,
  as `runtime/` does);
* `cublas_bf16`: `torch.mm` on BF16 copies of the dequantised weights (`wo_a`: one `torch.bmm`).

Per point: median µs eager and as a replayed CUDA graph (`step_timing.measure`: CUDA events, a
256 MB L2 flush before every call), the weight bytes the pass must read (E4M3 + fp32 tile scales;
2 B per element for BF16), GB/s and the fraction of the copy bandwidth measured in the same run
(decode), and TFLOP/s (2·M·N·K; prefill). `per_weight`: each weight alone (graph µs) for
`w8a8`, `fp8_linear`, `cublas_bf16` (and `w8a8_gemv` at ≤ 4 rows when that variant runs). `agreement`: whether each configuration gives the decode
configuration's bits (64 rows, every weight) — configurations with another chunking or MMA give
other bits (module doc of kernels/fp8_w8a8.py).
`accuracy` (`_gemv`: with the GEMV tier): the first rows of each weight against `reference.ops.linear_fp8` on the CPU, as a
fraction of the tests' bound (`tests/test_kernels_fp8_w8a8.py`). Writes `fp8_w8a8.json` and
`fp8_w8a8.png` to `--out`. CUDA only.

    python benchmarks/fp8_w8a8.py [--layer 2] [--rows 1 8 64 256 8192] [--variants L ...]
        [--no-per-weight | --per-weight-rows M ...] [--cap-s 0.25] [--out benchmarks/results]
    python benchmarks/fp8_w8a8.py --sweep [--jobs 8] [--budget-s 150] [--min-gain 0.03] [--cap-s 0.02]

`--sweep`: the decode / mid row tiers' candidate configurations weight by weight instead
(benchmarks/fp8_w8a8_sweep.py; writes `fp8_w8a8_sweep.json`).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Callable

import torch

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
from device_bandwidth import copy_bandwidth_gbs  # noqa: E402
from step_timing import capture_graph, measure, settle_after_failed_capture  # noqa: E402
from plotting import pyplot, save_png  # noqa: E402

ROWS = (1, 8, 64, 256, 8192)
#: fixed configurations swept besides the row tiers: label → ((block_m, block_n, sub_blocks, warps, stages,
#: fused_quant, split_k[, fp8_mma, target_programs]), (fewest rows, most rows) timed). All compile for sm_90
#: without spills: decode-shaped (BLOCK_M 16: mma.sync f16) and wgmma-shaped (BLOCK_M ≥ 64: f16, or E4M3 with
#: fp8_mma). Decode shapes are not timed at prefill sizes (they re-quantise x per column block). `s7_*`:
#: session 7's tiers (decode: 4 stages, ≈ 2 programs per SM; mid: E4M3 wgmma). Results: docs/performance.md.
ALTERNATIVES = {"s7_decode": ((16, 64, 4, 4, 4, True, True, False, 264), (1, 64)),
                "s7_mid_fp8": ((64, 128, 1, 4, 4, True, True, True, 264), (17, 256)),
                "decode_t528": ((16, 64, 4, 4, 3, True, True, False, 528), (1, 64)),
                "decode_t2112": ((16, 64, 4, 4, 3, True, True, False, 2112), (1, 64)),
                "decode_s4_t1056": ((16, 64, 4, 4, 4, True, True, False, 1056), (1, 64)),
                "decode_bn32_t1056": ((16, 32, 4, 4, 3, True, True, False, 1056), (1, 64)),
                "decode_prequant_t1056": ((16, 64, 4, 4, 3, False, True, False, 1056), (1, 64)),
                "mid_t1056": ((64, 128, 1, 4, 4, True, True, False, 1056), (17, 256)),
                "bm16_bn64_sub8": ((16, 64, 8, 4, 4, True, True), (1, 64)),
                "bm64_bn128_prequant": ((64, 128, 2, 4, 4, False, False), (8, 8192)),
                # the CUDA-core GEMV tier (`kernels.fp8_gemv`, ≤ 4 rows; `gemv` = GEMV_CONFIG) and its neighbours
                "gemv": ((4, 64, 4, 4, 1, True, True, False, 1056, False, True), (1, 4)),
                "gemv_prequant": ((4, 64, 4, 4, 1, False, True, False, 1056, False, True), (1, 4)),
                "gemv_bn32": ((4, 32, 4, 4, 1, True, True, False, 1056, False, True), (1, 4)),
                "gemv_bn128_w8": ((4, 128, 4, 8, 1, True, True, False, 1056, False, True), (1, 4)),
                "gemv_sub2": ((4, 64, 2, 4, 1, True, True, False, 1056, False, True), (1, 4)),
                "gemv_t528": ((4, 64, 4, 4, 1, True, True, False, 528, False, True), (1, 4)),
                "gemv_t2112": ((4, 64, 4, 4, 1, True, True, False, 2112, False, True), (1, 4))}
#: the GEMV tier's sweep (scripts/gpu/session25a.sh)
GEMV_VARIANTS = ("gemv", "gemv_prequant", "gemv_bn32", "gemv_bn128_w8", "gemv_sub2", "gemv_t528", "gemv_t2112")
#: the sweep of scripts/gpu/speed3.sh (old vs new at decode, the levers around the new decode tier)
SPEED3_VARIANTS = ("s7_decode", "s7_mid_fp8", "decode_t528", "decode_t2112", "decode_s4_t1056",
                   "decode_bn32_t1056", "decode_prequant_t1056", "mid_t1056")
#: the prefill form forced at every M (`fp8_w8a8_linear(bf16_gemm=True)`): dequantise + cuBLAS BF16
BF16_GEMM = "bf16_gemm"
PER_WEIGHT = ("w8a8", "fp8_linear", "cublas_bf16")


def layer_shapes(layer: int) -> list[tuple[str, int, int, int]]:
    """(name, N, K, groups) of every FP8 dense weight of Flash layer `layer`; `wo_a` [G·r, d] is
    grouped: its product reads x [M, G·d]."""
    from sglang_dsv41.checkpoint.names import Kind, tensor_inventory
    from sglang_dsv41.config import DeepseekV41Config
    from sglang_dsv41.presets import flash_config_dict

    cfg = DeepseekV41Config.from_dict(flash_config_dict())
    prefix = f"layers.{layer}."
    out = []
    for s in tensor_inventory(cfg, vision=False, dspark=False):
        if s.name.startswith(prefix) and s.kind is Kind.FP8 and len(s.shape) == 2 and ".experts." not in s.name:
            name = s.name[len(prefix):]
            out.append((name, s.shape[0], s.shape[1], cfg.text.o_groups if name.endswith("wo_a.weight") else 1))
    return out


def random_fp8(n: int, k: int, g: torch.Generator, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    values = (torch.randn(n, k, generator=g, device=dev) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    exps = torch.randint(-12, -4, (-(-n // 32), -(-k // 32)), generator=g, device=dev)
    return values, torch.exp2(exps.float())


def dequantised_bf16(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    n, k = values.shape
    s = scales.repeat_interleave(32, 0)[:n].repeat_interleave(32, 1)[:, :k]
    return (values.float() * s).to(torch.bfloat16)


def variant_configs(W, labels: list[str] | None) -> dict[str, object]:
    """label → W8A8Config (None = the row tiers) for `w8a8` and the chosen `ALTERNATIVES`
    (all when `labels` is None); unknown labels raise SystemExit."""
    if labels is not None:
        unknown = sorted(set(labels) - set(ALTERNATIVES))
        if unknown:
            raise SystemExit(f"unknown variants {unknown}; known: {sorted(ALTERNATIVES)}")
    chosen = ALTERNATIVES if labels is None else {k: ALTERNATIVES[k] for k in labels}
    return ({"w8a8": None, "w8a8_bf16_gemm": BF16_GEMM}
            | {f"w8a8_{k}": W.W8A8Config(*v[0]) for k, v in chosen.items()})


def timed_at(label: str, m: int) -> bool:
    """Whether variant `label` is timed at M = m (`ALTERNATIVES`' row ranges; baselines always)."""
    if not label.startswith("w8a8_") or label == "w8a8_bf16_gemm":
        return True
    lo, hi = ALTERNATIVES[label[len("w8a8_"):]][1]
    return lo <= m <= hi


def weight_calls(W, F, weights: list, bf16: list) -> dict[str, list[Callable]]:
    """label → one call(x) per weight, for the W8A8 variants (added by the caller) and the baselines."""
    fp8_linear, cublas = [], []
    for (name, n, k, groups, v, s), wb in zip(weights, bf16):
        if groups == 1:
            fp8_linear.append(lambda x, v=v, s=s: F.fp8_linear(x, v, s))
            cublas.append(lambda x, wb=wb: torch.mm(x, wb.t()))
        else:
            r = n // groups
            fp8_linear.append(lambda x, v=v, s=s, r=r, k=k, groups=groups: [
                F.fp8_linear(x[:, i * k:(i + 1) * k], v[i * r:(i + 1) * r], s[i * r // 32:(i + 1) * r // 32])
                for i in range(groups)])
            wt = wb.view(groups, r, k).transpose(1, 2)
            cublas.append(lambda x, wt=wt, k=k, groups=groups: torch.bmm(x.view(-1, groups, k).transpose(0, 1), wt))
    return {"fp8_linear": fp8_linear, "cublas_bf16": cublas}


def w8a8_calls(W, weights: list, cfg, counters: list | None = None) -> list[Callable]:
    """One call per weight: the row tiers (cfg None), the prefill form (BF16_GEMM) or a fixed config;
    `counters` (one `split_k_counters` per weight): split-K summed inside the GEMM launch, as the
    runtime's weights do; None: a second launch sums (session 7)."""
    cs = counters or [None] * len(weights)
    if cfg == BF16_GEMM:
        return [lambda x, v=v, s=s, groups=groups: W.fp8_w8a8_linear(x, v, s, groups=groups, bf16_gemm=True)
                for _, _, _, groups, v, s in weights]
    return [lambda x, v=v, s=s, groups=groups, c=c: W.fp8_w8a8_linear(x, v, s, groups=groups, config=cfg, counters=c)
            for (_, _, _, groups, v, s), c in zip(weights, cs)]


def time_eager_and_graph(fn: Callable[[], object], cap_s: float, dev: torch.device) -> dict:
    out = dict(eager_us=measure(fn, cap_s, dev)["median_us"])
    if dev.type != "cuda":
        return out | dict(graph_error=f"no CUDA graphs on {dev}")
    try:
        graph = capture_graph([fn])
        out["graph_us"] = measure(graph.replay, cap_s, dev)["median_us"]
    except Exception as exc:            # reported; the eager number stands
        settle_after_failed_capture()
        out["graph_error"] = f"{type(exc).__name__}: {exc}"[:300]
    return out


def with_rates(t: dict, nbytes: int, flops: int, copy_gbs: float) -> dict:
    us = t.get("graph_us", t["eager_us"])
    gbs = nbytes / us / 1e3
    return t | dict(bytes=nbytes, gbs=gbs, fraction_of_copy=gbs / copy_gbs, tflops=flops / us / 1e6)


def pass_flops(weights: list, m: int) -> int:
    return sum(2 * m * n * k for _, n, k, _, _, _ in weights)


def agreement(W, weights: list, xs: list, configs: dict) -> dict:
    """{label: bit-identical to DECODE_CONFIG on every weight} at the rows of xs, for the mid and
    prefill tiers and every fixed configuration but the GEMV tier's (≤ 4 rows)."""
    ref = [c(x) for c, x in zip(w8a8_calls(W, weights, W.DECODE_CONFIG), xs)]
    fixed = ({"mid_tier": W.MID_CONFIG, "prefill_tier": W.PREFILL_CONFIG}
             | {k: v for k, v in configs.items() if v and not getattr(v, "gemv", False)})
    return {label: all(torch.equal(c(x), r) for c, x, r in zip(w8a8_calls(W, weights, cfg), xs, ref))
            for label, cfg in fixed.items()}


def accuracy(W, weights: list, xs: list, rows: int = 2, gemv: bool = False) -> dict:
    """{weight: worst |Δ| / bound} of the row-tier W8A8 result (`gemv`: with the GEMV tier) on the
    first `rows` rows against `reference.ops.linear_fp8` (CPU, float64 bound as in the tests)."""
    from sglang_dsv41.reference import ops

    out = {}
    for (name, n, k, groups, v, s), x in zip(weights, xs):
        y = W.fp8_w8a8_linear(x[:rows], v, s, groups=groups, gemv=gemv).float().cpu()
        w = (v.float() * s.repeat_interleave(32, 0)[:n].repeat_interleave(32, 1)[:, :k]).cpu()
        worst = 0.0
        r = n // groups
        for gi in range(groups):
            xg, wg = x[:rows, gi * k:(gi + 1) * k].float().cpu(), w[gi * r:(gi + 1) * r]
            ref = ops.linear_fp8(xg, wg).double()
            xq = ops.fp8_act_fake_quant(xg).double()
            bound = 2.0 ** -7 * (xq @ wg.double().t()).abs() + 2 * 2.0 ** -12 * (xq.abs() @ wg.double().abs().t())
            worst = max(worst, float(((y[:, gi * r:(gi + 1) * r].double() - ref).abs() / (bound + 2.0 ** -133)).max()))
        out[name] = worst
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layer", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    ap.add_argument("--variants", nargs="*", help="ALTERNATIVES labels to sweep (default: all; none: only the tiers)")
    ap.add_argument("--no-per-weight", action="store_true", help="skip the weight-by-weight timings")
    ap.add_argument("--per-weight-rows", type=int, nargs="+", help="time weight by weight only at these M (default: all)")
    ap.add_argument("--cap-s", type=float, default=0.25, help="seconds of timed calls per point")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--sweep", action="store_true", help="time the row tiers' candidate configurations per weight")
    ap.add_argument("--jobs", type=int, default=8, help="--sweep: processes compiling the candidates first (0: none)")
    ap.add_argument("--budget-s", type=float, default=150.0, help="--sweep: stop timing after this many seconds")
    ap.add_argument("--min-gain", type=float, default=0.03, help="--sweep: suggest a shape config from this gain")
    args = ap.parse_args(argv)
    if any(m < 1 for m in args.rows):
        ap.error("--rows must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/fp8_w8a8.py needs a CUDA GPU")
    if args.sweep:
        from fp8_w8a8_sweep import run_sweep

        return run_sweep(args, torch.device("cuda"), copy_bandwidth_gbs(torch.device("cuda")))
    return run(args, torch.device("cuda"), copy_bandwidth_gbs(torch.device("cuda")))


def run(args: argparse.Namespace, dev: torch.device, copy_gbs: float) -> int:
    """The benchmark on `dev` (CUDA; the CPU tests drive it under the Triton interpreter with
    small shapes). Returns 1 when any point failed (listed in the JSON's `errors`)."""
    from sglang_dsv41.kernels import fp8_linear as F
    from sglang_dsv41.kernels import fp8_w8a8 as W

    g = torch.Generator(device=dev).manual_seed(0)
    weights = [(name, n, k, groups, *random_fp8(n, k, g, dev)) for name, n, k, groups in layer_shapes(args.layer)]
    bf16 = [dequantised_bf16(v, s) for *_, v, s in weights]
    counters = [W.split_k_counters(n, dev) for _, n, *_ in weights]
    fp8_bytes = sum(W.weight_bytes(n, k) for _, n, k, *_ in weights)
    bf16_bytes = sum(2 * n * k for _, n, k, *_ in weights)
    configs = variant_configs(W, args.variants)
    baselines = weight_calls(W, F, weights, bf16)
    rows, per_weight, errors = [], [], []
    agree, acc, acc_gemv = {}, {}, {}
    for m in args.rows:
        xs = [torch.randn(m, groups * k, generator=g, device=dev).to(torch.bfloat16) for _, _, k, groups, *_ in weights]
        calls = {label: w8a8_calls(W, weights, cfg, None if label.startswith("w8a8_s7_") else counters)
                 for label, cfg in configs.items()} | baselines
        point: dict = {"rows": m}
        for label, fns in calls.items():
            if not timed_at(label, m):
                continue
            nbytes = bf16_bytes if label == "cublas_bf16" else fp8_bytes
            try:
                t = time_eager_and_graph(lambda: [f(x) for f, x in zip(fns, xs)], args.cap_s, dev)
                point[label] = with_rates(t, nbytes, pass_flops(weights, m), copy_gbs)
            except Exception as exc:   # a configuration that fails to compile or run is reported, not fatal
                errors.append(f"M={m} {label}: {type(exc).__name__}: {exc}"[:400])
        rows.append(point)
        print(f"M={m}: " + "  ".join(f"{k} {v.get('graph_us', v['eager_us']):.0f}µs/{v['tflops']:.0f}TF/"
                                      f"{100 * v['fraction_of_copy']:.0f}%" for k, v in point.items()
                                      if isinstance(v, dict)), flush=True)
        if not args.no_per_weight and (args.per_weight_rows is None or m in args.per_weight_rows):
            pw: dict = {"rows": m}
            for (name, n, k, *_), x, i in zip(weights, xs, range(len(weights))):
                pw[name] = {}
                for label in PER_WEIGHT + tuple(lb for lb in ("w8a8_gemv",) if lb in calls and timed_at(lb, m)):
                    try:
                        pw[name][label] = time_eager_and_graph(lambda: calls[label][i](x), args.cap_s / 2, dev)
                    except Exception as exc:
                        errors.append(f"M={m} {name} {label}: {type(exc).__name__}: {exc}"[:400])
            per_weight.append(pw)
        if m == 64:
            agree = agreement(W, weights, xs, configs)
            acc = accuracy(W, weights, xs)
            acc_gemv = accuracy(W, weights, xs, gemv=True)
            print(f"bits equal to the decode configuration at M=64: {agree}", flush=True)
            print(f"worst |Δ|/bound vs reference.ops.linear_fp8 (2 rows): {acc}; GEMV tier: {acc_gemv}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    result = dict(device=torch.cuda.get_device_name() if dev.type == "cuda" else str(dev), layer=args.layer,
                  shapes=[(name, n, k, groups) for name, n, k, groups, *_ in weights],
                  fp8_bytes=fp8_bytes, bf16_bytes=bf16_bytes, copy_gbs=copy_gbs,
                  configs={k: (v.__dict__ if isinstance(v, W.W8A8Config) else (v or "row tiers"))
                           for k, v in configs.items()},
                  bf16_gemm_min_rows=W.BF16_GEMM_MIN_ROWS,
                  row_tiers={str(lim): c.__dict__ for lim, c in W.ROW_TIERS} | {"above": W.PREFILL_CONFIG.__dict__},
                  rows=rows, per_weight=per_weight, agreement=agree, accuracy_over_bound=acc,
                  accuracy_over_bound_gemv=acc_gemv, errors=errors,
                  timing="step_timing.measure median, 256 MB L2 flush per call; graph = one CUDAGraph replay of the pass",
                  when=time.strftime("%F %T"))
    (args.out / "fp8_w8a8.json").write_text(json.dumps(result, indent=1))
    plot(result, args.out / "fp8_w8a8.png")
    return 1 if errors else 0


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        print("matplotlib missing: no plot")
        return
    labels = [k for k in result["rows"][0] if isinstance(result["rows"][0][k], dict)]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / max(1, len(labels))
    for j, label in enumerate(labels):
        ys = [p.get(label, {}).get("graph_us", p.get(label, {}).get("eager_us", 0)) for p in result["rows"]]
        ax.bar([i + j * width for i in range(len(result["rows"]))], ys, width, label=label)
    ax.set_xticks([i + width * (len(labels) - 1) / 2 for i in range(len(result["rows"]))],
                  [f"M = {p['rows']}" for p in result["rows"]])
    ax.set(yscale="log", ylabel="µs per layer pass (graph replay)",
           title=f"FP8 dense linears of Flash layer {result['layer']} ({result.get('device', '')})")
    ax.legend(fontsize=7, ncol=2)
    save_png(fig, path)


if __name__ == "__main__":
    raise SystemExit(main())

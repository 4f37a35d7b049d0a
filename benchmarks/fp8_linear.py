"""FP8 dense linears of one full-width Flash layer: `kernels.fp8_linear` tile shapes vs cuBLAS BF16 (issue 3).

What it times: every FP8-stored dense weight of Flash layer `--layer` (shapes from
`names.tensor_inventory`: wq_a, wq_b, wkv, wo_a, wo_b, shared-expert w1/w2/w3, compressor and
indexer FP8 weights where the layer has them), random E4M3 values with power-of-two tile scales,
multiplied in sequence — one "layer pass" — at M ∈ {1, 64} rows:

* `fp8_linear` with the runtime's configuration (`config_for`) and with alternative fixed
  configurations (each batch invariant, different bits);
* the swap-AB candidate `kernels.fp8_linear_skinny.fp8_linear_swap_ab` (yᵀ = W·xᵀ: weight rows on
  the MMA's M side, 16 x rows on its N side; not the runtime default): label `swap_ab` with its
  `SWAP_AB_CONFIG`, `swap_ab_*` with other fixed configurations (`SWAP_AB_ALTERNATIVES`);
* the previous runtime path as the baseline: `torch.mm` of BF16 copies of the same weights with
  fp32 output (`dense_ops.BlockedBf16Gemm` without its row padding), 2 bytes per weight element.

Per row: median µs of the pass (`step_timing.measure`: CUDA events, L2 flushed before every
call; the pass reads ≈ 155 MiB at Flash widths), the bytes it must read (E4M3 + fp32 tile scales; BF16 for
the baseline), GB/s and the fraction of the copy bandwidth measured in the same run; `per_weight`:
each weight alone (runtime, swap_ab, cuBLAS); `agreement`: which variants give the runtime
configuration's bits (`bit_agreement`). Writes
`fp8_linear.json` and `fp8_linear.png` to `--out`. CUDA only; bounded by the row list.

    python benchmarks/fp8_linear.py [--layer 2] [--rows 1 64 8192] [--variants L ...] [--per-weight L ...]
        [--out benchmarks/results]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
from device_bandwidth import copy_bandwidth_gbs  # noqa: E402
from step_timing import measure  # noqa: E402
from plotting import pyplot, save_png  # noqa: E402

CAP_S = 0.3                 # seconds of timed calls per point
#: fixed `fp8_linear` configurations (block_m, block_n, block_k, warps, stages). Run 11 (2026-11-30): of the
#: first four, bm64_bn32_bk64_w4 was fastest over M = 1 and 64 together (451 / 482 µs vs the runtime's 521 / 1,013);
#: the rest probe around it (BLOCK_K 128 at BLOCK_M 64, 4 stages, BLOCK_M 32/128) and the prefill shape (M = 8192).
#: Compiled for sm_90 on CPU (tests/triton_checks.compile_for_sm90): BLOCK_M 64 uses wgmma, 16/32 mma.sync;
#: bm16_bn16_bk256_w4 and bm64_bn32_bk128_w4 spill (stack 16 / 8 B), BLOCK_M 64 with BLOCK_K 256 spills 488 B (left out).
#: Wide tiles (BLOCK_N a multiple of 32, for prefill: x is re-read once per BLOCK_N columns) without spills on
#: sm_90: 64 x 64 x 64 with 8 warps (184 registers) and 128 x 128 x 32 with 8 warps, 4 stages (213); 4-warp wide
#: tiles spill (8-736 B)
ALTERNATIVES = {"bm16_bn32_w4": (16, 32, 128, 4, 3), "bm64_bn32_w8": (64, 32, 128, 8, 3),
                "bm64_bn32_bk64_w4": (64, 32, 64, 4, 3), "bm16_bn16_bk256_w4": (16, 16, 256, 4, 3),
                "bm64_bn32_bk128_w4": (64, 32, 128, 4, 3),
                "bm64_bn32_bk64_w4_s4": (64, 32, 64, 4, 4), "bm32_bn32_bk64_w4": (32, 32, 64, 4, 3),
                "bm128_bn32_bk64_w8": (128, 32, 64, 8, 3),
                "bm64_bn64_bk64_w8": (64, 64, 64, 8, 3), "bm128_bn128_bk32_w8_s4": (128, 128, 32, 8, 4)}
#: `fp8_linear_swap_ab` configurations besides its default (label `swap_ab`): (block_w, block_k, warps, stages)
SWAP_AB_ALTERNATIVES = {"swap_ab_bw32": (32, 256, 4, 4), "swap_ab_bw128": (128, 128, 4, 4),
                        "swap_ab_s3": (64, 256, 4, 3)}
#: variants also timed weight by weight (`--per-weight` overrides)
PER_WEIGHT_LABELS = ("runtime", "swap_ab", "bm64_bn32_bk64_w4")


def layer_fp8_shapes(layer: int) -> list[tuple[str, int, int]]:
    from sglang_dsv41.checkpoint.names import Kind, tensor_inventory
    from sglang_dsv41.config import DeepseekV41Config
    from sglang_dsv41.presets import flash_config_dict

    cfg = DeepseekV41Config.from_dict(flash_config_dict())
    prefix = f"layers.{layer}."
    return [(s.name[len(prefix):], s.shape[0], s.shape[1]) for s in tensor_inventory(cfg, vision=False, dspark=False)
            if s.name.startswith(prefix) and s.kind is Kind.FP8 and len(s.shape) == 2 and ".experts." not in s.name]


def random_fp8(n: int, k: int, g: torch.Generator, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    values = (torch.randn(n, k, generator=g, device=dev) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    exps = torch.randint(-12, -4, (-(-n // 32), -(-k // 32)), generator=g, device=dev)
    return values, torch.exp2(exps.float())


def time_pass(fn, dev: torch.device) -> float:
    """Median µs of fn() (`step_timing.measure`: CUDA events, a 256 MB L2 flush before every call,
    as many calls as fit in CAP_S)."""
    return measure(fn, CAP_S, dev)["median_us"]


def variant_calls(F, SK) -> dict:
    """label → call(x, values, scales) for every timed FP8 variant (F = kernels.fp8_linear,
    SK = kernels.fp8_linear_skinny)."""
    calls = {"runtime": lambda x, v, s: F.fp8_linear(x, v, s)}
    for label, tiles in ALTERNATIVES.items():
        calls[label] = lambda x, v, s, t=F.Fp8LinearConfig(*tiles): F.fp8_linear(x, v, s, tiles=t)
    calls["swap_ab"] = lambda x, v, s: SK.fp8_linear_swap_ab(x, v, s)
    for label, cfg in SWAP_AB_ALTERNATIVES.items():
        calls[label] = lambda x, v, s, c=SK.Fp8SkinnyConfig(*cfg): SK.fp8_linear_swap_ab(x, v, s, config=c)
    return calls


def bit_agreement(weights: list, variants: dict, g: torch.Generator, dev: torch.device, errors: list[str],
                  rows: int = 300) -> dict:
    """{label: {"bit_equal": all weights' products bit-identical to the runtime configuration's,
    "max_abs_diff": largest |Δ|}} at `rows` x rows. Every configuration multiplies exactly and adds the
    products in K order in 16-wide MMA steps, so they differ only if the tensor-core instruction
    (mma.sync for BLOCK_M 16/32, wgmma for 64/128) sums a step differently: equal bits would let the
    runtime pick a tile shape by M (decode narrow, prefill wide) and stay batch invariant."""
    out: dict = {}
    xs = {}
    for _, v, _ in weights:
        xs.setdefault(v.shape[1], torch.randn(rows, v.shape[1], generator=g, device=dev).to(torch.bfloat16).float())
    ref = [variants["runtime"](xs[v.shape[1]], v, s) for _, v, s in weights]
    for label, call in variants.items():
        if label == "runtime":
            continue
        try:
            got = [call(xs[v.shape[1]], v, s) for _, v, s in weights]
        except Exception as exc:
            errors.append(f"agreement {label}: {type(exc).__name__}: {exc}"[:400])
            continue
        out[label] = {"bit_equal": all(torch.equal(a, b) for a, b in zip(got, ref)),
                      "max_abs_diff": max(float((a - b).abs().max()) for a, b in zip(got, ref))}
    return out


def select_variants(calls: dict, labels: list[str] | None) -> dict:
    """The variants `--variants` names (all when None), always with `runtime` first; unknown labels raise."""
    if labels is None:
        return calls
    unknown = sorted(set(labels) - set(calls))
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; known: {sorted(calls)}")
    return {k: v for k, v in calls.items() if k == "runtime" or k in labels}


def weight_times(M: int, weights: list, bf16_weights: list, xs: dict, variants: dict, dev: torch.device,
                 errors: list[str], labels: tuple[str, ...] = PER_WEIGHT_LABELS) -> dict:
    """{"rows": M, name: {label: µs}} for each weight alone, `labels` + cublas_bf16
    (which kernel wins per shape; a shape-only choice between them stays batch invariant). The
    L2 flush before each call (`time_pass`) keeps one weight alone from staying in L2."""
    out: dict = {"rows": M}
    for (name, v, s), w in zip(weights, bf16_weights):
        x = xs[v.shape[1]]
        times = {}
        for label in labels:
            try:
                times[label] = time_pass(lambda: variants[label](x, v, s), dev)
            except Exception as exc:
                errors.append(f"M={M} {name} {label}: {type(exc).__name__}: {exc}"[:400])
        times["cublas_bf16"] = time_pass(lambda: torch.mm(x.to(torch.bfloat16), w.t(), out_dtype=torch.float32), dev)
        out[name] = times
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layer", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--variants", nargs="+", help="labels to time (default: all; `runtime` is always timed)")
    ap.add_argument("--per-weight", nargs="*", default=list(PER_WEIGHT_LABELS),
                    help="labels also timed weight by weight (none: skip)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/fp8_linear.py needs a CUDA GPU")
    from sglang_dsv41.kernels import fp8_linear as F
    from sglang_dsv41.kernels import fp8_linear_skinny as SK

    dev, g = torch.device("cuda"), torch.Generator(device="cuda").manual_seed(0)
    shapes = layer_fp8_shapes(args.layer)
    weights = [(name, *random_fp8(n, k, g, dev)) for name, n, k in shapes]
    bf16_weights = [(v.float() * s.repeat_interleave(32, 0)[:v.shape[0]].repeat_interleave(32, 1)[:, :v.shape[1]])
                    .to(torch.bfloat16) for _, v, s in weights]
    fp8_bytes = sum(F.weight_bytes(*v.shape) for _, v, _ in weights)
    bf16_bytes = sum(2 * w.numel() for w in bf16_weights)
    copy_gbs = copy_bandwidth_gbs(dev)
    variants = select_variants(variant_calls(F, SK), args.variants)
    per_weight_labels = tuple(label for label in args.per_weight if label in variants)
    rows, errors, per_weight = [], [], []
    for M in args.rows:
        xs = {k: torch.randn(M, k, generator=g, device=dev).to(torch.bfloat16).float() for _, _, k in shapes}
        point: dict = {"rows": M}
        for label, call in variants.items():
            try:
                us = time_pass(lambda: [call(xs[v.shape[1]], v, s) for _, v, s in weights], dev)
                point[label] = dict(us=us, gbs=fp8_bytes / us / 1e3, fraction_of_copy=fp8_bytes / us / 1e3 / copy_gbs)
            except Exception as exc:  # a tile shape that fails to compile is reported, not fatal
                errors.append(f"M={M} {label}: {type(exc).__name__}: {exc}"[:400])
        us = time_pass(lambda: [torch.mm(xs[w.shape[1]].to(torch.bfloat16), w.t(), out_dtype=torch.float32)
                                for w in bf16_weights], dev)
        point["cublas_bf16"] = dict(us=us, gbs=bf16_bytes / us / 1e3, fraction_of_copy=bf16_bytes / us / 1e3 / copy_gbs)
        rows.append(point)
        if per_weight_labels:
            per_weight.append(weight_times(M, weights, bf16_weights, xs, variants, dev, errors, per_weight_labels))
            print(f"M={M} per weight (µs): " + "; ".join(f"{n.split('.')[-2]} " + "/".join(f"{t:.0f}" for t in ts.values())
                                                        for n, ts in per_weight[-1].items() if n != "rows")
                  + f"  [{' / '.join(per_weight_labels + ('cublas_bf16',))}]", flush=True)
        print(f"M={M}: " + "  ".join(f"{k} {v['us']:.0f} µs ({100 * v['fraction_of_copy']:.0f} %)"
                                     for k, v in point.items() if isinstance(v, dict)), flush=True)
    agreement = bit_agreement(weights, variants, g, dev, errors)
    print("bit-identical to the runtime configuration (300 rows, every weight): "
          + ", ".join(f"{k} {'yes' if v['bit_equal'] else 'no'}" for k, v in agreement.items()), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    result = dict(device=torch.cuda.get_device_name(), layer=args.layer, shapes=shapes, fp8_bytes=fp8_bytes,
                  agreement=agreement,
                  bf16_bytes=bf16_bytes, copy_gbs=copy_gbs, rows=rows, per_weight=per_weight, errors=errors,
                  when=time.strftime("%F %T"))
    (args.out / "fp8_linear.json").write_text(json.dumps(result, indent=1))
    plot(result, args.out / "fp8_linear.png")
    return 1 if errors else 0


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        print("matplotlib missing: no plot")
        return
    labels = [k for k in result["rows"][0] if isinstance(result["rows"][0][k], dict)]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / max(1, len(result["rows"]))
    for i, point in enumerate(result["rows"]):
        ax.bar([j + i * width for j in range(len(labels))], [point.get(k, {}).get("us", 0) for k in labels], width,
               label=f"M = {point['rows']}")
    centres = [j + width * (len(result["rows"]) - 1) / 2 for j in range(len(labels))]
    ax.set_xticks(centres, labels, rotation=20, fontsize=8)
    ax.set(ylabel="µs per layer pass", title=f"FP8 dense linears of Flash layer {result['layer']}")
    ax.legend()
    save_png(fig, path)


if __name__ == "__main__":
    raise SystemExit(main())

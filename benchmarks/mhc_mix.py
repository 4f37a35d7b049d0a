"""The mHC coefficient kernels by token count (issue 21; sessions 13–14): the sweep that fits `auto`.

Per T in TOKENS (1 … 8,192; --tokens), at Flash width (hc = 4, H = 5120; a BF16-valued residual in the CUDA
runtime's dtype, `mhc_ops.TritonMhc.residual_dtype`, or --residual's: the record's `residual_dtype`):
`kernels.mhc.hc_coefficients` with each partial-dot kernel of `MIX_KERNELS` (`dot`, `rows`), and the
sublayer input / residual update (unchanged, for scale) — µs by `triton.testing.do_bench` (median, L2
not flushed; at T = 8192 the residual is 671 MB in fp32, 336 MB in BF16), plus the largest |Δ| of `dot`'s
coefficients from `rows`' and whether they are bit-equal; `auto_kernel` (what `mhc_ops.mix_for_tokens` runs at T) and
`auto_over_best` (its µs over the faster kernel's). Top level: `fit` (`fit_dot_min_tokens`: the smallest
swept T > 1 from which `dot` is faster at every larger swept T, the value MIX_DOT_MIN_TOKENS should take;
`rows_faster_at`, `dot_faster_at`; `threshold_now`). Writes OUT/mhc_mix.json.

    python benchmarks/mhc_mix.py --out DIR [--residual fp32]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton.testing

TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 8192)
HC, H, ITERS = 4, 5120, 20


def fit(rows: list[dict], threshold_now: int) -> dict:
    """The smallest swept T > 1 from which `dot` is faster at every larger swept T (None: `rows` wins
    at the largest T), and the Ts each kernel wins."""
    def faster(r: dict) -> str:
        return "dot" if r["coefficients_dot_us"] < r["coefficients_rows_us"] else "rows"

    ts = [r["tokens"] for r in rows if r["tokens"] > 1]
    suffix = None
    for r in reversed([r for r in rows if r["tokens"] > 1]):
        if faster(r) != "dot":
            break
        suffix = r["tokens"]
    return dict(fit_dot_min_tokens=suffix, threshold_now=threshold_now, swept=ts,
                dot_faster_at=[r["tokens"] for r in rows if faster(r) == "dot"],
                rows_faster_at=[r["tokens"] for r in rows if faster(r) == "rows"])


def hc_weights(dev: torch.device, hc: int, hidden: int) -> tuple[torch.Generator, torch.Tensor, torch.Tensor,
                                                                   torch.Tensor]:
    """(generator, fn [hc·(2+hc), hc·hidden], base, scale) of one hyper-connection, seeded: the inputs
    both mHC sweeps time."""
    g = torch.Generator(device=dev).manual_seed(0)
    rows = hc * (2 + hc)
    fn = torch.randn(rows, hc * hidden, generator=g, device=dev) / (hc * hidden) ** 0.5
    base, scale = 0.5 * torch.randn(rows, generator=g, device=dev), torch.tensor([0.7, 0.8, 0.9], device=dev)
    return g, fn, base, scale


def run(out: Path, tokens: tuple[int, ...] = TOKENS, residual: torch.dtype | None = None) -> dict:
    from sglang_dsv41.kernels import mhc as K
    from sglang_dsv41.runtime import mhc_ops
    dev = torch.device("cuda")
    residual = residual or mhc_ops.TritonMhc.residual_dtype
    g, fn, base, scale = hc_weights(dev, HC, H)
    w = 1.0 + 0.1 * torch.randn(H, generator=g, device=dev)
    result: dict = dict(device=torch.cuda.get_device_name(dev), hc=HC, hidden=H, method=__doc__,
                        residual_dtype=str(residual).removeprefix("torch."), rows=[])
    for T in tokens:
        R = torch.randn(T, HC, H, generator=g, device=dev).to(torch.bfloat16).to(residual)
        y = torch.randn(T, H, generator=g, device=dev).to(torch.bfloat16).float()
        row: dict = dict(tokens=T)
        co = {}
        for mix in K.MIX_KERNELS:
            def coeff(mix=mix, R=R):
                return K.hc_coefficients(R, fn, base, scale, rms_eps=1e-6, hc_eps=1e-6, sinkhorn_iters=ITERS, mix=mix)
            co[mix] = coeff()
            row[f"coefficients_{mix}_us"] = triton.testing.do_bench(coeff, warmup=10, rep=50, return_mode="median") * 1e3
        pre, post, comb = co[K.MIX_KERNELS[0]]
        row["dot_vs_rows_max_abs"] = max(float((a - b).abs().max()) for a, b in zip(co["dot"], co["rows"]))
        row["dot_rows_bit_equal"] = all(torch.equal(a, b) for a, b in zip(co["dot"], co["rows"]))
        row["auto_kernel"] = mhc_ops.mix_for_tokens(T)
        best = min(row[f"coefficients_{m}_us"] for m in K.MIX_KERNELS)
        row["auto_over_best"] = row[f"coefficients_{row['auto_kernel']}_us"] / best
        row["sublayer_input_us"] = triton.testing.do_bench(lambda R=R, pre=pre: K.hc_sublayer_input(R, pre, w, 1e-6), warmup=10,
                                                           rep=50, return_mode="median") * 1e3
        row["residual_update_us"] = triton.testing.do_bench(lambda R=R, y=y, post=post, comb=comb: K.hc_residual_update(R, y, post, comb), warmup=10,
                                                            rep=50, return_mode="median") * 1e3
        result["rows"].append(row)
        print("  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), flush=True)
        del R, y, co, pre, post, comb
        torch.cuda.empty_cache()
    result["fit"] = fit(result["rows"], mhc_ops.MIX_DOT_MIN_TOKENS)
    print("fit", json.dumps(result["fit"]), flush=True)
    (out / "mhc_mix.json").write_text(json.dumps(result, indent=1))
    return result


#: --residual: the dtype the sweeps hold the residual in (default: the CUDA runtime's)
RESIDUAL_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def cli(run_fn, doc: str, tokens: tuple[int, ...]) -> None:
    """The command line of the mHC sweeps (this one, mhc_decode.py): --out DIR (made), --tokens T …,
    --residual bf16|fp32 (RESIDUAL_DTYPES; default the runtime's); then run_fn(out, tokens, dtype or None)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--tokens", type=int, nargs="+", default=list(tokens))
    ap.add_argument("--residual", choices=tuple(RESIDUAL_DTYPES), default=None)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    run_fn(args.out, tuple(args.tokens), RESIDUAL_DTYPES.get(args.residual))


def main() -> None:
    cli(run, __doc__, TOKENS)


if __name__ == "__main__":
    main()

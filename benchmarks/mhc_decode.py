"""mHC coefficients at decode batch sizes: the old path (`dot`: partial-dot + coefficient kernels,
2 launches) vs `fused` (`kernels/mhc_decode.py`, 1 launch) at Flash width (hc = 4, H = 4096,
Sinkhorn ITERS = 20, a BF16-valued residual held in the CUDA runtime's dtype or --residual's: `residual_dtype`),
T in TOKENS (1 … 256; --tokens).

Per T: µs of the full coefficient op (all its launches) by `triton.testing.do_bench_cudagraph`
(median of CUDA-graph replays, the serving form) for `dot`, `rows`, `rows_regcoef` / `dot_regcoef`
(the same partial-dot kernels, then coeff="registers": `kernels/mhc_coef.py`), `fused` (default split width,
persistent counters) and `fused` at each width of SPLITS (columns per program); the largest |Δ| of
`fused` from `dot` (`regcoef_vs_rows_max_abs`: of `rows_regcoef` from `rows`); `best_fused_split`; `fused_over_dot` (fused µs / dot µs). Top level:
`fused_wins_at` (the Ts where default `fused` beats both old kernels) and `fit_fused_max_tokens`
(the largest swept T up to which `fused` wins at every swept T: the value for
`mhc_ops.FUSED_MAX_TOKENS`). Writes OUT/mhc_decode.json.

    python benchmarks/mhc_decode.py --out DIR [--residual fp32]
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import triton.testing
from mhc_mix import cli, hc_weights

TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
SPLITS = (256, 512, 1024)
HC, H, ITERS = 4, 4096, 20


def bench(fn) -> float:
    """µs per call: median of CUDA-graph replays (a warm-up call first, outside the capture)."""
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median") * 1e3


def run(out: Path, tokens: tuple[int, ...] = TOKENS, residual: torch.dtype | None = None) -> dict:
    from sglang_dsv41.kernels import mhc as K
    from sglang_dsv41.kernels import mhc_decode as D
    from sglang_dsv41.runtime.mhc_ops import TritonMhc
    dev = torch.device("cuda")
    residual = residual or TritonMhc.residual_dtype
    g, fn, base, scale = hc_weights(dev, HC, H)
    counters = D.fused_counters(max(tokens), dev)
    opts = {**K._launch_options(), "num_warps": D.FUSED_NUM_WARPS}
    result: dict = dict(device=torch.cuda.get_device_name(dev), hc=HC, hidden=H, iters=ITERS, method=__doc__,
                        default_split=D.FUSED_SPLIT_K, residual_dtype=str(residual).removeprefix("torch."), rows=[])
    for T in tokens:
        R = torch.randn(T, HC, H, generator=g, device=dev).to(torch.bfloat16).to(residual)
        row: dict = dict(tokens=T)
        co = {}
        for variant in ("dot", "rows", "rows_regcoef", "dot_regcoef", "fused"):
            mix, _, reg = variant.partition("_")

            def coeff(mix=mix, R=R, reg=reg):
                return K.hc_coefficients(R, fn, base, scale, rms_eps=1e-6, hc_eps=1e-6, sinkhorn_iters=ITERS,
                                         mix=mix, counters=counters if mix == "fused" else None,
                                         coeff="registers" if reg else "tile")
            co[variant] = coeff()
            row[f"{variant}_us"] = bench(coeff)
        x = R.reshape(T, HC * H)
        outs = tuple(torch.empty_like(t) for t in co["fused"])
        for split in SPLITS:
            def split_call(split=split, x=x, outs=outs):
                D.launch_fused(x, fn, base, scale, *outs, hc=HC, rms_eps=1e-6, hc_eps=1e-6, sinkhorn_iters=ITERS,
                               counters=counters, opts=opts, split_k=split)
            row[f"fused_split{split}_us"] = bench(split_call)
        row["fused_vs_dot_max_abs"] = max(float((a - b).abs().max()) for a, b in zip(co["fused"], co["dot"]))
        row["regcoef_vs_rows_max_abs"] = max(float((a - b).abs().max()) for a, b in zip(co["rows_regcoef"], co["rows"]))
        row["rows_regcoef_over_rows"] = row["rows_regcoef_us"] / row["rows_us"]
        row["counters_zero"] = int(counters.abs().sum()) == 0
        row["best_fused_split"] = min(SPLITS, key=lambda s: row[f"fused_split{s}_us"])
        row["fused_over_dot"] = row["fused_us"] / row["dot_us"]
        result["rows"].append(row)
        print("  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), flush=True)
        del R, x, co, outs
    wins = [r["tokens"] for r in result["rows"] if r["fused_us"] < min(r["dot_us"], r["rows_us"])]
    fit = None
    for r in result["rows"]:
        if r["tokens"] not in wins:
            break
        fit = r["tokens"]
    result.update(fused_wins_at=wins, fit_fused_max_tokens=fit)
    print("fused_wins_at", wins, "fit_fused_max_tokens", fit, flush=True)
    (out / "mhc_decode.json").write_text(json.dumps(result, indent=1))
    return result


def main() -> None:
    cli(run, __doc__, TOKENS)


if __name__ == "__main__":
    main()

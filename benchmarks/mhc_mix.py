"""The mHC kernels old against new at decode and prefill row counts (issue 21, session 13).

Per T in TOKENS, at Flash width (hc = 4, H = 5120, BF16-valued fp32 residual as the runtime holds it):
`kernels.mhc.hc_coefficients` with each partial-dot kernel of `MIX_KERNELS` (`dot`, `rows`), and the
sublayer input / residual update (unchanged, for scale) — µs by `triton.testing.do_bench` (median, L2
not flushed; at T = 8192 the residual is 671 MB), plus the largest |Δ| of `dot`'s coefficients from
`rows`'. Writes OUT/mhc_mix.json.

    python benchmarks/mhc_mix.py --out DIR
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton.testing

TOKENS = (1, 64, 1024, 8192)
HC, H, ITERS = 4, 5120, 20


def run(out: Path) -> dict:
    from sglang_dsv41.kernels import mhc as K
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    rows = HC * (2 + HC)
    fn = torch.randn(rows, HC * H, generator=g, device=dev) / (HC * H) ** 0.5
    base, scale = 0.5 * torch.randn(rows, generator=g, device=dev), torch.tensor([0.7, 0.8, 0.9], device=dev)
    w = 1.0 + 0.1 * torch.randn(H, generator=g, device=dev)
    result: dict = dict(device=torch.cuda.get_device_name(dev), hc=HC, hidden=H, method=__doc__, rows=[])
    for T in TOKENS:
        R = torch.randn(T, HC, H, generator=g, device=dev).to(torch.bfloat16).float()
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
        row["sublayer_input_us"] = triton.testing.do_bench(lambda R=R, pre=pre: K.hc_sublayer_input(R, pre, w, 1e-6), warmup=10,
                                                           rep=50, return_mode="median") * 1e3
        row["residual_update_us"] = triton.testing.do_bench(lambda R=R, y=y, post=post, comb=comb: K.hc_residual_update(R, y, post, comb), warmup=10,
                                                            rep=50, return_mode="median") * 1e3
        result["rows"].append(row)
        print("  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), flush=True)
    (out / "mhc_mix.json").write_text(json.dumps(result, indent=1))
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("."))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    run(args.out)


if __name__ == "__main__":
    main()

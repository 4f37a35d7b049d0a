"""The `tc` mHC partial-dot kernel's launch shape at a prefill chunk (issue 21): tokens per program, columns
per chained step and warps, at the serving slice width (`kernels.mhc.MIX_TC_BLOCK_K` columns, so the same
partial sums are formed).

At T tokens (default 8,192; Flash width: hc = 4, hidden 5120, BF16 residual as the CUDA runtime holds it),
`kernels.mhc.hc_coefficients(mix="tc")` with `DOT_LAUNCHES["tc"]` replaced by each shape of SHAPES (the
first is the serving one): µs (`triton.testing.do_bench` median) and whether its pre / post / comb are the
serving shape's bit for bit (else the largest |Δ|). A shape that fails to build or launch is recorded with
its error. For scale: the residual's bytes (`residual_bytes`, what the partial-dot launch must read). Writes
mhc_tc_sweep.json.

    python benchmarks/mhc_tc_sweep.py [--tokens 8192] [--out DIR]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

#: (tokens per program, columns per chained step, warps); the serving shape first
SHAPES = ((64, 32, 4), (64, 32, 8), (32, 32, 4), (32, 32, 8), (64, 64, 8), (128, 32, 8), (128, 64, 8), (128, 32, 16))


def run(tokens: int, shapes=SHAPES) -> dict:
    import triton.testing

    from mhc_mix import H, HC, ITERS, hc_weights
    from sglang_dsv41.kernels import mhc as K
    dev = torch.device("cuda")
    g, fn, base, scale = hc_weights(dev, HC, H)
    R = torch.randn(tokens, HC, H, generator=g, device=dev).to(torch.bfloat16)
    saved = K.DOT_LAUNCHES["tc"]
    block_k, split3 = saved[0], saved[4]
    rows, ref = {}, None
    try:
        for bt, sub_k, warps in shapes:
            name = f"t{bt}_k{sub_k}_w{warps}"
            K.DOT_LAUNCHES["tc"] = (block_k, bt, sub_k, warps, split3)

            def coeff():
                return K.hc_coefficients(R, fn, base, scale, rms_eps=1e-6, hc_eps=1e-6, sinkhorn_iters=ITERS,
                                         mix="tc")
            try:
                out = coeff()
                ref = out if ref is None else ref
                us = triton.testing.do_bench(coeff, warmup=10, rep=50, return_mode="median") * 1e3
                equal = all(torch.equal(a, b) for a, b in zip(out, ref))
                rows[name] = dict(us=us, bits_equal=equal,
                                  max_abs=max(float((a - b).abs().max()) for a, b in zip(out, ref)))
            except Exception as exc:          # a shape that does not build is a loser, not an error
                rows[name] = dict(error=f"{type(exc).__name__}: {exc}"[:300])
            print(name, rows[name], flush=True)
    finally:
        K.DOT_LAUNCHES["tc"] = saved
    first = next(iter(rows.values())).get("us")
    for r in rows.values():
        if "us" in r and first:
            r["over_serving"] = r["us"] / first
    return dict(device=torch.cuda.get_device_name(dev), tokens=tokens, block_k=block_k,
                residual_bytes=R.numel() * R.element_size(), method=__doc__, rows=rows)


def main(argv: list[str] | None = None) -> int:
    from results_io import require_cuda, write_result
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--out", type=Path, default=HERE / "results")
    args = ap.parse_args(argv)
    require_cuda("mhc_tc_sweep")
    write_result(args.out, "mhc_tc_sweep.json", run(args.tokens))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The routed-expert GEMMs at a prefill chunk under triton_kernels launch constraints (issue 21): which
`SGLANG_DSV41_MOE_PREFILL_FLAGS` is fastest at the 8K Flash prefill.

One MoE layer of random MXFP4 weights at the Flash shape (`moe_mxfp4.random_layer`: 384 experts, top-6,
hidden 5120, intermediate 2304), T tokens (default 8,192) with uniform random routing (≈ 128 rows an
expert). For each flag set of FLAG_SETS (the first, "", is triton_kernels' own choice): the flags set as
SGLANG_DSV41_MOE_PREFILL_FLAGS for the call, `routed_experts_mxfp4` timed (`step_timing.measure`: CUDA
events, an L2 flush before each call, the median within --cap-s, after a first call that compiles), the launch flags triton_kernels chose for both GEMMs (block
sizes, stages, split-K, epilogue subtiles: `make_opt_flags`' result, recorded by wrapping it), and the
output against the first set's: bit-equal, or the fraction of outputs that differ and the largest
difference in BF16 ulps of the larger of the two values. `over_default` is a set's time over the first set's (with
the default FLAG_SETS, triton_kernels' own choice). A set that fails (e.g. too much shared memory) is
recorded with its error. Writes moe_prefill_flags.json.

    python benchmarks/moe_prefill_flags.py [--tokens 8192] [--cap-s 0.3] [--flag-sets "" num_stages=2 ...] [--out DIR]

At more than DECODE_FLAG_MAX_TOKENS (16) tokens a call takes the prefill flags, so `--tokens 64` sweeps the
N = 64 decode batch's GEMMs too (the same flags through SGLANG_DSV41_MOE_PREFILL_FLAGS).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

#: flag sets timed (triton_kernels' keys; "" = its own choice, the serving default)
FLAG_SETS = ("", "num_stages=2", "num_stages=4", "block_k=64", "block_k=256", "epilogue_subtile=1",
             "epilogue_subtile=2")
#: the fields of triton_kernels' OptFlags recorded per GEMM
OPT_FIELDS = ("block_m", "block_n", "block_k", "num_warps", "num_stages", "split_k", "epilogue_subtile",
              "is_persistent", "fused_scatter")


class FlagRecorder:
    """Wraps `matmul_ogs.make_opt_flags` while active: the flags of every GEMM launched, in order."""

    def __init__(self) -> None:
        self.seen: list[dict] = []

    def __enter__(self) -> "FlagRecorder":
        from triton_kernels import matmul_ogs as ogs
        self._ogs, self._original = ogs, ogs.make_opt_flags

        def recording(*args, **kwargs):
            flags = self._original(*args, **kwargs)
            self.seen.append({f: getattr(flags, f) for f in OPT_FIELDS if hasattr(flags, f)})
            return flags
        ogs.make_opt_flags = recording
        return self

    def __exit__(self, *exc) -> None:
        self._ogs.make_opt_flags = self._original


def ulps_apart(out: torch.Tensor, ref: torch.Tensor) -> dict:
    """Share of differing outputs and the largest |Δ| in BF16 ulps of max(|out|, |ref|) (a zero on one side
    is measured against the other's ulp)."""
    from sglang_dsv41.kernels import moe_mxfp4 as mx
    diff = out != ref
    if not bool(diff.any()):
        return dict(bits_equal=True, differing=0.0, max_ulps=0.0)
    ulp = mx.bf16_ulp(torch.maximum(out.float().abs(), ref.float().abs()))
    return dict(bits_equal=False, differing=float(diff.float().mean()),
                max_ulps=float(((out.float() - ref.float()).abs() / ulp).max()))


def run(tokens: int, cap_s: float, flag_sets=FLAG_SETS) -> dict:
    import moe_mxfp4 as bench
    from step_timing import measure
    from sglang_dsv41.kernels import moe_mxfp4 as mx
    dev = torch.device("cuda", torch.cuda.current_device())
    raw = bench.random_layer(dev, seed=0)
    experts = mx.prepare_mxfp4_stacked(raw["w1"], raw["w1_scale"], raw["w3"], raw["w3_scale"], raw["w2"],
                                       raw["w2_scale"], device=dev)
    ids, w = bench.routing(tokens, dev, seed=1)
    x = torch.randn(tokens, bench.HIDDEN, device=dev).to(torch.bfloat16)

    def call() -> torch.Tensor:
        return mx.routed_experts_mxfp4(x, ids, w, experts, swiglu_limit=bench.LIMIT, routed_scale=bench.SCALE,
                                       check_ids=False)
    saved = os.environ.get(mx.PREFILL_FLAGS_ENV)
    rows, ref = {}, None
    try:
        for flags in flag_sets:
            os.environ[mx.PREFILL_FLAGS_ENV] = flags
            mx.prefill_flags.cache_clear()
            try:
                with FlagRecorder() as rec:
                    out = call()
                ref = out if ref is None else ref
                rows[flags or "default"] = dict(us=measure(call, cap_s, dev)["median_us"], gemms=rec.seen,
                                                **ulps_apart(out, ref))
            except Exception as exc:          # a set that does not launch is a loser, not an error
                rows[flags or "default"] = dict(error=f"{type(exc).__name__}: {exc}"[:300])
            print(flags or "default", rows[flags or "default"], flush=True)
    finally:
        if saved is None:
            os.environ.pop(mx.PREFILL_FLAGS_ENV, None)
        else:
            os.environ[mx.PREFILL_FLAGS_ENV] = saved
        mx.prefill_flags.cache_clear()
    base = rows.get(flag_sets[0] or "default", {}).get("us")   # the first set: the bits' reference too
    for r in rows.values():
        if "us" in r and base:
            r["over_default"] = r["us"] / base
    return dict(device=torch.cuda.get_device_name(dev), tokens=tokens, cap_s=cap_s, method=__doc__, rows=rows)


def main(argv: list[str] | None = None) -> int:
    from results_io import require_cuda, write_result
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--cap-s", type=float, default=0.3, help="timing seconds per flag set (step_timing.measure)")
    ap.add_argument("--flag-sets", nargs="+", default=list(FLAG_SETS),
                    help='flag sets to time, the first the baseline of the comparison ("" = triton_kernels\' own)')
    ap.add_argument("--out", type=Path, default=HERE / "results")
    args = ap.parse_args(argv)
    from sglang_dsv41.kernels.moe_mxfp4_flags import DECODE_FLAG_MAX_TOKENS
    if args.tokens <= DECODE_FLAG_MAX_TOKENS:
        ap.error(f"--tokens must exceed {DECODE_FLAG_MAX_TOKENS} (smaller calls take the decode flags)")
    require_cuda("moe_prefill_flags")
    write_result(args.out, "moe_prefill_flags.json", run(args.tokens, args.cap_s, tuple(args.flag_sets)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The prefill attention kernels alone at the Flash prefill shape (issue 21; CUDA only).

One request of `--tokens` queries (64 heads × 512 dims), each attending to its SWA window (the 128
positions up to itself, −1 before the start) and to 512 compressed entries drawn at random among
the ⌊(t + 1)/2⌋ it can see (ratio 2; −1 where it sees fewer) of a BF16 workspace: the launch the
runtime makes on the prefill workspace (`runtime.attention_prefill`), with its slot types (int64 windows,
int32 workspace rows; a kernel that needs one type casts the windows in the timed call). Per candidate, the median
CUDA-event µs of `--reps` calls and the output against `sparse_attention`'s launch with
`plan_prefill_config` (the `bf16` choice): the fraction of equal elements and the largest
difference in BF16 ulps of the output scale (the oracle bound is one ulp each way, so ≤ 2).

Candidates: `bf16` (`sparse_attention.sparse_sink_attention`, `plan_prefill_config`); `wide` and
`wide_*` (`sparse_attention_prefill.prefill_sink_attention` under `plan` and the configurations of
WIDE_CONFIGS); `wide_pv_bf16` / `wide_pv_fp16` (`plan` with P·V in one product: P rounded to BF16,
FlashMLA's numerics, or P and the key tile converted to FP16 in the kernel) and `wide_fp16_rows` (q and
both row sources given as FP16, P·V in one FP16 product); `heads*` (`PrefillAttentionConfig(layout="heads")`:
heads as the MMA's rows, the split P·V over duplicated rows or as two products, or P in BF16); with `--alt-wide FILE`, `wide_alt`: another version of that module (a file of it, e.g.
an earlier commit's, for an A/B in one process) under its own `plan`. One that fails (e.g. out of
shared memory) is recorded with its error. Writes attention_prefill.json (+ PNG).

    python benchmarks/attention_prefill.py [--tokens 8192] [--reps 20] [--alt-wide FILE] [--only NAME ...] [--out DIR]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

import torch

HEADS, HEAD_DIM, WINDOW, TOPK, RATIO = 64, 512, 128, 512, 2
#: configurations of the `wide` kernel timed besides its `plan` (block_h, num_warps, num_stages)
WIDE_CONFIGS = {"wide_h32_w8": (32, 8, 2), "wide_h32_w4": (32, 4, 2), "wide_h16_w4": (16, 4, 2),
                "wide_h64_w8_s3": (64, 8, 3)}

#: the heads layout (`sparse_attention_prefill_heads`): the split over duplicated rows, as two products, P in BF16
HEADS_CONFIGS = {"heads": {}, "heads_s3": dict(num_stages=3), "heads_split2": dict(pv="split2"),
                 "heads_pv_bf16": dict(pv="bf16"),
                 # 16 keys a tile: deep enough a pipeline (5–7 stages) for the gather to overlap the products
                 "heads_k16_s5": dict(tile_keys=16, num_stages=5), "heads_k16_s7": dict(tile_keys=16, num_stages=7),
                 "heads_pv_bf16_k16_s5": dict(pv="bf16", tile_keys=16, num_stages=5),
                 "heads_pv_bf16_k32_s5": dict(pv="bf16", tile_keys=32, num_stages=5)}


def make_case(tokens: int, device: torch.device, seed: int = 0) -> dict:
    """q, SWA rows, the workspace, the window slots and the compressed rows (module doc)."""
    g = torch.Generator(device=device).manual_seed(seed)
    bf16 = dict(dtype=torch.bfloat16, device=device)
    entries = tokens // RATIO
    t = torch.arange(tokens, device=device)
    swa_slots = t[:, None] - (WINDOW - 1) + torch.arange(WINDOW, device=device)[None, :]
    swa_slots = torch.where(swa_slots >= 0, swa_slots, -1)            # int64, as kernels.swa_window makes
    visible = (t + 1) // RATIO
    score = torch.rand(tokens, entries, generator=g, device=device)
    score = torch.where(torch.arange(entries, device=device)[None, :] < visible[:, None], score, -1.0)
    top, idx = score.topk(min(TOPK, entries), dim=1)
    comp_slots = torch.where(top >= 0, idx, -1).to(torch.int32)
    return dict(q=torch.randn(tokens, HEADS, HEAD_DIM, generator=g, **bf16),
                swa=torch.randn(tokens, HEAD_DIM, generator=g, **bf16),
                workspace=torch.randn(entries, HEAD_DIM, generator=g, **bf16),
                swa_slots=swa_slots, comp_slots=comp_slots,
                sink=torch.randn(HEADS, generator=g, device=device))


def load_alt(path: Path):
    """The module in `path` as a sibling of `sglang_dsv41.kernels.sparse_attention_prefill` (its relative
    imports resolve in that package)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("sglang_dsv41.kernels.sparse_attention_prefill_alt", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module          # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


def candidates(case: dict, alt: Path | None = None) -> dict:
    from sglang_dsv41.kernels import sparse_attention as SA
    from sglang_dsv41.kernels import sparse_attention_prefill as SAP
    args = (case["q"], case["swa"], case["swa_slots"], case["workspace"], case["comp_slots"], case["sink"],
            HEAD_DIM ** -0.5)
    n = case["q"].shape[0]
    plan = SA.plan_prefill_config(n, HEADS, HEAD_DIM, WINDOW, TOPK)
    calls = {"bf16": lambda: SA.sparse_sink_attention(*args, config=plan),
             "wide": lambda: SAP.prefill_sink_attention(*args)}
    for name, (bh, w, st) in WIDE_CONFIGS.items():
        cfg = dataclasses.replace(SAP.plan(HEADS, HEAD_DIM), block_h=bh, num_warps=w, num_stages=st)
        calls[name] = lambda cfg=cfg: SAP.prefill_sink_attention(*args, config=cfg)
    for pv in ("bf16", "fp16"):
        cfg = dataclasses.replace(SAP.plan(HEADS, HEAD_DIM), pv=pv)
        calls[f"wide_pv_{pv}"] = lambda cfg=cfg: SAP.prefill_sink_attention(*args, config=cfg)
    half = [a.half() if torch.is_tensor(a) and a.dtype == torch.bfloat16 else a for a in args]
    cfg16 = dataclasses.replace(SAP.plan(HEADS, HEAD_DIM), pv="fp16")
    calls["wide_fp16_rows"] = lambda: SAP.prefill_sink_attention(*half, config=cfg16)
    for name, over in HEADS_CONFIGS.items():
        cfg = dataclasses.replace(SAP.plan(HEADS, HEAD_DIM), layout="heads", **over)
        calls[name] = lambda cfg=cfg: SAP.prefill_sink_attention(*args, config=cfg)
    if alt is not None:
        calls["wide_alt"] = lambda mod=load_alt(alt): mod.prefill_sink_attention(*args)
    return calls


def scale_ulps(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest |out − ref| in BF16 ulps of the output scale (max |ref| of the same query and head)."""
    scale = ref.float().abs().amax(dim=-1, keepdim=True).clamp(min=2.0 ** -120)
    ulp = torch.exp2(torch.floor(torch.log2(scale)) - 7)
    return float(((out.float() - ref.float()).abs() / ulp).max())


def time_us(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def run(tokens: int, reps: int, alt: Path | None = None, only: list[str] | None = None) -> dict:
    dev = torch.device("cuda", torch.cuda.current_device())
    case = make_case(tokens, dev)
    rows, ref = {}, None
    calls = candidates(case, alt)
    if only:                              # `bf16` first: the reference of the equality columns
        unknown = sorted(set(only) - set(calls))
        if unknown:
            raise SystemExit(f"attention_prefill: unknown candidates {unknown} (known: {sorted(calls)})")
        calls = {n: f for n, f in calls.items() if n == "bf16" or n in only}
    for name, fn in calls.items():
        try:
            out = fn()
            if ref is None:
                ref = out
            rows[name] = dict(us=time_us(fn, reps), equal_fraction=float((out == ref).float().mean()),
                              max_scale_ulps=scale_ulps(out, ref))
        except Exception as exc:     # a configuration that does not launch is a loser, not an error
            rows[name] = dict(error=f"{type(exc).__name__}: {exc}"[:300])
        print(name, rows[name], flush=True)
    base = rows["bf16"].get("us")
    for r in rows.values():
        if "us" in r and base:
            r["speedup_vs_bf16"] = base / r["us"]
    return dict(device=torch.cuda.get_device_name(dev), tokens=tokens, heads=HEADS, head_dim=HEAD_DIM,
                window=WINDOW, topk=TOPK, ratio=RATIO, reps=reps, alt_wide=str(alt) if alt else None, only=only,
                method=__doc__, candidates=rows)


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n, r in result["candidates"].items() if "us" in r]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.barh(names, [result["candidates"][n]["us"] / 1e3 for n in names])
    ax.set_xlabel("ms per launch")
    ax.set_title(f"prefill attention, {result['tokens']} queries × {result['heads']} heads — {result['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--alt-wide", type=Path, default=None, help="another version of kernels/sparse_attention_prefill.py")
    ap.add_argument("--only", nargs="*", default=None, help="candidate names to time (and `bf16`, the reference)")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("attention_prefill benchmark: needs a CUDA device")
    result = run(args.tokens, args.reps, args.alt_wide, args.only)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "attention_prefill.json").write_text(json.dumps(result, indent=1))
    plot(result, args.out / "attention_prefill.png")
    print(f"wrote {args.out / 'attention_prefill.json'}")


if __name__ == "__main__":
    main()

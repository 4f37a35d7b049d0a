"""The decode attention at the Flash shape: the split-KV decode kernel against the `wide` kernel with key splits (CUDA only).

Issue 21, "Attention: … with split-KV at decode". `kernels.sparse_attention.sparse_sink_attention` on BF16
rows (`SGLANG_DSV41_ATTN_DECODE=gather`; the serving `auto` for one query) runs under `plan_decode_config`:
`mma.sync` tiles of 32 heads × 32 keys. The prefill's `wide` kernel (`kernels.sparse_attention_prefill`: every
head of a query in one program, 64-key `wgmma` tiles; the serving `auto` for 2–256 queries) splits a query's key
tiles too (`plan_decode`). This script times both on the same inputs, for N decode queries of distinct requests
(D 512, H 64, W 128, K 512 over scattered BF16 rows, int32 slots, 2 % holes):

* `decode`: the split-KV decode kernel and its plan;
* `wide`: `prefill_sink_attention` under `plan_decode`;
* `wide_sS`: the same with S splits (S in `--splits`), to place the plan.

Each candidate's BF16 output is checked first against the float64 oracle: within one BF16 ulp of the output
scale (max |o| of the query and head), the bound of both kernels' tests; a candidate outside it is recorded and
not timed. Timing: `triton.testing.do_bench` median, L2 flushed before every call (`l2_flushed`), and the same
call replayed in a CUDA graph without flushing (`graph`). Writes `attention_decode.json` and `.png` under `--out`.

    python benchmarks/attention_decode.py [--batches 1 8 16 64 256] [--splits 1 2 5 10] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
from plotting import pyplot, save_png  # noqa: E402
from sparse_attention import HEAD_DIM, HEADS, HOLE_FRACTION, SEQ_LEN, TOPK, WINDOW, decode_case  # noqa: E402

BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def oracle(c: dict, scale: float) -> torch.Tensor:
    """float64 attention with the sink over both key lists (−1 = no key)."""
    keys, valid = [], []
    for cache, slots in ((c["swa_cache"], c["swa_slots"]), (c["comp_cache"], c["comp_slots"])):
        keys.append(cache[slots.clamp(min=0).long()].double())
        valid.append(slots >= 0)
    keys, valid = torch.cat(keys, 1), torch.cat(valid, 1)
    logits = torch.einsum("thd,tsd->ths", c["q"].double(), keys) * scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    sink = c["sink"].double()[None, :]
    m = torch.maximum(logits.amax(dim=2), sink)
    p = torch.exp(logits - m[..., None])
    return torch.einsum("ths,tsd->thd", p, keys) / (p.sum(dim=2) + torch.exp(sink - m))[..., None]


def ulps_over(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out − ref| in BF16 ulps of the output scale (max |ref| of the query and head)."""
    scale = ref.abs().amax(dim=-1, keepdim=True).clamp(min=2.0 ** -120)
    return float(((out.double() - ref).abs() / torch.exp2(torch.floor(torch.log2(scale)) - 7)).max())


def candidates(n: int, splits: list[int], sm_count: int) -> dict:
    from sglang_dsv41.kernels import sparse_attention as sa
    from sglang_dsv41.kernels import sparse_attention_prefill as sap

    serving_plan = sa.plan_decode_config(n, HEADS, HEAD_DIM, WINDOW, TOPK, sm_count)

    def serving(c, scale):
        return lambda: sa.sparse_sink_attention(c["q"], c["swa_cache"], c["swa_slots"], c["comp_cache"],
                                                c["comp_slots"], c["sink"], scale, config=serving_plan)

    def wide(cfg):
        return lambda c, scale: lambda: sap.prefill_sink_attention(
            c["q"], c["swa_cache"], c["swa_slots"], c["comp_cache"], c["comp_slots"], c["sink"], scale, config=cfg)

    plan = sap.plan_decode(n, HEADS, HEAD_DIM, WINDOW, TOPK, sm_count)
    out = {"decode": (serving, serving_plan.num_splits),
           "wide": (wide(plan), plan.num_splits)}
    for s in splits:
        if s != plan.num_splits:
            cfg = sap.PrefillAttentionConfig(plan.block_h, plan.num_warps, plan.num_stages, s)
            out[f"wide_s{s}"] = (wide(cfg), s)
    return out


def time_graph(fn, reps: int = 50) -> float:
    """µs per call of fn replayed in a CUDA graph (`step_timing.capture_graph`; no L2 flush)."""
    import triton.testing
    from step_timing import capture_graph
    graph = capture_graph([fn], warmup_calls=2)
    return triton.testing.do_bench(graph.replay, warmup=10, rep=reps, return_mode="median") * 1e3


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    ap.add_argument("--splits", type=int, nargs="*", default=[1, 2, 5, 10])
    ap.add_argument("--out", type=Path, default=HERE / "results")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/attention_decode.py needs a CUDA GPU")
    import triton
    import triton.testing
    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    scale = HEAD_DIM ** -0.5
    rows = []
    for n in args.batches:
        c = decode_case(n, device, seed=n)
        ref = oracle(c, scale)
        row: dict = dict(n=n)
        for name, (make, splits) in candidates(n, args.splits, props.multi_processor_count).items():
            fn = make(c, scale)
            entry = dict(splits=splits, ulps_vs_oracle=ulps_over(fn(), ref))
            if entry["ulps_vs_oracle"] <= 1.0:
                entry["l2_flushed_us"] = triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median") * 1e3
                entry["graph_us"] = time_graph(fn)
            row[name] = entry
            print(f"N={n:4d} {name:10s} splits {splits:2d}  " + (
                f"{entry['l2_flushed_us']:8.1f} us flushed {entry['graph_us']:8.1f} us graph"
                if "graph_us" in entry else "OUTSIDE THE BOUND") + f"  ({entry['ulps_vs_oracle']:.2f} ulp)", flush=True)
        rows.append(row)
        del c, ref
        torch.cuda.empty_cache()
    result = dict(device=props.name, sm_count=props.multi_processor_count, torch=torch.__version__,
                  triton=triton.__version__, python=platform.python_version(),
                  shape=dict(heads=HEADS, head_dim=HEAD_DIM, window=WINDOW, topk=TOPK, seq_len=SEQ_LEN,
                             hole_fraction=HOLE_FRACTION),
                  timing="do_bench median with L2 flushed before every call; CUDA-graph replay median", rows=rows)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "attention_decode.json").write_text(json.dumps(result, indent=2))
    plot(result, args.out / "attention_decode.png")
    print(f"wrote {args.out / 'attention_decode.json'}")


def plot(result: dict, path: Path) -> None:
    plt = pyplot(required=True)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    names = sorted({k for r in result["rows"] for k in r if k != "n"}, key=lambda k: (k != "decode", k != "wide", k))
    for ax, key in zip(axes, ("graph_us", "l2_flushed_us")):
        for name in names:
            pts = [(r["n"], r[name][key]) for r in result["rows"] if key in r.get(name, {})]
            if pts:
                ax.plot(*zip(*pts), "o-" if name in ("decode", "wide") else "x:", label=name)
        ax.set(xscale="log", yscale="log", xlabel="decode queries N", ylabel="µs per call",
               title=f"{result['device']}: {key.replace('_us', '')}")
        ax.legend(fontsize=7)
    save_png(fig, path)


if __name__ == "__main__":
    main()

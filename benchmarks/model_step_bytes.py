"""Bytes a whole-model decode step reads per layer, and its share of copy bandwidth (issue 21 targets).

`model_step.py` times the whole model on the dummy weights of `runtime/dummy_weights.py`, whose routers
spread a batch over about as many experts as uniform routing would (`runtime/routing_spread.py`: 6 / 44 /
242 / 375 of 384 at 1 / 8 / 64 / 256 tokens). `decode_step.py` times layer 2 alone on its own random
layer, whose router touched fewer until session 35 (6 / 37 / 111 / 155 in its records up to then): its `bytes`
are that layer's. Dividing the first
benchmark's time by the second's bytes understates what the step reads. Here a layer's bytes at N tokens are
decode_step's bytes (dense weights, norms, attention and indexer reads of layer 2 at the same context) with
its experts replaced by the dummy router's distinct experts, each at the stored bytes per expert:

    bytes(N) = decode_bytes(N) + (spread(N) − decode_distinct(N)) · expert_bytes

and share = bytes(N) / layer_us(N) / copy bandwidth. Layer 2's dense and KV bytes stand for every layer's
(the experts — over 80 % of the bytes from N = 8, 95 % from 64 — are the same in each MoE layer). CPU only: the spread is
measured here with the dummy routers of the model_step model (`--preset slice --layers L`).

    python benchmarks/model_step_bytes.py --decode-step benchmarks/results/decode_step_h200_s24.json \
        --model-step H200=benchmarks/results/model_step_h200_s35.json@4262 [LABEL=JSON@GBS ...] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Mapping

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_io import write_result  # noqa: E402


def layer_bytes(decode: Mapping, spread: Mapping[int, float], n_routed: int) -> dict[int, dict]:
    """{N: {decode_bytes, decode_distinct, spread_distinct, bytes}} from a decode_step record (its graphed
    step's `current` bytes per N, `stored_layer_bytes.experts` over the `n_routed` routed experts) and the
    distinct experts per N of the model's routers; batch sizes missing from either are left out."""
    per_expert = decode["stored_layer_bytes"]["experts"] / n_routed
    out = {}
    for row in decode["decode"]:
        n, graph = row["tokens"], row.get("graph") or {}
        if n not in spread or not isinstance(graph.get("bytes"), Mapping):
            continue
        base, distinct = graph["bytes"]["current"], row["distinct_experts"]
        out[n] = dict(decode_bytes=base, decode_distinct=distinct, spread_distinct=spread[n],
                      bytes=base + (spread[n] - distinct) * per_expert)
    return out


def shares(step: Mapping, by_n: Mapping[int, Mapping], copy_gbs: float) -> list[dict]:
    """Per model_step row (side stream on): per-layer µs, the bytes of `layer_bytes` and the share of
    `copy_gbs`, beside the share by decode_step's bytes."""
    rows = []
    for r in step["rows"]:
        n, us = r["batch"], r["on"]["layer_us"]
        if n not in by_n:
            continue
        b = by_n[n]
        rows.append(dict(tokens=n, layer_us=us, bytes=b["bytes"], decode_bytes=b["decode_bytes"],
                         share=b["bytes"] / (us * 1e-6) / (copy_gbs * 1e9),
                         share_by_decode_bytes=b["decode_bytes"] / (us * 1e-6) / (copy_gbs * 1e9)))
    return rows


def plot(result: Mapping, path: Path) -> bool:
    """Share of copy bandwidth per batch size and run, by these bytes (solid) and by decode_step's (dashed),
    with issue 21's targets; False (no PNG) without matplotlib."""
    from plotting import pyplot, save_png

    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for label, run in result["runs"].items():
        n = [r["tokens"] for r in run["rows"]]
        line, = ax.plot(n, [100 * r["share"] for r in run["rows"]], marker="o", label=f"{label}: routed spread")
        ax.plot(n, [100 * r["share_by_decode_bytes"] for r in run["rows"]], ls="--", color=line.get_color(),
                label=f"{label}: decode_step's bytes")
    ax.step([1, 8, 64, 256], [30, 50, 60, 60], where="post", color="k", lw=1, label="target")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("decode batch (tokens)")
    ax.set_ylabel("% of copy bandwidth (whole-model step, per layer)")
    ax.legend(fontsize=7)
    save_png(fig, path)
    return True


def model_spread(layers: int, batches: tuple[int, ...], draws: int = 4) -> dict:
    """`routing_spread.dummy_router_spread` of model_step's model (`slice`, `layers` layers) on the CPU."""
    from sglang_dsv41.checkpoint.synth import make_config_dir
    from sglang_dsv41.config import DeepseekV41Config
    from sglang_dsv41.runtime.routing_spread import dummy_router_spread

    with tempfile.TemporaryDirectory() as tmp:
        cfg = DeepseekV41Config.from_file(make_config_dir("slice", Path(tmp) / "model", layers=layers))
    return dummy_router_spread(cfg, "cpu", batches=batches, draws=draws)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--decode-step", type=Path, required=True, help="a decode_step.py JSON (layer 2's bytes)")
    ap.add_argument("--model-step", nargs="+", required=True, metavar="LABEL=JSON@GBS",
                    help="model_step.py JSONs, each with the copy bandwidth (GB/s) of its machine")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    a = ap.parse_args(argv)
    decode = json.loads(a.decode_step.read_text())
    runs = []
    for item in a.model_step:
        label, rest = item.split("=", 1)
        path, gbs = rest.rsplit("@", 1)
        runs.append((label, Path(path), float(gbs)))
    batches = tuple(sorted({r["batch"] for _, p, _ in runs for r in json.loads(p.read_text())["rows"]}))
    spread = model_spread(a.layers, batches)
    by_n = layer_bytes(decode, {row["tokens"]: row["distinct_experts"] for row in spread["per_batch"]},
                       spread["n_routed_experts"])
    result = dict(method=__doc__.split("\n\n", 2)[1], decode_step=str(a.decode_step), spread=spread,
                  layer_bytes={str(n): v for n, v in by_n.items()},
                  runs={label: dict(model_step=str(p), copy_gbs=gbs, rows=shares(json.loads(p.read_text()), by_n, gbs))
                        for label, p, gbs in runs})
    for label, run in result["runs"].items():
        for r in run["rows"]:
            print(f"{label} N={r['tokens']}: {r['layer_us']:.1f} µs, {r['bytes'] / 1e6:,.0f} MB, "
                  f"{100 * r['share']:.1f} % (by decode_step's bytes {100 * r['share_by_decode_bytes']:.1f} %)")
    write_result(a.out, "model_step_bytes.json", result)
    plot(result, a.out / "model_step_bytes.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Arithmetic and plots of the SGLang 0.5.17 DeepSeek-V4 baseline (benchmarks/sglang_v4_baseline.py).

Invariants:
* per-layer time = Δ(step) / Δ(layers) between the smallest and largest layer count of the *same*
  batch and context; the embedding, the final mHC head, the LM head and sampling cancel;
* per-layer prefill rate = Δ(tokens) / Δ(prefill seconds) the same way, never from a worker's first timed
  batch (its 8K-token extend is the first of that shape after load and may JIT-compile kernels: its
  seconds are not a rate);
* a merged result keeps every source run as it was measured. Merging is for batch sizes timed in
  separate calls on the same machine (a fresh machine's first decode-graph capture JIT-compiles for
  minutes, so one call cannot always hold all four batches): the merge refuses sources whose model
  configs, context or layer counts differ, and a batch measured twice.

    python benchmarks/sglang_v4_results.py merge OUT.json IN.json [IN.json ...]
    python benchmarks/sglang_v4_results.py plot RESULT.json        # writes RESULT.png (needs matplotlib)
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plotting import pyplot, save_png  # noqa: E402

#: prefill runs shorter than this many seconds at either layer count give no rate (timer noise)
MIN_PREFILL_S = 0.5


def per_layer(step_by_layers: dict[int, dict[int, dict]], layer_counts: list[int],
              batches: list[int]) -> list[dict[str, Any]]:
    """Per requested batch: per-layer µs = Δstep / Δlayers between the smallest and largest layer count,
    the fixed (non-layer) part, and the per-layer prefill rate where both prefills are long enough;
    an `error` row where either run is missing or the contexts differ."""
    lo, hi = min(layer_counts), max(layer_counts)
    rows = []
    for bs in batches:
        a, b = step_by_layers.get(lo, {}).get(bs), step_by_layers.get(hi, {}).get(bs)
        row: dict[str, Any] = {"batch": bs}
        if a is None or b is None:
            row["error"] = f"missing run for {lo if a is None else hi} layers"
        elif a["context"] != b["context"]:
            row["error"] = f"contexts differ ({a['context']} vs {b['context']})"
        else:
            layer_us = (b["step_median_us"] - a["step_median_us"]) / (hi - lo)
            row.update(context=a["context"], per_layer_us=layer_us, fixed_us=a["step_median_us"] - lo * layer_us,
                       **{f"step_{n}_layers_us": r["step_median_us"] for n, r in ((lo, a), (hi, b))})
            dt = (b.get("prefill_s", 0.0) - a.get("prefill_s", 0.0)) / (hi - lo)
            first = a.get("first_timed") or b.get("first_timed")
            if not first and min(a.get("prefill_s", 0.0), b.get("prefill_s", 0.0)) >= MIN_PREFILL_S and dt > 0:
                row["prefill_tokens_per_s_per_layer"] = bs * a["context"] / dt
        rows.append(row)
    return rows


def timed_runs(worker: dict[str, Any]) -> dict[int, dict]:
    """{batch: run} of one worker record, warm-up runs left out; the first timed run carries `first_timed`."""
    runs = [r for r in worker.get("runs", []) if not r.get("warmup")]
    return {r["batch"]: {**r, "first_timed": i == 0} for i, r in enumerate(runs)}


def steps_by_layers(result: dict[str, Any]) -> dict[int, dict[int, dict]]:
    """{layers: {batch: run}} of a result's workers (warm-up runs left out)."""
    out: dict[int, dict[int, dict]] = {}
    for w in result.get("workers", []):
        out.setdefault(w["layers"], {}).update(timed_runs(w))
    return out


def merge(results: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    """One result from several runs of the same model on the same machine, each contributing its batches."""
    first = results[0]
    for name, r in zip(names[1:], results[1:]):
        for key in ("configs", "context", "layer_counts"):
            if json.dumps(r.get(key), sort_keys=True) != json.dumps(first.get(key), sort_keys=True):
                raise ValueError(f"{name}: '{key}' differs from {names[0]}'s; only runs of one model merge")
    seen: dict[int, str] = {}
    steps: dict[int, dict[int, dict]] = {}
    for name, r in zip(names, results):
        for bs in r["batches"]:
            if bs in seen:
                raise ValueError(f"batch {bs} is in both {seen[bs]} and {name}")
            seen[bs] = name
        for layers, runs in steps_by_layers(r).items():
            steps.setdefault(layers, {}).update({bs: run for bs, run in runs.items() if bs in r["batches"]})
    batches = sorted(seen)
    merged = {k: v for k, v in first.items() if k not in ("workers", "per_layer", "errors", "batches", "wall_s")}
    merged.update(batches=batches, merged_from=[{"file": n, "batches": r["batches"], "wall_s": r.get("wall_s"),
                                                 "prefill_chunk_tokens": r.get("prefill_chunk_tokens"),
                                                 "errors": r.get("errors", [])} for n, r in zip(names, results)],
                  workers=[w for r in results for w in r.get("workers", [])],
                  per_layer=per_layer(steps, first["layer_counts"], batches))
    merged["errors"] = [f"per-layer, batch {row['batch']}: {row['error']}" for row in merged["per_layer"]
                        if "error" in row]
    return merged


def ours_graph_us(decode_step_json: Path) -> dict[int, float]:
    """Our graphed per-layer step (decode_step.json `layer_us_graph`) by decode tokens."""
    if not decode_step_json.exists():
        return {}
    return {r["tokens"]: r["layer_us_graph"] for r in json.loads(decode_step_json.read_text()).get("decode", [])
            if r.get("layer_us_graph")}


def plot(result: dict[str, Any], path: Path) -> int:
    """Per-layer decode µs by batch; our graphed layer step (decode_step.json beside `path`) next to it."""
    plt = pyplot(required=True)
    rows = [r for r in result.get("per_layer", []) if "per_layer_us" in r]
    if not rows:
        print("nothing to plot: no per-layer rows")
        return 1
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = list(range(len(rows)))
    ax.bar([x - 0.2 for x in xs], [r["per_layer_us"] for r in rows], 0.4,
           label="SGLang 0.5.17 V4-Flash layer (mean of c4 + c128)")
    ours = ours_graph_us(path.parent / "decode_step.json")
    if ours:
        ax.bar([x + 0.2 for x in xs], [ours.get(r["batch"], 0.0) for r in rows], 0.4,
               label="sglang-dsv41 V4.1-Flash layer (decode_step.json, graph)")
    ax.set_xticks(xs, [f"{r['batch']}\n(ctx {r['context']})" for r in rows])
    ax.set(yscale="log", xlabel="decode batch", ylabel="µs per layer per step",
           title="Per-layer decode step with CUDA graphs, one H200")
    ax.legend(fontsize=8)
    save_png(fig, path, dpi=120)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("merge")
    m.add_argument("out", type=Path)
    m.add_argument("inputs", type=Path, nargs="+")
    p = sub.add_parser("plot")
    p.add_argument("result", type=Path)
    args = ap.parse_args(argv)
    if args.cmd == "plot":
        return plot(json.loads(args.result.read_text()), args.result.with_suffix(".png"))
    merged = merge([json.loads(f.read_text()) for f in args.inputs], [str(f) for f in args.inputs])
    args.out.write_text(json.dumps(merged, indent=2))
    print(f"wrote {args.out}: " + ", ".join(
        f"bs {r['batch']}: {r['per_layer_us']:.0f} us" if "per_layer_us" in r else f"bs {r['batch']}: {r['error']}"
        for r in merged["per_layer"]) + f"; errors: {merged['errors'] or 'none'}")
    if importlib.util.find_spec("matplotlib") is not None:
        plot(merged, args.out.with_suffix(".png"))
    return 1 if merged["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())

"""The whole runtime model's decode step in a CUDA graph, side stream off and on (issue 21, item 2).

`decode_step.py` times one layer's step composed from its parts in order; this times the model the
server runs — `TorchForward.hidden_states` over every layer, the batch's static decode layout
included, as SGLang's decode runner captures it — so work forked to the side stream
(`runtime/overlap.py`, SGLANG_DSV41_OVERLAP) shows. Model: `--preset` (`slice`: Flash widths) with
`--layers` layers and the dummy weights of `--load-format dummy` (`runtime/dummy_weights.py`), built
on the device with no checkpoint. Caches: B requests of `--context` tokens each, packed rows random
bytes (no NaN codes), SWA rows random BF16; token b decodes at position context − 1. `--table-width`
(default: the context) is the width of the request-to-token table, i.e. the served `--context-length`:
the static decode layout's bound (`BatchLayout.max_seq_len`), which sizes the indexer's score rows and
entry tables whatever the requests' lengths (docs/runtime.md "CUDA-graph padding"); a capture that does
not fit records `oom` instead of a time.

Per batch size B and mode (`off`, `on`): the step captured in one `torch.cuda.CUDAGraph` (two warm-up
calls first) and replayed; `step_us` (median of CUDA-event replays, `step_timing.measure`: an L2
flush before each) and `layer_us` = step / layers. Then the two graphs replay from the same Engram
history (each replay advances it) and their hidden states are compared: `bits_equal` (the same
kernels run either way; a difference is a missing join). `on / off` is the ratio of step times.
CPU (`--device cpu`, tests): eager calls only, no graph, the same records.

MODEL_STEP_ACTIVATIONS=fp32 runs everything with the activations in fp32 as before session 26
(`fp32_activations.Fp32Activations`); the record says which (`activations`). Two processes, one with it and
one without, on one warm machine give session 26's decode ratio (`scripts/gpu/session26b.sh`).

    python benchmarks/model_step.py --layers 4 --batches 1 8 64 256 --context 8192 --out DIR
    python benchmarks/model_step.py --batches 1 8 --profile --out DIR   (exposed time per kernel, stream_profile.py)
    python benchmarks/model_step.py --plot triton=a.json flashmla=b.json --out DIR    (the PNG only)
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_timing import capture_graph, measure  # noqa: E402

PAGE = 64
MODES = ("off", "on")
ACTIVATIONS_ENV = "MODEL_STEP_ACTIVATIONS"


def build_engine(preset: str, layers: int, device: torch.device):
    """The server's forward of `preset` (`slice`: `layers` layers; the tiny presets keep theirs) with
    dummy weights on `device` (CUDA: MXFP4 experts, E4M3 dense weights; CPU: dequantised)."""
    from sglang_dsv41.checkpoint.synth import make_config_dir
    from sglang_dsv41.config import DeepseekV41Config
    from sglang_dsv41.engram_hash import EngramHasher, _load_fast_tokenizer, compressed_token_map
    from sglang_dsv41.runtime.dummy_weights import dummy_stored_tensors
    from sglang_dsv41.runtime.forward import TorchForward, fp32_default_dtype

    with tempfile.TemporaryDirectory() as tmp:
        path = make_config_dir(preset, Path(tmp) / "model", layers=layers if preset == "slice" else None)
        cfg = DeepseekV41Config.from_file(path)
        token_map, _ = compressed_token_map(_load_fast_tokenizer(path))
    cuda = device.type == "cuda"
    with fp32_default_dtype(), torch.device(device):
        engine = TorchForward.for_loading(cfg, EngramHasher.from_config(cfg, token_map).to(device),
                                          experts_mxfp4=cuda, dense_fp8=cuda, deterministic=False)
        engine.load_weights(dummy_stored_tensors(cfg, device))
        engine.post_load_weights()
    return engine


def decode_case(engine, batch: int, context: int, seed: int = 0, table_width: int | None = None):
    """(forward callable, caches, history snapshot) of one decode step: B requests of `context`
    tokens, request b in row b + 1, token b at position context − 1, in a request-to-token table of
    `table_width` ≥ context columns (default: context)."""
    from sglang_dsv41.runtime.batch import static_decode_layout
    from sglang_dsv41.runtime.cache import RuntimeCaches

    t, dev = engine.text, engine.weights["embed.weight"].device
    caches = RuntimeCaches.allocate(t, PAGE + batch * context, batch + 1, device=dev, page_size=PAGE)
    g = torch.Generator(device=dev).manual_seed(seed)
    for rows in (caches.latent_rows, caches.key_rows):
        rows.copy_(torch.randint(0, 120, rows.shape, generator=g, device=dev, dtype=torch.uint8))
    for swa in caches.swa:
        swa.copy_(torch.randn(swa.shape, generator=g, device=dev).to(swa.dtype))
    width = context if table_width is None else table_width
    if width < context:
        raise ValueError(f"decode_case: table width {width} < context {context}")
    table = torch.zeros(batch + 1, width, dtype=torch.int32, device=dev)
    table[1:, :context] = (PAGE + torch.arange(batch * context, device=dev, dtype=torch.int32)).view(batch, context)
    rows = torch.arange(1, batch + 1, device=dev)
    seq_lens = torch.full((batch,), context, device=dev)
    positions = seq_lens - 1
    out_slots = table[1:, context - 1].to(torch.int64)
    ids = torch.randint(3, min(t.vocab_size, 100_000), (batch,), generator=g, device=dev)

    def forward():
        layout = static_decode_layout(rows, seq_lens, positions, out_slots, table)
        return engine.hidden_states(ids, layout, caches)

    ring = caches.engram_history
    return forward, ring, (ring.ids.clone(), ring.end.clone())


def _restore(ring, snapshot) -> None:
    ring.ids.copy_(snapshot[0])
    ring.end.copy_(snapshot[1])


def _captured(forward):
    """(graph, its static output) of one `forward` call (`step_timing.capture_graph`: two warm-up
    calls on a side stream, then the capture; the last call's output is the captured one)."""
    held = {}
    graph = capture_graph([lambda: held.update(out=forward())])
    return graph, held["out"]


def run_batch(engine, batch: int, context: int, cap_s: float, profile: bool = False,
              table_width: int | None = None, modes: tuple[str, ...] = MODES) -> dict:
    """One batch size: both modes timed, then their outputs compared (module docstring); with `profile`
    (CUDA only) each graph's replays traced last (`stream_profile.profile_graph`). A trace leaves the
    process's later replays slower (session 28: +4–12 %), so a profiled run's later batches are not
    timings to compare: take those from a run without --profile. `modes`: the side-stream modes timed
    (both: their outputs compared too); CUDA: `peak_reserved_mb`, the most memory the process held
    from the case's caches to the first capture (weights included).
    A capture that runs out of device memory gives a row with `oom` (the error) and no times."""
    from sglang_dsv41.runtime.overlap import side_stream_for

    dev = engine.weights["embed.weight"].device
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
    forward, ring, snapshot = decode_case(engine, batch, context, table_width=table_width)
    row: dict = dict(batch=batch, context=context, table_width=table_width or context,
                     layers=engine.text.num_hidden_layers)
    runs = {}
    for mode in modes:
        engine.overlap = side_stream_for(dev, mode)
        if dev.type == "cuda":
            try:
                graph, out = _captured(forward)
            except torch.OutOfMemoryError as e:
                row["oom"] = str(e).split("\n")[0][:300]
                return row
            row.setdefault("peak_reserved_mb", round(torch.cuda.max_memory_reserved(dev) / 2**20, 1))
            runs[mode] = (graph.replay, lambda out=out: out)
        else:
            result = {}
            runs[mode] = (lambda result=result: result.update(out=forward()), lambda result=result: result["out"])
        _restore(ring, snapshot)
        timing = measure(runs[mode][0], cap_s, dev)
        step_us = round(timing["median_us"], 1)
        row[mode] = dict(step_us=step_us, min_us=round(timing["min_us"], 1), reps=timing["reps"],
                         layer_us=round(step_us / row["layers"], 1))
    if tuple(modes) == MODES:
        outs = {}
        for mode in MODES:                 # the same Engram history before each: comparable outputs
            engine.overlap = side_stream_for(dev, mode)
            _restore(ring, snapshot)
            run, output = runs[mode]
            run()
            outs[mode] = output().clone()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        row["bits_equal"] = bool(torch.equal(outs["off"], outs["on"]))
        row["on_over_off"] = round(row["on"]["step_us"] / row["off"]["step_us"], 4)
    if profile and dev.type == "cuda":                  # after the timings: a trace slows later replays
        from stream_profile import profile_graph
        for mode in modes:
            row[mode]["profile"] = profile_graph(runs[mode][0], dev)
    return row


def _headline(row: dict) -> dict:
    """The row without its profiles' kernel lists (the log line; the JSON keeps them)."""
    out = dict(row)
    for mode in MODES:
        if isinstance(row.get(mode), dict) and "profile" in row[mode]:
            out[mode] = {k: v for k, v in row[mode].items() if k != "profile"}
            out[mode]["profile"] = {k: v for k, v in row[mode]["profile"].items() if k not in ("kernels", "by_name")}
    return out


def plot(records: dict[str, dict], path: Path) -> bool:
    """µs per layer against batch size, side stream off (dashed) and on (solid), one colour per
    record (label → a `model_step.json`; records without rows are left out, and with none no file is
    written); False without matplotlib."""
    from plotting import pyplot, save_png

    plt = pyplot()
    if plt is None:
        return False
    records = {label: rec for label, rec in records.items() if rec["rows"]}
    if not records:                               # every batch skipped (budget): nothing to draw
        return True
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (label, rec) in enumerate(records.items()):
        for mode, style in (("off", "--"), ("on", "-")):
            timed = [r for r in rec["rows"] if mode in r]
            if timed:
                ax.plot([r["batch"] for r in timed], [r[mode]["layer_us"] for r in timed], style, marker="o",
                        color=f"C{i}", label=f"{label}, side stream {mode}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("decode batch (tokens)")
    ax.set_ylabel("µs per layer (whole-model CUDA graph / layers)")
    first = next(iter(records.values()))
    ax.set_title(f"runtime decode step, {first['layers']} layers, context {first['context']} ({first['device']})",
                 fontsize=9)
    ax.legend(fontsize=7)
    save_png(fig, path)
    return True


def plot_widths(records: dict[str, dict], path: Path) -> bool:
    """µs per layer against the request-to-token table width (the served context), one line per record
    (label → a `model_step.json` of several `--table-width`s) and batch size, side stream on; False
    without matplotlib."""
    from plotting import pyplot, save_png

    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (label, rec) in enumerate(records.items()):
        for j, batch in enumerate(sorted({r["batch"] for r in rec["rows"]})):
            rows = sorted((r for r in rec["rows"] if r["batch"] == batch and "on" in r), key=lambda r: r["table_width"])
            ax.plot([r["table_width"] for r in rows], [r["on"]["layer_us"] for r in rows], "-" if i == 0 else "--",
                    marker="o", color=f"C{j}", label=f"{label}, N = {batch}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("request-to-token table width (served context length), requests of "
                  f"{next(iter(records.values()))['context']} tokens")
    ax.set_ylabel("µs per layer (whole-model CUDA graph / layers)")
    first = next(iter(records.values()))
    ax.set_title(f"decode step by served context, {first['layers']} layers ({first['device']})", fontsize=9)
    ax.legend(fontsize=7)
    save_png(fig, path)
    return True


def _plot_any(records: dict[str, dict], path: Path) -> bool:
    """`plot_widths` when a record has several table widths, else `plot`."""
    if any(len(rec.get("table_widths", [])) > 1 for rec in records.values()):
        return plot_widths(records, path)
    return plot(records, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="slice")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--table-width", type=int, nargs="+",
                    help="request-to-token table widths (the served --context-length; default: --context): "
                         "every batch at each width")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="side-stream modes timed")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--cap-s", type=float, default=1.0)
    ap.add_argument("--budget-s", type=float, default=400.0)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--profile", action="store_true",
                    help="also trace each graph's replays: exposed time per kernel (`stream_profile.py`)")
    ap.add_argument("--plot", nargs="+", metavar="LABEL=JSON",
                    help="only draw model_step.png in --out from earlier records (no run)")
    args = ap.parse_args(argv)
    if args.plot:
        records = {k: json.loads(Path(v).read_text()) for k, v in (a.split("=", 1) for a in args.plot)}
        args.out.mkdir(parents=True, exist_ok=True)
        return 0 if _plot_any(records, args.out / "model_step.png") else 1
    activations = os.environ.get(ACTIVATIONS_ENV, "default")
    if activations not in ("default", "fp32"):
        raise SystemExit(f"{ACTIVATIONS_ENV}={activations!r}: expected 'default' or 'fp32'")
    dev = torch.device(args.device)
    t0 = time.perf_counter()
    engine = build_engine(args.preset, args.layers, dev)
    rec = dict(device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", preset=args.preset,
               layers=args.layers, context=args.context, table_widths=args.table_width or [args.context],
               modes=args.modes, activations=activations,
               build_s=round(time.perf_counter() - t0, 1), rows=[], skipped=[])
    if activations == "fp32":
        from fp32_activations import Fp32Activations
        scope = Fp32Activations(engine.backend)
    else:
        scope = contextlib.nullcontext()
    with scope:
        for width, b in [(w, b) for w in args.table_width or [None] for b in args.batches]:
            if time.perf_counter() - t0 > args.budget_s:
                rec["skipped"].append(b if width is None else [b, width])
                continue
            row = run_batch(engine, b, args.context, args.cap_s, args.profile, width, tuple(args.modes))
            print(json.dumps(_headline(row)), flush=True)
            rec["rows"].append(row)
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "model_step.json").write_text(json.dumps(rec, indent=2) + "\n")
    if not _plot_any({args.preset: rec}, args.out / "model_step.png"):
        print("no model_step.png: matplotlib is not installed", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

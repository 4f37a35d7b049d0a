"""Launches of one eager decode step of the CUDA serving path, in order and by site — CPU, no GPU.

`model_step.py --profile` lists a graphed step's kernels on the GPU, but a torch kernel's name does not
say which line of ours launched it. This runs the same step (`model_step.decode_case`: the static
decode layout inside the forward, B requests of `--context` tokens) through the CUDA path's code on
CPU tensors (`host_ops.cpu_as_cuda`: Triton kernels in the interpreter) and lists, in order, every op
that would launch a device kernel — Triton launches, and aten ops that are not views, allocations or
metadata — with the repository line that issued it. `--pattern slice4` gives the tiny widths the
4-layer Flash slice's layer pattern (`model_step.py --preset slice --layers 4`: two SWA layers, the
Engram layer 1, a ratio-2 kv source with its indexer at layer 2, a ratio-2 reader at layer 3), so the
list lines up with that profile. Width-dependent choices (the top-k method, tile sizes) follow the
tiny widths, and a CPU aten op may not be one CUDA kernel (`torch.mm` on CPU casts first), so the
count is an estimate of the glue, not of the GPU's kernel list.

    python benchmarks/decode_glue.py --pattern slice4 --batch 1 --context 256 --out /tmp/glue.json
    python benchmarks/decode_glue.py --plot before=a.json after=b.json --out glue.png   (launches by file, the PNG only)
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NO_KERNEL = ("aten.view", "aten.reshape", "aten._unsafe_view", "aten.slice", "aten.select", "aten.unsqueeze",
             "aten.squeeze", "aten.t.", "aten.transpose", "aten.permute", "aten.expand", "aten.alias",
             "aten.empty", "aten.detach", "aten.as_strided", "aten.split", "aten.unbind", "aten.chunk",
             "aten.narrow", "aten.lift_fresh", "aten.sym_", "aten.is_same_size", "aten.new_empty",
             "aten._reshape_alias", "aten.unflatten", "aten.flatten", "aten.view_as", "aten.movedim",
             "aten.dim", "aten.stride", "aten.size", "aten.is_nonzero", "aten.result_type", "aten.set_",
             "aten.resize_", "aten.diagonal", "aten.unfold", "aten.real")
PATTERNS = {
    "slice4": dict(num_hidden_layers=4, compress_ratios=[0, 0, 2, 2, 0, 0, 0], kv_source_layer_ids=[2],
                   index_source_layer_ids=[2], candidate_source_layer_id=-1, engram_layer_ids=[1],
                   engram_num_embeddings=[434], dspark_target_layer_ids=[1, 2, 3]),
}


def launches_kernel(name: str) -> bool:
    """Whether an aten op (its `str(func)`) would launch a device kernel (not a view / allocation)."""
    return not name.startswith(NO_KERNEL)


def model_dir(pattern: str | None, out: Path) -> Path:
    """The tiny preset's config (tokenizer included), with `pattern`'s layer fields when given."""
    from sglang_dsv41.checkpoint.synth import make_config_dir

    path = make_config_dir("tiny", out)
    if pattern:
        cfg_path = path / "config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["text_config"].update(PATTERNS[pattern])
        cfg_path.write_text(json.dumps(cfg))
    return path


def build_engine(path: Path):
    """The serving model of `path` with dummy weights in the CUDA forms (E4M3 dense, MXFP4 experts), on CPU."""
    import torch
    from sglang_dsv41.config import DeepseekV41Config
    from sglang_dsv41.engram_hash import EngramHasher, _load_fast_tokenizer, compressed_token_map
    from sglang_dsv41.runtime.dummy_weights import dummy_stored_tensors
    from sglang_dsv41.runtime.forward import TorchForward, fp32_default_dtype

    cfg = DeepseekV41Config.from_file(path)
    token_map, _ = compressed_token_map(_load_fast_tokenizer(path))
    with fp32_default_dtype(), torch.device("cpu"):
        engine = TorchForward.for_loading(cfg, EngramHasher.from_config(cfg, token_map), experts_mxfp4=True,
                                          dense_fp8=True, deterministic=False)
        engine.load_weights(dummy_stored_tensors(cfg, "cpu"))
        engine.post_load_weights()
    return engine


def trace_step(engine, batch: int, context: int) -> list[tuple[str, str]]:
    """(site, op) of every kernel-launching op of one decode step after a warm-up step, in order."""
    import host_ops
    from model_step import decode_case
    from torch.utils._python_dispatch import TorchDispatchMode

    forward, _, _ = decode_case(engine, batch, context)
    forward()
    order: list[tuple[str, str]] = []
    counter = host_ops.HostCounter()

    class Ordered(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not counter.inside_launch and launches_kernel(str(func)):
                order.append((host_ops.repo_site(), str(func)))
            return func(*args, **(kwargs or {}))

    launched = counter.launched

    def launched_in_order():
        order.append((host_ops.repo_site(), "triton"))
        return launched()
    counter.launched = launched_in_order
    host_ops.ACTIVE.append(counter)
    try:
        with Ordered():
            forward()
    finally:
        host_ops.ACTIVE.pop()
    return order


def summarise(order: list[tuple[str, str]]) -> dict:
    by_file: collections.Counter = collections.Counter(site.rsplit(":", 1)[0] for site, _ in order)
    by_site: collections.Counter = collections.Counter(site for site, _ in order)
    return {"launches": len(order), "triton": sum(op == "triton" for _, op in order),
            "torch": sum(op != "triton" for _, op in order), "by_file": dict(by_file.most_common()),
            "by_site": dict(by_site.most_common()), "order": [f"{site} {op}" for site, op in order]}


def plot(runs: list[tuple[str, dict]], out: Path) -> bool:
    """Horizontal bars: each run's launches per file (files with ≥ 4 in some run); the legend splits each
    run's total into torch ops and Triton launches. False without matplotlib."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from plotting import pyplot, save_png

    plt = pyplot()
    if plt is None:
        return False
    files = sorted({f for _, r in runs for f, n in r["by_file"].items() if n >= 4},
                   key=lambda f: -max(r["by_file"].get(f, 0) for _, r in runs))
    fig, ax = plt.subplots(figsize=(9, 0.32 * len(files) + 1.6))
    height = 0.8 / len(runs)
    for i, (label, r) in enumerate(runs):
        ys = [k + i * height for k in range(len(files))]
        ax.barh(ys, [r["by_file"].get(f, 0) for f in files], height=height,
                label=f"{label}: {r['launches']} ({r['torch']} torch, {r['triton']} Triton)")
    ax.set_yticks([k + 0.4 - height / 2 for k in range(len(files))], files, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("kernel launches in one decode step (CPU census)")
    first = runs[0][1]
    ax.set_title(f"decode step launches by site: pattern {first['pattern']}, batch {first['batch']}, "
                 f"context {first['context']}", fontsize=9)
    ax.legend(fontsize=8)
    save_png(fig, out)
    return True


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pattern", choices=sorted(PATTERNS), default=None, help="layer pattern (default: tiny's own)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--plot", nargs="+", metavar="LABEL=JSON", help="only draw these runs' launches by file")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    if a.plot:
        runs = [(label, json.loads(Path(path).read_text())) for label, path in (x.split("=", 1) for x in a.plot)]
        if not plot(runs, a.out):
            print("no PNG: matplotlib is not installed")
        return 0
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import host_ops
    import torch

    host_ops.patch_launches()
    host_ops.cpu_as_cuda()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        engine = build_engine(model_dir(a.pattern, Path(tmp) / "model"))
    result = {"pattern": a.pattern or "tiny", "batch": a.batch, "context": a.context,
              **summarise(trace_step(engine, a.batch, a.context))}
    print(f"launches {result['launches']} (Triton {result['triton']}, torch {result['torch']})")
    print("by file:", result["by_file"])
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

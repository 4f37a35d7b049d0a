"""What one extend over a long prefix costs in the model forward, without a server (issues 14 and 21;
docs/hicache.md "What a hit costs").

The tiny checkpoint's forward as the CUDA server builds it (serving mode: `TorchForward.for_loading`,
deterministic off), on stand-alone caches (`RuntimeCaches.allocate`) whose packed rows hold random
bytes: a prefix hit's forward reads the prefix's compressed entries and never writes them, so their
values only change the scores, not the work. One request at row 1, prefix L tokens in slots
page..page+L−1, the extend's N tokens after them (page-aligned, as SGLang's paged allocator gives).

Per case (L, N), in this order:
* `first_ms`: the first forward of the case's shapes (Triton builds of new kernel variants land here);
* `wall_ms` (median of REPS): host wall of one forward, synchronised before and after;
* `host_ms`: the time until the forward returned to Python (kernel launches queued, no wait);
* `gpu_busy_ms`, `launches`, `top_kernels`: one more forward under torch.profiler (CUDA kernels'
  summed device time and count), `aten_ops` and `host_syncs` (aten ops that wait for the device:
  `_local_scalar_dense` (`.item()`, `int()`, `bool()`, `.tolist()`), `nonzero`, `equal`, … on CUDA
  tensors) by the repository frame that issued them, and `aten_ops_by_file` (every op by the file
  of its innermost repository frame: where an eager forward's host time goes), from a
  TorchDispatchMode over one forward.

Reading it: wall − gpu_busy ≈ host time the GPU waited for (launch-bound); a kernel whose device time
grows with L at N = 32 is the context-proportional part; first − wall is the JIT cost of the case.
With `--cprofile`, one more forward of each case under cProfile (`host_profile`): the Python functions the
host time goes to (self and cumulative seconds, top CPROFILE_TOP) and the self time summed by package
(triton, triton_kernels, torch, ours by file), so an eager forward's host time can be read by where it is spent.
`--topk-variants` repeats the longest-prefix case of the first --new-tokens with
SGLANG_DSV41_INDEXER_TOPK=torch. N = 1 is an eager decode step: under SGLang's overlap scheduler a
prefill's first token is sent only after the next batch (the request's first decode step) has been
launched, so with --disable-cuda-graph a hit's TTFT holds the host time of both forwards.

  python benchmarks/hit_extend.py --model-path /tmp/tiny --out /tmp/out/hit_extend.json
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

if str(Path(__file__).resolve().parent) not in sys.path:   # sibling benchmark modules (loaded by path too)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from host_profile import host_profile, package_of, summary_lines  # noqa: E402,F401 (package_of: re-exported)

SYNC_OPS = ("aten._local_scalar_dense", "aten.nonzero", "aten.equal", "aten.is_nonzero", "aten.masked_select",
            "aten.repeat_interleave.Tensor", "aten._unique2", "aten.unique")
PAGE = 64


class OpWatch(TorchDispatchMode):
    """Counts aten ops, and the ops that synchronise with a CUDA device by repository frame."""

    def __init__(self, device: str = "cuda") -> None:
        super().__init__()
        self.device = device
        self.ops = 0
        self.syncs: collections.Counter = collections.Counter()
        self.by_file: collections.Counter = collections.Counter()     # aten ops by the issuing file

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        name = str(func)
        frames = [f for f in traceback.extract_stack() if "sglang_dsv41" in f.filename]
        where = f"{frames[-1].filename.split('sglang_dsv41/')[-1]}:{frames[-1].lineno}" if frames else "?"
        self.by_file[where.rsplit(":", 1)[0]] += 1
        if name.startswith(SYNC_OPS) and any(isinstance(a, torch.Tensor) and a.device.type == self.device
                                            for a in args):
            self.syncs[f"{name} {where}"] += 1
        return func(*args, **(kwargs or {}))


def build_engine(model_path: str, dev: torch.device):
    from sglang_dsv41.checkpoint.reader import CheckpointReader
    from sglang_dsv41.config import DeepseekV41Config
    from sglang_dsv41.engram_hash import EngramHasher, _load_fast_tokenizer, compressed_token_map
    from sglang_dsv41.runtime.forward import TorchForward, fp32_default_dtype

    cfg = DeepseekV41Config.from_file(model_path)
    token_map, _ = compressed_token_map(_load_fast_tokenizer(model_path))
    cuda = dev.type == "cuda"
    with fp32_default_dtype(), torch.device(dev), CheckpointReader(model_path) as reader:
        engine = TorchForward.for_loading(cfg, EngramHasher.from_config(cfg, token_map).to(dev), experts_mxfp4=cuda,
                                          dense_fp8=cuda, deterministic=False)
        engine.load_weights((name, reader.get(name)) for name in reader.names())
    return engine


def make_case(engine, prefix: int, n: int, seed: int = 0):
    """(ids [N], layout, caches) of one request extending `n` tokens after `prefix` cached ones."""
    from sglang_dsv41.runtime.batch import make_layout
    from sglang_dsv41.runtime.cache import RuntimeCaches
    from sglang_dsv41.runtime.engram_history import host_history

    cfg, dev = engine.text, engine.weights["embed.weight"].device
    seq = prefix + n
    caches = RuntimeCaches.allocate(cfg, PAGE + seq + PAGE, 4, device=dev, page_size=PAGE)
    g = torch.Generator(device=dev).manual_seed(seed)
    for rows in (caches.packed(cfg.kv_source_layer_ids[0]).latent_rows, caches.packed(cfg.kv_source_layer_ids[0]).key_rows):
        rows.copy_(torch.randint(0, 120, rows.shape, generator=g, device=dev, dtype=torch.uint8))  # no NaN bytes
    table = torch.zeros(4, seq + PAGE, dtype=torch.int32, device=dev)
    table[1, :seq] = torch.arange(PAGE, PAGE + seq, dtype=torch.int32, device=dev)
    ids = torch.randint(3, 900, (seq,), generator=g, device=dev)
    history = host_history([ids.tolist()], [prefix], engine.hasher.history_len)
    layout = make_layout(torch.tensor([1], device=dev), torch.tensor([prefix], device=dev),
                         torch.tensor([n], device=dev), torch.arange(prefix, seq, device=dev),
                         table[1, prefix:seq].to(torch.int64), table, engram_history=history)
    return ids[prefix:], layout, caches


def kernel_table(prof) -> tuple[float, int, list[tuple[str, float, int]]]:
    per: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None)
        if us is None:
            us = getattr(e, "self_cuda_time_total", 0.0)
        if us > 0 and e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.key][0] += float(us)
            per[e.key][1] += int(e.count)
    busy = sum(v[0] for v in per.values())
    top = sorted(((k, v[0] / 1e3, v[1]) for k, v in per.items()), key=lambda x: -x[1])[:12]
    return busy / 1e3, sum(v[1] for v in per.values()), top


def run_case(engine, prefix: int, n: int, reps: int, cprofile: bool = False) -> dict:
    ids, layout, caches = make_case(engine, prefix, n)
    sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
    fwd = lambda: engine.hidden_states(ids, layout, caches)  # noqa: E731
    sync()
    t0 = time.perf_counter()
    fwd()
    sync()
    first = (time.perf_counter() - t0) * 1e3
    walls, hosts = [], []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fwd()
        hosts.append((time.perf_counter() - t0) * 1e3)
        sync()
        walls.append((time.perf_counter() - t0) * 1e3)
    watch = OpWatch(ids.device.type)
    with watch:
        fwd()
    sync()
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if ids.is_cuda else [])
    with torch.profiler.profile(activities=acts) as prof:
        fwd()
        sync()
    busy, launches, top = kernel_table(prof)
    extra = {"host_profile": host_profile(fwd, sync)} if cprofile else {}
    return {**extra, "prefix": prefix, "new_tokens": n, "first_ms": round(first, 2),
            "wall_ms": round(statistics.median(walls), 2), "walls_ms": [round(w, 2) for w in walls],
            "host_ms": round(statistics.median(hosts), 2), "gpu_busy_ms": round(busy, 2), "launches": launches,
            "aten_ops": watch.ops, "host_syncs": sum(watch.syncs.values()), "host_sync_sites": dict(watch.syncs),
            "aten_ops_by_file": dict(watch.by_file.most_common(15)),
            "top_kernels": [{"name": k[:90], "ms": round(ms, 3), "count": c} for k, ms, c in top]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--prefixes", type=int, nargs="+", default=[0, 1024, 8192, 32768])
    p.add_argument("--new-tokens", type=int, nargs="+", default=[32])
    p.add_argument("--chunk", type=int, nargs=2, metavar=("PREFIX", "N"), default=[24576, 8192],
                   help="one more case: a cold chunk (default the 4th 8K chunk of a 32K prompt); N 0 = none")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--topk-variants", action="store_true")
    p.add_argument("--cprofile", action="store_true", help="one more forward per case under cProfile (host_profile)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--device", default="cuda", help="cuda (the measurement) or cpu (a smoke run of the script)")
    a = p.parse_args()
    dev = torch.device(a.device)
    engine = build_engine(a.model_path, dev)
    cases = [(L, n) for n in a.new_tokens for L in a.prefixes]
    if a.chunk[1]:
        cases.append(tuple(a.chunk))
    rows: list[dict] = []
    result = {"model_path": a.model_path, "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "cases": rows}
    for L, n in cases:
        rows.append(run_case(engine, L, n, a.reps, a.cprofile))
        r = rows[-1]
        print(f"prefix {L:6d} new {n:5d}: first {r['first_ms']:9.1f} ms  wall {r['wall_ms']:8.2f} ms  host "
              f"{r['host_ms']:8.2f} ms  gpu busy {r['gpu_busy_ms']:8.2f} ms  launches {r['launches']:5d}  "
              f"aten ops {r['aten_ops']:5d}  host syncs {r['host_syncs']}", flush=True)
        if a.cprofile:
            print("\n".join(summary_lines(r["host_profile"])))
        a.out.write_text(json.dumps(result, indent=1))
    if a.topk_variants:
        L = max(a.prefixes)
        os.environ["SGLANG_DSV41_INDEXER_TOPK"] = "torch"
        r = run_case(engine, L, a.new_tokens[0], a.reps)
        os.environ.pop("SGLANG_DSV41_INDEXER_TOPK")
        r["variant"] = "SGLANG_DSV41_INDEXER_TOPK=torch"
        rows.append(r)
        print(f"  topk=torch prefix {L}: wall {r['wall_ms']:.2f} ms gpu busy {r['gpu_busy_ms']:.2f} ms", flush=True)
    n0 = a.new_tokens[0]
    hits = {r["prefix"]: r for r in rows if r["new_tokens"] == n0 and "variant" not in r}
    if len(hits) >= 2:
        lo, hi = hits[min(hits)], hits[max(hits)]
        span = (max(hits) - min(hits)) / 1024
        result["per_1k_prefix_ms"] = {"wall": round((hi["wall_ms"] - lo["wall_ms"]) / span, 3),
                                      "gpu_busy": round((hi["gpu_busy_ms"] - lo["gpu_busy_ms"]) / span, 3)}
        print("per 1K prefix tokens at N =", n0, result["per_1k_prefix_ms"])
        for k in hi["top_kernels"][:8]:
            print(f"  longest prefix: {k['ms']:8.3f} ms x{k['count']:4d} {k['name']}")
        print("  host syncs at the longest prefix:", hi["host_sync_sites"])
        print("  aten ops by file at the longest prefix:", hi["aten_ops_by_file"])
        last = [r for r in rows if r["new_tokens"] == n0 and "variant" not in r][-1]
        result["last_prefix_build_ms"] = round(last["first_ms"] - last["wall_ms"], 2)
        print(f"first − wall of the last N = {n0} case (prefix {last['prefix']}; ≈ 0 when its "
              f"kernel builds exist already): {result['last_prefix_build_ms']} ms")
    a.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The Engram row gather from host tables (pinned, read through UVA) against device tables (CUDA only).

For each token count T (decode batches and prefill chunks) the lookup of one Flash Engram layer
gathers T·ROWS_PER_TOKEN rows (n-gram orders 2..max × heads: 3 × 8 = 24 at Flash) of 256 E4M3 bytes
+ 8 scale bytes from a table of `--rows` rows, with uniformly random ids (what hashed n-grams give).
It times `kernels.engram_gather.engram_gather` on

* `device`: the table in GPU memory;
* `host`: the same bytes in a `HostEngramTable` (anonymous mmap, huge pages requested, registered
  mapped + portable) read through UVA;
* `host_sorted`: the same with `sorted_reads` (ascending row order, plus one `torch.sort`),

each as a CUDA graph of one call, replayed, timed with CUDA events (median of `--reps`, the device's L2
flushed before each replay), after checking that host and device give the same bits. It writes
`engram_gather.json` (+ PNG) with µs per call, µs per row and the host/device ratio per T.

    python benchmarks/engram_gather.py [--tokens 1 16 64 256 1024 8192] [--rows 4194304] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
from pathlib import Path

import torch

ROWS_PER_TOKEN = 24          # Flash: n-gram orders 2, 3, 4 × 8 heads (presets.flash_config_dict)
HEAD_DIM = 256               # Flash `engram_head_dim`: E4M3 bytes per row
TOKENS = (1, 16, 64, 256, 1024, 8192)
L2_FLUSH_BYTES = 256 << 20
METHODS = ("device", "host", "host_sorted")


def make_tables(rows: int, device: torch.device):
    """(values E4M3 [rows, 256], scales UE8M0 [rows, 8]) on `device`: finite random codes."""
    g = torch.Generator(device=device).manual_seed(0)
    codes = torch.randint(0, 0x7F, (rows, HEAD_DIM), generator=g, device=device, dtype=torch.uint8)
    signs = torch.randint(0, 2, (rows, HEAD_DIM), generator=g, device=device, dtype=torch.uint8) << 7
    values = (codes | signs).view(torch.float8_e4m3fn)
    scales = torch.randint(120, 134, (rows, HEAD_DIM // 32), generator=g, device=device,
                           dtype=torch.uint8).view(torch.float8_e8m0fnu)
    return values, scales


def graph_time_us(fn, reps: int, flush: torch.Tensor) -> float:
    """Median µs of one replay of `fn` captured in a CUDA graph, L2 flushed before each replay."""
    fn()                                          # compile and warm outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(reps):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def run(tokens: list[int], rows: int, reps: int) -> dict:
    from sglang_dsv41.kernels.engram_gather import engram_gather
    from sglang_dsv41.runtime.engram_host import HostEngramTable

    dev = torch.device("cuda", torch.cuda.current_device())
    values, scales = make_tables(rows, dev)
    host = {"host": HostEngramTable.copy_of(values.cpu(), scales.cpu(), dev),
            "host_sorted": HostEngramTable.copy_of(values.cpu(), scales.cpu(), dev, sorted_reads=True)}
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=dev)
    g = torch.Generator(device=dev).manual_seed(1)
    out = []
    for T in tokens:
        ids = torch.randint(0, rows, (T, ROWS_PER_TOKEN), generator=g, device=dev)
        calls = {"device": lambda: engram_gather(values, scales, ids),
                 **{name: (lambda t=t: t[ids]) for name, t in host.items()}}
        want = calls["device"]().view(torch.int32)
        same = {name: bool(torch.equal(calls[name]().reshape(want.shape[0], -1).view(torch.int32), want))
                for name in host}
        us = {name: graph_time_us(fn, reps, flush) for name, fn in calls.items()}
        n = T * ROWS_PER_TOKEN
        row = dict(tokens=T, rows_read=n, bytes_read=n * (HEAD_DIM + HEAD_DIM // 32), us=us,
                   us_per_row={k: v / n for k, v in us.items()},
                   host_over_device={k: us[k] / us["device"] for k in host}, same_bits_as_device=same)
        print(f"T={T:5d} rows={n:7d}: " + "  ".join(f"{k} {v:8.1f} µs" for k, v in us.items())
              + f"  | host/device {row['host_over_device']['host']:.2f}× same={all(same.values())}", flush=True)
        out.append(row)
    return dict(device=torch.cuda.get_device_name(dev), host=platform.node(), table_rows=rows,
                rows_per_token=ROWS_PER_TOKEN, head_dim=HEAD_DIM, reps=reps,
                huge_pages_requested={k: t.huge_pages_requested for k, t in host.items()}, rows_by_tokens=out)


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows_by_tokens"]
    fig, ax = plt.subplots(figsize=(7, 4))
    for m in METHODS:
        ax.plot([r["tokens"] for r in rows], [r["us"][m] for r in rows], marker="o", label=m)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(f"tokens (× {result['rows_per_token']} rows of {result['head_dim']} B)")
    ax.set_ylabel("µs per gather (graph replay)")
    ax.set_title(f"Engram gather, {result['table_rows']:,}-row table — {result['device']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    ap.add_argument("--rows", type=int, default=1 << 22, help="table rows (default 4M: 1.1 GB)")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("engram_gather benchmark: needs a CUDA device")
    result = run(args.tokens, args.rows, args.reps)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "engram_gather.json").write_text(json.dumps(result, indent=1))
    plot(result, args.out / "engram_gather.png")
    print(f"wrote {args.out / 'engram_gather.json'}")


if __name__ == "__main__":
    main()

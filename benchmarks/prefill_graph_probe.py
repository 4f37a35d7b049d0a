"""What a prefill CUDA graph would save on one extend: the static extend forward captured and replayed
against the eager forward, without a server (docs/prefill_graphs.md "GPU experiment").

The tiny checkpoint's forward as the CUDA server builds it (`hit_extend.build_engine`: serving mode),
on `hit_extend.make_case`'s stand-alone caches (one request at row 1, prefix L tokens of random
packed rows, N new tokens). Per case (L, N, bucket):

* eager: `wall_ms` / `host_ms` (median of REPS) of the eager extend forward (checked `make_layout`);
* graph: the same extend through `batch.static_extend_layout`, padded to `bucket` tokens the way
  SGLang's prefill runners pad (tail: id 0, position 0, slot 0) with `--sentinels` zero-length
  request slots after the request (the `full` runner's unused slots), `hidden_states` captured in one
  `torch.cuda.CUDAGraph` on static input buffers (two warm-ups on scratch cache copies first);
  `capture_s`, then `replay_wall_ms` / `replay_host_ms` (inputs copied into the buffers + replay)
  and `replay_gpu_ms` (torch.profiler: the replay's kernels);
* agreement: the LM head applied eagerly to both paths' live rows (as SGLang's eager logits tail
  would) after each path's first run on its own fresh copy of the caches: `max_abs_dlogit`,
  `bits_equal`, `greedy_equal` (argmax of every live row).

The req_to_token width (`--table-width`, the server's context length) is the static indexer width:
the static layout scores every column of it (docs/prefill_graphs.md "Costs").
A failed capture is recorded (`capture_error`) and the next case runs.

  python benchmarks/prefill_graph_probe.py --model-path /tmp/tiny --out /tmp/out/prefill_graph.json
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hit_extend import PAGE, build_engine, kernel_table, make_case  # noqa: E402


def _timed(fn, reps: int) -> tuple[float, float]:
    """(median wall ms, median host ms) of `fn`, synchronised before and after each call."""
    walls, hosts = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        hosts.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - t0) * 1e3)
    return round(statistics.median(walls), 3), round(statistics.median(hosts), 3)


def run_case(engine, prefix: int, n: int, bucket: int, width: int, reps: int, sentinels: int) -> dict:
    from sglang_dsv41.runtime.batch import static_extend_layout

    ids, layout, caches = make_case(engine, prefix, n)
    dev = ids.device
    table = torch.zeros(layout.req_to_token.shape[0], max(width, layout.req_to_token.shape[1]), dtype=torch.int32,
                        device=dev)
    table[:, :layout.req_to_token.shape[1]] = layout.req_to_token
    layout = dataclasses.replace(layout, req_to_token=table)
    row = {"prefix": prefix, "new_tokens": n, "bucket": bucket, "sentinels": sentinels, "table_width": table.shape[1]}

    eager_caches = copy.deepcopy(caches)
    eager = lambda: engine.hidden_states(ids, layout, eager_caches)  # noqa: E731
    want = engine.logits(eager()[:n])                # the case's extend once, on fresh caches
    row["eager_wall_ms"], row["eager_host_ms"] = _timed(eager, reps)

    pad = bucket - n
    z = torch.zeros(pad, dtype=torch.int64, device=dev)
    e = torch.zeros(sentinels, dtype=torch.int64, device=dev)          # unused request slots: row 0, length 0
    history = layout.engram_history
    live = {"input_ids": torch.cat([ids.to(torch.int64), z]), "positions": torch.cat([layout.positions, z]),
            "out_slots": torch.cat([layout.out_slots, z]), "req_rows": torch.cat([layout.req_rows, e]),
            "seq_lens": torch.cat([layout.seq_lens, e]), "extend_lens": torch.cat([layout.extend_lens, e]),
            "history": torch.cat([history, history.new_full((sentinels, history.shape[1]), -1)])}
    buf = {k: v.clone() for k, v in live.items()}

    def static_forward(c):
        lay = static_extend_layout(buf["req_rows"], buf["seq_lens"], buf["extend_lens"], buf["positions"],
                                   buf["out_slots"], table, engram_history=buf["history"])
        return engine.hidden_states(buf["input_ids"], lay, c)

    graph_caches = copy.deepcopy(caches)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    t0 = time.perf_counter()
    try:
        with torch.cuda.stream(side):
            for _ in range(2):
                static_forward(copy.deepcopy(caches))
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = static_forward(graph_caches)
        torch.cuda.synchronize()
    except Exception as e:   # noqa: BLE001 — recorded, the next case runs
        row["capture_error"] = f"{type(e).__name__}: {str(e)[:400]}"
        return row
    row["capture_s"] = round(time.perf_counter() - t0, 2)

    def replay():
        for k, v in live.items():
            buf[k].copy_(v)
        graph.replay()

    replay()                                         # the first replay = the case's extend, on graph_caches
    torch.cuda.synchronize()
    got = engine.logits(out[:n])
    d = (got - want).abs().max().item()
    row.update(max_abs_dlogit=round(d, 6), bits_equal=bool(torch.equal(got, want)),
               greedy_equal=bool(torch.equal(got.argmax(-1), want.argmax(-1))))
    row["replay_wall_ms"], row["replay_host_ms"] = _timed(replay, reps)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        replay()
        torch.cuda.synchronize()
    row["replay_gpu_ms"], row["replay_launches"], _ = kernel_table(prof)
    row["saved_ms"] = round(row["eager_wall_ms"] - row["replay_wall_ms"], 3)
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--cases", type=int, nargs=3, action="append", metavar=("PREFIX", "N", "BUCKET"),
                   help="default: (0, 32, 32) (0, 32, 64) (8192, 32, 32) (32768, 32, 32) (0, 256, 256)")
    p.add_argument("--table-width", type=int, default=65536, help="req_to_token width (the context length)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--sentinels", type=int, default=2,
                   help="zero-length request slots after the live request (the full runner's unused slots)")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    cases = a.cases or [(0, 32, 32), (0, 32, 64), (8192, 32, 32), (32768, 32, 32), (0, 256, 256)]
    engine = build_engine(a.model_path, torch.device("cuda"))
    rows: list[dict] = []
    result = {"model_path": a.model_path, "device": torch.cuda.get_device_name(), "page": PAGE, "cases": rows}
    for L, n, bucket in cases:
        if bucket < n:
            raise SystemExit(f"bucket {bucket} < {n} new tokens")
        rows.append(run_case(engine, L, n, bucket, a.table_width, a.reps, a.sentinels))
        r = rows[-1]
        if "capture_error" in r:
            print(f"prefix {L} new {n} bucket {bucket}: CAPTURE FAILED {r['capture_error']}", flush=True)
        else:
            print(f"prefix {L:6d} new {n:4d} bucket {bucket:4d}: eager wall {r['eager_wall_ms']:8.2f} host "
                  f"{r['eager_host_ms']:8.2f} | replay wall {r['replay_wall_ms']:7.2f} host {r['replay_host_ms']:6.2f} "
                  f"gpu {r['replay_gpu_ms']:6.2f} ms | max|Δlogit| {r['max_abs_dlogit']:.3g} bits "
                  f"{r['bits_equal']} greedy {r['greedy_equal']} | capture {r['capture_s']} s", flush=True)
        a.out.write_text(json.dumps(result, indent=1))
    ok = all("capture_error" not in r and r["greedy_equal"] for r in rows)
    result["pass"] = ok
    a.out.write_text(json.dumps(result, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

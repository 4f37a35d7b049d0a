"""Decode tokens/s of the runtime forward on CPU, batch 1, greedy (issue 13 item 5; docs/performance.md).

`python benchmarks/cpu_decode.py CHECKPOINT [--steps N] [--threads T] [--backend torch|exact]`
builds the forward the server builds (`runtime_scenarios.runtime_engine`: the stored tensors
checked and dequantised) on the chosen compute backend, prefills a 36-token prompt, then times
`--steps` single-token decode forwards (layout, caches, hidden states and logits; no SGLang
scheduler) and prints one JSON line.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from runtime_scenarios import Slots, allocate_caches, run_batch, runtime_engine  # noqa: E402

from sglang_dsv41.runtime.forward import TorchForward  # noqa: E402

PROMPT = [0] + list(range(5, 40))


def decode_rate(checkpoint: Path, steps: int, backend: str) -> dict:
    """{backend, steps, prefill_s, decode_s, tokens_per_s} of one greedy request."""
    cpu = torch.device("cpu")
    built = runtime_engine(checkpoint, cpu)
    engine = TorchForward(built.cfg, built.weights, built.hasher, deterministic=backend == "exact")
    slots = Slots(cpu, rows=2, max_context=len(PROMPT) + steps + 1)
    caches = allocate_caches(engine, slots)
    t0 = time.perf_counter()
    token = int(torch.argmax(run_batch(engine, caches, slots, [(1, 0, PROMPT)])[0][-1]))
    t1 = time.perf_counter()
    for i in range(steps):
        token = int(torch.argmax(run_batch(engine, caches, slots, [(1, len(PROMPT) + i, [token])])[0][-1]))
    t2 = time.perf_counter()
    return {"backend": engine.backend.name, "steps": steps, "prefill_s": round(t1 - t0, 3),
            "decode_s": round(t2 - t1, 3), "tokens_per_s": round(steps / (t2 - t1), 2)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--backend", choices=("torch", "exact"), default="torch")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be ≥ 1")
    torch.set_num_threads(args.threads)
    print(json.dumps(dict(decode_rate(args.checkpoint, args.steps, args.backend), threads=args.threads)))


if __name__ == "__main__":
    main()

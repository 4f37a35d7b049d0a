"""Spawned gloo ranks for the CPU tensor-parallel tests (tests/test_runtime_tp*.py).

`run_tp(ckpt, tmp, size, scenario)` starts `size` processes (spawn), each builds the runtime
forward of `ckpt` with its `TensorParallel(rank, size)` shard and runs `scenario` — a
"module:function" name taking the engine and returning {name: logits}, importable in a fresh
process — and returns every rank's {held_experts, logits}. Every wait is capped."""
from __future__ import annotations

import datetime
import importlib
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sglang_dsv41.checkpoint.reader import CheckpointReader
from sglang_dsv41.config import DeepseekV41Config
from sglang_dsv41.engram_hash import EngramHasher, _load_fast_tokenizer, compressed_token_map
from sglang_dsv41.runtime.forward import TorchForward
from sglang_dsv41.runtime.tensor_parallel import TensorParallel, load_shard_weights

WORKER_TIMEOUT_S = 240


def stored_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    """Every stored tensor of `ckpt`, as SGLang hands them to `load_weights`."""
    with CheckpointReader(ckpt) as reader:
        return {name: reader.get(name) for name in reader.names()}


def engine_for(ckpt: Path, tp: TensorParallel) -> TorchForward:
    """The CPU runtime forward of `ckpt` holding `tp`'s shard (the server's loader, CPU)."""
    cfg = DeepseekV41Config.from_file(ckpt)
    weights = load_shard_weights(stored_tensors(ckpt), cfg, tp.plan(cfg.text))
    token_map, _ = compressed_token_map(_load_fast_tokenizer(ckpt))
    return TorchForward(cfg, weights, EngramHasher.from_config(cfg, token_map), tp=tp)


def _scenario(name: str):
    module, function = name.split(":")
    return getattr(importlib.import_module(module), function)


def _tp_worker(rank: int, size: int, ckpt: str, rendezvous: str, out_dir: str, scenario: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=WORKER_TIMEOUT_S))
    try:
        engine = engine_for(Path(ckpt), TensorParallel(rank, size))
        held = sorted({int(n.split(".")[4]) for n in engine.weights if ".ffn.experts." in n})
        torch.save({"held_experts": held, "logits": _scenario(scenario)(engine)}, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_tp(ckpt: Path, tmp: Path, size: int, scenario: str) -> list[dict[str, object]]:
    """Every rank's {held_experts, logits} of `scenario` at TP `size` (module docstring)."""
    ctx = mp.start_processes(_tp_worker, args=(size, str(ckpt), str(tmp / "rendezvous"), str(tmp), scenario),
                             nprocs=size, join=False, start_method="spawn")
    deadline = time.monotonic() + WORKER_TIMEOUT_S
    try:
        while not ctx.join(timeout=5):
            if time.monotonic() > deadline:
                raise TimeoutError(f"TP {size} workers did not finish within {WORKER_TIMEOUT_S} s")
    finally:
        for proc in ctx.processes:
            if proc.is_alive():
                proc.kill()
                proc.join(10)
    return [torch.load(tmp / f"rank{r}.pt") for r in range(size)]

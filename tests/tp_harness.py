"""Spawned tensor-parallel ranks for the TP tests (tests/test_runtime_tp*.py).

`run_tp(ckpt, tmp, size, scenario, *, backend="gloo", timeout_s=WORKER_TIMEOUT_S)` starts `size`
processes (`_start_method`), each builds SGLang's TP group (`init_sglang_tp`) and the runtime forward of `ckpt`
with its `TensorParallel.from_sglang()` shard and runs `scenario` — a "module:function" name taking the engine and returning {name:
value}, importable in a fresh process — and returns every rank's {held_experts, logits} (`logits`
= the scenario's dict, tensors moved to the CPU).

Backends:
* "gloo" (default): CPU ranks, the CPU engine (dequantised experts, the reference math);
* "nccl": rank r on `cuda:r` (`torch.cuda.set_device(r)` before `init_process_group`), the engine
  built as the server builds it (`runtime/model.py`: `TorchForward.for_loading` + streamed
  `load_weights` under `fp32_default_dtype()`, FP8 dense weights kept FP8, `EngramHasher(...).to(device)`), with
  SGLang's default NCCL environment (NVLink SHARP off, cuMem off, 8 device connections).
  Both are checked before anything is spawned (`TPHarnessError`).

Every wait is capped by `timeout_s` (also the process group's collective timeout). A rank that
raises writes its traceback to `rank{r}.error` and exits at once (no process-group teardown, which
can block on a peer stuck in a collective); the parent polls for those files, so a failure is
reported with the rank's exception text within seconds, and every straggler (e.g. a peer waiting
in an NCCL kernel for the rank that died) is killed. A timeout names each rank's last stage
(`report_stage`, written to `rank{r}.stage`)."""
from __future__ import annotations

import importlib
import os
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

from sglang_dsv41.checkpoint.reader import CheckpointReader
from sglang_dsv41.config import DeepseekV41Config
from sglang_dsv41.engram_hash import EngramHasher, _load_fast_tokenizer, compressed_token_map
from sglang_dsv41.runtime.cpu_env import NO_NCCL_LIBRARY
from sglang_dsv41.runtime.forward import TorchForward, fp32_default_dtype
from sglang_dsv41.runtime.moe_ops import RoutedExpertsMxfp4
from sglang_dsv41.runtime.tensor_parallel import TensorParallel

#: per run; generous: the CI machine is shared (TP 8 = 8 processes on 2 cores at load ~18 took > 240 s)
WORKER_TIMEOUT_S = 600
BACKENDS = ("gloo", "nccl")
POLL_S = 1.0
#: after the first rank's error file appears: time for the others to report theirs
ERROR_GRACE_S = 3.0
#: after every rank saved its result: time to tear the process group down before being killed
TEARDOWN_GRACE_S = 30.0
#: what SGLang 0.5.17's launcher sets for its NCCL groups unless the user did (`_set_envs_and_config`);
#: NVLink SHARP (multicast) must stay off on shared machines anyway
NCCL_WORKER_ENV = {"NCCL_NVLS_ENABLE": "0", "NCCL_CUMEM_ENABLE": "0", "CUDA_DEVICE_MAX_CONNECTIONS": "8"}

CPU = torch.device("cpu")

_stage_file: Path | None = None
_checkpoint: Path | None = None


def worker_checkpoint() -> Path:
    """The checkpoint the `run_tp` worker calling this loaded (for scenarios that need the reference)."""
    if _checkpoint is None:
        raise RuntimeError("worker_checkpoint() outside a run_tp worker")
    return _checkpoint


class TPHarnessError(ValueError):
    """A `run_tp` request that cannot run here (checked before spawning)."""


def stored_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    """Every stored tensor of `ckpt`, as SGLang hands them to `load_weights`."""
    with CheckpointReader(ckpt) as reader:
        return {name: reader.get(name) for name in reader.names()}


def engine_for(ckpt: Path, tp: TensorParallel, device: torch.device = CPU, *,
               engram_placement: str = "device") -> TorchForward:
    """The runtime forward of `ckpt` holding `tp`'s shard on `device`, loaded as the server
    loads it (`TorchForward.for_loading` + streamed `load_weights`): CPU → dequantised weights
    (the reference path); CUDA → routed experts MXFP4 and FP8 dense weights kept FP8, under fp32
    default dtype, the Engram hasher on the device; `engram_placement` "host" keeps the Engram
    rows in host memory (`runtime/engram_host.py`)."""
    if device.type not in ("cpu", "cuda"):
        raise TPHarnessError(f"engine_for: no runtime for device {device}")
    cfg = DeepseekV41Config.from_file(ckpt)
    token_map, _ = compressed_token_map(_load_fast_tokenizer(ckpt))
    on_cuda = device.type == "cuda"
    with fp32_default_dtype(), torch.device(device):
        engine = TorchForward.for_loading(cfg, EngramHasher.from_config(cfg, token_map).to(device), tp=tp,
                                          experts_mxfp4=on_cuda, dense_fp8=on_cuda, engram_placement=engram_placement)
        engine.load_weights(stored_tensors(ckpt).items())
    return engine


def held_experts(engine: TorchForward) -> list[int]:
    """Routed expert ids the engine holds: dequantised per-expert tensors (CPU) or the prepared
    MXFP4 layers' `expert_ids` (CUDA: no per-expert keys)."""
    held: set[int] = set()
    for name, value in engine.weights.items():
        if isinstance(value, RoutedExpertsMxfp4):
            held.update(value.expert_ids)
        elif ".ffn.experts." in name:
            held.add(int(name.split(".")[4]))
    return sorted(held)


def report_stage(stage: str) -> None:
    """Record this rank's progress (named in a timeout report); a no-op outside `run_tp` workers."""
    if _stage_file is not None:
        _stage_file.write_text(f"{stage} (at {time.strftime('%H:%M:%S')})")


def check_request(size: int, backend: str, timeout_s: float) -> None:
    """Raise `TPHarnessError` for a request this machine cannot run (nothing spawned yet)."""
    if backend not in BACKENDS:
        raise TPHarnessError(f"backend {backend!r} is not one of {BACKENDS}")
    if size < 1:
        raise TPHarnessError(f"TP size {size} < 1")
    if not timeout_s > 0:
        raise TPHarnessError(f"timeout_s must be positive, got {timeout_s}")
    if backend == "nccl":
        if not dist.is_nccl_available():
            raise TPHarnessError("backend 'nccl': this torch build has no NCCL")
        found = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if found < size:
            raise TPHarnessError(f"backend 'nccl' runs rank r on cuda:r: TP {size} needs {size} CUDA devices, "
                                 f"found {found}")


def init_sglang_tp(rank: int, size: int, init_method: str, backend: str, timeout_s: float) -> None:
    """SGLang's distributed environment and TP group of `size` ranks, as its scheduler builds them
    (`init_distributed_environment` + `initialize_model_parallel`): the runtime's collectives then
    go through `tensor_model_parallel_all_reduce` / `_all_gather` (gloo on CPU; pynccl and custom
    all-reduce on CUDA)."""
    from sglang.srt.distributed.parallel_state import (init_distributed_environment, initialize_model_parallel,
                                                       set_custom_all_reduce)

    set_custom_all_reduce(backend == "nccl")       # custom all-reduce is CUDA-only (the CPU server fails it)
    init_distributed_environment(world_size=size, rank=rank, distributed_init_method=init_method, local_rank=rank,
                                 backend=backend, timeout=int(timeout_s))
    initialize_model_parallel(tensor_model_parallel_size=size)


def _scenario(name: str):
    module, function = name.split(":")
    return getattr(importlib.import_module(module), function)


def _on_cpu(value: object) -> object:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _on_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_on_cpu(v) for v in value)
    return value


def _tp_worker(rank: int, size: int, ckpt: str, rendezvous: str, out_dir: str, scenario: str, backend: str,
               timeout_s: float) -> None:
    global _stage_file, _checkpoint
    out = Path(out_dir)
    _checkpoint = Path(ckpt)
    _stage_file = out / f"rank{rank}.stage"
    torch.set_num_threads(1)
    try:
        report_stage("init_process_group")
        device = CPU
        if backend == "gloo":      # SGLang's CPU TP group: no PyNccl communicator (runtime/cpu_env.py)
            os.environ["SGLANG_NCCL_SO_PATH"] = NO_NCCL_LIBRARY
        if backend == "nccl":
            for key, value in NCCL_WORKER_ENV.items():
                os.environ.setdefault(key, value)
            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
            torch.backends.cuda.matmul.allow_tf32 = False     # the runtime refuses TF32 (runtime/model.py)
        init_sglang_tp(rank, size, f"file://{rendezvous}", backend, timeout_s)
        report_stage("engine")
        engine = engine_for(Path(ckpt), TensorParallel.from_sglang(), device)
        report_stage("scenario")
        result = {"held_experts": held_experts(engine), "logits": _on_cpu(_scenario(scenario)(engine))}
        partial = out / f"rank{rank}.pt.partial"
        torch.save(result, partial)
        partial.replace(out / f"rank{rank}.pt")
        report_stage("saved")
    except BaseException:   # noqa: BLE001 — reported to the parent, then a hard exit (module docstring)
        (out / f"rank{rank}.error").write_text(traceback.format_exc())
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    from sglang.srt.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

    destroy_model_parallel()
    destroy_distributed_environment()


def _read_all(tmp: Path, size: int, suffix: str) -> dict[int, str]:
    return {r: (tmp / f"rank{r}.{suffix}").read_text(errors="replace")
            for r in range(size) if (tmp / f"rank{r}.{suffix}").exists()}


def _failure(tmp: Path, size: int, backend: str, what: str, kind: type[Exception] = RuntimeError) -> Exception:
    """`kind` with `what`, each rank's last stage and the traceback of every rank that raised."""
    errors = _read_all(tmp, size, "error")
    stages = _read_all(tmp, size, "stage")
    lines = [f"TP {size} ({backend}) workers: {what}"]
    lines += [f"rank {r} last stage: {s}" for r, s in sorted(stages.items())]
    lines += [f"---- rank {r} raised:\n{text}" for r, text in sorted(errors.items())]
    return kind("\n".join(lines))


def _start_method(backend: str) -> str:
    """"forkserver" for CPU ranks: one server process imports this module (torch, SGLang: ~15 CPU-s)
    once per session and forks every rank from that clean state, instead of each spawned rank
    importing it again; CUDA ranks are spawned (nothing CUDA-initialised is ever forked)."""
    if backend != "gloo":
        return "spawn"
    mp.get_context("forkserver").set_forkserver_preload([__name__])    # read when the server starts
    return "forkserver"


def run_tp(ckpt: Path, tmp: Path, size: int, scenario: str, *, backend: str = "gloo",
           timeout_s: float = WORKER_TIMEOUT_S) -> list[dict[str, object]]:
    """Every rank's {held_experts, logits} of `scenario` at TP `size` (module docstring)."""
    check_request(size, backend, timeout_s)
    ctx = mp.start_processes(_tp_worker, args=(size, str(ckpt), str(tmp / "rendezvous"), str(tmp), scenario, backend,
                                               timeout_s),
                             nprocs=size, join=False, start_method=_start_method(backend))
    deadline = time.monotonic() + timeout_s
    saved_at: float | None = None
    try:
        while True:
            try:
                if ctx.join(timeout=POLL_S, grace_period=ERROR_GRACE_S):
                    break
            except ProcessException as e:
                raise _failure(tmp, size, backend, f"a rank exited: {e}") from None
            if _read_all(tmp, size, "error"):
                time.sleep(ERROR_GRACE_S)
                raise _failure(tmp, size, backend, "a rank raised")
            if all((tmp / f"rank{r}.pt").exists() for r in range(size)):
                saved_at = saved_at or time.monotonic()
                if time.monotonic() - saved_at > TEARDOWN_GRACE_S:      # results are in; killed below
                    stuck = [r for r, proc in enumerate(ctx.processes) if proc.is_alive()]
                    warnings.warn(f"TP {size} ({backend}): ranks {stuck} saved their results but did not exit "
                                  f"within {TEARDOWN_GRACE_S} s (process-group teardown); killed")
                    break
            if time.monotonic() > deadline:
                raise _failure(tmp, size, backend, f"did not finish within {timeout_s} s", TimeoutError)
    finally:
        for proc in ctx.processes:
            if proc.is_alive():
                proc.kill()
                proc.join(10)
    return [torch.load(tmp / f"rank{r}.pt") for r in range(size)]

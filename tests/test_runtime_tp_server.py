"""A real `sglang-dsv41 serve --tp-size 2` (issue 3: "TP2 == TP1").

* CPU (`slow`): SGLang's CPU engine at TP 2 (two scheduler ranks over gloo; one core per rank via
  `SGLANG_CPU_OMP_THREADS_BIND=0|1` — SGLang otherwise requires one NUMA node per rank; and
  `SGLANG_NCCL_SO_PATH` pointing at no file — torch here is a CUDA build, so 0.5.17 loads
  libnccl and builds a PyNccl communicator for the TP group on the CPU device, which raises
  "Expected a cuda device, but got: cpu"; without the library it is disabled) serves
  greedy tokens equal to `ReferenceModel.generate`: the CPU forward is bit-identical to TP 1,
  which is bit-identical to the reference (tests/test_runtime_tp.py, test_runtime_forward.py);
* CUDA (`gpu`, ≥ 2 devices): the TP-2 server's greedy tokens equal a TP-1 server's on the same
  prompts (the CUDA kernels are not bit-identical to the reference, so TP 1 on the same GPUs is
  the oracle; the sharded parts are per-head / per-expert and the collectives exact).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from server_helpers import Server
from sglang_dsv41.reference.model import ReferenceModel

NEW_TOKENS = 8
CPU_TP2_ENV = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1", "SGLANG_NCCL_SO_PATH": "/nonexistent/libnccl.so.2"}


def _prompts() -> list[list[int]]:
    out = []
    for seed, n in ((61, 13), (62, 29)):
        g = torch.Generator().manual_seed(seed)
        out.append([0] + torch.randint(3, 990, (n - 1,), generator=g).tolist())
    return out


def _served_tokens(checkpoint: Path, log: Path, tp: int, env: dict[str, str] | None) -> list[list[int]]:
    srv = Server(checkpoint, log, ["--tp-size", str(tp), "--max-total-tokens", "2048",
                                   "--max-running-requests", "4"], env=env)
    try:
        srv.wait_ready()
        return [srv.generate(p, NEW_TOKENS)["output_ids"] for p in _prompts()]
    finally:
        srv.stop()


@pytest.mark.slow
def test_cpu_tp2_server_greedy_equals_reference(tiny_checkpoint: Path, tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("the CPU-engine variant (the GPU machine runs the gpu variant)")
    got = _served_tokens(tiny_checkpoint, tmp_path / "tp2.log", 2, CPU_TP2_ENV)
    reference = ReferenceModel.from_checkpoint(tiny_checkpoint)
    assert got == [reference.generate(p, NEW_TOKENS) for p in _prompts()]


@pytest.mark.gpu
def test_gpu_tp2_server_greedy_equals_tp1_server(tiny_checkpoint: Path, tmp_path: Path) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA devices, found {torch.cuda.device_count()}")
    want = _served_tokens(tiny_checkpoint, tmp_path / "tp1.log", 1, None)
    got = _served_tokens(tiny_checkpoint, tmp_path / "tp2.log", 2, None)
    assert got == want

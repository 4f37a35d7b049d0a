"""benchmarks/decode_step_profile.py on CPU: the kernel aggregation and the no-GPU refusal (the
profile itself runs on the GPU machine)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from benchmark_loader import load_benchmark



@pytest.fixture(scope="module")
def prof():
    return load_benchmark("decode_step_profile.py")


def test_kernel_table_sums_device_time_of_cuda_kernels_only(prof) -> None:
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    events = [SimpleNamespace(key="gemm", count=3, self_device_time_total=30.0, device_type=cuda),
              SimpleNamespace(key="sinkhorn", count=20, self_device_time_total=40.0, device_type=cuda),
              SimpleNamespace(key="gemm", count=1, self_device_time_total=5.0, device_type=cuda),
              SimpleNamespace(key="aten::add", count=7, self_device_time_total=0.0, device_type=cpu),
              SimpleNamespace(key="memcpy", count=2, self_device_time_total=9.0, device_type=cpu)]
    table, launches = prof.kernel_table(events)
    assert table == {"gemm": 35.0, "sinkhorn": 40.0} and launches == 24


def test_refuses_without_a_gpu(prof) -> None:
    if torch.cuda.is_available():
        pytest.skip("checks the no-GPU refusal")
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        prof.main([])

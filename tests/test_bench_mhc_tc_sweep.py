"""`benchmarks/mhc_tc_sweep.py` on CPU (its timing needs CUDA): the first shape is the serving `tc` launch
(so `over_serving` compares against it), every shape is a launch the kernel takes, and without CUDA the
script refuses."""
from __future__ import annotations

import pytest
import torch

from benchmark_loader import load_benchmark
from sglang_dsv41.kernels import mhc as K

bench = load_benchmark("mhc_tc_sweep.py")


def test_first_shape_is_the_serving_launch() -> None:
    assert bench.SHAPES[0] == K.DOT_LAUNCHES["tc"][1:4]
    assert len(set(bench.SHAPES)) == len(bench.SHAPES)
    for bt, sub_k, warps in bench.SHAPES:
        assert bt & (bt - 1) == 0 and sub_k & (sub_k - 1) == 0 and warps in (4, 8, 16)
        assert K.DOT_LAUNCHES["tc"][0] % sub_k == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is CPU-only")
def test_refuses_without_cuda() -> None:
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        bench.main([])

"""`benchmarks/results_io.py`: the CUDA refusal names the benchmark; the result lands as indented JSON in a
made directory, and its path is returned and printed."""
from __future__ import annotations

import json

import pytest
import torch

from benchmark_loader import load_benchmark

io = load_benchmark("results_io.py")


def test_write_result_makes_the_directory(tmp_path, capsys) -> None:
    path = io.write_result(tmp_path / "a" / "b", "r.json", {"x": 1, "y": [2, 3]})
    assert path == tmp_path / "a" / "b" / "r.json" and json.loads(path.read_text()) == {"x": 1, "y": [2, 3]}
    assert f"wrote {path}" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is CPU-only")
def test_require_cuda_names_the_benchmark() -> None:
    with pytest.raises(SystemExit, match="^some_bench: needs a CUDA device$"):
        io.require_cuda("some_bench")

"""benchmarks/engram_gather.py on CPU: the random tables are finite Flash-shaped rows and the
benchmark refuses to run without CUDA (its timing is GPU-only)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import engram_gather as bench  # noqa: E402

from sglang_dsv41.checkpoint.codecs import dequantize_engram_rows  # noqa: E402


def test_tables_are_finite_flash_rows() -> None:
    values, scales = bench.make_tables(64, torch.device("cpu"))
    assert values.shape == (64, bench.HEAD_DIM) and values.dtype == torch.float8_e4m3fn
    assert scales.shape == (64, bench.HEAD_DIM // 32) and scales.dtype == torch.float8_e8m0fnu
    rows = dequantize_engram_rows(values, scales).float()
    assert bool(torch.isfinite(rows).all()) and bool((rows != 0).any()) and bool((rows < 0).any())


def test_refuses_without_cuda(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["engram_gather.py"])
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        bench.main()

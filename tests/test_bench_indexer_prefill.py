"""benchmarks/indexer_prefill.py on CPU: the case is one prefill chunk over packed keys whose BF16
decoding sits at the same slots, with causal visibility at ratio 2; no timing without CUDA."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import indexer_prefill as bench  # noqa: E402


def test_prefill_case_shapes_and_visibility() -> None:
    c = bench.prefill_case(64, torch.device("cpu"))
    assert c["q"].shape == (64, bench.HI, bench.DI) and c["w"].shape == (64, bench.HI)
    assert c["slots"].shape == (1, 32) and c["keys"].shape == (32, bench.DI) and c["packed"].num_entries == 32
    assert c["n_visible"].tolist() == [(t + 1) // 2 for t in range(64)] and not c["token_req"].any()


def test_refuses_without_cuda(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["indexer_prefill.py"])
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        bench.main()

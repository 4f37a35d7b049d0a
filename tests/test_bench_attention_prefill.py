"""benchmarks/attention_prefill.py on CPU: the case is the runtime's prefill launch (windows up to
each query, compressed rows among the visible entries) and the benchmark refuses to run without
CUDA (its timing is GPU-only)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import attention_prefill as bench  # noqa: E402


def test_case_windows_and_visible_selections() -> None:
    c = bench.make_case(300, torch.device("cpu"))
    assert c["q"].shape == (300, bench.HEADS, bench.HEAD_DIM) and c["workspace"].shape == (150, bench.HEAD_DIM)
    w = c["swa_slots"]
    assert w[0, -1] == 0 and (w[0, :-1] == -1).all() and w[299].tolist() == list(range(172, 300))
    cs = c["comp_slots"]
    assert cs.shape == (300, 150)                               # top-k capped by the 150 entries
    visible = (torch.arange(300) + 1) // bench.RATIO
    for t in (0, 1, 7, 299):
        chosen = cs[t][cs[t] >= 0]
        assert chosen.numel() == min(visible[t], 150) and (chosen < visible[t]).all()
        assert chosen.unique().numel() == chosen.numel()


def test_scale_ulps() -> None:
    ref = torch.tensor([[[1.0, 0.5]]])
    assert bench.scale_ulps(ref.to(torch.bfloat16), ref) == 0.0
    assert bench.scale_ulps(ref + torch.tensor([0.0, 2.0 ** -7]), ref) == 1.0


def test_refuses_without_cuda(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["attention_prefill.py"])
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        bench.main()


def test_candidates_include_both_layouts() -> None:
    """The keys layout as served, its P·V variants, and every heads-layout configuration (not launched here)."""
    names = set(bench.candidates(bench.make_case(64, torch.device("cpu"))))
    assert {"bf16", "wide", "wide_pv_bf16", "wide_fp16_rows"} <= names
    assert set(bench.HEADS_CONFIGS) <= names and "heads" in bench.HEADS_CONFIGS

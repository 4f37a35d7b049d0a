"""benchmarks/attention_decode.py without a GPU: its case, oracle and ulp measure, its candidates and plot."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import attention_decode as ad  # noqa: E402


def test_case_shapes_and_slots():
    c = ad.decode_case(2, torch.device("cpu"), seed=0)
    assert c["q"].shape == (2, ad.HEADS, ad.HEAD_DIM) and c["q"].dtype == torch.bfloat16
    assert c["swa_slots"].shape == (2, ad.WINDOW) and c["comp_slots"].shape == (2, ad.TOPK)
    assert c["swa_slots"].dtype == c["comp_slots"].dtype == torch.int32
    assert int(c["swa_slots"].min()) >= 1 and int((c["comp_slots"] == -1).sum()) > 0     # slot 0 unused; holes
    assert len(set(c["swa_slots"].flatten().tolist())) == 2 * ad.WINDOW                   # distinct requests


def test_oracle_and_ulps():
    """The oracle is a sink softmax over both lists; one BF16 ulp of the output scale measures 1.0."""
    c = ad.decode_case(1, torch.device("cpu"), seed=1)
    ref = ad.oracle(c, ad.HEAD_DIM ** -0.5)
    assert ref.shape == (1, ad.HEADS, ad.HEAD_DIM) and torch.isfinite(ref).all()
    c2 = dict(c, sink=torch.full_like(c["sink"], float("-inf")))
    weights_sum_to_one = ad.oracle(dict(c2, swa_cache=torch.ones_like(c["swa_cache"]),
                                        comp_cache=torch.ones_like(c["comp_cache"])), 1.0)
    assert torch.allclose(weights_sum_to_one, torch.ones_like(weights_sum_to_one))
    assert ad.ulps_over(ref.to(torch.bfloat16), ref) <= 0.5 + 1e-9
    scale = ref.abs().amax(dim=-1, keepdim=True)
    one_ulp = torch.exp2(torch.floor(torch.log2(scale)) - 7)
    assert ad.ulps_over(ref + one_ulp, ref) == pytest.approx(1.0)


def test_candidates_name_the_plan_and_the_sweep():
    got = ad.candidates(8, [1, 2, 10], sm_count=132)
    assert list(got)[:2] == ["decode", "wide"] and got["wide"][1] == 10
    assert set(got) == {"decode", "wide", "wide_s1", "wide_s2"}          # 10 is the plan: not twice


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")          # an optional extra: the CI host has none
    rows = [dict(n=n, decode=dict(splits=1, graph_us=10.0 * n, l2_flushed_us=12.0 * n),
                 wide=dict(splits=2, graph_us=5.0 * n, l2_flushed_us=6.0 * n), wide_s1=dict(splits=1, ulps_vs_oracle=3.0))
            for n in (1, 8)]
    ad.plot(dict(device="cpu", rows=rows), tmp_path / "a.png")
    assert (tmp_path / "a.png").stat().st_size > 1000
    json.dumps(rows)

"""CPU checks of benchmarks/topk_kernels.py (the timing needs the GPU: scripts/gpu/topk_kernels.sh):
the cases cover the issue's shapes, causal lengths, the scores' −∞ tail, the agreement measure, the
raw SGLang calls' arguments (on tests/fake_sglang_topk.py), the plot, arguments, no CUDA → refusal."""
from __future__ import annotations

import math

import pytest
import torch

from benchmark_loader import load_benchmark
from fake_sglang_topk import FakeTopk

bench = load_benchmark("topk_kernels.py")
INF = math.inf


def test_cases_cover_decode_hit_and_prefill() -> None:
    shapes = {(g, n, e, c) for g, n, e, c in bench.CASES}
    assert {("decode", n, e, False) for n in (1, 8, 64) for e in (8192, 32768, 65536)} <= shapes
    assert {("hit", 32, 16384, True), ("hit", 32, 32768, True)} <= shapes
    assert {("prefill", 8192, 4096, True), ("prefill", 8192, 16384, True)} <= shapes
    assert {("long", 1, 1 << 20, False), ("long", 64, 1 << 18, False)} <= shapes
    assert bench.parse_args(["--out", "x"]).cases == ["decode", "hit", "prefill"]
    assert bench.K == 512 and set(bench.METHODS) == {"ours", "ours_torch", "ours_bisect", "ours_radix_w4", "ours_radix_w16",
                                                       "ours_split", "sglang_v1", "sglang_v2", "raw_v1", "raw_v2"}


def test_lengths_and_scores() -> None:
    assert bench.lengths(3, 100, False).tolist() == [100, 100, 100]
    lens = bench.lengths(8192, 4096, True)
    assert lens[0] == 2048 and lens[-1] == 4096 and bool((lens[1:] >= lens[:-1]).all())
    assert bench.lengths(10, 2, True).tolist() == [0, 0, 0, 0, 0, 1, 1, 1, 1, 2]
    lens = torch.tensor([0, 3, 5])
    s = bench.make_scores(3, 5, lens, "bf16", torch.Generator().manual_seed(0))
    finite = s > -INF
    assert finite.sum(1).tolist() == [0, 3, 5] and bool(finite[1, :3].all())
    assert torch.equal(s[finite], s[finite].to(torch.bfloat16).float())


def test_agreement_exact_ties_and_misses() -> None:
    s = torch.tensor([[5.0, 1.0, 1.0, 0.0], [3.0, 2.0, 1.0, 0.0], [1.0, -INF, -INF, -INF]])
    ours = torch.tensor([[0, 1], [0, 1], [0, -1]])
    other = torch.tensor([[0, 2], [0, 2], [0, -1]])         # row 0: a tie swapped; row 1: a worse column
    a = bench.agreement(s, ours, other)
    assert a == dict(exact_rows=1 / 3, equal_up_to_ties_rows=2 / 3, worst_row_columns_not_in_ours=1)
    assert bench.agreement(s, ours, ours)["exact_rows"] == 1.0


def test_raw_calls_pass_sglang_valid_arguments() -> None:
    from sglang_dsv41.kernels import indexer_select as IX
    from sglang_dsv41.kernels import topk_sglang as TS

    lens = bench.lengths(6, 1030, True)
    s = bench.make_scores(6, 1030, lens, "fp32", torch.Generator().manual_seed(1))
    fake = FakeTopk()
    calls = bench.method_calls(TS, IX, fake, s, lens)
    assert set(calls) == set(bench.METHODS)
    for name in ("raw_v1", "raw_v2"):
        calls[name]()
    assert fake.calls == [("v1", 512), ("v2", 512)]
    assert calls["ours"]().shape == (6, 512)
    with pytest.raises(TS.SglangTopkUnavailable, match="needs CUDA"):
        calls["sglang_v2"]()


def test_plot(tmp_path) -> None:
    row = dict(group="decode", rows=1, width=8192) | {m: dict(median_us=10.0 + i) for i, m in enumerate(bench.METHODS)}
    doc = dict(k=512, device="cpu", dist="bf16", rows=[row, dict(row, width=65536, raw_v2=dict(error="x"))])
    drew = bench.plot(doc, tmp_path / "p.png")
    assert drew == (tmp_path / "p.png").exists()
    assert drew or bench.pyplot() is None


def test_arguments_and_cuda_refusal(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    a = bench.parse_args(["--out", str(tmp_path)])
    assert (a.cases, a.dist, a.cap_s, a.budget_s) == (["decode", "hit", "prefill"], "bf16", 0.3, 240.0)
    assert bench.parse_args(["--out", "x", "--cases", "hit", "--dist", "fp32"]).cases == ["hit"]
    with pytest.raises(SystemExit):
        bench.parse_args(["--out", "x", "--cases", "nope"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs CUDA"):
        bench.main(["--out", str(tmp_path)])


def test_a_case_row_on_the_cpu_with_the_fake(monkeypatch: pytest.MonkeyPatch) -> None:
    """`run_case` end to end on CPU tensors: the SGLang wrappers on the fake module (ties → the fake's
    torch.topk picks may differ from ours, so BF16 scores agree up to ties), every method timed."""
    from sglang_dsv41.kernels import indexer_select as IX
    from sglang_dsv41.kernels import topk_sglang as TS

    fake = FakeTopk()
    monkeypatch.setattr(IX.TS, "select_topk_fused",                 # the Triton kernel needs CUDA
                        lambda s, k, *, radix=None, num_warps=None: IX.select_topk(s, k, method="torch"))
    monkeypatch.setattr(IX.TSPLIT, "select_topk_split", lambda s, k: IX.select_topk(s, k, method="torch"))
    monkeypatch.setattr(TS, "select_topk_sglang", lambda s, k, *, variant=None, valid_lengths=None, check_nan=True:
                        TS.topk_with_module(fake, s, k, valid_lengths=valid_lengths, variant=variant))
    errors, skipped = [], []
    gen = torch.Generator().manual_seed(0)
    row = bench.run_case(TS, IX, fake, ("hit", 32, 2000, True), "bf16", gen, 0.01, errors, skipped, 1e18)
    assert errors == [] and skipped == []
    assert (row["rows"], row["width"], row["causal"], row["ours_method"]) == (32, 2000, True, "torch")
    assert all(row[m]["median_us"] > 0 and row[m]["first_ms"] > 0 for m in bench.METHODS)
    for v in ("sglang_v1", "sglang_v2"):
        assert row[v]["agreement"]["equal_up_to_ties_rows"] == 1.0 and row[v]["over_ours"] > 0
    assert all(row[m]["agreement"]["exact_rows"] == 1.0
               for m in ("ours_bisect", "ours_radix_w4", "ours_radix_w16", "ours_split"))
    line = bench.case_line(row)
    assert line.startswith("hit N=32 E=2000: ours ") and "sglang_v2 agree " in line
    late = bench.run_case(TS, IX, fake, ("decode", 1, 100, False), "fp32", gen, 0.01, errors, skipped, 0.0)
    assert all(set(late[m]) == {"skipped"} for m in bench.METHODS) and len(skipped) == len(bench.METHODS)
    assert "agreement" not in late["sglang_v1"] and bench.case_line(late).endswith("raw_v2 skipped")


def test_methods_subset_needs_no_sglang_module() -> None:
    from sglang_dsv41.kernels import indexer_select as IX
    from sglang_dsv41.kernels import topk_sglang as TS

    lens = bench.lengths(4, 600, False)
    s = bench.make_scores(4, 600, lens, "fp32", torch.Generator().manual_seed(2))
    calls = bench.method_calls(TS, IX, None, s, lens, ("ours_split",))
    assert set(calls) == {"ours", "ours_split"}
    assert bench.parse_args(["--out", "x", "--methods", "ours_split"]).methods == ["ours_split"]
    with pytest.raises(SystemExit):
        bench.parse_args(["--out", "x", "--methods", "nope"])


def test_ours_method_follows_the_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang_dsv41.kernels import indexer_select as IX

    monkeypatch.delenv(IX.TSPLIT.SPLIT_ENV, raising=False)
    assert bench.ours_method(IX, 1, 1 << 17) == "split" and bench.ours_method(IX, 1, 1 << 20) == "torch"
    assert bench.ours_method(IX, 1, 8192) == IX.topk_method(True)
    assert bench.ours_method(IX, 1, 1 << 17, cuda=False) == IX.topk_method(False)
    monkeypatch.setenv(IX.TSPLIT.SPLIT_ENV, "off")
    assert bench.ours_method(IX, 1, 1 << 17) == "torch"

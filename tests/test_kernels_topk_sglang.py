"""`kernels.topk_sglang` (the indexer top-k through SGLang's JIT radix top-k; not in serving).

CPU: the glue (`topk_with_module`) against `fake_sglang_topk.FakeTopk`, which checks the arguments
the way SGLang's kernels do, applies the page transform through the page table it is given and
ranks with `torch.topk` (min(k, seq_len) columns whatever their scores, as SGLang does): on scores
without ties the result must be `kernels.indexer_select.select_topk`'s exactly. Plus the dispatch and the
raise paths. GPU: the wrapper against torch.topk sets, rows with fewer valid columns than k included.
"""
from __future__ import annotations

import math
import sys

import pytest
import torch

from sglang_dsv41.kernels import indexer_select as SEL
from sglang_dsv41.kernels import topk_sglang as TS

from fake_sglang_topk import FakeTopk

INF = math.inf
Tensor = torch.Tensor


def distinct_scores(n: int, e: int, seed: int, masked: float = 0.3) -> Tensor:
    """fp32 scores without ties (a random permutation of distinct values), `masked` of them −∞."""
    g = torch.Generator().manual_seed(seed)
    s = (torch.randperm(n * e, generator=g).float() / 7.0 - 100.0).reshape(n, e)
    return s.masked_fill(torch.rand(n, e, generator=g) < masked, -INF)


@pytest.mark.parametrize("n,e,k,variant", [(3, 2000, 512, "v1"), (4, 700, 1024, "v1"), (5, 1030, 8, "v2"),
                                           (2, 3001, 100, "v2"), (3, 4000, 2048, "v2"), (2, 50, 513, "v2")])
def test_equals_select_topk_without_ties(n: int, e: int, k: int, variant: str) -> None:
    fake = FakeTopk()
    s = distinct_scores(n, e, seed=n * e + k)
    s[0, :] = -INF                                          # nothing allowed
    s[1, k // 2:] = -INF                                    # fewer allowed than k
    got = TS.topk_with_module(fake, s, k)
    assert fake.calls == [(variant, k)]
    assert got.dtype == torch.int64 and got.shape == (n, k)
    assert torch.equal(got, SEL.select_topk(s, k))
    assert bool((got[0] == -1).all())


def test_rows_of_at_most_k_columns_drop_their_minus_inf_columns() -> None:
    """SGLang returns 0 … seq_len − 1 for a row of ≤ k columns, −∞ ones included."""
    s = torch.tensor([[1.0, -INF, 3.0, -INF, 0.5], [-INF] * 5, [2.0] * 5])
    got = TS.topk_with_module(FakeTopk(), s, 512)
    assert got[0, :4].tolist() == [0, 2, 4, -1] and got[1, 0] == -1 and got[2, :6].tolist() == [0, 1, 2, 3, 4, -1]
    assert bool((got[:, 6:] == -1).all())


def test_valid_lengths_rank_only_the_columns_before_them() -> None:
    n, e, k = 6, 1500, 512
    s = distinct_scores(n, e, seed=5, masked=0.0)
    lens = torch.tensor([-4, 0, 300, 512, 1499, 9000])      # negative and too long: clamped
    got = TS.topk_with_module(FakeTopk(), s, k, valid_lengths=lens)
    cols = torch.arange(e)[None, :]
    want = SEL.select_topk(s.masked_fill(cols >= lens.clamp(0, e)[:, None], -INF), k)
    assert torch.equal(got, want)
    assert bool((got[:2] == -1).all()) and int((got[2] >= 0).sum()) == 300
    with pytest.raises(ValueError, match="valid_lengths"):
        TS.topk_with_module(FakeTopk(), s, k, valid_lengths=lens[:3])
    with pytest.raises(ValueError, match="valid_lengths"):
        TS.topk_with_module(FakeTopk(), s, k, valid_lengths=lens.float())


def test_v2_gets_padded_aligned_rows_and_strided_input_works() -> None:
    base = distinct_scores(9, 1031, seed=9)                 # row stride 1031: not a multiple of 4
    assert TS.v2_scores(base).stride(0) == 1032 and TS.v2_scores(base).shape == base.shape
    ok = distinct_scores(4, 1024, seed=1)
    assert TS.v2_scores(ok) is ok
    for view in (base, base[1:], base[:, 3:900], base.t().contiguous().t()):   # offset / narrowed / column-major
        for k in (64, 512):
            got = TS.topk_with_module(FakeTopk(), view, k, variant="v2")
            assert torch.equal(got, SEL.select_topk(view.contiguous(), k)), (view.stride(), k)
    got = TS.topk_with_module(FakeTopk(), base.t().contiguous().t(), 512)   # v1: made contiguous
    assert torch.equal(got, SEL.select_topk(base, 512))


@pytest.mark.parametrize("stray", [1 << 30, 1400, -5])
def test_a_stray_column_outside_the_length_becomes_minus_one(stray: int) -> None:
    """A slot SGLang left unwritten (its bounded candidate buffer overflowed) can hold anything:
    columns outside [0, seq_len) must not be read or returned."""
    s = distinct_scores(3, 1500, seed=4, masked=0.0)
    lens = torch.tensor([1000, 1200, 100])
    got = TS.topk_with_module(FakeTopk(stray=stray), s, 512, valid_lengths=lens)
    assert bool((got[:2, -1] == -1).all()) and int((got[:2] >= 0).sum()) == 2 * 511
    assert bool((got < lens[:, None]).all())


def test_identity_pages() -> None:
    for e, size in ((1, 1), (2, 2), (3, 4), (4096, 4096), (4097, 8192)):
        pages, page_size = TS.identity_pages(5, e, torch.device("cpu"))
        assert page_size == size and pages.shape == (5, 1) and pages.dtype == torch.int32 and not pages.any()


def test_unordered_output_is_the_same_set() -> None:
    s = distinct_scores(4, 3000, seed=3)
    s[2, 100:] = -INF
    got = TS.topk_with_module(FakeTopk(), s, 512, ordered=False)
    want = SEL.select_topk(s, 512)
    assert not torch.equal(got, want)                       # the fake's order is descending
    assert torch.equal(torch.sort(torch.where(got < 0, 1 << 40, got), dim=1).values,
                       torch.sort(torch.where(want < 0, 1 << 40, want), dim=1).values)


def test_dispatch_and_empty_shapes() -> None:
    assert [TS.choose_variant(k) for k in (512, 1024, 1, 511, 513, 2048)] == ["v1", "v1", "v2", "v2", "v2", "v2"]
    assert TS.choose_variant(512, "v2") == "v2"
    fake = FakeTopk()
    assert TS.topk_with_module(fake, torch.empty(0, 10), 512).shape == (0, 512)
    assert torch.equal(TS.topk_with_module(fake, torch.empty(3, 0), 8), torch.full((3, 8), -1))
    assert fake.calls == []
    with pytest.raises(ValueError, match="variant"):
        TS.choose_variant(512, "v3")
    with pytest.raises(ValueError, match="k must be"):
        TS.choose_variant(0)


def test_raises_where_it_cannot_serve(monkeypatch: pytest.MonkeyPatch) -> None:
    s = distinct_scores(2, 100, seed=0)
    with pytest.raises(TS.SglangTopkUnavailable, match="k ≤ 2048"):
        TS.topk_with_module(FakeTopk(), s, 2049)
    with pytest.raises(TS.SglangTopkUnavailable, match="v1 serves"):
        TS.topk_with_module(FakeTopk(), s, 8, variant="v1")
    with pytest.raises(TS.SglangTopkUnavailable, match="needs CUDA"):
        TS.select_topk_sglang(s, 512)
    with pytest.raises(TS.SglangTopkUnavailable, match="k ≤ 2048"):
        TS.select_topk_sglang(s, 4096)
    with pytest.raises(TypeError, match="fp32"):
        TS.select_topk_sglang(s.double(), 512)
    for variant, k in (("v1", 512), ("v2", 100)):
        fake = FakeTopk(fail=True)
        with pytest.raises(TS.SglangTopkUnavailable, match=f"top-k {variant} failed .*nvcc"):
            TS.topk_with_module(fake, s, k)
        assert fake.calls == [(variant, k)]
    monkeypatch.setitem(sys.modules, "sglang.kernels.ops.attention.dsv4.topk", None)   # import fails
    with pytest.raises(TS.SglangTopkUnavailable, match="not importable"):
        TS.sglang_topk_module()


def _tie_free_rows(s: Tensor, allowed: Tensor, k: int) -> Tensor:
    """Rows where no tie straddles the k-th largest allowed score (or fewer than k+1 are allowed)."""
    m = torch.where(allowed, s, -INF)
    top = torch.topk(m, min(k + 1, m.shape[1]), dim=1).values
    if top.shape[1] <= k:
        return torch.ones(s.shape[0], dtype=torch.bool, device=s.device)
    return (top[:, k - 1] != top[:, k]) | (top[:, k] == -INF)


def _sets(idx: Tensor) -> list[set[int]]:
    return [set(r[r >= 0].tolist()) for r in idx.cpu()]


@pytest.mark.gpu
@pytest.mark.parametrize("n,e,k,variant", [
    (1, 8192, 512, "v1"), (1, 8192, 512, "v2"),            # decode, register path
    (8, 65536, 512, "v1"), (8, 65536, 512, "v2"),          # v2: the small-batch cluster kernel (L > 32K)
    (64, 4096, 1024, None), (32, 16384, 2048, None),       # v1 k 1024; v2 at its largest k
    (16, 3001, 100, None),                                 # v2, a row stride not a multiple of 4 (copied)
    (300, 20000, 512, "v2"),                               # v2 streaming (L > 16K, N > 15)
    (300, 70000, 512, "v2")])                              # v2 persistent clusters + main kernel (L > 64K)
def test_gpu_matches_torch_topk_sets(n: int, e: int, k: int, variant: str | None) -> None:
    g = torch.Generator(device="cuda").manual_seed(n + e + k)
    s = torch.randn(n, e, generator=g, device="cuda")
    lens = torch.randint(0, e + 1, (n,), generator=g, device="cuda")
    lens[: max(1, n // 4)] = torch.randint(0, k, (max(1, n // 4),), generator=g, device="cuda")   # < k valid
    lens[-1] = e
    cols = torch.arange(e, device="cuda")[None, :]
    allowed = cols < lens[:, None]
    masked = s.masked_fill(~allowed, -INF)
    n_valid = torch.minimum(allowed.sum(1), torch.tensor(k, device="cuda"))
    want = torch.topk(masked, min(k, e), dim=1).indices.masked_fill(
        torch.arange(min(k, e), device="cuda")[None, :] >= n_valid[:, None], -1)
    ours = SEL.select_topk(masked, k)
    tie_free = _tie_free_rows(s, allowed, k).cpu()
    assert float(tie_free.float().mean()) > 0.9
    for kwargs in (dict(valid_lengths=lens), {}):         # the hint, and −∞ alone
        got = TS.select_topk_sglang(masked, k, variant=variant, **kwargs)
        assert got.shape == (n, k) and got.dtype == torch.int64
        assert torch.equal((got >= 0).sum(1), n_valid)
        assert bool(((got[:, 1:] >= 0) <= (got[:, :-1] >= 0)).all())                  # −1 only at the end
        assert bool((got[:, :-1] < got[:, 1:]).where(got[:, 1:] >= 0, True).all())    # ascending
        for i, (a, b, c) in enumerate(zip(_sets(got), _sets(want), _sets(ours))):
            if tie_free[i]:
                assert a == b == c, (i, int(lens[i]), len(a ^ b))
    bad = masked.clone()
    bad[0, 0] = math.nan
    with pytest.raises(ValueError, match="NaN"):
        TS.select_topk_sglang(bad, k, variant=variant)

"""Whole-batch indexer kernels (`sglang_dsv41.kernels.indexer`, selection `kernels.indexer_select`, entry
tables `kernels.entry_index`) vs the reference indexer (spec §3.4.4).

What is pinned:
* `index_scores` (Triton) == reference `index_scores` on packed batches (tiny and Flash head
  shapes, −1 slot padding, requests of different lengths, zero-visibility queries, a request row
  without queries, arbitrary token order): bit for bit with the float64 head sum (default), and
  within |Δ| ≤ (Di+Hi+2)·2⁻²³·Σ_h|w_h|Σ_d|q_hd||k_jd| with the fp32 head sum; −∞ outside
  visibility; every tiling (block_t/block_j/j_steps) gives the same bits;
* `select_topk` == `top_k_lower_index_on_ties` exactly on scores with many exact ties, ±0, ±∞;
* `candidate_blocks` == reference `candidate_blocks` (forced newest block, partial last block);
  `restrict_to_blocks` == reference `block_membership`;
* a packed batch through `index_query` → `index_scores` → `select_for_role` equals per-request
  `run_indexer` for a ratio-2 source, the candidate source and a candidate consumer (tiny
  config, random weights, real index keys written to slots).

Triton's interpreter must be enabled before triton is first imported, which a shared pytest
session cannot promise (other test modules import SGLang → triton). The kernel cases therefore
run in a child pytest on this file with TRITON_INTERPRET=1 (`test_kernel_cases_in_triton_interpreter`);
with CUDA they also run here, compiled. GPU-only Flash-shape checks are marked `gpu`.
"""
from __future__ import annotations

import math
import re

import pytest
import torch
import triton
import triton.language as tl

from sglang_dsv41.kernels import entry_index as EI
from sglang_dsv41.kernels import indexer as K
from sglang_dsv41.kernels import indexer_select as SEL
from sglang_dsv41.kernels.packed_rows import load_key_pair_tiles
from sglang_dsv41.reference import indexer as ref
from sglang_dsv41.reference import ops
from sglang_dsv41.reference.attention import layer_inv_freq
from sglang_dsv41.reference.compressor import index_keys
from sglang_dsv41.runtime.indexer_select import select_for_role

from packed_rows_codec import E2M1_MAGNITUDES, packed_rows_case, write_entries
from reference_weights import random_reference_weights, tiny_config
from triton_checks import compile_for_sm90, no_spills, run_kernel_cases_in_interpreter

INF = math.inf
KERNEL_HERE = K.INTERPRETED or torch.cuda.is_available()
DEVICE = "cuda" if torch.cuda.is_available() and not K.INTERPRETED else "cpu"


def error_bound(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """((Di+Hi+2)·2⁻²³ + 2⁻⁶)·Σ_h|w_h|Σ_d|q_hd||k_jd| ([T, n], float64): fp32 dot + head sum in any
    order, truncating or rounding, against the reference: its BF16 roundings of the dots, the terms
    and the sum (each ≤ 2⁻⁸ relative, on both sides) move a score by at most 2⁻⁶ of the magnitude."""
    T, Hi, Di = q.shape
    mag = torch.einsum("th,thd,nd->tn", w.double().abs(), q.double().abs(), keys.double().abs())
    return ((Di + Hi + 2) * 2.0**-23 + 2.0**-6) * mag


# ---- packed inputs ------------------------------------------------------------------------

#: (entries of the request, n_visible of each of its queries): prefill runs, decode, ratio-2
#: style repeats, zero visibility, a request without entries, one without queries, tiles > 64.
REQUESTS = [(37, list(range(30, 38))), (0, [0]), (70, [70]), (5, [0, 1, 1, 2, 2, 3]), (20, []),
            (130, [128, 129, 130])]


def packed_case(hi: int, di: int, seed: int, shuffle: bool, device: str = DEVICE):
    g = torch.Generator().manual_seed(seed)
    R = len(REQUESTS)
    E = max(e for e, _ in REQUESTS) + 10
    S = 700
    perm = torch.randperm(S, generator=g)
    slots = torch.full((R, E), -1, dtype=torch.int64)
    used = 0
    for r, (e, _) in enumerate(REQUESTS):
        slots[r, :e] = perm[used:used + e]
        used += e
    # FP4 keys with a spread of row magnitudes (scale exponents differ by up to 2^6)
    rows = torch.randn(S, di, generator=g) * 2.0 ** torch.randint(-3, 4, (S, 1), generator=g)
    keys = ops.fp4_fake_quant_ue8m0_scale(rows).to(torch.bfloat16)
    token_req = torch.cat([torch.full((len(v),), r) for r, (_, v) in enumerate(REQUESTS)])
    n_visible = torch.cat([torch.tensor(v, dtype=torch.int64) for _, v in REQUESTS])
    if shuffle:
        order = torch.randperm(token_req.numel(), generator=g)
        token_req, n_visible = token_req[order], n_visible[order]
    N = token_req.numel()
    q = ops.fp4_fake_quant_ue8m0_scale(torch.randn(N, hi, di, generator=g))
    w = ops.bf16(torch.randn(N, hi, generator=g)) * (di ** -0.5 * hi ** -0.5)
    to = lambda t: t.to(device)  # noqa: E731
    return to(q), to(w), to(keys), to(slots), to(token_req), to(n_visible)


def reference_scores(q, w, keys, slots, token_req, n_visible) -> torch.Tensor:
    """[N, E] reference scores (float64 oracle rounded to fp32), −∞ where not scored."""
    q, w, keys, slots, token_req, n_visible = (t.cpu() for t in (q, w, keys, slots, token_req, n_visible))
    N, E = q.shape[0], slots.shape[1]
    out = torch.full((N, E), -INF)
    for t in range(N):
        r = int(token_req[t])
        n = int(n_visible[t])
        if n:
            row_keys = keys[slots[r, :n]].float()
            out[t, :n] = ref.index_scores(ref.IndexQuery(q[t:t + 1], w[t:t + 1]), row_keys)[0]
    return out


def reference_bound(q, w, keys, slots, token_req, n_visible) -> torch.Tensor:
    q, w, keys, slots, token_req = (t.cpu() for t in (q, w, keys, slots, token_req))
    N, E = q.shape[0], slots.shape[1]
    out = torch.zeros(N, E, dtype=torch.float64)
    for t in range(N):
        n = int(n_visible[t])
        if n:
            out[t, :n] = error_bound(q[t:t + 1], w[t:t + 1], keys[slots[int(token_req[t]), :n]].float())[0]
    return out


@triton.jit
def _key_pairs_kernel(rows_ptr, even_ptr, odd_ptr, n, row_stride, offset, ratio, DI: tl.constexpr,
                      SHARE: tl.constexpr, BLOCK_N: tl.constexpr, COMPILED: tl.constexpr):
    """Test harness: `load_key_pair_tiles` of entries [0, n) → even / odd [n, DI/2] fp32."""
    e = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    valid = e < n
    even, odd = load_key_pair_tiles(rows_ptr, e.to(tl.int64) * ratio * row_stride, valid, DI, row_stride, offset,
                                    SHARE, DI // 2, COMPILED)
    out = e[:, None] * (DI // 2) + tl.arange(0, DI // 2)[None, :]
    tl.store(even_ptr + out, even.to(tl.float32), mask=valid[:, None])
    tl.store(odd_ptr + out, odd.to(tl.float32), mask=valid[:, None])


# ---- kernel cases (interpreter child, or CUDA) ----------------------------------------------

if KERNEL_HERE:

    @pytest.mark.parametrize("hi,di", [(2, 64), (32, 128)], ids=["tiny", "flash_heads"])
    @pytest.mark.parametrize("shuffle", [False, True], ids=["packed", "shuffled"])
    def test_kernel_case_scores_match_reference(hi: int, di: int, shuffle: bool) -> None:
        case = packed_case(hi, di, seed=hi + shuffle, shuffle=shuffle)
        expected = reference_scores(*case)
        exact = K.index_scores(*case).cpu()
        assert torch.equal(exact, expected)
        assert not bool((exact == 0).logical_and(exact.signbit()).any())       # −0 canonicalised
        fast = K.index_scores(*case, head_sum_exact=False).cpu()
        finite = expected > -INF
        assert torch.equal(fast > -INF, finite)
        err = (fast.double() - expected.double()).where(finite, 0.0).abs()
        assert bool((err <= reference_bound(*case)).all())
        if hi == 2:  # the tiny head count makes exact zero scores (ties) common
            assert int((expected[finite] == 0).sum()) > 10

    @pytest.mark.parametrize("hi,di,tilings", [
        (2, 64, [dict(block_t=8, block_j=16, j_steps=1), dict(block_t=16, block_j=32, j_steps=4),
                 dict(block_t=32, block_j=128, j_steps=2)]),
        (32, 128, [dict(block_t=1, block_j=16, j_steps=8), dict(block_t=2, block_j=64, j_steps=2)]),
    ], ids=["tiny", "flash_heads"])
    def test_kernel_case_tilings_agree(hi: int, di: int, tilings: list[dict]) -> None:
        case = packed_case(hi, di, seed=7, shuffle=True)
        base = K.index_scores(*case)
        for tiling in tilings:
            assert torch.equal(K.index_scores(*case, **tiling), base), tiling
        q, w, keys, slots, token_req, n_visible = case                  # int32 index tensors
        assert torch.equal(K.index_scores(q, w, keys, slots.int(), token_req.int(), n_visible.int()), base)

    def test_kernel_case_unfilled_scores_define_the_visible_columns_only() -> None:
        """`fill_invisible=False`: every column j < n_visible[t] holds the filled launch's score; entry
        tiles no query of a query tile sees keep what `out` held (NaN here), at one and several tiles a
        program; bad `out` raises."""
        case = packed_case(32, 128, seed=3, shuffle=True)
        N, E = case[0].shape[0], case[3].shape[1]
        n_visible = case[5].cpu()
        visible = torch.arange(E)[None, :] < n_visible[:, None]
        filled = K.index_scores(*case).cpu()
        for tiling in (dict(block_t=1, block_j=16, j_steps=1), dict(block_t=2, block_j=16, j_steps=4)):
            out = torch.full((N, E), math.nan, device=DEVICE)
            got = K.index_scores(*case, fill_invisible=False, out=out, **tiling).cpu()
            assert got.data_ptr() == out.cpu().data_ptr() or DEVICE == "cuda"
            assert torch.equal(got[visible], filled[visible]), tiling
            assert bool(got.isnan().any()), "some tile no query sees was written"
            assert bool((got.isnan() | (got == -INF) | visible).all())
        with pytest.raises(ValueError, match="out must be"):
            K.index_scores(*case, out=torch.empty(N, E + 1, device=DEVICE))

    @pytest.mark.parametrize("search", ["bisect", "radix"])
    def test_kernel_case_fused_topk_equals_torch_path(monkeypatch, search: str) -> None:
        """`kernels.topk_select` (SGLANG_DSV41_INDEXER_TOPK=fused), with either threshold search
        (SGLANG_DSV41_TOPK_SEARCH), == the torch ranking bit for bit: exact ties, ±0, ±∞, k above
        the allowed count, empty rows; rows held in registers and (resident limit lowered) rows
        read in chunks; the radix write pass in one chunk and in several."""
        from sglang_dsv41.kernels import topk_select as TS
        g = torch.Generator().manual_seed(5)
        values = torch.tensor([-1.5, -0.0, 0.0, 0.25, 0.25, 1.0, 3.0, INF, -INF])
        for N, E, k, tied, chunked in ((2, 900, 40, True, False), (1, 700, 600, False, True),
                                       (2, 600, 30, True, True), (1, 90, 7, True, False), (2, 0, 3, False, False),
                                       (2, 300, 290, True, False), (2, 300, 290, True, True)):
            if chunked:
                monkeypatch.setattr(TS, "RESIDENT_MAX_ENTRIES", 128)
                monkeypatch.setattr(TS, "BLOCK_E", 256)
            if E >= 600:                                # the radix write pass in several chunks
                monkeypatch.setattr(TS, "WRITE_BLOCK", 256)
            monkeypatch.setenv(TS.SEARCH_ENV, search)
            s = values[torch.randint(0, 9, (N, E), generator=g)] if tied else torch.randn(N, E, generator=g)
            s = s.to(DEVICE)
            want = SEL.select_topk(s, k, method="torch")
            assert torch.equal(SEL.select_topk(s, k, method="fused"), want), (N, E, k, chunked)
            monkeypatch.undo()
        s[:, :] = -INF
        monkeypatch.setenv(TS.SEARCH_ENV, search)
        assert torch.equal(SEL.select_topk(s, 3, method="fused"), torch.full((2, 3), -1, device=DEVICE))

    def test_kernel_case_split_topk_equals_torch_path(monkeypatch) -> None:
        """`kernels.topk_split` (two stages over segments) == the torch ranking bit for bit: exact ties
        across segment borders, ±0, ±∞, rows with fewer allowed columns than k, a last segment
        shorter than the others, and stage 2 split again when its candidates are too many."""
        from sglang_dsv41.kernels import topk_select as TS
        from sglang_dsv41.kernels import topk_split as TSPLIT
        g = torch.Generator().manual_seed(11)
        values = torch.tensor([-1.5, -0.0, 0.0, 0.25, 0.25, 1.0, 3.0, INF, -INF])
        for N, E, k, segment, tied, nested in ((2, 1000, 24, 64, True, False), (1, 700, 40, 128, False, False),
                                               (2, 300, 200, 256, True, False), (1, 2000, 12, 32, True, True)):
            if nested:                              # 63 segments × 12 candidates > 256 columns
                monkeypatch.setattr(TS, "FUSED_MAX_ENTRIES", 256)
            s = values[torch.randint(0, 9, (N, E), generator=g)] if tied else torch.randn(N, E, generator=g)
            s[:, 0] = 3.0                           # a padded candidate must not stand in for column 0
            s = s.to(DEVICE)
            want = SEL.select_topk(s, k, method="torch")
            assert torch.equal(TSPLIT.select_topk_split(s, k, segment=segment), want), (N, E, k, segment)
            monkeypatch.undo()
        s = torch.full((2, 500), -INF, device=DEVICE)
        assert torch.equal(TSPLIT.select_topk_split(s, 3, segment=64), torch.full((2, 3), -1, device=DEVICE))

    @pytest.mark.parametrize("search", ["bisect", "radix"])
    def test_kernel_case_bounded_topk_reads_only_the_row_lengths(monkeypatch, search: str) -> None:
        """`select_topk(lengths=)` through the fused kernel (resident and chunked rows), the two stages
        (stage 2 split again too) and the torch path == the torch ranking of the scores with −∞ from
        each row's length on. The columns past a length hold NaN, which a read would turn into a
        different selection (or a raise), so equality shows they are not read; lengths 0, inside a
        segment, on a segment border, at E and past E."""
        from sglang_dsv41.kernels import topk_select as TS
        from sglang_dsv41.kernels import topk_split as TSPLIT
        g = torch.Generator().manual_seed(17)
        values = torch.tensor([-1.5, -0.0, 0.0, 0.25, 0.25, 1.0, 3.0, INF, -INF])
        cases = ((300, 20, [0, 37, 256, 300, 999], "fused"), (600, 40, [5, 128, 599, 600, 3], "chunked"),
                 (1000, 24, [0, 64, 65, 700, 1000], "split"), (2000, 12, [1999, 33, 1024, 0, 4000], "nested"))
        for E, k, lengths, route in cases if search == "radix" else cases[:2]:   # bisect: slow in the interpreter
            if route == "chunked":
                monkeypatch.setattr(TS, "RESIDENT_MAX_ENTRIES", 128)
                monkeypatch.setattr(TS, "BLOCK_E", 256)
            if route == "nested":                            # 63 segments × 12 candidates > 256 columns
                monkeypatch.setattr(TS, "FUSED_MAX_ENTRIES", 256)
            monkeypatch.setenv(TS.SEARCH_ENV, search)
            N = len(lengths)
            s = values[torch.randint(0, 9, (N, E), generator=g)]
            s[:, 0] = 3.0
            lens = torch.tensor(lengths)
            cols = torch.arange(E)
            want = SEL.select_topk(s.masked_fill(cols[None, :] >= lens[:, None], -INF), k, method="torch")
            poisoned = s.masked_fill(cols[None, :] >= lens[:, None], math.nan).to(DEVICE)
            lens = lens.to(DEVICE)
            if route in ("split", "nested"):
                got = TSPLIT.select_topk_split(poisoned, k, segment=64 if route == "split" else 32, lengths=lens)
            else:
                got = SEL.select_topk(poisoned, k, method="fused", check_nan=False, lengths=lens)
            assert torch.equal(got.cpu(), want), (E, k, lengths, route)
            assert torch.equal(SEL.select_topk(poisoned.cpu(), k, method="torch", check_nan=False,
                                               lengths=lens.cpu()), want)
            monkeypatch.undo()

    @pytest.mark.parametrize("search", ["radix", "bisect"])
    def test_kernel_case_segment_candidates_are_the_spans_as_row_columns(monkeypatch, search: str) -> None:
        """`segment_candidates` == `segment_topk`'s local columns + each span's start, with the row's scores
        there (raw bits: −0 stays −0), −1 / −∞ padded; with lengths, the candidates of the spans before
        each length equal the unbounded ones of the length-masked row, and later spans write nothing
        (their positions keep what the allocation held: −7 / 7.5 here)."""
        from sglang_dsv41.kernels import topk_select as TS
        monkeypatch.setenv(TS.SEARCH_ENV, search)
        g = torch.Generator().manual_seed(23)
        values = torch.tensor([-1.5, -0.0, 0.0, 0.25, 1.0, 3.0, INF, -INF])
        N, E, k, seg = 3, 200, 6, 64
        s = values[torch.randint(0, 8, (N, E), generator=g)].to(DEVICE)
        cols, vals = TS.segment_candidates(s, k, seg)
        local = TS.segment_topk(s, k, seg).view(N, -1, k)
        start = torch.arange(0, local.shape[1] * seg, seg, device=DEVICE).view(1, -1, 1)
        want = torch.where(local >= 0, local + start, -1).view(N, -1)
        assert torch.equal(cols, want)
        picked = s.gather(1, want.clamp(min=0)).masked_fill(want < 0, -INF)
        assert torch.equal(vals.view(torch.int32), picked.view(torch.int32))
        lens = torch.tensor([0, 65, 200], device=DEVICE)
        masked = s.masked_fill(torch.arange(E, device=DEVICE)[None, :] >= lens[:, None], -INF)
        full_cols, full_vals = TS.segment_candidates(masked, k, seg)
        empty = torch.empty
        monkeypatch.setattr(torch, "empty", lambda *a, dtype=None, **kw: empty(*a, dtype=dtype, **kw).fill_(
            -7 if dtype == torch.int64 else 7.5))
        got_cols, got_vals = TS.segment_candidates(s, k, seg, lengths=lens)
        monkeypatch.undo()
        for r, n in enumerate(lens.tolist()):
            live = -(-n // seg) * k
            assert torch.equal(got_cols[r, :live], full_cols[r, :live])
            assert torch.equal(got_vals[r, :live].view(torch.int32), full_vals[r, :live].view(torch.int32))
            assert bool((got_cols[r, live:] == -7).all()) and bool((got_vals[r, live:] == 7.5).all())

    def test_kernel_case_input_checks() -> None:
        q, w, keys, slots, token_req, n_visible = packed_case(2, 64, seed=3, shuffle=False)
        holed = slots.clone()
        holed[0, 5] = -1                                          # request 0's queries see j = 5
        with pytest.raises(ValueError, match="slot is −1"):
            K.index_scores(q, w, keys, holed, token_req, n_visible)
        with pytest.raises(ValueError, match="n_visible"):
            K.index_scores(q, w, keys, slots, token_req, n_visible + slots.shape[1])
        with pytest.raises(ValueError, match="token_req"):
            K.index_scores(q, w, keys, slots, token_req + len(REQUESTS), n_visible)
        bad = slots.clone()
        bad[4, 0] = keys.shape[0]
        with pytest.raises(ValueError, match="entry_slots"):
            K.index_scores(q, w, keys, bad, token_req, n_visible)
        with pytest.raises(ValueError, match="powers of two"):
            K.index_scores(q[:, :, :48], w, keys[:, :48], slots, token_req, n_visible)
        # without checks a hole is simply not scorable (−∞), like padding
        scores = K.index_scores(q, w, keys, holed, token_req, n_visible, check_inputs=False)
        assert bool((scores[token_req == 0][:, 5] == -INF).all())

    #: (Hi, Di, D, kv-source ratios in row order, source under test): tiny and Flash rows, both ratios
    PACKED_SHAPES = [(2, 64, 96, (2, 2, 1), 0), (2, 64, 96, (2, 2, 1), 2),
                     (32, 128, 512, (2, 2, 2, 1), 1), (32, 128, 512, (2, 2, 2, 1), 3)]
    PACKED_IDS = ["tiny_ratio2", "tiny_ratio1", "flash_ratio2", "flash_ratio1"]

    def packed_key_case(hi: int, di: int, dim: int, ratios: tuple, source: int, seed: int):
        """`packed_case` queries and requests over packed index-key rows: entry_slots become entry
        indices of a PackedSource (every source's columns present, garbage outside `source`), plus
        the BF16 key cache of the decoded keys indexed by entry — the BF16 path's input."""
        q, w, _, entries, token_req, n_visible = packed_case(hi, di, seed=seed, shuffle=True)
        ratio = ratios[source]
        pr = packed_rows_case(700 * ratio, dim, di, ratios, source, seed, "key", pad_columns=6)   # 700 entries ≥ S
        src = K.PackedSource(pr["rows"].to(DEVICE), pr["offset"], pr["share"], ratio, dim, di, "key")
        return (q, w, entries, token_req, n_visible), src, pr["key_cache"].to(DEVICE)

    @pytest.mark.parametrize("hi,di,dim,ratios,source", PACKED_SHAPES if DEVICE == "cuda" else PACKED_SHAPES[:3],
                             ids=PACKED_IDS if DEVICE == "cuda" else PACKED_IDS[:3])   # CI time: 3 in the interpreter
    def test_kernel_case_packed_keys_bit_identical_to_bf16_keys(hi, di, dim, ratios, source) -> None:
        (q, w, entries, token_req, n_visible), src, cache = packed_key_case(hi, di, dim, ratios, source, seed=60)
        for head_sum_exact in (True, False):
            packed = K.index_scores(q, w, src, entries, token_req, n_visible, head_sum_exact=head_sum_exact)
            plain = K.index_scores(q, w, cache, entries, token_req, n_visible, head_sum_exact=head_sum_exact)
            assert torch.equal(packed.view(torch.int32), plain.view(torch.int32))
            assert int((packed > -INF).sum()) > 100
        if source == 0:   # the decoded keys score like the reference on them
            assert torch.equal(K.index_scores(q, w, src, entries, token_req, n_visible).cpu(),
                               reference_scores(q, w, cache, entries, token_req, n_visible))

    @pytest.mark.parametrize("ratio", [2, 1])
    def test_kernel_case_key_pair_tiles_decode_every_byte(ratio: int) -> None:
        """`packed_rows.load_key_pair_tiles` (compiled on CUDA: the FP8-conversion branch; else the
        interpreter's integer decode) gives e2m1 × 2^(b−127) for every payload byte × every UE8M0
        scale byte b (2^-127 at b = 0, NaN at 255, ±∞ past 2^128), even / odd columns = low / high nibbles, over
        the Flash key column 102 (not 4-byte aligned) of 176-byte rows. Values below fp32's normal
        range (b ≤ 2) may be flushed to a signed zero: the interpreter's fp32 products flush them (so did
        the per-dim decode before session 23); a quantiser never stores such scales with nonzero codes."""
        n_entries, row_bytes, offset = 1024, 176, 102
        share = -(-68 // ratio)
        e = torch.arange(n_entries)
        payload = (torch.arange(64)[None, :] + 64 * (e // 256)[:, None]) % 256
        scale = (e % 256)[:, None].expand(n_entries, 4)
        data = torch.cat([payload, scale], dim=1).to(torch.uint8)
        rows = torch.randint(0, 256, (n_entries * ratio, row_bytes), generator=torch.Generator().manual_seed(5),
                             dtype=torch.uint8)
        write_entries(rows, e, data, offset, share, ratio)
        even = torch.full((n_entries, 64), 7.0, device=DEVICE)
        odd = torch.full((n_entries, 64), 7.0, device=DEVICE)
        _key_pairs_kernel[(n_entries // 32,)](rows.to(DEVICE), even, odd, n_entries, row_bytes, offset, ratio,
                                               DI=128, SHARE=share, BLOCK_N=32, COMPILED=DEVICE == "cuda")
        mag = E2M1_MAGNITUDES.double()
        e2m1 = lambda c: torch.where((c & 8) != 0, -mag[c & 7], mag[c & 7])   # noqa: E731
        unit = torch.exp2(scale[:, :1].double() - 127)
        for got, codes in ((even, payload & 15), (odd, payload >> 4)):
            want = torch.where(scale[:, :1] == 255, math.nan, e2m1(codes) * unit).float().double()   # ±inf past 2^128
            got = got.cpu().double()
            nan = torch.isnan(want)
            assert torch.equal(torch.isnan(got), nan) and int(nan.sum()) == 4 * 64
            tiny = want.abs() < 2.0**-126       # below fp32's normal range: may flush to a signed zero
            flushed = tiny & (got == 0)
            assert torch.equal(got[~nan & ~flushed], want[~nan & ~flushed])
            assert int((~nan & ~tiny & (want != 0)).sum()) > 50_000
            assert torch.equal(torch.signbit(got[~nan]), torch.signbit(want[~nan]))   # −0 codes keep their sign

    def test_kernel_case_packed_input_checks() -> None:
        (q, w, entries, token_req, n_visible), src, _ = packed_key_case(2, 64, 96, (2, 2, 1), 0, seed=61)
        bad = entries.clone()
        bad[4, 0] = src.num_entries
        with pytest.raises(ValueError, match=r"entry_slots must be −1 or a slot in \[0, 700\)"):
            K.index_scores(q, w, src, bad, token_req, n_visible)
        with pytest.raises(ValueError, match="key width 64"):
            K.index_scores(q[:, :, :32].contiguous(), w, src, entries, token_req, n_visible)
        assert (src.rows.shape[1], src.share, src.entry_bytes) == (68, 17, 34)   # tiny key rows: 17 + 17 + 34
        latents = K.PackedSource(torch.zeros(src.rows.shape[0], 108, dtype=torch.uint8, device=DEVICE), 0, 27, 2,
                                 96, 64, "latent")
        with pytest.raises(ValueError, match="reads the key part"):          # latent rows are not the indexer's
            K.index_scores(q, w, latents, entries, token_req, n_visible)

    @pytest.fixture(scope="module")
    def tiny_batch():
        """Packed batch over slot caches: requests (prefix, extend) of a tiny model forward."""
        cfg = tiny_config(vision=False)
        w = random_reference_weights(cfg, seed=0, vision=False, dspark=False)
        text = cfg.text
        g = torch.Generator().manual_seed(11)
        requests = [(0, 11), (17, 1), (6, 5), (30, 1), (22, 9), (0, 1)]
        R = len(requests)
        width = max(p + e for p, e in requests)
        num_slots = 400
        req_to_token = torch.randperm(num_slots, generator=g)[:R * width].reshape(R, width)
        positions = torch.cat([torch.arange(p, p + e) for p, e in requests])
        token_req = torch.cat([torch.full((e,), r) for r, (_, e) in enumerate(requests)])
        seq_lens = torch.tensor([p + e for p, e in requests])
        key_cache = {}
        for src in text.kv_source_layer_ids:
            ratio = text.compress_ratios[src]
            cache = torch.zeros(num_slots, text.index_head_dim, dtype=torch.bfloat16)
            n = width // ratio
            rope_pos = torch.arange(n) * ratio                    # ratio 2: the pair's even position
            for r in range(R):
                latents = ops.bf16(torch.randn(n, text.head_dim, generator=g))
                k = index_keys(text, w, f"layers.{src}.attn.", latents, rope_pos, layer_inv_freq(text, ratio))
                cache[req_to_token[r, torch.arange(n) * ratio + ratio - 1]] = k.to(torch.bfloat16)
            key_cache[src] = cache
        x = {r.layer: ops.bf16(torch.randn(positions.numel(), text.hidden_size, generator=g))
             for r in text.layer_roles() if r.runs_indexer}
        q_lora = {layer: ops.bf16(torch.randn(positions.numel(), text.q_lora_rank, generator=g)) for layer in x}
        return dict(cfg=text, w=w, requests=requests, req_to_token=req_to_token, positions=positions,
                    token_req=token_req, seq_lens=seq_lens, key_cache=key_cache, x=x, q_lora=q_lora)

    @pytest.mark.parametrize("fill", [True, False], ids=["filled", "unfilled_bounded"])
    def test_kernel_case_batch_equals_per_request_run_indexer(tiny_batch, fill: bool) -> None:
        """`unfilled_bounded`: scores past each query's visibility left NaN (`fill_invisible=False`) and the
        rankings bounded, as a CUDA-graph layout runs them — the same selections and published blocks."""
        b = tiny_batch
        cfg, w = b["cfg"], b["w"]
        roles = [r for r in cfg.layer_roles() if r.runs_indexer]
        assert {r.candidate_source for r in roles} == {True, False} and any(r.candidate_consumer for r in roles)
        dev = torch.device(DEVICE)
        starts = [0]
        for _, e in b["requests"]:
            starts.append(starts[-1] + e)
        published_kernel, published_ref = None, None
        restriction_mattered = False
        for role in roles:
            ratio, src, prefix = role.ratio, role.kv_source, f"layers.{role.layer}.attn."
            inv_freq = layer_inv_freq(cfg, ratio)
            x, q_lora, pos = b["x"][role.layer], b["q_lora"][role.layer], b["positions"]
            # whole batch: the drop-in for runtime `_select`
            query = ref.index_query(cfg, w, prefix, x, q_lora, pos, inv_freq, True)
            n_vis = ref.visible_counts(pos, ratio)
            slots = EI.entry_slot_table(b["req_to_token"], torch.arange(len(b["requests"])), b["seq_lens"] // ratio,
                                        ratio, int(b["seq_lens"].max()) // ratio)
            nan_out = torch.full((n_vis.numel(), slots.shape[1]), math.nan, device=dev)
            scores = K.index_scores(query.q.to(dev), query.head_weights.to(dev), b["key_cache"][src].to(dev),
                                    slots.to(dev), b["token_req"].to(dev), n_vis.to(dev), fill_invisible=fill,
                                    out=None if fill else nan_out)
            selection, blocks = select_for_role(
                SEL, cfg, role, scores, n_vis.to(dev),
                published_kernel if role.candidate_consumer else None, bounded=not fill)
            # reference: one request at a time
            sel_ref, blocks_ref = [], []
            for r, (start, stop) in enumerate(zip(starts[:-1], starts[1:])):
                n_entries = int(b["seq_lens"][r]) // ratio
                keys = b["key_cache"][src][slots[r, :n_entries]].float()
                result = ref.run_indexer(cfg, role, w, prefix, x[start:stop], q_lora[start:stop], pos[start:stop],
                                         keys, inv_freq, True,
                                         published_ref[start:stop] if role.candidate_consumer else None)
                sel_ref.append(result.selection)
                blocks_ref.append(result.blocks)
            assert torch.equal(selection.cpu(), torch.cat(sel_ref)), f"layer {role.layer}"
            if role.candidate_source:
                published_kernel, published_ref = blocks, torch.cat(blocks_ref)
                assert torch.equal(blocks.cpu(), published_ref), f"layer {role.layer}"
            else:
                assert blocks is None
            if role.candidate_consumer:
                full = SEL.select_topk(scores, cfg.index_topk, lengths=None if fill else n_vis.to(dev))
                restriction_mattered |= not torch.equal(full, selection)
        assert restriction_mattered, "the batch is too short for the candidate restriction to change a selection"


# ---- the interpreter child ------------------------------------------------------------------

if not K.INTERPRETED:

    def test_kernel_cases_in_triton_interpreter() -> None:
        """Run this file's kernel cases in a child pytest with TRITON_INTERPRET=1 (CPU)."""
        run_kernel_cases_in_interpreter(__file__, min_passed=10)

    @pytest.mark.parametrize("share,fill", [(68, True), (34, False)], ids=["ratio1", "ratio2_unfilled"])
    @pytest.mark.parametrize("block_t", [1, 4], ids=["decode_mma", "prefill_wgmma"])
    def test_packed_kernel_compiles_for_hopper_without_spills(block_t: int, share: int, fill: bool) -> None:
        """The packed-key kernel at Flash shapes builds for sm_90 (Triton's bundled ptxas, no GPU)
        with no register spills — also where the dot becomes wgmma (block_t·Hi ≥ 64), which the
        join/reshape decode (removed) cannot be lowered to in Triton 3.6; no float64 instruction."""
        kern = K._index_scores_kernel
        consts = dict(HI=32, DI=128, BLOCK_T=block_t, BLOCK_J=64, J_STEPS=1, DOT_BF16=True, HEAD_SUM_EXACT=True,
                      KEY_PACKED=True, KEY_SHARE=share, FILL_DEAD=fill)
        pointers = {"q_ptr": "*fp32", "w_ptr": "*fp32", "key_ptr": "*u8", "out_ptr": "*fp32"}
        sig = {n: "constexpr" if n in consts else pointers.get(n, "*i64" if n.endswith("_ptr") else "i32")
               for n in kern.arg_names}
        compiled, usage = compile_for_sm90(kern, sig, consts, {"num_warps": 4 if 32 * block_t * 64 <= 4096 else 8})
        assert no_spills(usage), usage
        assert ("wgmma" in compiled.asm["ptx"]) == (block_t == 4)
        # the parity-split key decode: 162 / 233 registers (the per-dim decode held 254 at decode, two
        # 4-warp programs per multiprocessor; docs/performance.md "Session 23")
        assert int(re.search(r"REG:(\d+)", usage).group(1)) <= (176 if block_t == 1 else 240), usage
        assert not re.search(r"\.f64\b", compiled.asm["ptx"])     # double-fp32 head sum: no float64 (issue 21)

    @pytest.mark.parametrize("search", ["radix", "bisect"])
    @pytest.mark.parametrize("rows", [1, 8192], ids=["decode", "prefill"])
    @pytest.mark.parametrize("E,spans", [(256, False), (2048, False), (4096, False), (8192, False), (65536, False),
                                         (4096, True)], ids=["256", "2048", "4096", "8192", "65536", "4096-spans"])
    def test_topk_compiles_for_hopper_without_spills(E: int, rows: int, search: str, spans: bool) -> None:
        """The fused top-k with either search at the launch configuration of rows × E builds for sm_90
        with no register spills and at most 128 registers a thread (the write pass once held 255 and
        spilled: one program per multiprocessor at prefill; docs/performance.md, session 19), with row
        lengths; a whole row a program (SEGS = 1, which the launcher specialises) or, at the two stages'
        segment width, a span a program (SEGS a runtime value) writing the two stages' candidates."""
        from sglang_dsv41.kernels import topk_select as TS
        from sglang_dsv41.kernels import topk_split as TSPLIT
        assert not spans or E == TSPLIT.SEGMENT                  # spans are launched at the segment width only
        block, resident, warps = TS.launch_blocks(E)
        kern = TS._topk_rows_radix_kernel if search == "radix" else TS._topk_rows_kernel
        warps = TS.radix_warps(block, resident, rows) if search == "radix" else warps
        consts = dict(BLOCK=block, RESIDENT=resident, WBLOCK=min(block, TS.WRITE_BLOCK), HAS_LEN=True, CAND=spans)
        if not spans:
            consts["SEGS"] = 1
        sig = {n: "constexpr" if n in consts else {"s_ptr": "*fp32", "out_ptr": "*i64", "len_ptr": "*i64",
                                                   "val_ptr": "*fp32"}.get(n, "i32")
               for n in kern.arg_names}
        _, usage = compile_for_sm90(kern, sig, consts, {"num_warps": warps})
        assert no_spills(usage), usage
        assert int(re.search(r"REG:(\d+)", usage).group(1)) <= 128, usage

    def test_cpu_without_interpreter_raises() -> None:
        case = packed_case(2, 64, seed=0, shuffle=False, device="cpu")
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
            K.index_scores(*case)


# ---- pure torch parts (any process) -----------------------------------------------------------

def test_compiled_key_decode_formula_is_exact() -> None:
    """The GPU branch of `load_key_pair_tiles` in torch terms: e4m3(nibble moved to bits 7|4..2) · 64
    in BF16, times the UE8M0 scale as BF16 bits (b << 7; 0x0040 = 2^-127 at b = 0, NaN at 255), equals
    e2m1 × 2^(b−127) for every payload byte and every scale byte, both nibbles, signs of −0 kept."""
    byte = torch.arange(256, dtype=torch.int32)
    b = torch.arange(256, dtype=torch.int32)
    bits = torch.where(b == 0, 0x0040, torch.where(b == 255, 0x7FC0, b << 7))
    scale = bits.to(torch.int16).view(torch.bfloat16)
    mag = E2M1_MAGNITUDES.double()
    e2m1 = lambda c: torch.where((c & 8) != 0, -mag[c & 7], mag[c & 7])   # noqa: E731
    unit = torch.where(b == 255, math.nan, torch.exp2(b.double() - 127))
    for nibble, codes in (((((byte << 2) & 0x1C) | ((byte << 4) & 0x80)), byte & 15),
                          ((((byte >> 2) & 0x1C) | (byte & 0x80)), byte >> 4)):
        e4m3 = nibble.to(torch.uint8).view(torch.float8_e4m3fn)
        got = ((e4m3.to(torch.bfloat16) * 64.0)[:, None] * scale[None, :]).double()
        want = (e2m1(codes)[:, None] * unit[None, :]).float().double()      # ±inf past 2^128, like BF16
        nan = torch.isnan(want)
        assert torch.equal(torch.isnan(got), nan) and bool(nan[:, 255].all()) and int(nan.sum()) == 256
        assert torch.equal(got[~nan], want[~nan])
        assert torch.equal(torch.signbit(got[~nan]), torch.signbit(want[~nan]))



def tied_scores(g: torch.Generator, N: int, E: int) -> torch.Tensor:
    """Scores drawn from a few values incl. +0, −0, ±∞-free; many exact ties."""
    values = torch.tensor([-1.5, -0.0, 0.0, 0.25, 0.25, 1.0, 3.0])
    return values[torch.randint(0, values.numel(), (N, E), generator=g)]


def test_select_topk_equals_reference_on_ties() -> None:
    g = torch.Generator().manual_seed(0)
    for trial in range(60):
        N, E = int(torch.randint(1, 9, (1,), generator=g)), int(torch.randint(0, 40, (1,), generator=g))
        scores = tied_scores(g, N, E)
        allowed = torch.rand(N, E, generator=g) < 0.8
        if trial % 5 == 0:
            scores[torch.rand(N, E, generator=g) < 0.1] = INF             # forced blocks look like this
        k = int(torch.randint(1, E + 4, (1,), generator=g))
        expected = ref.top_k_lower_index_on_ties(scores, allowed, k)
        masked = scores.masked_fill(~allowed, -INF)
        assert torch.equal(SEL.select_topk(masked, k), expected), (trial, N, E, k)
        assert torch.equal(SEL.select_topk(masked, k, max_chunk_elements=max(E, 1)), expected)  # one row per chunk


def test_topk_method_from_the_environment(monkeypatch) -> None:
    """Unset: fused on CUDA scores (the serving default), torch on CPU (the fused kernel is not
    even called there); the variable overrides both; unknown values raise."""
    from sglang_dsv41.kernels import topk_select as TS

    monkeypatch.delenv("SGLANG_DSV41_INDEXER_TOPK", raising=False)
    assert SEL.topk_method() == SEL.topk_method(cuda=False) == "torch"
    assert SEL.topk_method(cuda=True) == "fused"
    with monkeypatch.context() as m:
        m.setattr(TS, "select_topk_fused", lambda *a: pytest.fail("CPU scores went to the fused kernel"))
        assert torch.equal(SEL.select_topk(torch.tensor([[0.5, 2.0, 1.0]]), 2), torch.tensor([[1, 2]]))
    monkeypatch.setenv("SGLANG_DSV41_INDEXER_TOPK", " Fused ")
    assert SEL.topk_method() == SEL.topk_method(cuda=True) == "fused"
    monkeypatch.setenv("SGLANG_DSV41_INDEXER_TOPK", "torch")
    assert SEL.topk_method(cuda=True) == "torch"
    monkeypatch.setenv("SGLANG_DSV41_INDEXER_TOPK", "radix")
    with pytest.raises(ValueError, match="SGLANG_DSV41_INDEXER_TOPK='radix'"):
        SEL.select_topk(torch.zeros(1, 4), 2)


def test_no_kernel_build_per_request_length() -> None:
    """Every first use of a Triton constexpr value builds a kernel variant (seconds on a cold cache),
    so no constexpr of the indexer's two kernels may follow the request's length beyond a few
    classes: over 1..8,192 queries per request, `index_scores` has ≤ 4 query tiles (BLOCK_T) per head
    count (its J_STEPS takes five values, 1 … 16); the fused top-k has 7 builds in all over
    1..65,536 entries (it had one per power of two of the width, 11)."""
    from sglang_dsv41.kernels import topk_select as TS

    for hi in (2, 4, 32, 64):
        tiles = {K.default_block_t(n, r, hi) for n in range(1, 8193, 7) for r in (1, 2, 3, 64)}
        assert len(tiles) <= 4 and all(t * hi >= 16 for t in tiles), (hi, tiles)
    builds = {TS.launch_blocks(E) for E in range(1, 1 << 16 | 1)}
    assert len(builds) == 7, builds
    for E in (1, 16, 256, 257, 1000, 1024, 1025, 4097, 8192, 8193, 65536):
        block, resident, _ = TS.launch_blocks(E)
        assert resident == (E <= TS.RESIDENT_MAX_ENTRIES) and (not resident or block >= E), E
        assert not resident or block == max(TS.RESIDENT_MIN_BLOCK, 1 << (E - 1).bit_length()), E


@pytest.mark.gpu
@pytest.mark.parametrize("N,E", [(1, 4096), (8, 65536), (64, 4096)])
@pytest.mark.parametrize("search", ["bisect", "radix"])
def test_gpu_fused_topk_equals_torch_path_at_flash_widths(N: int, E: int, search: str, monkeypatch) -> None:
    """The fused ranking at decode widths (context 8K / 128K at ratio 2), top-512 and the candidate
    blocks' top-k, with either threshold search: the torch path's result bit for bit, on
    BF16-valued scores (many exact ties)."""
    from sglang_dsv41.kernels import topk_select as TS

    monkeypatch.setenv(TS.SEARCH_ENV, search)
    g = torch.Generator(device="cuda").manual_seed(N + E)
    s = ops.bf16(torch.randn(N, E, generator=g, device="cuda"))
    s[:, E // 2:] = -INF                                            # invisible half
    for k in (512, 8):
        assert torch.equal(SEL.select_topk(s, k, method="fused"), SEL.select_topk(s, k, method="torch"))


@pytest.mark.gpu
@pytest.mark.parametrize("N,E,mode", [(1, 32768, "on"), (8, 65536, "on"), (2, 200000, "on"), (64, 131072, None),
                                      (1, 262144, None)])
def test_gpu_split_topk_equals_torch_path_at_flash_widths(N: int, E: int, mode: str | None, monkeypatch) -> None:
    """`kernels.topk_split` at long-context decode widths (64K / 128K / 400K tokens at ratio 2; 128K /
    256K columns under the default "auto"), top-512 and the candidate blocks' top-k: the torch path's
    result bit for bit on BF16-valued scores (many exact ties), the invisible half −∞."""
    from sglang_dsv41.kernels import topk_split as TSPLIT

    if mode is None:
        monkeypatch.delenv(TSPLIT.SPLIT_ENV, raising=False)
    else:
        monkeypatch.setenv(TSPLIT.SPLIT_ENV, mode)
    g = torch.Generator(device="cuda").manual_seed(N + E)
    s = ops.bf16(torch.randn(N, E, generator=g, device="cuda"))
    s[:, E // 2:] = -INF
    for k in (512, 8):
        assert TSPLIT.split_applies(N, E, k)
        assert torch.equal(SEL.select_topk(s, k, method="fused"), SEL.select_topk(s, k, method="torch"))


@pytest.mark.gpu
@pytest.mark.parametrize("N,E", [(1, 1 << 20), (64, 1 << 19), (256, 1 << 20), (8, 4096)])
def test_gpu_bounded_topk_at_a_served_context_of_1m(N: int, E: int) -> None:
    """A decode graph's score rows are as wide as the served context (1M at ratio 1, 512K at ratio 2)
    while the requests hold 8K–200K entries: `select_topk(lengths=)` (the fused kernel or the two stages,
    as dispatched) gives the torch path's result on the scores with −∞ past each length, bit for bit,
    on BF16-valued scores (many exact ties), with NaN past the lengths (never read); so does a
    candidate consumer's ranking of its published blocks (`select_in_blocks`)."""
    g = torch.Generator(device="cuda").manual_seed(N + E)
    lens = torch.randint(0, min(E, 200_000), (N,), generator=g, device="cuda")
    lens[0] = min(E, 8192)
    s = ops.bf16(torch.randn(N, E, generator=g, device="cuda"))
    past = torch.arange(E, device="cuda")[None, :] >= lens[:, None]
    for k in (512, 8):
        want = SEL.select_topk(s.masked_fill(past, -INF), k, method="torch")
        got = SEL.select_topk(s.masked_fill(past, math.nan), k, method="fused", check_nan=False, lengths=lens)
        assert torch.equal(got, want), k
    # a candidate consumer: 2,048 published blocks of 8 (Flash), ranked in place of the restricted row
    n_visible = lens.clamp(min=1)
    blocks = SEL.candidate_blocks(s.masked_fill(past, -INF), n_visible, 8, 2048, check_nan=False, bounded=True)
    restricted = SEL.restrict_to_blocks(s.masked_fill(past, -INF), blocks, 8)
    sel, _ = SEL.select_indices(s.masked_fill(past, math.nan), lens, blocks, index_topk=512, block_size=8,
                                topk_blocks=2048, publish_blocks=False, check_nan=False, bounded=True)
    assert torch.equal(sel, SEL.select_topk(restricted, 512, method="torch"))


def test_select_topk_zero_signs_and_edges() -> None:
    s = torch.tensor([[-0.0, 0.0, -0.0, 0.0, -1.0]])
    assert SEL.select_topk(s, 2).tolist() == [[0, 1]]                       # −0 == +0: lower indices
    assert SEL.select_topk(s, 9).tolist() == [[0, 1, 2, 3, 4, -1, -1, -1, -1]]
    assert SEL.select_topk(torch.full((2, 3), -INF), 2).tolist() == [[-1, -1], [-1, -1]]
    assert SEL.select_topk(torch.empty(3, 0), 2).tolist() == [[-1, -1]] * 3
    tiny = torch.tensor([[1e-45, -1e-45, 0.0, float(torch.finfo(torch.float32).max)]])
    assert SEL.select_topk(tiny, 2).tolist() == [[0, 3]]
    with pytest.raises(ValueError, match="NaN"):
        SEL.select_topk(torch.tensor([[0.0, math.nan]]), 1)
    with pytest.raises(TypeError):
        SEL.select_topk(s.double(), 1)
    with pytest.raises(ValueError):
        SEL.select_topk(s, 0)


def test_candidate_blocks_equal_reference() -> None:
    g = torch.Generator().manual_seed(1)
    for trial in range(40):
        N = int(torch.randint(1, 7, (1,), generator=g))
        E = int(torch.randint(1, 60, (1,), generator=g))
        B = int(torch.randint(1, 9, (1,), generator=g))
        topk_blocks = int(torch.randint(1, 6, (1,), generator=g))
        scores = tied_scores(g, N, E)
        n_visible = torch.randint(0, E + 1, (N,), generator=g)
        n_visible[0] = E                                                   # partial last block when E % B
        visible = torch.arange(E)[None, :] < n_visible[:, None]
        expected = ref.candidate_blocks(scores, n_visible, B, topk_blocks)
        got = SEL.candidate_blocks(scores.masked_fill(~visible, -INF), n_visible, B, topk_blocks)
        assert torch.equal(got, expected), (trial, N, E, B, topk_blocks)
        newest = torch.div(n_visible - 1, B, rounding_mode="floor")
        for t in range(N):
            if n_visible[t] > 0:
                assert int(newest[t]) in got[t].tolist()


def test_candidate_blocks_force_the_newest_block() -> None:
    # the newest (partial) block has the lowest scores yet is published
    scores = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0, -9.0, -9.0]])
    got = SEL.candidate_blocks(scores, torch.tensor([7]), 2, 2)
    assert got.tolist() == [[0, 3]]
    assert torch.equal(got, ref.candidate_blocks(scores, torch.tensor([7]), 2, 2))


def test_restrict_to_blocks_equals_reference_membership() -> None:
    g = torch.Generator().manual_seed(2)
    N, E, B = 5, 23, 4
    scores = tied_scores(g, N, E)
    blocks = torch.tensor([[0, 2, -1], [5, -1, -1], [1, 3, 9], [-1, -1, -1], [0, 1, 5]])
    member = ref.block_membership(blocks, B, E)
    assert torch.equal(SEL.restrict_to_blocks(scores, blocks, B), scores.masked_fill(~member, -INF))
    k = 4
    assert torch.equal(SEL.select_topk(SEL.restrict_to_blocks(scores, blocks, B), k),
                       ref.top_k_lower_index_on_ties(scores, member, k))


@pytest.mark.parametrize("method", ["torch", "fused"])
def test_select_in_blocks_equals_the_restricted_ranking(method: str, monkeypatch) -> None:
    """Ranking the published blocks' columns only == ranking the row restricted to them, bit for bit:
    unsorted and repeated block ids, −1, ids past the row, a partial last block, exact ties, rows
    with fewer allowed columns than k, with and without row lengths (columns past a length NaN: not
    read); `select_indices` takes it when the blocks hold fewer columns than the row."""
    if method == "fused":
        monkeypatch.setattr(SEL, "INTERPRETED", True)        # the CPU tests' stand-in for the fused kernel
        monkeypatch.setattr(SEL.TS, "select_topk_fused",
                            lambda s, k, lengths=None: SEL.select_topk(s, k, method="torch", lengths=lengths))
    g = torch.Generator().manual_seed(8)
    N, E, B = 6, 61, 4
    scores = tied_scores(g, N, E)
    blocks = torch.tensor([[3, 0, 3, -1], [15, 2, 16, 40], [1, 2, 3, 4], [-1, -1, -1, -1], [14, 13, 0, 7],
                           [9, 9, 9, 9]])
    lens = torch.tensor([61, 30, 8, 0, 57, 40])
    for k in (3, 9):
        want = SEL.select_topk(SEL.restrict_to_blocks(scores, blocks, B), k, method="torch")
        assert torch.equal(SEL.select_in_blocks(scores, blocks, B, k), want), k
        past = torch.arange(E)[None, :] >= lens[:, None]
        want = SEL.select_topk(SEL.restrict_to_blocks(scores.masked_fill(past, -INF), blocks, B), k, method="torch")
        got = SEL.select_in_blocks(scores.masked_fill(past, math.nan), blocks, B, k, lengths=lens, check_nan=False)
        assert torch.equal(got, want), k
        n_visible = torch.full((N,), E)
        sel, _ = SEL.select_indices(scores, n_visible, blocks, index_topk=k, block_size=B, topk_blocks=4,
                                    publish_blocks=False)
        assert torch.equal(sel, SEL.select_topk(SEL.restrict_to_blocks(scores, blocks, B), k, method="torch"))


def test_select_for_role_errors() -> None:
    cfg = tiny_config(vision=False).text
    roles = {r.layer: r for r in cfg.layer_roles()}
    consumer = next(r for r in roles.values() if r.candidate_consumer)
    plain = next(r for r in roles.values() if not r.runs_indexer)
    scores, n = torch.zeros(1, 8), torch.tensor([8])
    with pytest.raises(ValueError, match="no candidate blocks"):
        select_for_role(SEL, cfg, consumer, scores, n, None)
    with pytest.raises(ValueError, match="does not run an indexer"):
        select_for_role(SEL, cfg, plain, scores, n, None)


def test_entry_index_table_is_slot_of_completing_token_div_ratio() -> None:
    """Paged slots (page 2, contract §2): entry e of compressed position j is slot(j·r + r − 1) // r,
    which is also slot(j·r) // r — the pair shares one entry; −1 beyond n_entries."""
    pages = torch.tensor([[5, 9, 2, 7, 11], [3, 8, 4, 6, 10]])
    req_to_token = (2 * pages[:, :, None] + torch.arange(2)).reshape(2, 10)
    table = EI.entry_index_table(req_to_token, torch.tensor([1, 0]), torch.tensor([3, 5]), 2, 5)
    assert table.tolist() == [[3, 8, 4, -1, -1], [5, 9, 2, 7, 11]]
    assert torch.equal(table[:, :3].clamp(min=0), req_to_token[[1, 0]][:, 0:6:2] // 2)
    ones = EI.entry_index_table(req_to_token, torch.tensor([0]), torch.tensor([4]), 1, 6)
    assert ones.tolist() == [[10, 11, 18, 19, -1, -1]]


def test_entry_slot_table() -> None:
    req_to_token = torch.arange(60).reshape(3, 20) + 100
    table = EI.entry_slot_table(req_to_token, torch.tensor([2, 0]), torch.tensor([3, 0]), 2, 5)
    assert table.tolist() == [[141, 143, 145, -1, -1], [-1] * 5]
    table = EI.entry_slot_table(req_to_token, torch.tensor([1]), torch.tensor([4]), 1, 4)
    assert table.tolist() == [[120, 121, 122, 123]]


# ---- GPU: Flash shapes against the float64 oracle ------------------------------------------

def flash_decode_case(N: int, E: int, seed: int):
    """N queries over requests of E entries each (N ≤ 64: one decode query per request;
    N = 1024: 4 prefill requests of 256 queries), Flash heads, on CUDA."""
    g = torch.Generator().manual_seed(seed)
    Hi, Di = 32, 128
    R = N if N <= 64 else 4
    per = N // R
    S = R * E + 17
    slots = torch.randperm(S, generator=g)[:R * E].reshape(R, E)
    keys = ops.fp4_fake_quant_ue8m0_scale(torch.randn(S, Di, generator=g)).to(torch.bfloat16)
    q = ops.fp4_fake_quant_ue8m0_scale(torch.randn(N, Hi, Di, generator=g))
    w = ops.bf16(torch.randn(N, Hi, generator=g)) / 64
    token_req = torch.arange(R).repeat_interleave(per)
    n_visible = E - per + 1 + torch.arange(per).repeat(R)
    return [t.cuda() for t in (q, w, keys, slots, token_req, n_visible)]


def oracle(q, w, keys, slots, token_req, n_visible) -> tuple[torch.Tensor, torch.Tensor]:
    """(reference score bf16(Σ_h bf16(w·ReLU(bf16(dot)))), dots and sum in float64, with −∞ masking;
    error bound), chunked on the GPU."""
    N, E = q.shape[0], slots.shape[1]
    scores = torch.empty(N, E, device=q.device)
    bound = torch.empty(N, E, dtype=torch.float64, device=q.device)
    for t0 in range(0, N, 64):
        t = slice(t0, t0 + 64)
        k = keys[slots[token_req[t]]].double()                          # [T, E, Di]
        dots = ops.bf16(torch.einsum("thd,ted->the", q[t].double(), k).float())
        terms = ops.bf16(dots.relu() * w[t].float()[:, :, None])
        s = ops.bf16(terms.double().sum(dim=1).float())
        vis = torch.arange(E, device=q.device)[None, :] < n_visible[t, None]
        scores[t] = torch.where(vis, s + 0.0, -INF)
        mag = torch.einsum("th,thd,ted->te", w[t].double().abs(), q[t].double().abs(), k.abs())
        bound[t] = ((q.shape[2] + q.shape[1] + 2) * 2.0**-23 + 2.0**-6) * mag
    return scores, bound


@pytest.mark.gpu
@pytest.mark.parametrize("N", [1, 64, 1024])
def test_gpu_flash_scores_within_bound_and_topk_sets(N: int) -> None:
    E, k = 8192, 512
    case = flash_decode_case(N, E, seed=N)
    expected, bound = oracle(*case)
    finite = expected > -INF
    want = SEL.select_topk(expected, k)
    assert torch.equal(want, ref.top_k_lower_index_on_ties(expected, finite, k))     # CUDA topk path
    for head_sum_exact in (True, False):
        got = K.index_scores(*case, head_sum_exact=head_sum_exact)
        assert torch.equal(got > -INF, finite)
        err = (got.double() - expected.double()).where(finite, 0.0).abs()
        assert bool((err <= bound).all())
        # BF16 scores tie often at the k/k+1 boundary, so sets are compared on the rows whose scores
        # are the oracle's bits (all but near-boundary rows with the exact head sum)
        same = (got == expected).where(finite, True).all(dim=1)
        assert torch.equal(SEL.select_topk(got, k)[same], want[same])
        if head_sum_exact:
            assert float(same.float().mean()) >= 0.9


@pytest.mark.gpu
@pytest.mark.parametrize("N", [1, 64, 1024])
def test_gpu_flash_fp64_head_sum_is_bitwise(N: int) -> None:
    """FP4 dots are exact in fp32 on tensor cores; the float64 head sum rounds once like the
    reference, so the scores should be the oracle's bits."""
    case = flash_decode_case(N, 8192, seed=N + 1)
    expected, _ = oracle(*case)
    assert torch.equal(K.index_scores(*case), expected)


@pytest.mark.gpu
@pytest.mark.parametrize("source", [1, 3], ids=["ratio2", "ratio1"])
@pytest.mark.parametrize("N", [1, 64, 1024])
def test_gpu_flash_packed_keys_bit_identical_to_bf16_keys(N: int, source: int) -> None:
    """Flash indexer shapes (Hi 32, Di 128, E = 8192 visible entries per request) over the 170-byte
    Flash index-key row: packed FP4 keys give the BF16-key path's scores bit for bit, both head sums."""
    ratios, n_entries, E = (2, 2, 2, 1), 16384, 8192
    g = torch.Generator().manual_seed(N + source)
    pr = packed_rows_case(n_entries * ratios[source], 512, 128, ratios, source, seed=N, part="key")
    src = K.PackedSource(pr["rows"].cuda(), pr["offset"], pr["share"], ratios[source], 512, 128, "key")
    assert src.rows.shape[1] == 170 and src.num_entries == n_entries
    R = N if N <= 64 else 4
    per = N // R
    entries = torch.randint(0, n_entries, (R, E), generator=g).cuda()
    q = ops.fp4_fake_quant_ue8m0_scale(torch.randn(N, 32, 128, generator=g)).cuda()
    w = (ops.bf16(torch.randn(N, 32, generator=g)) / 64).cuda()
    token_req = torch.arange(R).repeat_interleave(per).cuda()
    n_visible = (E - per + 1 + torch.arange(per).repeat(R)).cuda()
    cache = pr["key_cache"].cuda()
    for head_sum_exact in (True, False):
        packed = K.index_scores(q, w, src, entries, token_req, n_visible, head_sum_exact=head_sum_exact)
        plain = K.index_scores(q, w, cache, entries, token_req, n_visible, head_sum_exact=head_sum_exact)
        assert torch.equal(packed.view(torch.int32), plain.view(torch.int32))


def test_default_tiling_follows_the_measured_choice() -> None:
    """Prefill tiles of BF16 keys take 32 entries a step (session 34's H100 sweep, docs/performance.md);
    packed keys and decode-sized tiles keep 64; the 8K Flash prefill's tile is 4 queries × 32 heads."""
    assert K.default_block_t(8192, 1, 32) == 4 and K.default_block_t(64, 64, 32) == 1
    assert K.default_block_j(4 * 32, packed_keys=False) == 32
    assert K.default_block_j(4 * 32, packed_keys=True) == K.default_block_j(32, packed_keys=False) == 64


def test_topk_search_from_the_environment(monkeypatch) -> None:
    """SGLANG_DSV41_TOPK_SEARCH picks the fused kernel's threshold search; unset: DEFAULT_SEARCH;
    an unknown value raises."""
    from sglang_dsv41.kernels import topk_select as TS

    monkeypatch.delenv(TS.SEARCH_ENV, raising=False)
    assert TS.radix_search() == (TS.DEFAULT_SEARCH == "radix")
    monkeypatch.setenv(TS.SEARCH_ENV, " Radix ")
    assert TS.radix_search()
    monkeypatch.setenv(TS.SEARCH_ENV, "bisect")
    assert not TS.radix_search()
    monkeypatch.setenv(TS.SEARCH_ENV, "heap")
    with pytest.raises(ValueError, match="SGLANG_DSV41_TOPK_SEARCH='heap'"):
        TS.radix_search()


def test_radix_warps_follow_the_measured_choice() -> None:
    """16 warps for a wide row at decode row counts, 8 / 4 for prefill chunks (session 19's H200
    sweep, docs/performance.md); every choice is a power of two Triton accepts."""
    from sglang_dsv41.kernels import topk_select as TS
    assert TS.radix_warps(8192, True, 1) == TS.radix_warps(1024, False, TS.FEW_ROWS) == 16
    assert TS.radix_warps(4096, True, 64) == 16 and TS.radix_warps(2048, True, 64) == 4
    assert TS.radix_warps(8192, True, 8192) == 8
    assert TS.radix_warps(4096, True, TS.FEW_ROWS + 1) == TS.radix_warps(1024, False, 8192) == 4


def test_bounded_rankings_from_the_environment(monkeypatch) -> None:
    monkeypatch.delenv(SEL.BOUNDED_ENV, raising=False)
    assert SEL.bounded_rankings()
    monkeypatch.setenv(SEL.BOUNDED_ENV, "off")
    assert not SEL.bounded_rankings()
    monkeypatch.setenv(SEL.BOUNDED_ENV, "sometimes")
    with pytest.raises(ValueError, match=SEL.BOUNDED_ENV):
        SEL.bounded_rankings()


def test_bounded_rankings_never_take_the_torch_path_on_cuda(monkeypatch) -> None:
    """With lengths, CUDA rows past the fused kernel's width go to the two stages when few and to the
    fused kernel when many (each costs the rows' lengths), never to the torch path (which costs E);
    within its width, to the fused kernel as without lengths."""
    from sglang_dsv41.kernels import topk_select as TS
    from sglang_dsv41.kernels import topk_split as TSPLIT
    calls = []
    monkeypatch.setattr(TS, "select_topk_fused", lambda s, k, lengths=None: calls.append(("fused", lengths)) or s)
    monkeypatch.setattr(TSPLIT, "select_topk_split", lambda s, k, lengths=None: calls.append(("split", lengths)) or s)
    monkeypatch.setattr(SEL, "INTERPRETED", True)                 # CPU tensors take the kernels' route
    monkeypatch.setattr(TS, "FUSED_MAX_ENTRIES", 2048)            # small rows stand for wide ones
    monkeypatch.delenv(TSPLIT.SPLIT_ENV, raising=False)
    wide = TS.FUSED_MAX_ENTRIES * 16
    for rows, width, route in ((1, wide, "split"), (TS.FEW_ROWS + 1, wide, "fused"), (4, 1024, "fused")):
        lens = torch.full((rows,), 7)
        SEL.select_topk(torch.zeros(rows, width), 64, method="fused", check_nan=False, lengths=lens)
        assert calls[-1][0] == route and calls[-1][1] is lens, (rows, width)
    calls.clear()
    out = SEL.select_topk(torch.zeros(TS.FEW_ROWS + 1, wide), 64, method="fused", check_nan=False)
    assert calls == [] and out.shape == (TS.FEW_ROWS + 1, 64)       # unbounded: the torch path as before


def test_split_topk_dispatch_from_the_environment(monkeypatch) -> None:
    """SGLANG_DSV41_TOPK_SPLIT: "auto" by default — few rows past the fused kernel's width whose candidates
    fit one stage-2 launch; "on" sends few rows wider than a resident block, and any row wider than the
    fused kernel takes, to the two-stage ranking; "off" none; an unknown value raises."""
    from sglang_dsv41.kernels import topk_select as TS
    from sglang_dsv41.kernels import topk_split as TSPLIT
    wide, past = TS.RESIDENT_MAX_ENTRIES + 1, TS.FUSED_MAX_ENTRIES + 1
    one_pass = TSPLIT.SEGMENT * (TSPLIT.AUTO_MAX_CANDIDATES // 512)         # widest "auto" row at k 512 (256K)
    monkeypatch.delenv(TSPLIT.SPLIT_ENV, raising=False)
    assert TSPLIT.DEFAULT_SPLIT == "auto" and not TSPLIT.split_applies(1, 1 << 15, 512)
    assert TSPLIT.split_applies(1, past, 512) and TSPLIT.split_applies(TS.FEW_ROWS, one_pass, 512)
    assert not TSPLIT.split_applies(1, one_pass + 1, 512)                  # a wider stage 2 than measured
    assert TSPLIT.split_applies(1, 1 << 17, 1024) and not TSPLIT.split_applies(1, 1 << 18, 1024)
    assert not TSPLIT.split_applies(TS.FEW_ROWS + 1, past, 512)            # many rows: the torch path
    monkeypatch.setenv(TSPLIT.SPLIT_ENV, "off")
    assert not TSPLIT.split_applies(1, past, 512)
    monkeypatch.setenv(TSPLIT.SPLIT_ENV, "on")
    assert TSPLIT.split_applies(1, wide, 512) and TSPLIT.split_applies(TS.FEW_ROWS, wide, 512)
    assert not TSPLIT.split_applies(TS.FEW_ROWS + 1, wide, 512)            # a prefill chunk: one program a row
    assert not TSPLIT.split_applies(1, TS.RESIDENT_MAX_ENTRIES, 512)       # resident: one program is enough
    assert TSPLIT.split_applies(8192, TS.FUSED_MAX_ENTRIES + 1, 512)        # else the torch path
    assert not TSPLIT.split_applies(1, wide, TSPLIT.SEGMENT)               # k must be below a segment
    monkeypatch.delenv(TSPLIT.SPLIT_ENV)               # bounded rows: any number of stage-2 candidates
    assert TSPLIT.split_applies(1, 1 << 20, 512, bounded=True) and not TSPLIT.split_applies(1, 1 << 20, 512)
    assert not TSPLIT.split_applies(TS.FEW_ROWS + 1, 1 << 20, 512, bounded=True)
    monkeypatch.setenv(TSPLIT.SPLIT_ENV, "maybe")
    with pytest.raises(ValueError, match="SGLANG_DSV41_TOPK_SPLIT"):
        TSPLIT.split_applies(1, wide, 512)
    with pytest.raises(ValueError, match="k < segment"):
        TSPLIT.select_topk_split(torch.zeros(1, 10), 64, segment=64)

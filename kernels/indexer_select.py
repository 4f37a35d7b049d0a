"""Exact top-k selection over indexer scores (spec `model.md` §3.4.4; semantics =
`sglang_dsv41.reference.indexer`): `select_topk`, candidate blocks, and their combination per layer
role (`select_indices`), on the [N, E] fp32 scores of `kernels.indexer.index_scores`.

Top-k (`select_topk`): each fp32 score maps to an order-preserving int32 (−0 first made +0), and
key = int32·2^32 + (2^32 − 1 − j) in int64. Keys are distinct, and key order is exactly "score
descending (as reals), then index ascending" — the reference's stable descending sort order — so
`torch.topk` on keys returns the reference's set whatever its own tie handling; −∞ (not allowed)
ranks below every allowed score and is dropped, giving min(k, #allowed) like the reference. Cost
O(N·E) (radix selection, no E·log E sort of 10^6-entry rows), rows processed in chunks of at
most `max_chunk_elements` entries (int64 temporaries ≈ 28 B per entry); no host sync with
`check_nan=False`. Candidate blocks use the same selection on block keys.
"""
from __future__ import annotations

import math
import os

import torch
from torch import Tensor

from . import topk_select as TS
from . import topk_split as TSPLIT
from .fused_elementwise import INTERPRETED

NEG_INF = float("-inf")


def _order_keys(scores: Tensor) -> Tensor:
    """int64 keys, distinct per row, ordered by (score descending as reals, index ascending)."""
    canon = torch.where(scores == 0, torch.zeros_like(scores), scores)          # −0 → +0
    bits = canon.view(torch.int32).to(torch.int64)
    monotone = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)                    # order-preserving
    low = (2**32 - 1) - torch.arange(scores.shape[1], device=scores.device, dtype=torch.int64)
    return monotone * 2**32 + low[None, :]


#: How `select_topk` ranks (issue 21; timings: docs/performance.md "Session 12"): "torch" (int64
#: keys + torch.topk + sort) or "fused" (`kernels.topk_select`, one launch, the same result bit for
#: bit — so batch invariant too — rows of ≤ FUSED_MAX_ENTRIES columns). Default: "fused" for CUDA
#: scores, "torch" on CPU (the Triton interpreter's CPU tests stay on torch: the fused kernel's
#: interpreter cases live in tests/test_kernels_indexer.py); SGLANG_DSV41_INDEXER_TOPK overrides both.
TOPK_METHOD_ENV, TOPK_METHODS = "SGLANG_DSV41_INDEXER_TOPK", ("torch", "fused")


#: Whether CUDA-graph layouts tell the rankings each query's visible count (`select_indices(bounded=)`,
#: the same selections): "on" (default) or "off" (rank the static width, as before session 43; A/B runs).
BOUNDED_ENV, BOUNDED_CHOICES = "SGLANG_DSV41_TOPK_BOUNDED", ("on", "off")


def bounded_rankings() -> bool:
    """True unless SGLANG_DSV41_TOPK_BOUNDED=off; an unknown value raises."""
    chosen = os.environ.get(BOUNDED_ENV, "").strip().lower() or "on"
    if chosen not in BOUNDED_CHOICES:
        raise ValueError(f"{BOUNDED_ENV}={chosen!r}: expected one of {BOUNDED_CHOICES}")
    return chosen == "on"


def topk_method(cuda: bool = False) -> str:
    """The ranking method SGLANG_DSV41_INDEXER_TOPK names; when unset "fused" for CUDA scores
    (`cuda`), else "torch". An unknown value raises."""
    chosen = os.environ.get(TOPK_METHOD_ENV, "").strip().lower() or ("fused" if cuda else "torch")
    if chosen not in TOPK_METHODS:
        raise ValueError(f"{TOPK_METHOD_ENV}={chosen!r}: expected one of {TOPK_METHODS}")
    return chosen


def select_topk(scores: Tensor, k: int, *, check_nan: bool = True, max_chunk_elements: int = 1 << 24,
                method: str | None = None, lengths: Tensor | None = None) -> Tensor:
    """[N, k] int64: per row the min(k, #finite-or-+∞) columns with the largest scores, ties → lower column (−0 ==
    +0), sorted ascending, −1 padded — `top_k_lower_index_on_ties` with allowed = (score > −∞). NaN raises (one
    host sync; with `lengths`, NaN before a row's length) unless `check_nan=False` (then the caller guarantees
    none, e.g. inside a CUDA graph). `method` (default `topk_method(scores.is_cuda)`): "fused" ranks rows of ≤
    `topk_select.FUSED_MAX_ENTRIES` columns in one Triton launch, same result (few rows past its width in two
    stages, `kernels.topk_split`, as SGLANG_DSV41_TOPK_SPLIT picks). `lengths` [N] (integer, the scores'
    device): columns ≥ lengths[r] of row r are not allowed, whatever their scores. The fused kernels then read
    none of them, so a row costs its length, not E (a CUDA graph's static width; `topk_select` "Spans"): rows
    past the fused kernel's width go to the two stages when few, else to the fused kernel, never to the torch
    path."""
    if scores.dim() != 2 or scores.dtype != torch.float32:
        raise TypeError(f"select_topk: want a 2-D fp32 score tensor, got {scores.dtype} {tuple(scores.shape)}")
    if k < 1:
        raise ValueError(f"select_topk: k must be ≥ 1, got {k}")
    N, E = scores.shape
    out = torch.full((N, k), -1, dtype=torch.int64, device=scores.device)
    take = min(k, E)
    if N == 0 or take == 0:
        return out
    if lengths is not None and (lengths.shape != (N,) or lengths.device != scores.device):
        raise ValueError(f"select_topk: lengths must be [{N}] on {scores.device}, got {tuple(lengths.shape)} on "
                         f"{lengths.device}")
    if check_nan:
        nan = torch.isnan(scores)
        if lengths is not None:     # columns past a row's length are never read: any value there
            nan &= torch.arange(E, device=scores.device)[None, :] < lengths[:, None]
        if bool(nan.any()):
            raise ValueError("select_topk: NaN score (cannot be ranked)")
    if (method or topk_method(scores.is_cuda)) == "fused" and (scores.is_cuda or INTERPRETED):
        bounded = lengths is not None
        if TSPLIT.split_applies(N, E, k, bounded=bounded):
            return TSPLIT.select_topk_split(scores, k, lengths=lengths)
        if E <= TS.FUSED_MAX_ENTRIES or bounded:
            return TS.select_topk_fused(scores, k, lengths=lengths)
    if lengths is not None:
        cols = torch.arange(E, device=scores.device)
        scores = scores.masked_fill(cols[None, :] >= lengths[:, None], NEG_INF)
    big = torch.iinfo(torch.int64).max
    rows = max(1, max_chunk_elements // E)
    for r0 in range(0, N, rows):
        chunk = scores[r0:r0 + rows]
        idx = torch.topk(_order_keys(chunk), take, dim=1, sorted=False).indices
        allowed = chunk.gather(1, idx) > NEG_INF
        idx = torch.sort(torch.where(allowed, idx, big), dim=1).values
        out[r0:r0 + rows, :take] = torch.where(idx == big, -1, idx)
    return out


def candidate_blocks(scores: Tensor, n_visible: Tensor, block: int, topk_blocks: int, *,
                     check_nan: bool = True, bounded: bool = False) -> Tensor:
    """[N, topk_blocks] published block ids per query (spec §3.4.4): block b = entries
    [b·block, (b+1)·block); key_b = max visible score in b; the newest block ((n−1)//block) gets
    +∞; top-min(topk_blocks, ⌈n/block⌉), ties → lower block; ascending, −1 padded.
    `scores` must be unrestricted `index_scores` output up to each row's visible count (any value past it:
    blocks past the newest are masked, the newest one's key is +∞). `bounded`: the ranking of
    the block keys is told each row's block count (`select_topk(lengths=)`, the same result)."""
    if scores.dim() != 2 or n_visible.shape != scores.shape[:1] or block < 1:
        raise ValueError(f"candidate_blocks: scores {tuple(scores.shape)}, n_visible {tuple(n_visible.shape)}, "
                         f"block {block}")
    N, E = scores.shape
    n_blocks = -(-E // block)
    full = E // block
    keys = scores[:, :full * block].reshape(N, full, block).amax(dim=2)
    if E % block:
        keys = torch.cat((keys, scores[:, full * block:].amax(dim=1, keepdim=True)), dim=1)
    n = n_visible.to(torch.int64)
    b = torch.arange(n_blocks, device=scores.device)
    newest = torch.div(n - 1, block, rounding_mode="floor")
    keys = torch.where(b[None, :] == newest[:, None], math.inf, keys)
    n_blocks_visible = torch.div(n + block - 1, block, rounding_mode="floor")
    allowed = b[None, :] < n_blocks_visible[:, None]
    return select_topk(torch.where(allowed, keys, NEG_INF), topk_blocks, check_nan=check_nan,
                       lengths=n_blocks_visible if bounded else None)


def restrict_to_blocks(scores: Tensor, blocks: Tensor, block: int) -> Tensor:
    """scores with −∞ outside the row's published blocks (ids ≥ ⌈E/block⌉ hold no entry; −1 = none)."""
    if scores.dim() != 2 or blocks.dim() != 2 or blocks.shape[0] != scores.shape[0] or block < 1:
        raise ValueError(f"restrict_to_blocks: scores {tuple(scores.shape)}, blocks {tuple(blocks.shape)}, block {block}")
    N, E = scores.shape
    n_blocks = -(-E // block)
    ids = blocks.to(torch.int64)
    ids = torch.where((ids >= 0) & (ids < n_blocks), ids, n_blocks)              # spare column
    member = torch.zeros(N, n_blocks + 1, dtype=torch.bool, device=scores.device)
    member.scatter_(1, ids, True)
    inside = member[:, :n_blocks].repeat_interleave(block, dim=1)[:, :E]
    return scores.masked_fill(~inside, NEG_INF)


def select_in_blocks(scores: Tensor, blocks: Tensor, block: int, k: int, *, check_nan: bool = True,
                     lengths: Tensor | None = None) -> Tensor:
    """`select_topk(restrict_to_blocks(scores, blocks, block), k, lengths=lengths)` bit for bit, ranking
    only the published blocks' columns: they are gathered in ascending column order (blocks sorted,
    repeats, −1 and ids ≥ ⌈E/block⌉ dropped), ranked, and the chosen positions mapped back — the
    contract's tie break (lower column) is the lower position. O(N · blocks · block) instead of O(N · E):
    a candidate consumer's ranking costs its published blocks, not the row's (static) width."""
    if scores.dim() != 2 or blocks.dim() != 2 or blocks.shape[0] != scores.shape[0] or block < 1:
        raise ValueError(f"select_in_blocks: scores {tuple(scores.shape)}, blocks {tuple(blocks.shape)}, block {block}")
    N, E = scores.shape
    n_blocks = -(-E // block)
    ids = blocks.to(torch.int64)
    ids = torch.where((ids >= 0) & (ids < n_blocks), ids, n_blocks).sort(dim=1).values   # n_blocks: none
    repeat = torch.zeros_like(ids, dtype=torch.bool)
    repeat[:, 1:] = ids[:, 1:] == ids[:, :-1]
    ids = torch.where(repeat, n_blocks, ids)          # the live ids stay ascending
    cols = (ids[:, :, None] * block + torch.arange(block, device=scores.device)).view(N, -1)
    live = (ids[:, :, None] < n_blocks).expand(-1, -1, block).reshape(N, -1) & (cols < E)
    if lengths is not None:
        live = live & (cols < lengths.to(torch.int64)[:, None])
    picked = scores.gather(1, torch.where(live, cols, 0)).masked_fill(~live, NEG_INF)
    pos = select_topk(picked, k, check_nan=check_nan)
    return torch.where(pos >= 0, cols.gather(1, pos.clamp(min=0)), -1)


def select_indices(scores: Tensor, n_visible: Tensor, published_blocks: Tensor | None, *, index_topk: int,
                   block_size: int, topk_blocks: int, publish_blocks: bool,
                   check_nan: bool = True, bounded: bool = False) -> tuple[Tensor, Tensor | None]:
    """(selection [N, index_topk], blocks [N, topk_blocks] when `publish_blocks`, else None) from
    `index_scores`: blocks of `block_size` entries are published from the unrestricted scores;
    with `published_blocks` the ranking is restricted to those blocks first (`select_in_blocks` when
    the blocks hold fewer columns than the row, else `restrict_to_blocks`: the same result). `bounded`: each ranking
    is told the row's visible count (`select_topk(lengths=)`: the same result, read up to it only —
    for CUDA-graph layouts, whose score rows are as wide as the served context)."""
    blocks = (candidate_blocks(scores, n_visible, block_size, topk_blocks, check_nan=check_nan, bounded=bounded)
              if publish_blocks else None)
    lengths = n_visible if bounded else None
    if published_blocks is not None and published_blocks.shape[1] * block_size < scores.shape[1]:
        return select_in_blocks(scores, published_blocks, block_size, index_topk, check_nan=check_nan,
                                lengths=lengths), blocks
    ranked = scores if published_blocks is None else restrict_to_blocks(scores, published_blocks, block_size)
    return select_topk(ranked, index_topk, check_nan=check_nan, lengths=lengths), blocks


__all__ = ["BOUNDED_ENV", "NEG_INF", "TOPK_METHOD_ENV", "TOPK_METHODS", "bounded_rankings", "candidate_blocks",
           "restrict_to_blocks", "select_in_blocks", "select_indices", "select_topk", "topk_method"]

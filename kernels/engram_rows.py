"""Engram row ids of a batch from the per-request history ring, and the ring advanced, in two launches
(spec §3.3.1; issue 21).

`runtime/engram_rows.ring_rows_torch` reads the ring, forms each token's n-gram window, hashes it per
Engram layer and stores each request's new history in about sixty small torch launches per forward;
here:

* `engram_ring_rows`: one program per BLOCK_T tokens. Token t (request b, index i = t − starts[b] in
  its chunk, position p) takes for shift s = 0 … M−1 the id ids[t − s] when i ≥ s, else the history
  id hist[b, K + i − s] (the ring row req_rows[b]; none when the request's prefix is empty; none →
  the pad id); with an image id, ids ≥ MULTIMODAL_PAD_ID_BASE read as it, and every shift at or past
  the first image id is blocked, as are shifts s > p; a blocked shift reads the pad id. The ids go
  through the token map, then per layer H₁ = c₀·m₀, H_n = H_{n−1} XOR c_{n−1}·m_{n−1} (int64,
  wrapping) and column h of n-gram n ≥ 2 is H_n mod prime + offset (non-negative remainder):
  `EngramHasher.layer_row_ids` of `EngramHasher.compressed_window`.
* `advance_ring`: one program per request. The K ids before its new end (the chunk's own where it
  reaches back that far, else the history's) and the end seq_len are stored in its ring row; with
  `live_only`, only for requests whose last token is live (CUDA-graph padding writes nothing):
  `EngramHistoryRing.advance` of `history_tail`.

Integer arithmetic only, so the rows equal the torch path's exactly. Tensor-only signatures; no host
sync; CUDA-graph capturable.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .fused_elementwise import _launch_options, _pow2_at_least, check_device

#: ids from this base on are multimodal pad ids (`engram_hash.MULTIMODAL_PAD_ID_BASE`)
MULTIMODAL_PAD_ID_BASE = tl.constexpr(1_000_000)
#: the ring's "no id" (`runtime.engram_history.NO_TOKEN`)
NO_TOKEN = tl.constexpr(-1)
#: slots below this are the padding page (`runtime.batch.SLOT_GROUP`)
SLOT_GROUP = tl.constexpr(2)
TOKENS_PER_PROGRAM = 32


@triton.jit
def _engram_rows_kernel(ids_ptr, pos_ptr, token_req_ptr, starts_ptr, prefix_ptr, rows_ptr, ring_ptr, token_map_ptr,
                        mult_ptr, prime_ptr, offset_ptr, out_ptr, N, PAD, IMAGE,
                        K: tl.constexpr, M: tl.constexpr, HEADS: tl.constexpr, BLOCK_H: tl.constexpr, L: tl.constexpr,
                        BLOCK_L: tl.constexpr, HAS_IMAGE: tl.constexpr, BLOCK_T: tl.constexpr):
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    live = t < N
    b = tl.load(token_req_ptr + t, mask=live, other=0)
    local = t - tl.load(starts_ptr + b, mask=live, other=0)
    p = tl.load(pos_ptr + t, mask=live, other=0)
    ring_row = tl.load(rows_ptr + b, mask=live, other=0) * K
    fresh = tl.load(prefix_ptr + b, mask=live, other=0) == 0
    lay = tl.arange(0, BLOCK_L)
    live_l = lay < L
    head = tl.arange(0, BLOCK_H)
    col_mask = live_l[:, None] & (head < HEADS)[None, :]
    C: tl.constexpr = (M - 1) * HEADS
    h = tl.zeros((BLOCK_T, BLOCK_L), tl.int64)
    image_seen = t < 0
    for s in tl.static_range(M):
        back = local - s
        from_ids = tl.load(ids_ptr + tl.maximum(t - s, 0), mask=live, other=0)
        held = tl.load(ring_ptr + ring_row + tl.minimum(tl.maximum(back + K, 0), K - 1), mask=live & ~fresh,
                       other=NO_TOKEN).to(tl.int64)
        tok = tl.where(back >= 0, from_ids, tl.where(held >= 0, held, PAD))
        blocked = p < s
        if HAS_IMAGE:
            tok = tl.where(tok >= MULTIMODAL_PAD_ID_BASE, IMAGE, tok)
            image_seen = image_seen | (tok == IMAGE)
            blocked = blocked | image_seen
        tok = tl.where(blocked, PAD, tok)
        c = tl.load(token_map_ptr + tok, mask=live, other=0)
        m = tl.load(mult_ptr + lay * M + s, mask=live_l, other=0)
        h = h ^ (c[:, None] * m[None, :])
        if s >= 1:
            col = (s - 1) * HEADS + head
            at = lay[:, None] * C + col[None, :]
            prime = tl.load(prime_ptr + at, mask=col_mask, other=1)
            rem = h[:, :, None] % prime[None, :, :]
            rem = tl.where(rem < 0, rem + prime[None, :, :], rem)
            row = rem + tl.load(offset_ptr + at, mask=col_mask, other=0)[None, :, :]
            dst = (lay[None, :, None] * N + t[:, None, None]) * C + col[None, None, :]
            tl.store(out_ptr + dst, row, mask=live[:, None, None] & col_mask[None, :, :])


@triton.jit
def _advance_ring_kernel(ids_ptr, starts_ptr, ext_ptr, prefix_ptr, rows_ptr, out_ptr, ring_ptr, end_ptr, N,
                         K: tl.constexpr, BLOCK_K: tl.constexpr, LIVE_ONLY: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    n = tl.load(ext_ptr + b)
    start = tl.load(starts_ptr + b)
    prefix = tl.load(prefix_ptr + b)
    row = tl.load(rows_ptr + b)
    ring_row = row * K
    k = tl.arange(0, BLOCK_K)
    live_k = k < K
    offset = n - K + k
    from_batch = tl.load(ids_ptr + tl.minimum(tl.maximum(start + offset, 0), tl.maximum(N - 1, 0)),
                         mask=live_k & (offset >= 0), other=0)
    from_hist = tl.load(ring_ptr + ring_row + tl.minimum(tl.maximum(offset + K, 0), K - 1),
                        mask=live_k & (offset < 0) & (prefix != 0), other=NO_TOKEN)
    tail = tl.where(offset >= 0, from_batch, from_hist.to(tl.int64))
    write = n == n
    if LIVE_ONLY:
        last = tl.maximum(start + n - 1, 0)
        write = (n > 0) & (tl.load(out_ptr + last) >= SLOT_GROUP)
    tl.store(ring_ptr + ring_row + k, tail.to(tl.int32), mask=live_k & write)
    tl.store(end_ptr + row, prefix + n, mask=write)


def engram_ring_rows(ids: Tensor, positions: Tensor, token_req: Tensor, starts: Tensor, prefix_lens: Tensor,
                     req_rows: Tensor, ring_ids: Tensor, token_map: Tensor, multipliers: Tensor, primes: Tensor,
                     offsets: Tensor, *, heads: int, pad_id: int, image_id: int | None) -> Tensor:
    """int64 [L, N, (M−1)·heads]: every Engram layer's row ids of the N tokens (module doc). ids [N] int64
    (remapped), index tensors int64, ring_ids int32 [rows, K = M − 1], token_map int64, multipliers [L, M],
    primes / offsets [L, (M−1)·heads] int64."""
    L, M = multipliers.shape
    K, C = M - 1, (M - 1) * heads
    if ring_ids.dim() != 2 or ring_ids.shape[1] != K or ring_ids.dtype != torch.int32 or not ring_ids.is_contiguous():
        raise ValueError(f"engram_ring_rows: ring ids must be contiguous int32 [rows, {K}], got {ring_ids.dtype} "
                         f"{tuple(ring_ids.shape)}")
    if primes.shape != (L, C) or offsets.shape != (L, C):
        raise ValueError(f"engram_ring_rows: primes {tuple(primes.shape)} / offsets {tuple(offsets.shape)} for "
                         f"{L} layers of {C} columns")
    for name, x in (("ids", ids), ("token_map", token_map), ("multipliers", multipliers), ("primes", primes),
                    ("offsets", offsets), ("positions", positions), ("token_req", token_req)):
        if x.dtype != torch.int64 or not x.is_contiguous():
            raise ValueError(f"engram_ring_rows: {name} must be contiguous int64, got {x.dtype}")
    check_device("engram_ring_rows", ids, positions, token_req, starts, prefix_lens, req_rows, ring_ids, token_map,
                 multipliers, primes, offsets)
    N = ids.shape[0]
    out = torch.empty(L, N, C, dtype=torch.int64, device=ids.device)
    if N:
        _engram_rows_kernel[(triton.cdiv(N, TOKENS_PER_PROGRAM),)](
            ids, positions, token_req, starts, prefix_lens, req_rows, ring_ids, token_map, multipliers, primes,
            offsets, out, N, pad_id, -1 if image_id is None else image_id, K=K, M=M, HEADS=heads,
            BLOCK_H=_pow2_at_least(heads), L=L, BLOCK_L=_pow2_at_least(L), HAS_IMAGE=image_id is not None,
            BLOCK_T=TOKENS_PER_PROGRAM, **_launch_options())
    return out


def advance_ring(ids: Tensor, starts: Tensor, extend_lens: Tensor, prefix_lens: Tensor, req_rows: Tensor,
                 out_slots: Tensor, ring_ids: Tensor, ring_end: Tensor, *, live_only: bool) -> None:
    """After `engram_ring_rows` (it reads the rows this writes): each request's ring row advanced to its
    seq_len (module doc)."""
    if ring_end.dtype != torch.int64 or ring_end.shape != ring_ids.shape[:1] or ring_ids.dtype != torch.int32:
        raise ValueError(f"advance_ring: ring ids int32 [rows, K] and end int64 [rows], got {ring_ids.dtype} "
                         f"{tuple(ring_ids.shape)}, {ring_end.dtype} {tuple(ring_end.shape)}")
    check_device("advance_ring", ids, starts, extend_lens, prefix_lens, req_rows, out_slots, ring_ids, ring_end)
    B, K = req_rows.shape[0], ring_ids.shape[1]
    if B:
        _advance_ring_kernel[(B,)](ids, starts, extend_lens, prefix_lens, req_rows, out_slots, ring_ids, ring_end,
                                   ids.shape[0], K=K, BLOCK_K=_pow2_at_least(K), LIVE_ONLY=live_only,
                                   **_launch_options())


__all__ = ["advance_ring", "engram_ring_rows"]

"""Ratio-2 kv sources: the pair latents and the pending-pair ring in two launches (spec §3.4.3; issue 21).

`runtime/attention._write_compressed` forms, for every token t at position p of a ratio-2 kv source,
the candidate entry of the pair (p − 1, p) from the fp32 `wkv` / `wgate` outputs a, s [N, D] — the
first token's from the batch when p − 1 is in it, else from the request's pending-pair ring — then
stores the pending first tokens. In torch that is about sixty small launches per source and forward;
here it is two:

* `pair_latents`: one program per token. a₁, s₁ = a[t − 1], s[t − 1] when p > prefix_len of its
  request, else ring[req_row, ⌊(p−1)/2⌋ mod ring]; pooled = a₁σ₁ + a₂σ₂ with σ the softmax over the
  pair in `numerics.rounding.pair_pool`'s fp32 steps (max, differences, IEEE division, products
  rounded before the sum; no FMA); latent = RMSNorm(bf16(pooled)) rounded to BF16
  (`fused_elementwise.rms_row`, the `rms_norm` kernel's bits). Also the entry index (out_slot // 2 for
  live odd tokens, else −1) and the RoPE position max(p − 1, 0).
* `store_pending_pairs`: one program per request. A live request (its last token live, ≥ 1 token)
  whose last token sits at an even position stores that token's a, s and position in its ring slot;
  one ending at an odd position marks the slot empty (−1); other requests write nothing (the torch
  path writes their held values back: the same state).

exp. The exponentials of the pair softmax (arguments ≤ 0) are `double_fp32.exp_neg` rounded once to
fp32: the correctly rounded fp32 exp, which is what `pair_pool` gives with float64 exp (`exact`,
the reference) — except within ~2⁻⁴⁸ relative of a rounding boundary, and for results below 2⁻¹²⁶
(arguments under about −87), which are scaled in two roundings and may differ by one subnormal ulp.
torch's fp32 exp on CUDA (`expf`, the Triton backend's before this kernel) is within 2 ulps of it.

Tensor-only signatures; no host sync; CUDA-graph capturable. DSpark verify batches keep the torch path
(`store_block_pairs`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import double_fp32 as DF
from .fused_elementwise import _launch_options, _pow2, _pow2_at_least, _round_bf16, check_device, rms_row

#: the slot group of packed entries (`runtime.batch.SLOT_GROUP`): slots below it are the padding page
SLOT_GROUP = tl.constexpr(2)


@triton.jit
def exp_nonpositive(d):
    """fp32 exp(d) for fp32 d ≤ 0 (or NaN), rounded once from double-fp32 (module doc, "exp")."""
    m_h, m_l, k = DF.exp_neg(tl.maximum(d, -200.0))
    y = m_h + m_l
    k1 = tl.maximum(k, -120)
    y = y * _pow2(k1 + 127) * _pow2(tl.maximum(k - k1, -126) + 127)
    y = tl.where(d < -200.0, 0.0, y)
    return tl.where(d != d, d, y)


@triton.jit
def _pair_latents_kernel(a_ptr, s_ptr, a_stride, pos_ptr, token_req_ptr, prefix_ptr, rows_ptr, out_ptr,
                         ring_kv_ptr, ring_score_ptr, ring_slots, norm_ptr, latent_ptr, entry_ptr, rope_pos_ptr, D,
                         EPS_HI: tl.constexpr, EPS_LO: tl.constexpr, BLOCK_D: tl.constexpr, LOG2_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    live_d = d < D
    p = tl.load(pos_ptr + t)
    r = tl.load(token_req_ptr + t)
    in_batch = p > tl.load(prefix_ptr + r)
    first = tl.maximum(p - 1, 0)
    slot = (first // 2) & (ring_slots - 1)
    ring_row = (tl.load(rows_ptr + r) * ring_slots + slot) * D
    prev = tl.maximum(t - 1, 0)
    a2 = tl.load(a_ptr + t * a_stride + d, mask=live_d, other=0.0)
    s2 = tl.load(s_ptr + t * a_stride + d, mask=live_d, other=0.0)
    a1 = tl.where(in_batch, tl.load(a_ptr + prev * a_stride + d, mask=live_d, other=0.0),
                  tl.load(ring_kv_ptr + ring_row + d, mask=live_d & ~in_batch, other=0.0))
    s1 = tl.where(in_batch, tl.load(s_ptr + prev * a_stride + d, mask=live_d, other=0.0),
                  tl.load(ring_score_ptr + ring_row + d, mask=live_d & ~in_batch, other=0.0))
    m = tl.maximum(s1, s2, propagate_nan=tl.PropagateNan.ALL)
    e1 = exp_nonpositive(s1 - m)
    e2 = exp_nonpositive(s2 - m)
    total = e1 + e2
    pooled = a1 * tl.math.div_rn(e1, total) + a2 * tl.math.div_rn(e2, total)
    w = tl.load(norm_ptr + d, mask=live_d, other=0.0)
    latent = rms_row(tl.where(live_d, _round_bf16(pooled), 0.0), w, D, EPS_HI, EPS_LO, LOG2_D, True)
    tl.store(latent_ptr + t * D + d, latent, mask=live_d)
    out = tl.load(out_ptr + t)
    tl.store(entry_ptr + t, tl.where(((p % 2) == 1) & (out >= SLOT_GROUP), out // 2, -1))
    tl.store(rope_pos_ptr + t, first)


@triton.jit
def _store_pending_kernel(a_ptr, s_ptr, a_stride, pos_ptr, out_ptr, starts_ptr, ext_ptr, rows_ptr,
                          ring_kv_ptr, ring_score_ptr, ring_pos_ptr, ring_slots, D, BLOCK_D: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    n = tl.load(ext_ptr + r)
    last = tl.maximum(tl.load(starts_ptr + r) + n - 1, 0)
    live = (n > 0) & (tl.load(out_ptr + last) >= SLOT_GROUP)
    p = tl.load(pos_ptr + last)
    pending = live & ((p % 2) == 0)
    slot = (tl.maximum(p, 0) // 2) & (ring_slots - 1)
    at = tl.load(rows_ptr + r) * ring_slots + slot
    d = tl.arange(0, BLOCK_D)
    put = (d < D) & pending
    tl.store(ring_kv_ptr + at * D + d, tl.load(a_ptr + last * a_stride + d, mask=put, other=0.0), mask=put)
    tl.store(ring_score_ptr + at * D + d, tl.load(s_ptr + last * a_stride + d, mask=put, other=0.0), mask=put)
    tl.store(ring_pos_ptr + at, tl.where(pending, p, -1), mask=live)


def _pair_operands(a: Tensor, s: Tensor) -> tuple[int, int]:
    """(D, row stride) of a, s [N, D] fp32 with unit column stride and one row stride (e.g. halves of one
    stacked product)."""
    if a.shape != s.shape or a.dim() != 2 or a.dtype != torch.float32 or s.dtype != torch.float32:
        raise ValueError(f"pair state: a, s must be fp32 [N, D] of one shape, got {a.dtype} {tuple(a.shape)}, "
                         f"{s.dtype} {tuple(s.shape)}")
    if a.stride(1) != 1 or s.stride(1) != 1 or a.stride(0) != s.stride(0):
        raise ValueError(f"pair state: a, s need unit column strides and one row stride, got {a.stride()}, "
                         f"{s.stride()}")
    return a.shape[1], a.stride(0)


def _check_ring(kv: Tensor, score: Tensor, D: int) -> int:
    slots = kv.shape[1]
    if kv.shape != score.shape or kv.dim() != 3 or kv.shape[2] != D or not kv.is_contiguous() \
            or not score.is_contiguous() or kv.dtype != torch.float32 or score.dtype != torch.float32:
        raise ValueError(f"pair state: ring kv / score must be contiguous fp32 [rows, slots, {D}], got "
                         f"{tuple(kv.shape)}, {tuple(score.shape)}")
    if slots < 2 or slots & (slots - 1):
        raise ValueError(f"pair state: {slots} ring slots, expected a power of two ≥ 2")
    return slots


def pair_latents(a: Tensor, s: Tensor, positions: Tensor, token_req: Tensor, prefix_lens: Tensor, req_rows: Tensor,
                 out_slots: Tensor, ring_kv: Tensor, ring_score: Tensor, norm_weight: Tensor,
                 eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """(latents [N, D] fp32 holding BF16 values, entry indices [N] int64 (−1 = none), RoPE positions [N]
    int64) of the ratio-2 pairs ending at every token (module doc). Index tensors int64."""
    D, stride = _pair_operands(a, s)
    slots = _check_ring(ring_kv, ring_score, D)
    if norm_weight.shape != (D,):
        raise ValueError(f"pair_latents: norm weight {tuple(norm_weight.shape)} for latents of {D}")
    check_device("pair_latents", a, s, positions, token_req, prefix_lens, req_rows, out_slots, ring_kv, ring_score,
                 norm_weight)
    N = a.shape[0]
    latents = torch.empty(N, D, dtype=torch.float32, device=a.device)
    entries = torch.empty(N, dtype=torch.int64, device=a.device)
    rope_pos = torch.empty(N, dtype=torch.int64, device=a.device)
    if N:
        block = _pow2_at_least(D)
        eps_hi, eps_lo = DF.split_constant(float(eps))
        _pair_latents_kernel[(N,)](a, s, stride, positions, token_req, prefix_lens, req_rows, out_slots, ring_kv,
                                   ring_score, slots, norm_weight.to(torch.float32).contiguous(), latents, entries,
                                   rope_pos, D, EPS_HI=eps_hi, EPS_LO=eps_lo, BLOCK_D=block,
                                   LOG2_D=block.bit_length() - 1, **_launch_options(8 if block >= 4096 else 4))
    return latents, entries, rope_pos


def store_pending_pairs(a: Tensor, s: Tensor, positions: Tensor, out_slots: Tensor, starts: Tensor,
                        extend_lens: Tensor, req_rows: Tensor, ring_kv: Tensor, ring_score: Tensor,
                        ring_pos: Tensor) -> None:
    """After the layer's latents: each live request's pending first token into its ring slot (module doc)."""
    D, stride = _pair_operands(a, s)
    slots = _check_ring(ring_kv, ring_score, D)
    if ring_pos.shape != ring_kv.shape[:2] or ring_pos.dtype != torch.int64 or not ring_pos.is_contiguous():
        raise ValueError(f"store_pending_pairs: ring positions must be contiguous int64 {tuple(ring_kv.shape[:2])}")
    check_device("store_pending_pairs", a, s, positions, out_slots, starts, extend_lens, req_rows, ring_kv,
                 ring_score, ring_pos)
    B = req_rows.shape[0]
    if B:
        _store_pending_kernel[(B,)](a, s, stride, positions, out_slots, starts, extend_lens, req_rows, ring_kv,
                                    ring_score, ring_pos, slots, D, BLOCK_D=_pow2_at_least(D), **_launch_options())


__all__ = ["SLOT_GROUP", "exp_nonpositive", "pair_latents", "store_pending_pairs"]

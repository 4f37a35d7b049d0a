"""Sparse attention with a sink for prefill over BF16 rows, keys as the MMA's rows — Triton (spec
`model.md` §3.4.5; the invariant and the numerics of `sparse_attention`).

Same function as `sparse_attention.sparse_sink_attention` with one key split and BF16 compressed
rows (the prefill workspace of `runtime.attention_prefill`): o[t, h] = Σ_j e^{s_j} k_j /
(Σ_j e^{s_j} + e^{sink[h]}), s_j = scale · q[t, h]·k_j, keys the SWA rows at `swa_slots[t]` then the
compressed rows at `comp_slots[t]` (−1 = none), fp32 accumulation, P split into a BF16 high part and
remainder for P·V, one rounding to the output dtype. The oracle bound of `sparse_attention` holds
(≤ 1 BF16 ulp of the output scale from the float64 value).

Why a second kernel. One program of `sparse_attention` holds q·kᵀ as [heads, keys] with q as the
MMA's left operand; at 64 heads × 512 dims q and the [64, 512] fp32 accumulator do not fit one
program's registers (sm_90 build: 1,168 B/thread of spills at 8 warps, 5.6 KB at 16), so prefill
ran 16 heads a program, re-gathering every key row for each of the 4 head blocks (≈ 21 GB of
gathers at an 8K Flash prefill) on `mma.sync` tiles of 16 rows. Here the products are transposed:
sᵀ = k·qᵀ ([keys, heads]: the gathered key tile is the left operand, qᵀ the right one, which the
Hopper MMA reads from shared memory) and oᵀ += kᵀ·pᵀ ([dims, heads]: the key tile again, viewed
transposed). With BLOCK_N = 64 keys a tile is one 64-row `wgmma`; every head of the query shares the
tile, copied once (cp.async) into shared memory; the accumulator [512, 64] fp32 is 128 registers a
thread at 8 warps (the sm_90 build of the Flash plan: 214 KB of shared memory, 616 B/thread of
spills with a loop for each key list; 96 B as one loop over both, whose slot tensors the host casts to
one integer type). Measured: docs/performance.md "Session 33", "Session 45" and "Session 46".

Layout: the dims in two contiguous halves [0, P) and [P, 2P) (P = D/2), each a tile of its own (two
K = P products for the logits, two accumulators; measured 4 % faster than whole rows at Flash),
BF16 rows loaded as they are. The logits therefore sum the dims in another order than
`sparse_attention` (evens, then odds): the outputs may differ by an ulp where the exact value lies
near a rounding point. The sink is folded into the running state (m₀ = sink, l₀ = 1), as in `sparse_attention`.

Decode batches (`plan_decode`) split a query's key tiles over several programs (flash-decoding): each writes its
(m, l, unnormalised acc) to `sparse_attention`'s fp32 scratch and that module's merge kernel adds the sink, so
the bits depend on the split count.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import sparse_attention_prefill_heads as heads_kernel
from .sparse_attention import (MAX_SPLITS, _LOG2E, _dot, _load_slots, _merge_splits_kernel, _tile_source,
                               device_sm_count, merge_tile)
from .sparse_attention_checks import check_inputs

#: Keys per tile: the MMA's 64 rows.
BLOCK_N = 64


@dataclass(frozen=True)
class PrefillAttentionConfig:
    """Launch parameters: `block_h` heads per program (a power of two ≥ 16), Triton's `num_warps` /
    `num_stages`, `num_splits` key-tile splits per query (1..MAX_SPLITS; > 1: flash-decoding, each
    split's partial state merged by `sparse_attention`'s merge kernel), and `pv`, the P·V numerics:
    `split` (P as a BF16 high part + remainder, two products; the default), `fp16` (P and the key
    tile in FP16, one product: P to 2⁻¹¹ relative, within the serving bound; the sink added after the
    loop), `bf16` (P rounded to BF16, one product: FlashMLA's numerics, below the serving contract — a
    timing bound for benchmarks, never served). Measured: docs/performance.md "Session 44".
    `layout`: `keys` (this module's kernel, keys as the MMA's rows) or `heads`
    (`sparse_attention_prefill_heads`: heads as the rows; one split; `pv` split — as one product over
    duplicated rows —, bf16, or `split2`, the split as two products, for the benchmark), and its `tile_keys`
    keys a tile (16 or 32; 0: 32 under split, else 64). Triton's pipeliner prefetches a key tile
    ⌊(num_stages − 1) / 2⌋ tiles ahead (the slot → row chain is two loads deep), so the gather overlaps
    the products only from 5 stages, which fit shared memory at 16 keys a tile (docs/performance.md
    "Session 45")."""

    block_h: int
    num_warps: int
    num_stages: int
    num_splits: int = 1
    pv: str = "split"
    layout: str = "keys"
    tile_keys: int = 0

    PV_MODES = {"split": 0, "fp16": 1, "bf16": 2, "split2": 3}

    def __post_init__(self) -> None:
        if self.block_h < 16 or self.block_h & (self.block_h - 1):
            raise ValueError(f"PrefillAttentionConfig: block_h {self.block_h} (a power of two ≥ 16)")
        if self.num_warps not in (4, 8, 16) or self.num_stages < 1:
            raise ValueError(f"PrefillAttentionConfig: num_warps {self.num_warps} / num_stages {self.num_stages}")
        if not 1 <= self.num_splits <= MAX_SPLITS:
            raise ValueError(f"PrefillAttentionConfig: num_splits {self.num_splits} (1..{MAX_SPLITS})")
        if self.pv not in self.PV_MODES:
            raise ValueError(f"PrefillAttentionConfig: pv {self.pv!r} (one of {sorted(self.PV_MODES)})")
        if self.layout not in ("keys", "heads"):
            raise ValueError(f"PrefillAttentionConfig: layout {self.layout!r} (keys or heads)")
        if self.layout == "heads" and (self.num_splits != 1 or self.pv == "fp16"):
            raise ValueError("PrefillAttentionConfig: the heads layout takes one split and pv split / bf16 / split2")
        if self.tile_keys not in (0, 16, 32) or (self.tile_keys and self.layout != "heads"):
            raise ValueError(f"PrefillAttentionConfig: tile_keys {self.tile_keys} (16 or 32, the heads layout's)")
        if self.layout == "keys" and self.pv == "split2":
            raise ValueError("PrefillAttentionConfig: pv split2 is the heads layout's (keys: split is two products)")


def plan(num_heads: int, head_dim: int) -> PrefillAttentionConfig:
    """Every head in one program up to 64 (more: blocks of 64), 8 warps, 2 stages, one split."""
    del head_dim
    return PrefillAttentionConfig(block_h=min(64, max(16, triton.next_power_of_2(num_heads))), num_warps=8,
                                  num_stages=2)


def plan_heads(num_heads: int, head_dim: int) -> PrefillAttentionConfig:
    """`plan` in the heads layout (32-key tiles of duplicated rows, 2 stages: the fastest heads candidate
    measured; the runtime's `heads` prefill choice; docs/performance.md "Session 45")."""
    return dataclasses.replace(plan(num_heads, head_dim), layout="heads")


def plan_decode(num_queries: int, num_heads: int, head_dim: int, window: int, topk: int,
                sm_count: int) -> PrefillAttentionConfig:
    """`plan` with the key tiles of a query split over as many programs as the multiprocessors hold
    without a second wave (⌊sm_count / (queries · head blocks)⌋, at least 1, at most one split per tile
    and MAX_SPLITS). The split count depends on the batch's size, so a query's bits do too (the serving
    mode's decode, not the deterministic one's)."""
    base = plan(num_heads, head_dim)
    tiles = triton.cdiv(window, BLOCK_N) + triton.cdiv(topk, BLOCK_N)
    programs = max(1, num_queries) * triton.cdiv(num_heads, base.block_h)
    splits = max(1, min(tiles, MAX_SPLITS, sm_count // programs))
    return PrefillAttentionConfig(base.block_h, base.num_warps, base.num_stages, splits)


@triton.jit
def _attend_keys(acc_a, acc_b, m_i, l_i, qt_a, qt_b, k_a, k_b, valid, qk_scale_log2, DOT_FP32: tl.constexpr,
                 PV_MODE: tl.constexpr):
    """One online-softmax step over a key tile, transposed: sᵀ [keys, heads] = k_a·qt_a + k_b·qt_b
    (dims [0, P) then [P, 2P)), max and sum over the keys (axis 0), oᵀ += kᵀ·pᵀ for both halves
    (`PrefillAttentionConfig.pv`: PV_MODE 0 split, 1 fp16, 2 bf16)."""
    s = _dot(k_b, qt_b, _dot(k_a, qt_a, None, DOT_FP32), DOT_FP32) * qk_scale_log2
    s = tl.where(valid[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=0))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)              # nothing seen yet: no rescale
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[None, :])
    l_i = l_i * alpha + tl.sum(p, axis=0)
    if PV_MODE == 0:
        p_hi = p.to(tl.bfloat16)
        p_lo = (p - p_hi.to(tl.float32)).to(tl.bfloat16)
        acc_a = _dot(tl.trans(k_a), p_lo, _dot(tl.trans(k_a), p_hi, acc_a * alpha[None, :], DOT_FP32), DOT_FP32)
        acc_b = _dot(tl.trans(k_b), p_lo, _dot(tl.trans(k_b), p_hi, acc_b * alpha[None, :], DOT_FP32), DOT_FP32)
    elif PV_MODE == 1:
        p16 = p.to(tl.float16)
        acc_a = _dot(tl.trans(k_a).to(tl.float16), p16, acc_a * alpha[None, :], DOT_FP32)
        acc_b = _dot(tl.trans(k_b).to(tl.float16), p16, acc_b * alpha[None, :], DOT_FP32)
    else:
        p_hi = p.to(tl.bfloat16)
        acc_a = _dot(tl.trans(k_a), p_hi, acc_a * alpha[None, :], DOT_FP32)
        acc_b = _dot(tl.trans(k_b), p_hi, acc_b * alpha[None, :], DOT_FP32)
    return acc_a, acc_b, m_new, l_i


@triton.jit
def _keys_tile(rows_ptr, row_stride, slots, first, n_keys, offs_n, offs_p, p_mask, half_cols):
    """(valid, k_a, k_b): dims [0, P) and [P, 2P) (P = half_cols) of the BF16 rows of keys
    first … first + BLOCK_N − 1 of one slot list (zeros where the slot is −1 or past the list)."""
    slot = _load_slots(slots, first, n_keys, offs_n)
    valid = slot >= 0
    rows = rows_ptr + slot[:, None] * row_stride + offs_p[None, :]
    mask = valid[:, None] & p_mask[None, :]
    return valid, tl.load(rows, mask=mask, other=0.0), tl.load(rows + half_cols, mask=mask, other=0.0)


@triton.jit
def _prefill_attn_kernel(
        q_ptr, q_stride_n, q_stride_h,
        swa_ptr, swa_row_stride, swa_slots_ptr, swa_slots_stride, n_swa,
        comp_ptr, comp_row_stride, comp_slots_ptr, comp_slots_stride, n_comp,
        sink_ptr, out_ptr, out_stride_n, out_stride_h, part_acc_ptr, part_ml_ptr,
        H, D, qk_scale_log2, tiles_per_split,
        BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
        HAS_COMP: tl.constexpr, NUM_SPLITS: tl.constexpr, DOT_FP32: tl.constexpr, PV_MODE: tl.constexpr):
    """One program = one query × BLOCK_H heads × one split of its key tiles (the SWA tiles, then the
    compressed ones). D = 2·P dims in two halves of P ≤ BLOCK_P (D even); BF16 rows, row strides in
    elements. NUM_SPLITS > 1: (m, l, unnormalised acc) to `sparse_attention`'s fp32 scratch layout."""
    t = tl.program_id(0)
    split = tl.program_id(2)
    half = D // 2
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_p = tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    h_mask = offs_h < H
    p_mask = offs_p < half
    ph_mask = p_mask[:, None] & h_mask[None, :]
    qt_a_ptr = q_ptr + t.to(tl.int64) * q_stride_n + offs_h[None, :] * q_stride_h + offs_p[:, None]
    qt_a = tl.load(qt_a_ptr, mask=ph_mask, other=0.0)                     # [BLOCK_P, BLOCK_H]
    qt_b = tl.load(qt_a_ptr + half, mask=ph_mask, other=0.0)
    if NUM_SPLITS == 1 and PV_MODE != 1:  # the sink folded into the running state: m₀ = sink, l₀ = 1
        sink = tl.load(sink_ptr + offs_h, mask=h_mask, other=0.0) * 1.4426950408889634
        m_i = sink
        l_i = tl.where(sink == float("-inf"), 0.0, 1.0)
    else:                                 # the merge or the store adds the sink (fp16: P ≤ 1 by the keys' own max)
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
    acc_a = tl.zeros([BLOCK_P, BLOCK_H], tl.float32)
    acc_b = tl.zeros([BLOCK_P, BLOCK_H], tl.float32)
    swa_tiles = tl.cdiv(n_swa, BLOCK_N)
    comp_tiles = tl.cdiv(n_comp, BLOCK_N)
    tiles = swa_tiles + comp_tiles if HAS_COMP else swa_tiles
    if NUM_SPLITS == 1:                   # every tile: the SWA tiles, then the compressed ones
        tile_lo, tile_hi = 0, tiles
    else:                                 # tiles [lo, hi) of that sequence
        tile_lo = split * tiles_per_split
        tile_hi = tl.minimum(tile_lo + tiles_per_split, tiles)
    swa_slots = swa_slots_ptr + t.to(tl.int64) * swa_slots_stride
    comp_slots = comp_slots_ptr + t.to(tl.int64) * comp_slots_stride
    for tile in range(tile_lo, tile_hi):
        rows_ptr, row_stride, slots, first, n_keys = _tile_source(tile, swa_tiles, BLOCK_N, swa_ptr, swa_row_stride,
                                                                  swa_slots, n_swa, comp_ptr, comp_row_stride,
                                                                  comp_slots, n_comp)
        valid, k_a, k_b = _keys_tile(rows_ptr, row_stride, slots, first, n_keys, offs_n, offs_p, p_mask, half)
        acc_a, acc_b, m_i, l_i = _attend_keys(acc_a, acc_b, m_i, l_i, qt_a, qt_b, k_a, k_b, valid, qk_scale_log2,
                                              DOT_FP32, PV_MODE)
    if NUM_SPLITS == 1 and PV_MODE == 1:  # the sink added last: l = l·2^(m − m') + 2^(sink − m'), m' = max
        sink = tl.load(sink_ptr + offs_h, mask=h_mask, other=0.0) * 1.4426950408889634
        m_fin = tl.maximum(m_i, sink)
        m_ref = tl.where(m_fin == float("-inf"), 0.0, m_fin)
        alpha = tl.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.exp2(sink - m_ref)
        acc_a = acc_a * alpha[None, :]
        acc_b = acc_b * alpha[None, :]
    if NUM_SPLITS == 1:
        out_a = out_ptr + t.to(tl.int64) * out_stride_n + offs_h[None, :] * out_stride_h + offs_p[:, None]
        tl.store(out_a, (acc_a / l_i[None, :]).to(out_ptr.dtype.element_ty), mask=ph_mask)
        tl.store(out_a + half, (acc_b / l_i[None, :]).to(out_ptr.dtype.element_ty), mask=ph_mask)
    else:                                 # scratch: acc [N, S, H, D], (m, l) [N, S, 2, H], fp32
        row = t.to(tl.int64) * NUM_SPLITS + split
        part_a = part_acc_ptr + (row * H + offs_h[None, :]) * D + offs_p[:, None]
        tl.store(part_a, acc_a, mask=ph_mask)
        tl.store(part_a + half, acc_b, mask=ph_mask)
        tl.store(part_ml_ptr + row * 2 * H + offs_h, m_i, mask=h_mask)
        tl.store(part_ml_ptr + row * 2 * H + H + offs_h, l_i, mask=h_mask)


def prefill_sink_attention(q: Tensor, swa_cache: Tensor, swa_slots: Tensor, comp_cache: Tensor | None,
                           comp_slots: Tensor | None, sink: Tensor, scale: float, *, out: Tensor | None = None,
                           config: PrefillAttentionConfig | None = None) -> Tensor:
    """`sparse_attention.sparse_sink_attention` (its arguments, BF16 rows only: `comp_cache` a
    [S, D] bf16 cache or None) on this module's kernel; `config` overrides `plan`. No host sync.
    Under `pv="fp16"` q and both row sources may instead all be FP16 (no conversion in the kernel)."""
    if comp_cache is not None and not isinstance(comp_cache, Tensor):
        raise ValueError("prefill_sink_attention: comp_cache must be BF16 rows (a packed source: sparse_sink_attention)")
    fp16_rows = config is not None and config.pv == "fp16" and q.dtype == torch.float16
    check_inputs(q, swa_cache, swa_slots, comp_cache, comp_slots, sink, scale, out,
                 row_dtype=torch.float16 if fp16_rows else torch.bfloat16)
    N, H, D = q.shape
    interpreted = not isinstance(_prefill_attn_kernel, triton.runtime.jit.JITFunction)
    if q.device.type != "cuda" and not interpreted:
        raise ValueError(f"prefill_sink_attention: tensors on {q.device} need a CUDA device, or TRITON_INTERPRET=1 "
                         "set before this module is imported (Triton's CPU interpreter)")
    out = torch.empty_like(q) if out is None else out
    if N == 0:
        return out
    cfg = config or plan(H, D)
    K = comp_slots.shape[1] if comp_slots is not None else 0
    has_comp = comp_cache is not None and K > 0
    comp_arg = comp_cache if has_comp else swa_cache
    comp_slots_arg = comp_slots if has_comp else swa_slots
    swa_slots = swa_slots.to(comp_slots_arg.dtype)   # one loop over both lists: slot tensors of one integer type
    block_p = max(16, triton.next_power_of_2(D // 2))
    if cfg.layout == "heads":
        keys = cfg.tile_keys or (BLOCK_N // 2 if cfg.pv == "split" else BLOCK_N)
        heads_kernel.launch(q, swa_cache, swa_slots, comp_arg, comp_slots_arg, K, has_comp, sink, out,
                            float(scale) * _LOG2E, cfg.block_h, block_p, keys, cfg.PV_MODES[cfg.pv], cfg.num_warps,
                            cfg.num_stages, interpreted)
        return out
    W = swa_slots.shape[1]
    tiles = max(1, triton.cdiv(W, BLOCK_N) + (triton.cdiv(K, BLOCK_N) if has_comp else 0))
    tiles_per_split = triton.cdiv(tiles, min(cfg.num_splits, tiles))
    splits = triton.cdiv(tiles, tiles_per_split)                      # no empty split
    f32 = dict(dtype=torch.float32, device=q.device)                  # scratch; unused (= out) at one split
    part_acc = torch.empty(N, splits, H, D, **f32) if splits > 1 else out
    part_ml = torch.empty(N, splits, 2, H, **f32) if splits > 1 else out
    _prefill_attn_kernel[(N, triton.cdiv(H, cfg.block_h), splits)](
        q, q.stride(0), q.stride(1),
        swa_cache, swa_cache.stride(0), swa_slots, swa_slots.stride(0), W,
        comp_arg, comp_arg.stride(0), comp_slots_arg, comp_slots_arg.stride(0), K,
        sink, out, out.stride(0), out.stride(1), part_acc, part_ml, H, D, float(scale) * _LOG2E, tiles_per_split,
        BLOCK_H=cfg.block_h, BLOCK_P=block_p, BLOCK_N=BLOCK_N, HAS_COMP=has_comp, NUM_SPLITS=splits,
        DOT_FP32=interpreted, PV_MODE=cfg.PV_MODES[cfg.pv], num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if splits > 1:
        merge_h, merge_d = merge_tile(N, H, max(16, triton.next_power_of_2(D)), device_sm_count(q.device))
        _merge_splits_kernel[(N, triton.cdiv(H, merge_h), triton.cdiv(D, merge_d))](
            part_acc, part_ml, sink, out, out.stride(0), out.stride(1), H, D,
            BLOCK_H=merge_h, BLOCK_D=merge_d, NUM_SPLITS=splits, num_warps=4)
    return out


__all__ = ["BLOCK_N", "PrefillAttentionConfig", "plan", "plan_decode", "plan_heads", "prefill_sink_attention"]

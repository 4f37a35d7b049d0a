"""Sparse attention with a sink for prefill over BF16 rows, heads as the MMA's rows — Triton (spec
`model.md` §3.4.5; the function and the numerics of `sparse_attention_prefill`, `layout="heads"`).

The same function as `sparse_attention_prefill._prefill_attn_kernel` (one query × every head a program,
the SWA tiles then the compressed ones, dims in two halves, fp32 logits, an online softmax in the log2
domain with the sink folded into the running state, one rounding) with the products in the usual
orientation: s = q·kᵀ is [heads, keys] (q the MMA's left operand from shared memory) and o += p·k is
[heads, dims] with p the left operand from registers, so P never goes through shared memory.

P·V in the serving numerics (`pv="split"`, P = a BF16 high part + a BF16 remainder, fp32 sums) as one
product: a tile of KEYS keys is gathered as 2·KEYS rows, rows 2j and 2j + 1 holding key j; the even
columns of s are the logits (the odd ones, the same products, are dropped, so both parts of a key come
from one logit), and the left operand interleaves the high parts and the remainders: the sums of two
products in one K = 2·KEYS `wgmma` chain, with no spills where two products spill ≈ 600 B a thread
(docs/performance.md "Session 45"). `pv="split2"`: the two products (for the benchmark); `pv="bf16"`: P
rounded to BF16, FlashMLA's numerics, a timing bound never served. One split only (prefill); decode keeps
the keys layout. KEYS = 16 at 5–7 stages is the build whose key gathers overlap the products.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .sparse_attention import _dot, _load_slots, _tile_source


@triton.jit
def _attend_rows(acc_a, acc_b, m_i, l_i, q_a, q_b, k_a, k_b, valid, qk_scale_log2, KEYS: tl.constexpr,
                 DOT_FP32: tl.constexpr, PV_MODE: tl.constexpr):
    """One online-softmax step over a tile of rows: s [heads, rows] = q_a·k_aᵀ + q_b·k_bᵀ. PV_MODE 0: rows
    2j and 2j + 1 hold key j; the even columns are the logits, the odd ones are dropped (so a key's high
    part and remainder come from one logit), and P·V's left operand interleaves the two parts."""
    s = _dot(q_b, tl.trans(k_b), _dot(q_a, tl.trans(k_a), None, DOT_FP32), DOT_FP32) * qk_scale_log2
    s = tl.where(valid[None, :], s, float("-inf"))
    if PV_MODE == 0:
        s, _ = tl.split(tl.reshape(s, [s.shape[0], KEYS, 2]))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)              # nothing seen yet: no rescale
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    p_hi = p.to(tl.bfloat16)
    acc_a = acc_a * alpha[:, None]
    acc_b = acc_b * alpha[:, None]
    if PV_MODE == 0:                      # [hi₀, lo₀, hi₁, lo₁, …] against rows [k₀, k₀, k₁, k₁, …]
        p_hl = tl.reshape(tl.join(p_hi, (p - p_hi.to(tl.float32)).to(tl.bfloat16)), [s.shape[0], 2 * KEYS])
        acc_a = _dot(p_hl, k_a, acc_a, DOT_FP32)
        acc_b = _dot(p_hl, k_b, acc_b, DOT_FP32)
    elif PV_MODE == 3:
        p_lo = (p - p_hi.to(tl.float32)).to(tl.bfloat16)
        acc_a = _dot(p_lo, k_a, _dot(p_hi, k_a, acc_a, DOT_FP32), DOT_FP32)
        acc_b = _dot(p_lo, k_b, _dot(p_hi, k_b, acc_b, DOT_FP32), DOT_FP32)
    else:
        acc_a = _dot(p_hi, k_a, acc_a, DOT_FP32)
        acc_b = _dot(p_hi, k_b, acc_b, DOT_FP32)
    return acc_a, acc_b, m_new, l_i


@triton.jit
def _rows_tile(rows_ptr, row_stride, slots, first_key, n_keys, key_of_row, offs_p, p_mask, half_cols):
    """(valid, k_a, k_b) of the rows whose keys are first_key + key_of_row (zeros where −1 or past the list)."""
    slot = _load_slots(slots, first_key, n_keys, key_of_row)
    valid = slot >= 0
    rows = rows_ptr + slot[:, None] * row_stride + offs_p[None, :]
    mask = valid[:, None] & p_mask[None, :]
    return valid, tl.load(rows, mask=mask, other=0.0), tl.load(rows + half_cols, mask=mask, other=0.0)


@triton.jit
def _prefill_attn_heads_kernel(
        q_ptr, q_stride_n, q_stride_h,
        swa_ptr, swa_row_stride, swa_slots_ptr, swa_slots_stride, n_swa,
        comp_ptr, comp_row_stride, comp_slots_ptr, comp_slots_stride, n_comp,
        sink_ptr, out_ptr, out_stride_n, out_stride_h, H, D, qk_scale_log2,
        BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr, KEYS: tl.constexpr, HAS_COMP: tl.constexpr,
        DOT_FP32: tl.constexpr, PV_MODE: tl.constexpr):
    """One program = one query × BLOCK_H heads; KEYS keys a tile (2·KEYS rows under PV_MODE 0)."""
    t = tl.program_id(0)
    half = D // 2
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_p = tl.arange(0, BLOCK_P)
    h_mask = offs_h < H
    p_mask = offs_p < half
    hp_mask = h_mask[:, None] & p_mask[None, :]
    q_a_ptr = q_ptr + t.to(tl.int64) * q_stride_n + offs_h[:, None] * q_stride_h + offs_p[None, :]
    q_a = tl.load(q_a_ptr, mask=hp_mask, other=0.0)                      # [BLOCK_H, BLOCK_P]
    q_b = tl.load(q_a_ptr + half, mask=hp_mask, other=0.0)
    if PV_MODE == 0:
        key_of_row = tl.arange(0, 2 * KEYS) // 2
    else:
        key_of_row = tl.arange(0, KEYS)
    sink = tl.load(sink_ptr + offs_h, mask=h_mask, other=0.0) * 1.4426950408889634
    m_i = sink                            # the sink folded into the running state: m₀ = sink, l₀ = 1
    l_i = tl.where(sink == float("-inf"), 0.0, 1.0)
    acc_a = tl.zeros([BLOCK_H, BLOCK_P], tl.float32)
    acc_b = tl.zeros([BLOCK_H, BLOCK_P], tl.float32)
    swa_slots = swa_slots_ptr + t.to(tl.int64) * swa_slots_stride
    comp_slots = comp_slots_ptr + t.to(tl.int64) * comp_slots_stride
    swa_tiles = tl.cdiv(n_swa, KEYS)
    tiles = swa_tiles + tl.cdiv(n_comp, KEYS) if HAS_COMP else swa_tiles
    for tile in range(0, tiles):
        rows_ptr, row_stride, slots, first_key, n_keys = _tile_source(tile, swa_tiles, KEYS, swa_ptr, swa_row_stride,
                                                                      swa_slots, n_swa, comp_ptr, comp_row_stride,
                                                                      comp_slots, n_comp)
        valid, k_a, k_b = _rows_tile(rows_ptr, row_stride, slots, first_key, n_keys, key_of_row, offs_p, p_mask, half)
        acc_a, acc_b, m_i, l_i = _attend_rows(acc_a, acc_b, m_i, l_i, q_a, q_b, k_a, k_b, valid, qk_scale_log2, KEYS,
                                              DOT_FP32, PV_MODE)
    out_a = out_ptr + t.to(tl.int64) * out_stride_n + offs_h[:, None] * out_stride_h + offs_p[None, :]
    tl.store(out_a, (acc_a / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=hp_mask)
    tl.store(out_a + half, (acc_b / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=hp_mask)


def launch(q, swa_cache, swa_slots, comp_arg, comp_slots_arg, K: int, has_comp: bool, sink, out, scale_log2: float,
           block_h: int, block_p: int, keys: int, pv_mode: int, num_warps: int, num_stages: int,
           interpreted: bool) -> None:
    """The kernel over every query and head block (`sparse_attention_prefill.prefill_sink_attention`'s
    checked arguments)."""
    N, H, D = q.shape
    _prefill_attn_heads_kernel[(N, triton.cdiv(H, block_h))](
        q, q.stride(0), q.stride(1),
        swa_cache, swa_cache.stride(0), swa_slots, swa_slots.stride(0), swa_slots.shape[1],
        comp_arg, comp_arg.stride(0), comp_slots_arg, comp_slots_arg.stride(0), K,
        sink, out, out.stride(0), out.stride(1), H, D, scale_log2,
        BLOCK_H=block_h, BLOCK_P=block_p, KEYS=keys, HAS_COMP=has_comp, DOT_FP32=interpreted, PV_MODE=pv_mode,
        num_warps=num_warps, num_stages=num_stages)

"""Register-resident mHC coefficient kernel (`kernels.mhc.hc_coefficients(..., coeff="registers")`;
semantics and bound = `kernels.mhc`'s module doc, COEFFICIENT_BOUND).

Replaces `kernels.mhc._hc_coefficients_kernel` after the same partial-dot kernels. Grid
⌈T/REG_BLOCK_T⌉: a program takes REG_BLOCK_T tokens; each of a token's values is one element of
a [REG_BLOCK_T] vector. The chunk partials of a token are summed by a `tl.sum` (across lanes) per
CHUNKS_BLOCK chunks, the block sums added in chunk order (CHUNKS_BLOCK depends on hc·H only);
then the rsqrt, sigmoids and the hc × hc Sinkhorn run on the hc² comb values held as 16 separate
vectors: every row / column sum is element-wise adds in a fixed order (((a + b) + c) + d), so the
Sinkhorn needs no cross-lane reduction, shuffle, barrier or shared memory. Same operations and rounding
points as `_hc_coefficients_kernel` (fp32, IEEE `div_rn` / `sqrt_rn`, row softmax with the row
max subtracted, +ε, column normalise, then (iters − 1)×(row, column)); only the order of the
partial and 4-term sums may differ, so bits may differ from it (each within the bound).

hc = 4 only (the comb values are written out). Batch invariance: a token's coefficients are computed
from its own partials with T-independent shapes (masked tokens are discarded).
"""
from __future__ import annotations

import triton
import triton.language as tl

from sglang_dsv41.kernels.mhc_decode import _sigmoid

#: Tokens per program and warps of the register coefficient kernel (chunk tile [4, 32]: no spills).
REG_BLOCK_T = 4
REG_NUM_WARPS = 1
#: Chunk partials per `tl.sum` step (fewer when hc·H has fewer chunks; never depends on T).
REG_CHUNKS_BLOCK = 32
#: hc the register kernel is written for.
REG_HC = 4


@triton.jit
def _sum4(a, b, c, d):
    return ((a + b) + c) + d


@triton.jit
def _div4(a, b, c, d, s):
    return tl.div_rn(a, s), tl.div_rn(b, s), tl.div_rn(c, s), tl.div_rn(d, s)


@triton.jit
def _softmax4(a, b, c, d, EPS: tl.constexpr):
    """exp(x − max) / Σ exp + EPS over four values."""
    mx = tl.maximum(tl.maximum(tl.maximum(a, b), c), d)
    a = tl.exp(a - mx)
    b = tl.exp(b - mx)
    c = tl.exp(c - mx)
    d = tl.exp(d - mx)
    s = _sum4(a, b, c, d)
    return tl.div_rn(a, s) + EPS, tl.div_rn(b, s) + EPS, tl.div_rn(c, s) + EPS, tl.div_rn(d, s) + EPS


@triton.jit
def _normalise4(a, b, c, d, EPS: tl.constexpr):
    """x / (Σ x + EPS) over four values."""
    return _div4(a, b, c, d, _sum4(a, b, c, d) + EPS)


@triton.jit
def _dot_sum(row, c_ok, r: tl.constexpr):
    """Σ over the loaded chunk block of partial slot r: [BLOCK_T]."""
    return tl.sum(tl.load(row + r, mask=c_ok, other=0.0), axis=1)


@triton.jit
def _hc_coefficients_regs_kernel(part_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, T, K, NUM_CHUNKS,
                                 iters, SLOT: tl.constexpr, CHUNKS_BLOCK: tl.constexpr, BLOCK_T: tl.constexpr,
                                 RMS_EPS: tl.constexpr, HC_EPS: tl.constexpr):
    """BLOCK_T tokens (hc = 4): fixed-order partial sums, then rsqrt / sigmoid / Sinkhorn on
    per-lane values (module doc)."""
    HC: tl.constexpr = 4
    ROWS: tl.constexpr = HC * (2 + HC)
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < T
    zero = tl.zeros([BLOCK_T], dtype=tl.float32)
    ss = zero
    d0, d1, d2, d3, d4, d5, d6, d7 = zero, zero, zero, zero, zero, zero, zero, zero
    c00, c01, c02, c03, c10, c11, c12, c13 = zero, zero, zero, zero, zero, zero, zero, zero
    c20, c21, c22, c23, c30, c31, c32, c33 = zero, zero, zero, zero, zero, zero, zero, zero
    for c0 in range(0, NUM_CHUNKS, CHUNKS_BLOCK):
        c = c0 + tl.arange(0, CHUNKS_BLOCK)
        ok = t_ok[:, None] & (c < NUM_CHUNKS)[None, :]
        row = part_ptr + t[:, None] * NUM_CHUNKS * SLOT + c[None, :] * SLOT
        ss += _dot_sum(row, ok, ROWS)
        d0 += _dot_sum(row, ok, 0)
        d1 += _dot_sum(row, ok, 1)
        d2 += _dot_sum(row, ok, 2)
        d3 += _dot_sum(row, ok, 3)
        d4 += _dot_sum(row, ok, 4)
        d5 += _dot_sum(row, ok, 5)
        d6 += _dot_sum(row, ok, 6)
        d7 += _dot_sum(row, ok, 7)
        c00 += _dot_sum(row, ok, 8)
        c01 += _dot_sum(row, ok, 9)
        c02 += _dot_sum(row, ok, 10)
        c03 += _dot_sum(row, ok, 11)
        c10 += _dot_sum(row, ok, 12)
        c11 += _dot_sum(row, ok, 13)
        c12 += _dot_sum(row, ok, 14)
        c13 += _dot_sum(row, ok, 15)
        c20 += _dot_sum(row, ok, 16)
        c21 += _dot_sum(row, ok, 17)
        c22 += _dot_sum(row, ok, 18)
        c23 += _dot_sum(row, ok, 19)
        c30 += _dot_sum(row, ok, 20)
        c31 += _dot_sum(row, ok, 21)
        c32 += _dot_sum(row, ok, 22)
        c33 += _dot_sum(row, ok, 23)

    inv_rms = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(ss, K.to(tl.float32)) + RMS_EPS))
    a0 = tl.load(scale_ptr)
    a1 = tl.load(scale_ptr + 1)
    a2 = tl.load(scale_ptr + 2)
    out = pre_ptr + t * HC
    tl.store(out, _sigmoid(a0 * (d0 * inv_rms) + tl.load(base_ptr)) + HC_EPS, mask=t_ok)
    tl.store(out + 1, _sigmoid(a0 * (d1 * inv_rms) + tl.load(base_ptr + 1)) + HC_EPS, mask=t_ok)
    tl.store(out + 2, _sigmoid(a0 * (d2 * inv_rms) + tl.load(base_ptr + 2)) + HC_EPS, mask=t_ok)
    tl.store(out + 3, _sigmoid(a0 * (d3 * inv_rms) + tl.load(base_ptr + 3)) + HC_EPS, mask=t_ok)
    out = post_ptr + t * HC
    tl.store(out, 2.0 * _sigmoid(a1 * (d4 * inv_rms) + tl.load(base_ptr + 4)), mask=t_ok)
    tl.store(out + 1, 2.0 * _sigmoid(a1 * (d5 * inv_rms) + tl.load(base_ptr + 5)), mask=t_ok)
    tl.store(out + 2, 2.0 * _sigmoid(a1 * (d6 * inv_rms) + tl.load(base_ptr + 6)), mask=t_ok)
    tl.store(out + 3, 2.0 * _sigmoid(a1 * (d7 * inv_rms) + tl.load(base_ptr + 7)), mask=t_ok)

    b = base_ptr + 2 * HC                                     # logits[j][k] = a2·(dot·inv_rms) + base
    c00, c01, c02, c03 = _softmax4(a2 * (c00 * inv_rms) + tl.load(b), a2 * (c01 * inv_rms) + tl.load(b + 1),
                                   a2 * (c02 * inv_rms) + tl.load(b + 2), a2 * (c03 * inv_rms) + tl.load(b + 3),
                                   HC_EPS)
    c10, c11, c12, c13 = _softmax4(a2 * (c10 * inv_rms) + tl.load(b + 4), a2 * (c11 * inv_rms) + tl.load(b + 5),
                                   a2 * (c12 * inv_rms) + tl.load(b + 6), a2 * (c13 * inv_rms) + tl.load(b + 7),
                                   HC_EPS)
    c20, c21, c22, c23 = _softmax4(a2 * (c20 * inv_rms) + tl.load(b + 8), a2 * (c21 * inv_rms) + tl.load(b + 9),
                                   a2 * (c22 * inv_rms) + tl.load(b + 10), a2 * (c23 * inv_rms) + tl.load(b + 11),
                                   HC_EPS)
    c30, c31, c32, c33 = _softmax4(a2 * (c30 * inv_rms) + tl.load(b + 12), a2 * (c31 * inv_rms) + tl.load(b + 13),
                                   a2 * (c32 * inv_rms) + tl.load(b + 14), a2 * (c33 * inv_rms) + tl.load(b + 15),
                                   HC_EPS)
    c00, c10, c20, c30 = _normalise4(c00, c10, c20, c30, HC_EPS)
    c01, c11, c21, c31 = _normalise4(c01, c11, c21, c31, HC_EPS)
    c02, c12, c22, c32 = _normalise4(c02, c12, c22, c32, HC_EPS)
    c03, c13, c23, c33 = _normalise4(c03, c13, c23, c33, HC_EPS)
    for _ in range(1, iters):
        c00, c01, c02, c03 = _normalise4(c00, c01, c02, c03, HC_EPS)
        c10, c11, c12, c13 = _normalise4(c10, c11, c12, c13, HC_EPS)
        c20, c21, c22, c23 = _normalise4(c20, c21, c22, c23, HC_EPS)
        c30, c31, c32, c33 = _normalise4(c30, c31, c32, c33, HC_EPS)
        c00, c10, c20, c30 = _normalise4(c00, c10, c20, c30, HC_EPS)
        c01, c11, c21, c31 = _normalise4(c01, c11, c21, c31, HC_EPS)
        c02, c12, c22, c32 = _normalise4(c02, c12, c22, c32, HC_EPS)
        c03, c13, c23, c33 = _normalise4(c03, c13, c23, c33, HC_EPS)
    out = comb_ptr + t * (HC * HC)
    tl.store(out, c00, mask=t_ok)
    tl.store(out + 1, c01, mask=t_ok)
    tl.store(out + 2, c02, mask=t_ok)
    tl.store(out + 3, c03, mask=t_ok)
    tl.store(out + 4, c10, mask=t_ok)
    tl.store(out + 5, c11, mask=t_ok)
    tl.store(out + 6, c12, mask=t_ok)
    tl.store(out + 7, c13, mask=t_ok)
    tl.store(out + 8, c20, mask=t_ok)
    tl.store(out + 9, c21, mask=t_ok)
    tl.store(out + 10, c22, mask=t_ok)
    tl.store(out + 11, c23, mask=t_ok)
    tl.store(out + 12, c30, mask=t_ok)
    tl.store(out + 13, c31, mask=t_ok)
    tl.store(out + 14, c32, mask=t_ok)
    tl.store(out + 15, c33, mask=t_ok)


def launch_regs(partials, base, scale, pre, post, comb, *, K: int, num_chunks: int, slot: int, rms_eps: float,
                hc_eps: float, sinkhorn_iters: int, opts: dict) -> None:
    """`_hc_coefficients_regs_kernel` on partials [T, num_chunks, slot] (hc = REG_HC; base / scale
    fp32 contiguous); writes pre / post / comb."""
    T = partials.shape[0]
    chunks_block = min(REG_CHUNKS_BLOCK, 1 << max(0, (num_chunks - 1).bit_length()))
    _hc_coefficients_regs_kernel[(triton.cdiv(T, REG_BLOCK_T),)](
        partials, base, scale, pre, post, comb, T, K, num_chunks, sinkhorn_iters, SLOT=slot,
        CHUNKS_BLOCK=chunks_block, BLOCK_T=REG_BLOCK_T, RMS_EPS=float(rms_eps), HC_EPS=float(hc_eps), **opts)

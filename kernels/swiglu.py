"""Clamped SwiGLU in one launch: `clamped_swiglu` = `moe.clamped_swiglu` (spec `model.md` §3.6, §3.8).

bf16(silu(min(bf16(g), L))·clamp(bf16(u), −L, L)): the reference evaluates silu and the product in
float64 and rounds once; `swiglu_value` evaluates them in double-fp32 and rounds once, so its BF16
results equal the reference's except for rare one-ulp flips (`fused_elementwise` "fp64 results").
Outputs below 2⁻¹²⁶ in magnitude (gate < −87) are scaled in two roundings, so they may differ by
one subnormal ulp. Screen: an fp32 estimate (`_silu_mul_fp32`, ≤ 2⁻²⁰ relative for |g| ≤ 60)
decides a lane's BF16 result when it lies more than SWIGLU_SCREEN_ULPS fp32 ulps from a BF16
rounding boundary; otherwise its whole block takes the double-fp32 path — the same bits either way.
Every SwiGLU kernel (`stacked_halves` too) calls `swiglu_value`, so they agree bit for bit.

Batch invariance: blocks of SWIGLU_BLOCK elements, whatever the element count. No host
synchronisation: CUDA-graph capturable.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import double_fp32 as DF
from .fused_elementwise import _ELEMENTWISE_BLOCK, F32, INTERPRETED, _launch_options, _pow2, _round_bf16, check_device

#: `swiglu_value`'s screen: lanes whose fp32 estimate lies within this many fp32 ulps of a BF16
#: rounding boundary (twice the estimate's bound: `_silu_mul_fp32`) take the double-fp32 path
SWIGLU_SCREEN_ULPS = 32
_SCREEN_ULPS = tl.constexpr(SWIGLU_SCREEN_ULPS)
_LN2_HI = tl.constexpr(0.693115234375)        # ln 2 = HI + MID + rest, HI and MID of 12 significant bits
_LN2_MID = tl.constexpr(3.193318843841553e-05)  # (k·HI, k·MID exact for |k| < 2^12)
_LN2_REST = tl.constexpr(1.2996506e-08)


@triton.jit
def _silu_mul_exact(g, u):
    """silu(g)·u in double-fp32 rounded once to fp32, for BF16-valued g, u: for g < 0 as g·E/(1 + E),
    E = e^g = m·2^k, the 2^k applied last (in two normal steps) so g down to −200 keeps its fp32
    result; below, a signed zero with the reference's sign."""
    neg = g < 0.0
    m_h, m_l, k = DF.exp_neg(tl.maximum(-tl.abs(g), -200.0))
    e_scale = _pow2(tl.maximum(k, -126) + 127)                   # E = m·2^k (0 below 2^−126: negligible in 1 + E)
    e_scale = tl.where(k < -126, 0.0, e_scale)
    d_h, d_l = DF.df_add_f(m_h * e_scale, m_l * e_scale, 1.0)
    n_h = tl.where(neg, m_h, 1.0)
    n_l = tl.where(neg, m_l, 0.0)
    v_h, v_l = DF.df_mul_f(n_h, n_l, g)
    v_h, v_l = DF.df_mul_f(v_h, v_l, u)
    y_h, y_l = DF.df_div(v_h, v_l, d_h, d_l)
    y = y_h + y_l
    kk = tl.where(neg, k, 0)
    k1 = tl.maximum(kk, -120)
    y = y * _pow2(k1 + 127) * _pow2(tl.maximum(kk - k1, -126) + 127)
    return tl.where(y == 0.0, (g * u) * 0.0, y)                  # a zero keeps the reference's sign: sign(g)·sign(u)


@triton.jit
def _silu_mul_fp32(g, u):
    """fp32 estimate of silu(g)·u for |g| ≤ 60: E = e^−|g| = p(r)·2^k (Cody–Waite r, |r| ≤ ln2/2, degree-7
    Taylor p in fp32, truncation < 2^−27), then (g or g·E) / (1 + E) · u. Each of the ~11 roundings is
    ≤ 2^−24 relative, so |error| ≤ 2^−20·|value| (no FMA: the launch option)."""
    a = tl.maximum(-tl.abs(g), -60.0)
    k = (a * 1.4426950408889634 + 12582912.0) - 12582912.0        # RNE to an integer
    r = ((a - k * _LN2_HI) - k * _LN2_MID) - k * _LN2_REST
    p = 1.0 / 5040.0
    p = p * r + 1.0 / 720.0
    p = p * r + 1.0 / 120.0
    p = p * r + 1.0 / 24.0
    p = p * r + 1.0 / 6.0
    p = p * r + 0.5
    p = p * r + 1.0
    p = p * r + 1.0
    e = p * _pow2(k.to(tl.int32) + 127)
    num = tl.where(g < 0.0, g * e, g)
    return tl.math.div_rn(num, 1.0 + e) * u


@triton.jit
def swiglu_value(g, u, limit):
    """bf16(fp32(silu(g)·u)) of 1-D fp32 lanes g, u (rounded to BF16 and clamped here first), silu(g)
    = g/(1 + e^−g) rounded as the double-fp32 `_silu_mul_exact` gives it. Screened: the fp32 estimate
    decides a lane's BF16 result when it lies more than SWIGLU_SCREEN_ULPS fp32 ulps (twice its error
    bound) from a BF16 rounding boundary; if any lane of the block does not (≈ 0.1 % of lanes), or is
    zero, tiny, non-finite or has |g| > 60, the whole block takes the exact path. Every SwiGLU kernel
    calls this, so they agree bit for bit."""
    g = tl.minimum(_round_bf16(g), limit)
    u = _round_bf16(u)
    u = tl.minimum(tl.maximum(u, -limit), limit)
    y = _silu_mul_fp32(g, u)
    low = (y.to(tl.int32, bitcast=True) & 0xFFFF) - 0x8000       # fp32 ulps from the BF16 midpoint
    unsure = (tl.abs(low) <= _SCREEN_ULPS) | (tl.abs(g) > 60.0) | ~(tl.abs(y) >= 1e-30) | \
        (tl.abs(y) == float("inf"))
    if tl.max(unsure.to(tl.int32), axis=0) > 0:
        y = _silu_mul_exact(g, u)
    return _round_bf16(y)


@triton.jit
def _swiglu_kernel(g_ptr, u_ptr, out_ptr, n, limit, BLOCK: tl.constexpr):
    """`swiglu_value` over n elements."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = offs < n
    g = tl.load(g_ptr + offs, mask=live, other=1.0).to(tl.float32)     # dead lanes pass the screen
    u = tl.load(u_ptr + offs, mask=live, other=1.0).to(tl.float32)
    tl.store(out_ptr + offs, swiglu_value(g, u, limit), mask=live)


#: Elements per program of the SwiGLU kernels (compiled): `swiglu_value`'s screen sends a whole program to
#: the exact path when one lane is unsure (≈ 0.1 % of lanes), so small programs keep that rare
SWIGLU_BLOCK = _ELEMENTWISE_BLOCK if INTERPRETED else 128


def clamped_swiglu(gate: Tensor, up: Tensor, limit: float) -> Tensor:
    """`moe.clamped_swiglu`: bf16(silu(min(bf16(g), L))·clamp(bf16(u), −L, L)), silu and product in
    double-fp32 (screened: `swiglu_value`); fp32 out. Bound: module doc."""
    check_device("clamped_swiglu", gate, up)
    if gate.shape != up.shape:
        raise ValueError(f"clamped_swiglu: gate {tuple(gate.shape)} vs up {tuple(up.shape)}")
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty(gate.shape, dtype=F32, device=gate.device)
    n = gate.numel()
    if n:
        block = SWIGLU_BLOCK
        _swiglu_kernel[(triton.cdiv(n, block),)](gate, up, out, n, float(limit), BLOCK=block, **_launch_options())
    return out


__all__ = ["SWIGLU_BLOCK", "SWIGLU_SCREEN_ULPS", "clamped_swiglu", "swiglu_value"]

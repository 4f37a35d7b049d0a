"""RoPE on the last dims in one launch: `apply_rope_tail` = `ops.apply_rope_tail` (spec `model.md` §3.4.2).

The angle is the fp32 product p·f. The reference rounds float64 cos/sin of it once to fp32
(`ops.rope_cos_sin`); the kernel rounds a double-fp32 cos/sin once (`double_fp32.cos_sin`: π/2
reduction in four exact fp32 parts, Taylor in r²), so its fp32 cos/sin equal the reference's except
for rare one-ulp flips (`fused_elementwise` "fp64 results"): for |angle| < 2²⁴ the reduced argument
carries ≲ 2⁻⁴⁹ absolute error, flips being a little likelier within 2⁻⁵ of a multiple of π/2. The
rotation is fp32 products and sums in the reference's order (no FMA: `enable_fp_fusion=False`);
BF16 roundings are `fused_elementwise._round_bf16`'s.

Batch invariance: tiles of tokens × rows whose sizes depend only on the row count per token, never on
the number of tokens. No host synchronisation: CUDA-graph capturable.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import double_fp32 as DF
from .fused_elementwise import F32, INTERPRETED, _launch_options, _pow2_at_least, _round_bf16, check_device

_ROPE_HEAD_BLOCK = 128
# tokens × rows (heads) per program: one token's rows share its cos/sin; the interpreter (CPU) takes
# large tiles, since its cost is per program
_ROPE_TOKEN_BLOCK = 16 if INTERPRETED else 1
_ROPE_ROW_BLOCK = 64 if INTERPRETED else 8


@triton.jit
def _rope_tail_kernel(x_ptr, pos_ptr, freq_ptr, out_ptr, dst_ptr, out_stride, T, R, D, HEAD,
                      HALF: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_HEAD: tl.constexpr,
                      INVERSE: tl.constexpr, ROUND_BF16: tl.constexpr, ROUND_INPUT: tl.constexpr,
                      SCATTER: tl.constexpr, COPY_HEAD: tl.constexpr):
    """BLOCK_T tokens × BLOCK_R of their R rows (heads): dims [0, HEAD) copied (unless COPY_HEAD is
    off: out is x, rotated in place), the last 2·HALF rotated pairwise; cos/sin computed once per
    token and shared by its rows. ROUND_INPUT: x rounded to BF16 as loaded (`round_bf16`'s rounding,
    before the rotation). Token t's output starts at out_ptr + u·out_stride, u = dst[t] with SCATTER
    (rows of a cache), else t."""
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    r = tl.program_id(1).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    live = (t < T)[:, None, None] & (r < R)[None, :, None]                      # [BT, BR, 1]
    base = (t[:, None, None] * R + r[None, :, None]) * D
    if SCATTER:
        u = tl.load(dst_ptr + t, mask=t < T, other=0).to(tl.int64)
    else:
        u = t
    out_base = u[:, None, None] * out_stride + r[None, :, None] * D
    h = tl.arange(0, BLOCK_HEAD)[None, None, :]
    if COPY_HEAD:
        for h0 in range(0, HEAD, BLOCK_HEAD):
            hm = live & ((h0 + h) < HEAD)
            v = tl.load(x_ptr + base + h0 + h, mask=hm, other=0.0).to(tl.float32)
            if ROUND_BF16 or ROUND_INPUT:
                v = _round_bf16(v)
            tl.store(out_ptr + out_base + h0 + h, v, mask=hm)
    i = tl.arange(0, HALF)
    pos = tl.load(pos_ptr + t, mask=t < T, other=0).to(tl.float32)
    c, s = DF.cos_sin(pos[:, None] * tl.load(freq_ptr + i).to(tl.float32)[None, :])   # ≈ ops.rope_cos_sin
    if INVERSE:
        s = -s
    c = c[:, None, :]
    s = s[:, None, :]
    pa = base + HEAD + 2 * i[None, None, :]
    rm = live & (i[None, None, :] < HALF)
    a = tl.load(x_ptr + pa, mask=rm, other=0.0).to(tl.float32)
    b = tl.load(x_ptr + pa + 1, mask=rm, other=0.0).to(tl.float32)
    if ROUND_INPUT:
        a = _round_bf16(a)
        b = _round_bf16(b)
    ra = a * c - b * s                      # fp32 products and sum, no FMA (launch option)
    rb = a * s + b * c
    if ROUND_BF16:
        ra = _round_bf16(ra)
        rb = _round_bf16(rb)
    po = out_base + HEAD + 2 * i[None, None, :]
    tl.store(out_ptr + po, ra, mask=rm)
    tl.store(out_ptr + po + 1, rb, mask=rm)


def apply_rope_tail(x: Tensor, positions: Tensor, inv_freq: Tensor, inverse: bool = False,
                    round_bf16: bool = False, out_dtype: torch.dtype = F32, round_input: bool = False,
                    into: tuple[Tensor, Tensor] | None = None, in_place: bool = False) -> Tensor:
    """`ops.apply_rope_tail` (optionally preceded and / or followed by `ops.bf16`: `round_input`,
    `round_bf16`): x [T, ..., D] (any float dtype), positions [T]; the last 2·len(inv_freq) dims rotated
    in interleaved pairs; fp32 out, or with `round_bf16` BF16 out when `out_dtype` says so (the same
    values: half the bytes written). `into` = (cache [S, ...], rows [T] int): token t's result written to
    cache[rows[t]] instead (`cache[rows] = result` in the same launch; its dtype is the output's), and the
    cache returned. `in_place`: x (contiguous BF16, with `round_bf16` and a BF16 `out_dtype`, not `into`)
    rotated where it is and returned — only its last 2·len(inv_freq) dims are read and written; the
    other dims are BF16 already, so the values are the copy's. Bound: module doc."""
    check_device("apply_rope_tail", x, positions, inv_freq, *(into or ()))
    if in_place and not (x.dtype == torch.bfloat16 and x.is_contiguous() and round_bf16
                         and out_dtype == torch.bfloat16 and into is None):
        raise ValueError(f"apply_rope_tail: in_place needs a contiguous bfloat16 x rounded to a bfloat16 output "
                         f"(got {x.dtype}, contiguous={x.is_contiguous()}, round_bf16={round_bf16}, out_dtype "
                         f"{out_dtype}, into={into is not None})")
    if out_dtype != F32 and not (round_bf16 and out_dtype == torch.bfloat16):
        raise ValueError(f"apply_rope_tail: out_dtype {out_dtype} (bfloat16 only with round_bf16)")
    half = inv_freq.numel()
    D = x.shape[-1]
    if half & (half - 1) or 2 * half > D:
        raise ValueError(f"apply_rope_tail: {half} frequencies (a power of two, 2·{half} ≤ {D} dims required)")
    if x.dim() < 2 or positions.shape != (x.shape[0],):
        raise ValueError(f"apply_rope_tail: x {tuple(x.shape)} with positions {tuple(positions.shape)}")
    x = x.contiguous()
    rows = x.numel() // D
    if in_place:
        out, dst, out_stride = x, positions, rows * D // max(x.shape[0], 1)
    elif into is None:
        out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
        dst, out_stride = positions, rows * D // max(x.shape[0], 1)              # dst: unread without SCATTER
    else:
        out, dst = into
        if out.dtype != out_dtype or out.shape[1:] != x.shape[1:] or dst.shape != positions.shape \
                or out.stride()[1:] != x.stride()[1:]:                          # rows laid out as x's
            raise ValueError(f"apply_rope_tail: into a cache {out.dtype} {tuple(out.shape)} with rows "
                             f"{tuple(dst.shape)} for x {tuple(x.shape)} written as {out_dtype}")
        out_stride = out.stride(0)
    if rows:
        T, R = x.shape[0], rows // x.shape[0]
        block_t, block_r = _ROPE_TOKEN_BLOCK, min(_pow2_at_least(R), _ROPE_ROW_BLOCK)
        grid = (triton.cdiv(T, block_t), triton.cdiv(R, block_r))
        _rope_tail_kernel[grid](x, positions.contiguous(), inv_freq.contiguous(), out, dst.contiguous(), out_stride,
                                T, R, D, D - 2 * half, HALF=half, BLOCK_T=block_t, BLOCK_R=block_r,
                                BLOCK_HEAD=min(_ROPE_HEAD_BLOCK, _pow2_at_least(max(D - 2 * half, 1))),
                                INVERSE=inverse, ROUND_BF16=round_bf16, ROUND_INPUT=round_input,
                                SCATTER=into is not None, COPY_HEAD=not in_place, **_launch_options())
    return out


__all__ = ["apply_rope_tail"]

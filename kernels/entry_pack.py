"""Packed FP4 compressed entries encoded and scattered into their row buffers in one launch (spec
§3.4.3, contract §1–§2; issue 21): what `runtime/kv_layout.encode_entries` followed by
`write_source_entries` does in about a hundred torch launches per kv-source layer and forward.

One program per entry row t of latents [n, D] and keys [n, Dk] (fp32 or BF16, the pre-quantisation
RoPE'd values):
* latent part: per group of 16 dims scale = e4m3(clamp(amax·fp32(1/6), 2⁻⁹, 448)), codes
  rne_e2m1(clamp(x / scale, ±6)); bytes = D/2 nibble pairs (dim 2i low nibble) then D/16 E4M3 scale
  bytes;
* key part: per group of 32 dims scale = 2^⌈log2(max(amax, 6·2⁻¹²⁶)·fp32(1/6))⌉, codes as above;
  bytes = Dk/2 nibble pairs then Dk/32 biased exponent bytes;
* byte b of a part goes to row e·r + b // share, column offset + b % share of that part's buffer
  (e = entry_idx[t]), and the part's padding up to r·share bytes is written as zeros. Entry −1
  writes nothing (the torch path sends those rows to the never-read padding entry 0).
The scale and code formulas are `fused_elementwise`'s (`_e4m3_rne`, `_pow2_ceil`, `_e2m1_rne`, as its
`_group_quant_kernel` modes 1 and 2), so the bytes equal `encode_entries`' (tests/test_kernels_entry_pack.py).
Tensor-only signature; no host sync; CUDA-graph capturable.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .fused_elementwise import (_e2m1_rne, _e4m3_rne, _launch_options, _pow2, _pow2_at_least, _pow2_ceil,
                                check_device)

#: dims per scale: latent part (E4M3 scales), key part (UE8M0 scales)
LATENT_GROUP, KEY_GROUP = 16, 32


@triton.jit
def _codes(v):
    """4-bit E2M1 codes (uint8) of grid values: magnitude index in bits 0–2, sign (also of −0) in bit 3."""
    a = tl.abs(v)
    mag = tl.where(a < 2.0, a * 2.0, tl.where(a < 4.0, a + 2.0, a * 0.5 + 4.0)).to(tl.uint8)
    sign = ((v.to(tl.uint32, bitcast=True) >> 31) << 3).to(tl.uint8)
    return mag | sign


@triton.jit
def _e4m3_byte(s):
    """float8_e4m3fn bits of an fp32 value already on the E4M3 grid in [2⁻⁹, 448] (NaN → 0x7F)."""
    bits = s.to(tl.uint32, bitcast=True)
    exp = ((bits >> 23) & 0xFF).to(tl.int32) - 127
    normal = (((exp + 7) << 3) | ((bits >> 20) & 7).to(tl.int32))
    sub = (s * 512.0).to(tl.int32)                               # subnormal: s = m·2⁻⁹, m in 1..7
    out = tl.where(exp >= -6, normal, sub)
    return tl.where(s != s, 0x7F, out).to(tl.uint8)


@triton.jit
def _pack_part(x_row, rows_ptr, row_stride, entry, live, offset, share, ratio, n_pad,
               D: tl.constexpr, GROUP: tl.constexpr, GB: tl.constexpr, E4M3_SCALE: tl.constexpr,
               PAD: tl.constexpr):
    """Encode one part of one entry from its D values at x_row and scatter its bytes (module doc);
    GB: the part's D / GROUP groups rounded up to a power of two (masked)."""
    INV6 = 0.1666666716337204                                    # fp32(1/6)
    G: tl.constexpr = D // GROUP
    HALF: tl.constexpr = GROUP // 2
    g = tl.arange(0, GB)
    j = tl.arange(0, HALF)
    g_live = g < G
    d0 = g[:, None] * GROUP + 2 * j[None, :]                     # even dims [GB, HALF]
    xe = tl.load(x_row + d0, mask=g_live[:, None], other=0.0).to(tl.float32)
    xo = tl.load(x_row + d0 + 1, mask=g_live[:, None], other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(xe), axis=1), tl.max(tl.abs(xo), axis=1))
    if E4M3_SCALE:
        scale = _e4m3_rne(tl.minimum(tl.maximum(amax * INV6, 0.001953125), 448.0))
        full = tl.broadcast_to(scale[:, None], (GB, HALF))
        ve = _e2m1_rne(tl.minimum(tl.maximum(tl.math.div_rn(xe, full), -6.0), 6.0))
        vo = _e2m1_rne(tl.minimum(tl.maximum(tl.math.div_rn(xo, full), -6.0), 6.0))
        scale_byte = _e4m3_byte(scale)
    else:
        scale = _pow2_ceil(tl.maximum(amax, 7.052966104933725e-38) * INV6)
        biased = ((scale.to(tl.uint32, bitcast=True) >> 23) & 0xFF).to(tl.int32)
        inv = _pow2(254 - biased)[:, None]
        ve = _e2m1_rne(tl.minimum(tl.maximum(xe * inv, -6.0), 6.0))
        vo = _e2m1_rne(tl.minimum(tl.maximum(xo * inv, -6.0), 6.0))
        scale_byte = biased.to(tl.uint8)
    pairs = _codes(ve) | (_codes(vo) << 4)
    base = entry * ratio
    b = g[:, None] * HALF + j[None, :]                           # code bytes 0 .. D/2 − 1
    tl.store(rows_ptr + (base + b // share) * row_stride + offset + b % share, pairs,
             mask=live & g_live[:, None])
    s = D // 2 + g                                               # scale bytes
    tl.store(rows_ptr + (base + s // share) * row_stride + offset + s % share, scale_byte, mask=live & g_live)
    k = tl.arange(0, PAD)
    p = D // 2 + G + k                                           # padding to ratio·share bytes
    tl.store(rows_ptr + (base + p // share) * row_stride + offset + p % share, tl.zeros((PAD,), tl.uint8),
             mask=live & (k < n_pad))


@triton.jit
def _entry_pack_kernel(lat_ptr, key_ptr, entry_ptr, lat_rows_ptr, key_rows_ptr, lat_row_stride, key_row_stride,
                       lat_offset, lat_share, lat_pad, key_offset, key_share, key_pad, ratio,
                       D: tl.constexpr, DK: tl.constexpr, GB: tl.constexpr, GBK: tl.constexpr, PAD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    entry = tl.load(entry_ptr + t).to(tl.int64)
    live = entry >= 0
    entry = tl.maximum(entry, 0)
    _pack_part(lat_ptr + t * D, lat_rows_ptr, lat_row_stride, entry, live, lat_offset, lat_share, ratio, lat_pad,
               D, 16, GB, True, PAD)
    _pack_part(key_ptr + t * DK, key_rows_ptr, key_row_stride, entry, live, key_offset, key_share, ratio, key_pad,
               DK, 32, GBK, False, PAD)


def part_bytes(dim: int, group: int) -> int:
    """Bytes of one part: dim/2 code bytes and one scale byte per group."""
    return dim // 2 + dim // group


def write_packed_entries(latent_rows: Tensor, key_rows: Tensor, latent_cols: tuple[int, int],
                         key_cols: tuple[int, int], ratio: int, entry_idx: Tensor, latents: Tensor,
                         keys: Tensor) -> None:
    """Encode entries of (latents [n, D], keys [n, Dk]) and scatter them into the uint8 row buffers at
    `entry_idx` [n] (−1 = none) of a source of compress ratio `ratio` whose parts own the columns
    (offset, share) `latent_cols` / `key_cols` (module doc). D a multiple of 16, Dk of 32; valid entries
    distinct."""
    n, D = latents.shape
    Dk = keys.shape[1]
    if keys.shape[0] != n or entry_idx.shape != (n,):
        raise ValueError(f"write_packed_entries: latents {tuple(latents.shape)}, keys {tuple(keys.shape)}, "
                         f"entries {tuple(entry_idx.shape)}")
    for dim, group, what in ((D, LATENT_GROUP, "head_dim"), (Dk, KEY_GROUP, "index_head_dim")):
        if dim % group or dim == 0:
            raise ValueError(f"write_packed_entries: {what} {dim} is not a whole number of {group}-groups")
    pads = []
    for (offset, share), dim, group, rows in ((latent_cols, D, LATENT_GROUP, latent_rows),
                                              (key_cols, Dk, KEY_GROUP, key_rows)):
        pad = ratio * share - part_bytes(dim, group)
        if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.stride(1) != 1 or not 0 <= pad < 4 \
                or offset + share > rows.shape[1]:
            raise ValueError(f"write_packed_entries: columns ({offset}, {share}) × ratio {ratio} for a "
                             f"{part_bytes(dim, group)}-byte part in rows {rows.dtype} {tuple(rows.shape)}")
        pads.append(pad)
    check_device("write_packed_entries", latent_rows, key_rows, entry_idx, latents, keys)
    if n == 0:
        return
    _entry_pack_kernel[(n,)](latents.contiguous(), keys.contiguous(), entry_idx.contiguous(), latent_rows, key_rows,
                             latent_rows.stride(0), key_rows.stride(0), latent_cols[0], latent_cols[1], pads[0],
                             key_cols[0], key_cols[1], pads[1], ratio, D=D, DK=Dk,
                             GB=_pow2_at_least(D // LATENT_GROUP), GBK=_pow2_at_least(Dk // KEY_GROUP), PAD=4,
                             **_launch_options(4))


__all__ = ["write_packed_entries", "part_bytes"]

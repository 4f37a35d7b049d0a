"""Exact encode/decode of the checkpoint's quantised formats (spec `model.md` §2.3).

* UE8M0 scale byte `e` (safetensors F8_E8M0, torch `float8_e8m0fnu`): value 2^(e−127);
  byte 0 is 2^−127 (there is no zero), byte 255 is NaN.
* FP8 dense weights: E4M3 values, one UE8M0 scale per **2-D 32×32 tile**
  (`W[r, c] = fp8(W)[r, c] · scale[r // 32, c // 32]`); edge tiles may be partial.
* MXFP4 routed experts: E2M1 codes, two per byte (**low nibble = even element**), one UE8M0
  scale per 32 consecutive input elements of a row (scale layout [out, in/32]).
* Engram tables: E4M3 values, one UE8M0 scale per 32 values of a row; decoded in fp32 and
  rounded **once** to BF16.

Decoding is exact (every decoded value is a product of two exactly representable numbers,
computed in fp32). Encoding is what the synthetic-checkpoint writer uses: power-of-two scales
chosen as the smallest power of two that makes the group's amax fit the element format (448
for E4M3, 6 for E2M1), so no value is ever clipped; E4M3 rounding is torch's cast (round to
nearest even), E2M1 rounding is round to nearest with ties to the even code (even mantissa).

Packed FP4 tensors are accepted as uint8, int8 (same bytes) or torch's `float4_e2m1fn_x2`.
"""
from __future__ import annotations

import torch
from torch import Tensor

TILE = 32  # FP8 tile edge; MXFP4 / Engram scale group length
E4M3_MAX = 448.0
E2M1_MAX = 6.0
UE8M0_BIAS = 127
UE8M0_NAN_BYTE = 255

# E2M1 code → value (spec §2.3); bit 3 is the sign, code 8 is −0.
E2M1_VALUES: tuple[float, ...] = (
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
)
# Midpoints between consecutive non-negative E2M1 magnitudes (codes i and i+1).
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)

_FLOAT8_E8M0 = torch.float8_e8m0fnu
_FLOAT8_E4M3 = torch.float8_e4m3fn
_FLOAT4_X2 = getattr(torch, "float4_e2m1fn_x2", None)


# ---------------------------------------------------------------------------------------------
# UE8M0 scales
# ---------------------------------------------------------------------------------------------
def scale_bytes(scale: Tensor) -> Tensor:
    """The raw UE8M0 bytes of a scale tensor stored as `float8_e8m0fnu` or `uint8`."""
    if scale.dtype == _FLOAT8_E8M0:
        return scale.view(torch.uint8)
    if scale.dtype == torch.uint8:
        return scale
    raise TypeError(f"UE8M0 scales must be float8_e8m0fnu or uint8, got {scale.dtype}")


def ue8m0_to_float(scale: Tensor) -> Tensor:
    """Decode UE8M0 bytes to float32: 2^(e−127), byte 0 → 2^−127, byte 255 → NaN (spec §2.3).

    Built from the float32 bit pattern, so it is exact for every byte (2^−127 is a float32
    subnormal) and does not depend on torch's own e8m0 conversion.
    """
    e = scale_bytes(scale).to(torch.int32)
    bits = torch.where(e == 0, torch.full_like(e, 0x00400000), e << 23)
    bits = torch.where(e == UE8M0_NAN_BYTE, torch.full_like(e, 0x7FC00000), bits)
    return bits.view(torch.float32)


def ue8m0_from_exponent(exponent: Tensor) -> Tensor:
    """Scale tensor (`float8_e8m0fnu`) holding 2^exponent; exponents must lie in −127..127."""
    exponent = exponent.to(torch.int32)
    if exponent.numel() and (int(exponent.min()) < -UE8M0_BIAS or int(exponent.max()) > UE8M0_BIAS):
        raise ValueError(
            f"UE8M0 exponent out of range −127..127: min {int(exponent.min())}, max {int(exponent.max())}"
        )
    return (exponent + UE8M0_BIAS).to(torch.uint8).view(_FLOAT8_E8M0)


def _pow2_exponent_to_fit(amax: Tensor, limit: float) -> Tensor:
    """Smallest integer k with amax · 2^−k ≤ limit (k clamped to −127..127; amax 0 → k = 0).

    Computed from the exact float64 binary exponent, then corrected by one step where needed,
    so the guarantee holds exactly, not just up to log2 rounding.
    """
    a = amax.to(torch.float64)
    ratio = a / limit
    mant, exp = torch.frexp(ratio)  # ratio = mant · 2^exp, mant ∈ [0.5, 1)
    k = torch.where(mant == 0.5, exp - 1, exp).to(torch.int64)
    k = torch.where(a * torch.pow(2.0, -k.to(torch.float64)) > limit, k + 1, k)
    k = torch.where(a == 0, torch.zeros_like(k), k)
    return k.clamp(-UE8M0_BIAS, UE8M0_BIAS)


def _check_finite(w: Tensor, what: str) -> None:
    if not bool(torch.isfinite(w).all()):
        raise ValueError(f"{what}: input contains NaN or Inf")


# ---------------------------------------------------------------------------------------------
# FP8 E4M3 with 2-D 32×32 tiles (dense weights)
# ---------------------------------------------------------------------------------------------
def fp8_scale_shape(out_features: int, in_features: int) -> tuple[int, int]:
    return (-(-out_features // TILE), -(-in_features // TILE))


def _to_tiles(x: Tensor) -> Tensor:
    """[out, in] → [⌈out/32⌉, 32, ⌈in/32⌉, 32] view (zero-padded copy only for partial edge tiles)."""
    out_f, in_f = x.shape
    rt, ct = fp8_scale_shape(out_f, in_f)
    if (rt * TILE, ct * TILE) != (out_f, in_f):
        padded = x.new_zeros(rt * TILE, ct * TILE)
        padded[:out_f, :in_f] = x
        x = padded
    return x.reshape(rt, TILE, ct, TILE)


def _from_tiles(tiles: Tensor, out_features: int, in_features: int) -> Tensor:
    rt, _, ct, _ = tiles.shape
    return tiles.reshape(rt * TILE, ct * TILE)[:out_features, :in_features]


def quantize_fp8_block(w: Tensor) -> tuple[Tensor, Tensor]:
    """w [out, in] → (E4M3 [out, in], UE8M0 scale [⌈out/32⌉, ⌈in/32⌉]) (spec §2.3).

    The scale of each 32×32 tile (partial at the edges) is the smallest power of two with
    tile-amax / scale ≤ 448; values are divided in fp32 and cast with round-to-nearest-even.
    """
    if w.dim() != 2:
        raise ValueError(f"quantize_fp8_block expects a 2-D weight, got shape {tuple(w.shape)}")
    _check_finite(w, "quantize_fp8_block")
    out_f, in_f = w.shape
    tiles = _to_tiles(w.to(torch.float32))
    k = _pow2_exponent_to_fit(tiles.abs().amax(dim=(1, 3)), E4M3_MAX)
    inv_scale = torch.pow(2.0, -k.to(torch.float64)).to(torch.float32)[:, None, :, None]
    q = _from_tiles((tiles * inv_scale).to(_FLOAT8_E4M3), out_f, in_f).contiguous()
    return q, ue8m0_from_exponent(k)


def dequantize_fp8_block(w: Tensor, scale: Tensor) -> Tensor:
    """E4M3 [out, in] · its 32×32 tile scales → float32 [out, in] (exact)."""
    if w.dtype != _FLOAT8_E4M3:
        raise TypeError(f"FP8 weights must be float8_e4m3fn, got {w.dtype}")
    if w.dim() != 2:
        raise ValueError(f"FP8 weight must be 2-D, got shape {tuple(w.shape)}")
    out_f, in_f = w.shape
    want = fp8_scale_shape(out_f, in_f)
    if tuple(scale.shape) != want:
        raise ValueError(f"FP8 tile scale shape {tuple(scale.shape)} does not match weight {tuple(w.shape)}: "
                         f"expected {want}")
    tiles = _to_tiles(w.to(torch.float32)) * ue8m0_to_float(scale)[:, None, :, None]
    return _from_tiles(tiles, out_f, in_f).contiguous()


# ---------------------------------------------------------------------------------------------
# MXFP4 E2M1 (routed experts)
# ---------------------------------------------------------------------------------------------
def packed_fp4_bytes(packed: Tensor) -> Tensor:
    """The raw bytes of a packed-FP4 tensor stored as uint8, int8 or `float4_e2m1fn_x2`."""
    if packed.dtype == torch.uint8:
        return packed
    if packed.dtype == torch.int8 or (_FLOAT4_X2 is not None and packed.dtype == _FLOAT4_X2):
        return packed.view(torch.uint8)
    raise TypeError(f"packed FP4 must be uint8, int8 or float4_e2m1fn_x2, got {packed.dtype}")


def e2m1_encode(x: Tensor) -> Tensor:
    """float values (already divided by the scale, |x| ≤ 6 after clamping) → E2M1 codes (uint8).

    Round to nearest; a value exactly between two grid points takes the even code (even
    mantissa). The sign bit follows the input's sign, so small negatives become −0 (code 8).
    """
    a = x.to(torch.float32).abs().clamp(max=E2M1_MAX)
    mids = torch.tensor(_E2M1_MIDPOINTS, dtype=torch.float32)
    lower = (a.unsqueeze(-1) > mids).sum(dim=-1)  # code of the grid point at or below a (ties: lower)
    on_tie = (a.unsqueeze(-1) == mids).any(dim=-1)
    code = torch.where(on_tie & (lower % 2 == 1), lower + 1, lower)
    sign = torch.signbit(x.to(torch.float32)).to(torch.int64) << 3
    return (code | sign).to(torch.uint8)


def e2m1_decode(codes: Tensor) -> Tensor:
    """E2M1 codes (0..15) → float32 values (code table of spec §2.3)."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    return table[codes.to(torch.int64)]


def quantize_mxfp4(w: Tensor) -> tuple[Tensor, Tensor]:
    """w [out, in] → (packed uint8 [out, in/2], UE8M0 scale [out, in/32]) (spec §2.3).

    Each row's 32-element group gets the smallest power-of-two scale with amax / scale ≤ 6.
    Byte j of a row holds element 2j in its low nibble and 2j+1 in its high nibble.
    """
    if w.dim() != 2 or w.shape[1] % TILE != 0:
        raise ValueError(f"quantize_mxfp4 expects [out, in] with in a multiple of {TILE}, got {tuple(w.shape)}")
    _check_finite(w, "quantize_mxfp4")
    out_f, in_f = w.shape
    groups = w.to(torch.float32).view(out_f, in_f // TILE, TILE)
    k = _pow2_exponent_to_fit(groups.abs().amax(dim=-1), E2M1_MAX)
    scaled = groups / torch.pow(2.0, k.to(torch.float64)).to(torch.float32).unsqueeze(-1)
    codes = e2m1_encode(scaled).view(out_f, in_f)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.contiguous(), ue8m0_from_exponent(k)


def dequantize_mxfp4(packed: Tensor, scale: Tensor) -> Tensor:
    """packed [out, in/2] (uint8/int8/float4_e2m1fn_x2) + scale [out, in/32] → float32 [out, in]."""
    b = packed_fp4_bytes(packed)
    if b.dim() != 2:
        raise ValueError(f"packed FP4 weight must be 2-D, got shape {tuple(b.shape)}")
    out_f, in_f = b.shape[0], 2 * b.shape[1]
    if in_f % TILE != 0 or tuple(scale.shape) != (out_f, in_f // TILE):
        raise ValueError(f"MXFP4 scale shape {tuple(scale.shape)} does not match packed weight {tuple(b.shape)} "
                         f"(logical [{out_f}, {in_f}]): expected ({out_f}, {in_f // TILE})")
    codes = torch.stack((b & 0x0F, b >> 4), dim=-1).view(out_f, in_f)
    values = e2m1_decode(codes).view(out_f, in_f // TILE, TILE)
    return (values * ue8m0_to_float(scale).unsqueeze(-1)).view(out_f, in_f)


# ---------------------------------------------------------------------------------------------
# Engram table rows (E4M3, one UE8M0 per 32 values of a row)
# ---------------------------------------------------------------------------------------------
def quantize_engram_rows(w: Tensor) -> tuple[Tensor, Tensor]:
    """w [rows, d] → (E4M3 [rows, d], UE8M0 scale [rows, d/32]); power-of-two scales, amax ≤ 448."""
    if w.dim() != 2 or w.shape[1] % TILE != 0:
        raise ValueError(f"quantize_engram_rows expects [rows, d] with d a multiple of {TILE}, got {tuple(w.shape)}")
    _check_finite(w, "quantize_engram_rows")
    rows, d = w.shape
    groups = w.to(torch.float32).view(rows, d // TILE, TILE)
    k = _pow2_exponent_to_fit(groups.abs().amax(dim=-1), E4M3_MAX)
    scaled = groups / torch.pow(2.0, k.to(torch.float64)).to(torch.float32).unsqueeze(-1)
    return scaled.view(rows, d).to(_FLOAT8_E4M3), ue8m0_from_exponent(k)


def dequantize_engram_rows(w: Tensor, scale: Tensor) -> Tensor:
    """E4M3 [rows, d] · per-32 row scales, computed in fp32 and rounded once to BF16 (spec §2.3)."""
    if w.dtype != _FLOAT8_E4M3:
        raise TypeError(f"Engram table must be float8_e4m3fn, got {w.dtype}")
    if w.dim() != 2 or w.shape[1] % TILE != 0:
        raise ValueError(f"Engram table must be [rows, d] with d a multiple of {TILE}, got {tuple(w.shape)}")
    rows, d = w.shape
    if tuple(scale.shape) != (rows, d // TILE):
        raise ValueError(f"Engram scale shape {tuple(scale.shape)} does not match table {tuple(w.shape)}: "
                         f"expected ({rows}, {d // TILE})")
    values = w.to(torch.float32).view(rows, d // TILE, TILE) * ue8m0_to_float(scale).unsqueeze(-1)
    return values.view(rows, d).to(torch.bfloat16)

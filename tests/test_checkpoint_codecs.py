"""Codec golden bytes (computed by hand from spec §2.3) and round-trip error bounds."""
from __future__ import annotations

import math

import pytest
import torch

from sglang_dsv41.checkpoint import codecs as C


def _bytes(t: torch.Tensor) -> list:
    return C.scale_bytes(t).flatten().tolist() if t.dtype == torch.float8_e8m0fnu else t.flatten().tolist()


# ---------------------------------------------------------------------------------- UE8M0
def test_ue8m0_decode_golden():
    b = torch.tensor([0, 1, 126, 127, 128, 130, 254, 255], dtype=torch.uint8)
    got = C.ue8m0_to_float(b)
    want = [2.0 ** -127, 2.0 ** -126, 0.5, 1.0, 2.0, 8.0, 2.0 ** 127]
    assert got[:7].tolist() == want
    assert got[0].item() > 0  # byte 0 is 2^-127, not zero
    assert math.isnan(got[7].item())
    # same result through the e8m0 dtype view
    assert torch.equal(C.ue8m0_to_float(b.view(torch.float8_e8m0fnu))[:7], got[:7])


def test_ue8m0_encode_golden():
    s = C.ue8m0_from_exponent(torch.tensor([-127, -1, 0, 3, 127]))
    assert s.dtype == torch.float8_e8m0fnu
    assert _bytes(s) == [0, 126, 127, 130, 254]
    with pytest.raises(ValueError, match="out of range"):
        C.ue8m0_from_exponent(torch.tensor([128]))
    with pytest.raises(TypeError):
        C.ue8m0_to_float(torch.tensor([1.0]))


# ---------------------------------------------------------------------------------- MXFP4
def test_e2m1_code_table_and_negative_zero():
    codes = torch.arange(16, dtype=torch.uint8)
    vals = C.e2m1_decode(codes)
    assert vals.tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    assert math.copysign(1.0, vals[8].item()) == -1.0  # code 8 is −0
    assert math.copysign(1.0, vals[0].item()) == 1.0
    # encode every grid value back to its own code
    assert C.e2m1_encode(vals).tolist() == list(range(16))


def test_e2m1_ties_to_even_mantissa():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.26, 0.74, 7.0, -0.1, -5.0])
    # midpoint → even code: 0.25→0 (0), 0.75→1.0 (2), 1.25→1.0 (2), 1.75→2 (4), 2.5→2 (4), 3.5→4 (6), 5→4 (6)
    assert C.e2m1_encode(x).tolist() == [0, 2, 2, 4, 4, 6, 6, 1, 1, 7, 8, 14]


def test_mxfp4_pack_golden_bytes_nibble_order():
    w = torch.zeros(2, 64)
    w[0, :8] = torch.tensor([0.5, 1.0, -6.0, 3.0, 0.25, 0.75, -0.1, 1.25])
    w[0, 32:34] = torch.tensor([1.0, 0.0])  # second group of row 0: amax 1 → scale 2^-2 (1/0.25 = 4 ≤ 6)
    w[1, :2] = torch.tensor([12.0, -3.0])  # amax 12 → scale 2 (byte 128): 6, -1.5 → codes 7, 11
    packed, scale = C.quantize_mxfp4(w)
    assert packed.dtype == torch.uint8 and tuple(packed.shape) == (2, 32)
    assert tuple(scale.shape) == (2, 2) and scale.dtype == torch.float8_e8m0fnu
    # low nibble = even element
    assert packed[0, :4].tolist() == [0x21, 0x5F, 0x20, 0x28]
    assert packed[0, 4:16].tolist() == [0] * 12
    assert packed[0, 16].item() == 0x06  # 1.0 / 0.25 = 4 → code 6 in the low nibble
    assert packed[1, 0].item() == 0xB7
    assert _bytes(scale) == [127, 125, 128, 127]  # all-zero group → scale 1 (byte 127)


def test_mxfp4_decode_golden():
    packed = torch.zeros(1, 16, dtype=torch.uint8)
    packed[0, 0] = 0x9F  # element 0: code 15 (−6), element 1: code 9 (−0.5)
    packed[0, 1] = 0x08  # element 2: −0, element 3: 0
    scale = torch.tensor([[125]], dtype=torch.uint8)  # 2^-2
    out = C.dequantize_mxfp4(packed, scale)
    assert out.dtype == torch.float32 and tuple(out.shape) == (1, 32)
    assert out[0, :4].tolist() == [-1.5, -0.125, 0.0, 0.0]
    assert math.copysign(1.0, out[0, 2].item()) == -1.0
    # int8 and float4 views of the same bytes decode identically
    assert torch.equal(C.dequantize_mxfp4(packed.view(torch.int8), scale), out)
    if hasattr(torch, "float4_e2m1fn_x2"):
        assert torch.equal(C.dequantize_mxfp4(packed.view(torch.float4_e2m1fn_x2), scale), out)
    # scale byte 255 → NaN, byte 0 → 2^-127
    nan_out = C.dequantize_mxfp4(packed, torch.tensor([[255]], dtype=torch.uint8))
    assert torch.isnan(nan_out).all()
    tiny = C.dequantize_mxfp4(packed, torch.tensor([[0]], dtype=torch.uint8))
    assert tiny[0, 0].item() == -6.0 * 2.0 ** -127


def test_mxfp4_shape_errors():
    with pytest.raises(ValueError, match="scale shape"):
        C.dequantize_mxfp4(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8))
    with pytest.raises(ValueError):
        C.quantize_mxfp4(torch.zeros(2, 48))
    with pytest.raises(TypeError):
        C.dequantize_mxfp4(torch.zeros(2, 16), torch.zeros(2, 1, dtype=torch.uint8))


def test_mxfp4_roundtrip_error_bound():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 128, generator=g) * torch.logspace(-3, 2, 64).unsqueeze(1)
    packed, scale = C.quantize_mxfp4(w)
    back = C.dequantize_mxfp4(packed, scale)
    s = C.ue8m0_to_float(scale).repeat_interleave(32, 1)
    assert ((w / s).abs() <= 6).all()  # the chosen scale never clips
    assert ((back - w).abs() <= 0.25 * w.abs() + 0.25 * s).all()
    # scale is the smallest power of two that fits: half of it would clip some element
    amax = w.view(64, 4, 32).abs().amax(-1)
    assert (amax / (C.ue8m0_to_float(scale) / 2) > 6).all()


# ---------------------------------------------------------------------------------- FP8 tiles
def test_fp8_tile_scales_golden_with_partial_edges():
    w = torch.zeros(40, 40)
    w[0, 0] = 448.0  # tile (0,0): amax 448 → scale 1 (127)
    w[5, 35] = -896.0  # tile (0,1) partial (8 cols): amax 896 → scale 2 (128)
    w[39, 3] = 1.0  # tile (1,0) partial (8 rows): amax 1 → 2^ceil(log2(1/448)) = 2^-8 (119)
    q, s = C.quantize_fp8_block(w)  # tile (1,1) is all zero → scale 1 (127)
    assert q.dtype == torch.float8_e4m3fn and tuple(q.shape) == (40, 40)
    assert tuple(s.shape) == (2, 2)
    assert _bytes(s) == [127, 128, 119, 127]
    assert q[0, 0].item() == 448.0 and q[5, 35].item() == -448.0 and q[39, 3].item() == 256.0
    assert torch.equal(C.dequantize_fp8_block(q, s), w)


def test_fp8_scale_applies_to_exactly_its_block():
    ones = torch.ones(40, 70).to(torch.float8_e4m3fn)
    s = torch.tensor([[127, 128, 129], [126, 125, 124]], dtype=torch.uint8)
    out = C.dequantize_fp8_block(ones, s)
    want = torch.empty(40, 70)
    for r in range(40):
        for c in range(70):
            want[r, c] = 2.0 ** (int(s[r // 32, c // 32]) - 127)
    assert torch.equal(out, want)
    with pytest.raises(ValueError, match="tile scale shape"):
        C.dequantize_fp8_block(ones, torch.zeros(2, 2, dtype=torch.uint8))


def test_fp8_roundtrip_error_bound():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(96, 80, generator=g) * 0.05
    w[:32, :32] *= 1e4  # very different tile magnitudes must not interfere
    q, s = C.quantize_fp8_block(w)
    back = C.dequantize_fp8_block(q, s)
    sf = C.ue8m0_to_float(s).repeat_interleave(32, 0).repeat_interleave(32, 1)[:96, :80]
    assert ((back - w).abs() <= w.abs() * 2.0 ** -4 + sf * 2.0 ** -10).all()
    assert not torch.isnan(back).any()


def test_quantize_rejects_nonfinite():
    w = torch.zeros(32, 32)
    w[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        C.quantize_fp8_block(w)
    with pytest.raises(ValueError, match="NaN"):
        C.quantize_mxfp4(w)


# ---------------------------------------------------------------------------------- Engram rows
def test_engram_rows_golden_and_single_bf16_rounding():
    w = torch.zeros(2, 64, dtype=torch.float8_e4m3fn)
    w[0, 0] = 1.125  # E4M3 exact (1 + 1/8)
    w[0, 40] = 3.0
    s = torch.tensor([[127, 120], [127, 127]], dtype=torch.uint8)  # row 0, group 1: 2^-7
    out = C.dequantize_engram_rows(w, s)
    assert out.dtype == torch.bfloat16
    assert out[0, 0].item() == 1.125 and out[0, 40].item() == 3.0 * 2.0 ** -7
    # the fp32 product is formed first, then one cast to BF16 (here: 448 · 2^-127, a BF16 subnormal-range value)
    w2 = torch.full((1, 32), 448.0).to(torch.float8_e4m3fn)
    s2 = torch.tensor([[0]], dtype=torch.uint8)
    assert C.dequantize_engram_rows(w2, s2)[0, 0].item() == torch.tensor(448.0 * 2.0 ** -127).to(torch.bfloat16).item()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(8, 64, generator=g)
    q, sc = C.quantize_engram_rows(x)
    assert tuple(sc.shape) == (8, 2)
    ref = (q.float().view(8, 2, 32) * C.ue8m0_to_float(sc).unsqueeze(-1)).view(8, 64).to(torch.bfloat16)
    assert torch.equal(C.dequantize_engram_rows(q, sc), ref)
    assert ((C.dequantize_engram_rows(q, sc).float() - x).abs() <= x.abs() * 2.0 ** -4 + 1e-3).all()

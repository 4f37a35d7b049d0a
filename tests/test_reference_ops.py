"""Shared reference numerics (spec §3.4.2–§3.4.4, §3.8), checked against hand values and
independent formulations."""
from __future__ import annotations

import math

import torch

from sglang_dsv41.config import RopeScaling
from sglang_dsv41.reference import ops


def test_e2m1_rounding_ties_to_even_mantissa() -> None:
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.25, -5.0, 0.26, 1.9, -100.0])
    want = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -0.0, -4.0, 0.5, 2.0, -6.0])
    got = ops.e2m1_rne(x)
    assert torch.equal(got, want)
    assert torch.signbit(got[8])  # −0 keeps its sign


def test_e2m1_is_nearest_grid_point() -> None:
    grid = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6])
    x = torch.rand(10000) * 6
    got = ops.e2m1_rne(x)
    dist = (x[:, None] - grid[None]).abs()
    assert torch.allclose((got - x).abs(), dist.min(dim=1).values)


def test_pow2_ceil_is_exact_at_powers_of_two() -> None:
    v = torch.tensor([1.0, 1.5, 0.5, 3.0, 2.0**-126, 2.0**-126 * 1.0001, 448.0])
    want = torch.tensor([1.0, 2.0, 0.5, 4.0, 2.0**-126, 2.0**-125, 512.0])
    assert torch.equal(ops.pow2_ceil(v), want)


def test_fp4_e4m3_scale_matches_hand_computation() -> None:
    # one group of 16: amax 3 → scale e4m3(3/6) = 0.5; x/scale = [6, −2.2, 0.6, 0, 0.2…]
    # → E2M1 [6, −2, 0.5, 0, 0…] → ×0.5
    x = torch.tensor([3.0, -1.1, 0.3, 0.0] + [0.1] * 12)
    got = ops.fp4_fake_quant_e4m3_scale(x)
    want = torch.tensor([3.0, -1.0, 0.25, 0.0] + [0.0] * 12)
    assert torch.equal(got, want)
    # tiny groups: the scale floor 2⁻⁹ applies
    t = torch.full((16,), 2.0**-12)
    assert torch.equal(ops.fp4_fake_quant_e4m3_scale(t), torch.zeros(16))


def test_fp4_ue8m0_scale_matches_hand_computation() -> None:
    # amax 5 → scale 2^⌈log2(5/6)⌉ = 1: [5 → 4 (tie to even), 2.4 → 2, −0.7 → −0.5]
    # amax 7 → scale 2^⌈log2(7/6)⌉ = 2: x/2 = [3.5 → 4 (tie), 1.2 → 1, −0.35 → −0.5] → ×2
    a = torch.tensor([5.0, 2.4, -0.7] + [0.0] * 29)
    b = torch.tensor([7.0, 2.4, -0.7] + [0.0] * 29)
    ga, gb = ops.fp4_fake_quant_ue8m0_scale(a), ops.fp4_fake_quant_ue8m0_scale(b)
    assert ga[:3].tolist() == [4.0, 2.0, -0.5]
    assert gb[:3].tolist() == [8.0, 2.0, -1.0]


def test_fp8_activation_quant_per_32_groups() -> None:
    x = torch.randn(3, 64) * torch.tensor([1e-3] * 32 + [1e3] * 32)
    q = ops.fp8_act_fake_quant(x)
    for g in range(2):
        blk, qb = x[:, 32 * g:32 * (g + 1)], q[:, 32 * g:32 * (g + 1)]
        rel = ((qb - blk).abs() / blk.abs().amax(dim=1, keepdim=True)).max()
        assert rel < 2**-4  # E4M3: 3 mantissa bits
    # exact powers-of-two inputs pass through unchanged
    p = torch.tensor([[2.0**k for k in range(8)] * 4])
    assert torch.equal(ops.fp8_act_fake_quant(p), p)


def test_rms_norm_formula_and_bf16_output() -> None:
    x = torch.randn(4, 64)
    w = torch.rand(64) + 0.5
    y = ops.rms_norm(x, w, 1e-20)
    ref = x.double() / torch.sqrt((x.double() ** 2).mean(-1, keepdim=True)) * w.double()
    assert torch.allclose(y.double(), ref, rtol=2**-7)
    assert torch.equal(y, y.to(torch.bfloat16).float())


def test_yarn_inv_freq_regimes() -> None:
    base, rd = 160000.0, 64
    plain = ops.rope_inv_freq(rd, base, None)
    yarn = ops.rope_inv_freq(rd, base, RopeScaling(factor=16, original_max_position_embeddings=65536))
    assert torch.allclose(yarn[:16], plain[:16])           # i ≤ low (15): unchanged
    assert torch.allclose(yarn[25:], plain[25:] / 16)       # i ≥ high (25): divided by factor
    mid = yarn[20] / plain[20]
    assert 1 / 16 < mid < 1


def test_rope_interleaved_matches_complex_rotation_and_inverts() -> None:
    torch.manual_seed(0)
    x = torch.randn(5, 3, 96)
    pos = torch.tensor([0, 1, 7, 100, 4095])
    inv = ops.rope_inv_freq(32, 10000.0, None)
    y = ops.apply_rope_tail(x, pos, inv)
    assert torch.equal(y[..., :64], x[..., :64])
    z = torch.view_as_complex(x[..., 64:].double().reshape(5, 3, 16, 2).contiguous())
    rot = torch.polar(torch.ones(5, 16, dtype=torch.float64), pos.double()[:, None] * inv.double()[None])
    want = torch.view_as_real(z * rot[:, None, :]).reshape(5, 3, 32)
    assert torch.allclose(y[..., 64:].double(), want, atol=2e-3)  # fp32 angles at p=4095
    back = ops.apply_rope_tail(y, pos, inv, inverse=True)
    assert torch.allclose(back, x, atol=1e-5)


def test_cache_profiles() -> None:
    torch.manual_seed(1)
    kv = torch.randn(6, 96)                       # fp32 normed kv, before RoPE
    pos = torch.tensor([0, 1, 2, 3, 100, 4000])
    inv = ops.rope_inv_freq(32, 10000.0, None)
    none = ops.swa_cache_roundtrip(kv, pos, inv, ops.CacheProfile.NONE, 32)
    fp8 = ops.swa_cache_roundtrip(kv, pos, inv, ops.CacheProfile.FP8, 32)
    fp4 = ops.swa_cache_roundtrip(kv, pos, inv, ops.CacheProfile.FP4, 32)
    assert torch.equal(none, ops.bf16(ops.apply_rope_tail(ops.bf16(kv), pos, inv)))
    assert torch.equal(fp8[:, 64:], ops.bf16(ops.apply_rope_tail(kv, pos, inv)[:, 64:]))  # v4: fp32 rotation, BF16
    assert not torch.equal(fp8[:, :64], none[:, :64])
    assert not torch.equal(fp4[:, 64:], none[:, 64:])   # v41 layout quantises all dims
    latent = ops.fp4_fake_quant_e4m3_scale(torch.randn(6, 96))
    assert torch.equal(ops.compressed_cache_roundtrip(latent, ops.CacheProfile.FP4, 32), latent)
    assert torch.equal(ops.compressed_cache_roundtrip(latent, ops.CacheProfile.NONE, 32), latent)
    assert not torch.equal(ops.compressed_cache_roundtrip(latent, ops.CacheProfile.FP8, 32), latent)


def test_softmax_scale() -> None:
    assert ops.softmax_scale(512) == 1 / math.sqrt(512)


def test_exact_product_refuses_e4m3_codes_without_scales() -> None:
    """The CUDA runtime keeps FP8 weights as E4M3 codes + tile scales; the exact (reference) product
    must never multiply the bare codes (it would silently drop the scales)."""
    import pytest

    codes = torch.ones(4, 32).to(torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="E4M3"):
        ops.linear_fp8(torch.ones(2, 32), codes)
    assert torch.equal(ops.linear_fp8(torch.ones(2, 32), torch.ones(4, 32)), torch.full((2, 4), 32.0))

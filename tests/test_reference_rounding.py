"""The reference rounds where upstream SGLang 0.5.23's V4.1 code rounds (issue 18; audit table in
docs/reference.md "Rounding audit").

Every expected value here is derived from upstream's definitions, written independently of
`sglang_dsv41/reference/ops.py`: numpy float32 arithmetic for upstream's fp32 formulas,
mpmath (60 digits) for the correctly rounded cos/sin, bit manipulation for the UE8M0 / E4M3
scales. Every comparison is elementwise (no matmul), so exact equality is host-independent.
"""
from __future__ import annotations

import math

import mpmath
import numpy as np
import pytest
import torch

from sglang_dsv41.config import RopeScaling
from sglang_dsv41.reference import ops

f32 = np.float32
FLASH_YARN = RopeScaling(factor=16, original_max_position_embeddings=65536, beta_fast=32, beta_slow=1)
POSITIONS = (0, 65_535, 65_536, 1_048_575)


# ---- independent restatements of upstream's definitions -----------------------------------------

def mp_to_f32(v) -> np.float32:
    """The fp32 nearest to the mpmath value v (ties to even), without a double rounding."""
    f = f32(float(v))
    cands = (np.nextafter(f, f32(-np.inf)), f, np.nextafter(f, f32(np.inf)))
    return min(cands, key=lambda c: (abs(mpmath.mpf(float(c)) - v), int(np.array(c, dtype=f32).view(np.uint32)) & 1))


def pow_fp32(base: float, exponent: np.ndarray) -> np.ndarray:
    """fp32 base^e correctly rounded (60-digit mpmath). numpy's float32 `power` is not: it is
    off by one ulp for 4 of the 32 Flash exponents, so it cannot serve as the definition."""
    mpmath.mp.dps = 60
    return np.array([mp_to_f32(mpmath.power(mpmath.mpf(base), mpmath.mpf(float(e)))) for e in exponent], dtype=f32)


def upstream_inv_freq(dim: int, base: float, scaling: RopeScaling | None) -> np.ndarray:
    """`precompute_freqs_cis` (kernels/ops/attention/dsv4/rope.py:38-63) in numpy float32, with
    the fp32 power correctly rounded."""
    freqs = f32(1.0) / pow_fp32(base, np.arange(0, dim, 2, dtype=f32) / f32(dim))
    if scaling is not None and scaling.original_max_position_embeddings > 0:
        def corr(rot: float) -> float:
            return dim * math.log(scaling.original_max_position_embeddings / (rot * 2 * math.pi)) / (2 * math.log(base))
        low = max(math.floor(corr(scaling.beta_fast)), 0)
        high = min(math.ceil(corr(scaling.beta_slow)), dim - 1)
        high = high + 0.001 if high == low else high
        smooth = f32(1) - np.clip((np.arange(dim // 2, dtype=f32) - f32(low)) / f32(high - low), f32(0), f32(1))
        freqs = freqs / f32(scaling.factor) * (f32(1) - smooth) + freqs * smooth
    return freqs.astype(f32)


def exact_cos_sin(angle: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin of fp32 angles, correctly rounded to fp32 (60-digit mpmath)."""
    mpmath.mp.dps = 60
    c = [mp_to_f32(mpmath.cos(mpmath.mpf(float(a)))) for a in angle.ravel()]
    s = [mp_to_f32(mpmath.sin(mpmath.mpf(float(a)))) for a in angle.ravel()]
    return np.array(c, dtype=f32).reshape(angle.shape), np.array(s, dtype=f32).reshape(angle.shape)


def bf16_np(x: np.ndarray) -> np.ndarray:
    """Round fp32 to BF16 (nearest, ties to even) on the bits."""
    b = x.astype(f32).view(np.uint32).astype(np.uint64)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    return b.astype(np.uint32).view(f32)


def rope_np(x: np.ndarray, pos: np.ndarray, inv: np.ndarray) -> np.ndarray:
    """Upstream's `rope_tail` (dsv41_sparse.py:89-98): complex64 product in fp32, no rounding."""
    rd = 2 * inv.size
    ang = pos.astype(f32)[:, None] * inv[None, :]
    c, s = exact_cos_sin(ang)
    c, s = c.reshape(c.shape[0], *([1] * (x.ndim - 2)), c.shape[1]), s.reshape(s.shape[0], *([1] * (x.ndim - 2)), s.shape[1])
    a, b = x[..., -rd::2].astype(f32), x[..., -rd + 1::2].astype(f32)
    out = x.astype(f32).copy()
    out[..., -rd::2] = a * c - b * s
    out[..., -rd + 1::2] = a * s + b * c
    return out


def ceil_pow2_bits(v: np.ndarray) -> np.ndarray:
    """`ceil_pow2` of fp4_fake_quant.py:16-23, on the IEEE bits."""
    bits = v.astype(f32).view(np.int32)
    e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0)
    return (e << 23).astype(np.int32).view(f32)


def round_fp4_np(x: np.ndarray) -> np.ndarray:
    m = np.abs(x)
    step = np.where(m < 2, f32(0.5), np.where(m < 4, f32(1), f32(2))).astype(f32)
    return (np.round(m / step) * step * np.sign(x)).astype(f32)


def fake_quant_fp4_np(x: np.ndarray) -> np.ndarray:
    """`fake_quant_fp4` (UE8M0 per 32, floor 6·2⁻¹²⁶, ×fp32(1/6)), fp4_fake_quant.py:26-47."""
    g = x.astype(f32).reshape(*x.shape[:-1], -1, 32)
    amax = np.maximum(np.abs(g).max(-1, keepdims=True), f32(6 * 2.0**-126))
    scale = ceil_pow2_bits(amax * f32(1.0 / 6.0))
    return (round_fp4_np(np.clip(g / scale, -6, 6)) * scale).reshape(x.shape)


def fake_quant_compressed_kv_np(x: np.ndarray) -> np.ndarray:
    """`fake_quant_compressed_kv` (E4M3 per 16, ×fp32(1/6)), fp4_fake_quant.py:50-62."""
    g = x.astype(f32).reshape(*x.shape[:-1], -1, 16)
    scale = np.clip(np.abs(g).max(-1, keepdims=True) * f32(1.0 / 6.0), f32(2.0**-9), f32(448))
    scale = torch.from_numpy(scale).to(torch.float8_e4m3fn).float().numpy()
    return (round_fp4_np(np.clip(g / scale, -6, 6)) * scale).reshape(x.shape)


def same(got: torch.Tensor, want: np.ndarray) -> bool:
    """Equal values (−0 == +0: upstream's sign(0) drops the sign of a zero)."""
    return bool(np.array_equal(got.numpy(), want.astype(f32)))


# ---- RoPE table and rotation --------------------------------------------------------------------

TABLES = {"flash_compressed": (64, 160000.0, FLASH_YARN), "flash_swa": (64, 10000.0, None),
          "tiny_compressed": (32, 160000.0, RopeScaling(factor=16, original_max_position_embeddings=256)),
          "tiny_swa": (32, 10000.0, None)}


@pytest.mark.parametrize("name", sorted(TABLES))
def test_rope_table_is_upstreams_fp32_formula(name: str) -> None:
    dim, base, scaling = TABLES[name]
    assert same(ops.rope_inv_freq(dim, base, scaling), upstream_inv_freq(dim, base, scaling))


def test_float64_table_would_differ_at_one_million() -> None:
    """The float64-evaluated table (the old reference) moves the fp32 angle at p = 1,048,575 by
    whole fp32 ulps of the angle — the divergence this fidelity fix removes."""
    dim, base, scaling = TABLES["flash_swa"]
    i = np.arange(dim // 2, dtype=np.float64)
    old = (base ** (-2.0 * i / dim)).astype(f32)
    new = upstream_inv_freq(dim, base, scaling)
    assert (old != new).sum() >= 1
    assert np.abs(f32(1_048_575) * old - f32(1_048_575) * new).max() > 1e-3


@pytest.mark.parametrize("name", ["flash_compressed", "flash_swa"])
def test_rope_cos_sin_and_rotation_at_pinned_positions(name: str) -> None:
    dim, base, scaling = TABLES[name]
    inv = upstream_inv_freq(dim, base, scaling)
    pos = np.array(POSITIONS, dtype=np.int64)
    ang = pos.astype(f32)[:, None] * inv[None, :]
    want_c, want_s = exact_cos_sin(ang)
    got_c, got_s = ops.rope_cos_sin(torch.from_numpy(pos).float()[:, None] * torch.from_numpy(inv)[None, :])
    assert same(got_c, want_c) and same(got_s, want_s)
    g = torch.Generator().manual_seed(18)
    x = ops.bf16(torch.randn(len(POSITIONS), 2, 96, generator=g))
    got = ops.apply_rope_tail(x, torch.from_numpy(pos), torch.from_numpy(inv))
    assert same(got, rope_np(x.numpy(), pos, inv))
    back = ops.apply_rope_tail(x, torch.from_numpy(pos), torch.from_numpy(inv), inverse=True)
    want_back = rope_np(x.numpy(), pos, -inv)          # the conjugate rotation = angle −p·f
    assert same(back, want_back)


# ---- FP4 of rotated tails -----------------------------------------------------------------------

def _rotated_rows(seed: int, n: int, d: int) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
    g = torch.Generator().manual_seed(seed)
    x = ops.bf16(torch.randn(n, d, generator=g) * 3)
    pos = torch.randint(0, 1_048_576, (n,), generator=g)
    inv = upstream_inv_freq(64, 160000.0, FLASH_YARN)
    return x, pos.numpy(), inv


def test_fp4_of_rotated_tail_rounds_to_bf16_first() -> None:
    """Index keys / queries (UE8M0) and compressed latents (E4M3 scales): FP4 of bf16(RoPE(x)), as
    upstream's `_rope_fq4` (dsv41_sparse.py:31-44, fp4_rope_fake_quant.py:49)."""
    x, pos, inv = _rotated_rows(1, 64, 128)
    roped = ops.bf16_rope_tail(x, torch.from_numpy(pos), torch.from_numpy(inv))
    rot_np = rope_np(x.numpy(), pos, inv)
    assert same(roped, bf16_np(rot_np))
    assert same(ops.fp4_fake_quant_ue8m0_scale(roped), fake_quant_fp4_np(bf16_np(rot_np)))
    assert same(ops.fp4_fake_quant_e4m3_scale(roped), fake_quant_compressed_kv_np(bf16_np(rot_np)))
    # the BF16 step matters: FP4 of the unrounded fp32 tail differs somewhere
    assert not np.array_equal(fake_quant_fp4_np(rot_np), fake_quant_fp4_np(bf16_np(rot_np)))


def test_compressor_and_indexer_quantise_bf16_rotated_tails() -> None:
    """`compressor.rope_entry_values` → stored latents / index keys, and `indexer.index_query`'s q."""
    from sglang_dsv41.config import TextConfig  # noqa: F401  (the tiny config comes from the tests' weights)
    from sglang_dsv41.reference.compressor import index_keys, rope_entry_values, stored_latents
    from test_reference_attention import attention_weights, tiny_text

    t, w = tiny_text(), attention_weights(seed=3)
    src = t.kv_source_layer_ids[0]
    prefix = f"layers.{src}.attn."
    g = torch.Generator().manual_seed(2)
    latents = ops.bf16(torch.randn(9, t.head_dim, generator=g))
    pos = torch.tensor([0, 2, 4, 6, 100, 254, 256, 1000, 4094])
    inv = ops.rope_inv_freq(t.qk_rope_head_dim, t.compress_rope_theta, t.rope_scaling)
    roped, k = rope_entry_values(t, w, prefix, latents, pos, inv)
    assert same(roped, bf16_np(rope_np(latents.numpy(), pos.numpy(), inv.numpy())))
    stored = stored_latents(t, roped, ops.CacheProfile.FP4)
    assert same(stored, fake_quant_compressed_kv_np(roped.numpy()))
    keys = index_keys(t, w, prefix, latents, pos, inv)
    assert same(keys, fake_quant_fp4_np(k.numpy()))
    assert torch.equal(k, ops.bf16(k))


def test_index_head_weights_are_bf16_of_bf16_times_scale() -> None:
    """`head_weights = head_weights_raw(x) * scale` on a BF16 tensor (dsv41_sparse.py:282-283)."""
    from sglang_dsv41.reference.indexer import index_query
    from test_reference_attention import attention_weights, tiny_text

    t, w = tiny_text(), attention_weights(seed=4)
    layer = next(r.layer for r in t.layer_roles() if r.runs_indexer)
    prefix = f"layers.{layer}.attn."
    g = torch.Generator().manual_seed(5)
    x = ops.bf16(torch.randn(6, t.hidden_size, generator=g))
    q_lora = ops.bf16(torch.randn(6, t.q_lora_rank, generator=g))
    pos = torch.arange(6)
    inv = ops.rope_inv_freq(t.qk_rope_head_dim, t.compress_rope_theta, t.rope_scaling)
    query = index_query(t, w, prefix, x, q_lora, pos, inv, True)
    raw = ops.linear_bf16(x, w[prefix + "indexer.weights_proj.weight"]).numpy()
    scale = f32(t.index_head_dim ** -0.5 * t.index_n_heads ** -0.5)
    assert same(query.head_weights, bf16_np(raw * scale))


def test_fp4_of_rotated_tails_at_the_pinned_positions() -> None:
    """The issue's positions 0, 65,535, 65,536 and 1,048,575 on both Flash tables: bf16(RoPE) then
    FP4 (UE8M0 per 32 and E4M3 per 16), each step restated in numpy."""
    for name in ("flash_compressed", "flash_swa"):
        dim, base, scaling = TABLES[name]
        inv = upstream_inv_freq(dim, base, scaling)
        g = torch.Generator().manual_seed(21)
        pos = np.array(POSITIONS * 8, dtype=np.int64)
        x = ops.bf16(torch.randn(len(pos), 2 * dim, generator=g) * 2)
        roped = ops.bf16_rope_tail(x, torch.from_numpy(pos), torch.from_numpy(inv))
        want = bf16_np(rope_np(x.numpy(), pos, inv))
        assert same(roped, want)
        assert same(ops.fp4_fake_quant_ue8m0_scale(roped), fake_quant_fp4_np(want))
        assert same(ops.fp4_fake_quant_e4m3_scale(roped), fake_quant_compressed_kv_np(want))


# ---- ratio-2 pooling ------------------------------------------------------------------------------

def pair_pool_np(a: np.ndarray, s: np.ndarray) -> np.ndarray:
    """`pool_pairs` (dsv41_sparse.py:170-172) / `c2_decode_pool.py:86-97` in numpy float32: max,
    exp(s − max) (float64 then one rounding: the correctly rounded fp32 exp), e₀ + e₁, IEEE
    division, products rounded before the one fp32 add."""
    m = np.maximum(s[:, 0], s[:, 1])[:, None]
    e = np.exp((s - m).astype(np.float64)).astype(f32)
    sig = e / (e[:, 0] + e[:, 1])[:, None]
    t = a * sig
    return t[:, 0] + t[:, 1]


def test_ratio2_pooling_is_upstreams_fp32_steps() -> None:
    from sglang_dsv41.numerics.rounding import pair_pool
    from sglang_dsv41.reference.compressor import _weight, linear_fp32_out, ratio2_latents
    from test_reference_attention import attention_weights, tiny_text

    g = torch.Generator().manual_seed(11)
    a, s = torch.randn(4096, 2, 8, generator=g) * 4, torch.randn(4096, 2, 8, generator=g) * 3
    want = pair_pool_np(a.numpy(), s.numpy())
    assert same(pair_pool(a, s), want)
    # the float64 evaluation rounded once (the reference before) differs somewhere
    old = (a.double() * torch.softmax(s.double(), dim=1)).sum(1).float()
    assert not torch.equal(old, torch.from_numpy(want))
    # the reference compressor pools with it
    t, w = tiny_text(), attention_weights(seed=6)
    src = next(i for i in t.kv_source_layer_ids if t.compress_ratios[i] == 2)
    prefix = f"layers.{src}.attn."
    x = ops.bf16(torch.randn(8, t.hidden_size, generator=g))
    lat, _, pending = ratio2_latents(t, w, prefix, x, torch.arange(8), None)
    av = linear_fp32_out(x, _weight(w, prefix, "compressor.wkv.weight")).view(4, 2, -1)
    sv = linear_fp32_out(x, _weight(w, prefix, "compressor.wgate.weight")).view(4, 2, -1)
    pooled = torch.from_numpy(pair_pool_np(av.numpy(), sv.numpy()))
    assert pending is None
    assert torch.equal(lat, ops.rms_norm(ops.bf16(pooled), _weight(w, prefix, "compressor.norm.weight"),
                                            t.rms_norm_eps))


def test_index_scores_round_where_upstream_rounds() -> None:
    """`fp4_index_logits_paged` (fp4_indexer.py:425-430) and the prefill `scores`
    (dsv41_sparse.py:285-291): bf16 dot → ReLU → × BF16 weight → BF16 → Σ_h → BF16, restated in
    numpy (the dot and the head sum exact, then fp32)."""
    from sglang_dsv41.reference.indexer import IndexQuery, index_scores

    g = torch.Generator().manual_seed(31)
    q = ops.fp4_fake_quant_ue8m0_scale(torch.randn(3, 32, 128, generator=g))
    w = ops.bf16(torch.randn(3, 32, generator=g)) / 64
    k = ops.fp4_fake_quant_ue8m0_scale(torch.randn(300, 128, generator=g))
    got = index_scores(IndexQuery(q, w), k)
    d = np.einsum("thd,nd->thn", q.double().numpy(), k.double().numpy()).astype(f32)
    terms = bf16_np(np.maximum(bf16_np(d), f32(0)) * w.numpy()[:, :, None])
    want = bf16_np(terms.astype(np.float64).sum(axis=1).astype(f32))
    assert same(got, want)
    # the float64 score rounded once to fp32 (the reference before) differs, and BF16 scores tie
    old = np.einsum("th,thn->tn", w.double().numpy(), np.maximum(d.astype(np.float64), 0)).astype(f32)
    assert not np.array_equal(old, want)
    assert any(len(np.unique(row[row > 0])) < (row > 0).sum() for row in want)


# ---- scale edges --------------------------------------------------------------------------------

def test_e4m3_scale_uses_the_fp32_reciprocal() -> None:
    """An fp32 amax where e4m3(amax·fp32(1/6)) ≠ e4m3(amax/6): the reference follows the
    reciprocal (upstream's quantisers); for every BF16 amax the two agree."""
    ties = np.array([(1 + (2 * j + 1) / 16) * 2.0**k for k in range(-8, 8) for j in range(8)])
    found = None
    for t in ties:
        base = f32(6 * t)
        for delta in range(-4, 5):
            amax = (base.view(np.int32) + delta).astype(np.int32).view(f32)
            mul = torch.tensor([amax * f32(1 / 6)]).to(torch.float8_e4m3fn).float().item()
            div = torch.tensor([f32(amax / f32(6))]).to(torch.float8_e4m3fn).float().item()
            if mul != div:
                found = (amax, mul)
                break
        if found:
            break
    assert found is not None
    amax, want_scale = found
    block = torch.zeros(1, 16)
    block[0, 0] = float(amax)
    got = ops.fp4_fake_quant_e4m3_scale(block)
    assert got[0, 0].item() == 6 * want_scale or got[0, 0].item() == round_fp4_np(np.array([amax / f32(want_scale)]))[0] * want_scale
    assert same(got, fake_quant_compressed_kv_np(block.numpy()))
    # BF16 inputs: every positive finite BF16 amax in the scale's range gives the same scale both ways
    bits = (np.arange(0x3000, 0x4600, dtype=np.uint32) << 16).view(f32)     # 2^-31 .. 2^13
    mul = torch.from_numpy(np.clip(bits * f32(1 / 6), f32(2.0**-9), f32(448))).to(torch.float8_e4m3fn)
    div = torch.from_numpy(np.clip((bits / f32(6)).astype(f32), f32(2.0**-9), f32(448))).to(torch.float8_e4m3fn)
    assert torch.equal(mul.float(), div.float())


def test_ue8m0_scale_edges() -> None:
    """amax = 6·2^k → scale 2^k exactly; one fp32 ulp above → 2^(k+1); zero block → values 0."""
    rows = []
    for k in (-20, -1, 0, 3):
        a = f32(6 * 2.0**k)
        rows += [a, (a.view(np.int32) + 1).view(f32)]
    x = torch.zeros(len(rows), 32)
    x[:, 0] = torch.tensor(rows)
    x[:, 1] = x[:, 0] / 4                              # 1.5·2^k: on the grid at scale 2^k, a tie at 2^(k+1)
    got = ops.fp4_fake_quant_ue8m0_scale(x)
    assert same(got, fake_quant_fp4_np(x.numpy()))
    for r, k in enumerate((-20, -1, 0, 3)):
        assert got[2 * r, 1].item() == 1.5 * 2.0**k                 # scale 2^k: 1.5 exactly
        assert got[2 * r + 1, 1].item() == 2.0 ** (k + 1)           # scale 2^(k+1): 0.75+ → 1
    assert torch.equal(ops.fp4_fake_quant_ue8m0_scale(torch.zeros(2, 32)), torch.zeros(2, 32))


def test_v4_swa_amax_floor_is_1e_4() -> None:
    """v4 layout nope blocks: scale 2^⌈log2(max(amax, 1e-4)/448)⌉ (main_norm_rope.cuh:431)."""
    kv = torch.zeros(1, 96)
    kv[0, :64] = torch.linspace(1e-9, 1e-6, 64)     # the small ones are E4M3 subnormals at scale 2^-22
    pos, inv = torch.zeros(1, dtype=torch.int64), ops.rope_inv_freq(32, 10000.0, None)
    got = ops.swa_cache_roundtrip(kv, pos, inv, ops.CacheProfile.FP8, 32)
    scale = 2.0 ** math.ceil(math.log2(float(f32(1e-4)) / 448))   # 2^-22
    want = (kv[0, :64] / scale).to(torch.float8_e4m3fn).float() * scale
    assert torch.equal(got[0, :64], want)
    old_scale = 2.0 ** math.ceil(math.log2(1e-6 / 448))             # a 1e-8 floor would not bind
    assert not torch.equal(want, (kv[0, :64] / old_scale).to(torch.float8_e4m3fn).float() * old_scale)


def test_v41_swa_scale_floor() -> None:
    """v41 layout: scale 2^⌈log2(max(amax/448, 1e-4))⌉ = 2^-13 for tiny blocks (kv_layout.cuh:172-186)."""
    kv = torch.full((1, 96), 1e-3)
    got = ops.swa_cache_roundtrip(kv, torch.zeros(1, dtype=torch.int64), ops.rope_inv_freq(32, 10000.0, None),
                                  ops.CacheProfile.FP4, 32)
    v = ops.bf16(kv)
    assert torch.equal(got, (v / 2.0**-13).to(torch.float8_e4m3fn).float() * 2.0**-13)


# ---- the SWA row ---------------------------------------------------------------------------------

def test_swa_row_rounding_per_layout() -> None:
    """BF16 / v41 stores: bf16(normed) → RoPE → BF16 (fused_norm_rope.cuh:132,157-163,
    main_norm_rope.cuh:393-409); v4: RoPE of the fp32 normed values, tail BF16 (413-427)."""
    g = torch.Generator().manual_seed(7)
    kv = torch.randn(16, 96, generator=g)              # fp32 normed values (not BF16)
    pos = torch.tensor(list(POSITIONS) * 4)
    inv = ops.rope_inv_freq(32, 10000.0, None)
    assert same(inv, upstream_inv_freq(32, 10000.0, None))
    none = ops.swa_cache_roundtrip(kv, pos, inv, ops.CacheProfile.NONE, 32)
    twice = bf16_np(rope_np(bf16_np(kv.numpy()), pos.numpy(), inv.numpy()))
    assert same(none, twice)
    fp8 = ops.swa_cache_roundtrip(kv, pos, inv, ops.CacheProfile.FP8, 32)
    once = bf16_np(rope_np(kv.numpy(), pos.numpy(), inv.numpy()))
    assert same(fp8[:, 64:], once[:, 64:])
    assert not np.array_equal(once[:, 64:], twice[:, 64:])   # the two orders do differ
    fp4 = ops.swa_cache_roundtrip(kv, pos, inv, ops.CacheProfile.FP4, 32)
    g32 = twice.reshape(16, 3, 32)
    scale = ceil_pow2_bits(np.maximum(np.abs(g32).max(-1, keepdims=True) / f32(448), f32(1e-4)))
    want = torch.from_numpy(g32 / scale).to(torch.float8_e4m3fn).float().numpy() * scale
    assert same(fp4, want.reshape(16, 96))

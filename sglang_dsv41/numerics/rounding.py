"""Rounding points and fake quantisation (spec `model.md` §3.4.3, §3.8): plain fp32 torch.

* `bf16(x)`: round-to-nearest-even to BF16, returned as fp32 values.
* UE8M0 scales are exact powers of two: `pow2_ceil(v) = 2^⌈log2 v⌉` from `frexp`.
* E4M3 casts use torch's `float8_e4m3fn` conversion (RNE; callers keep inputs within ±448).
"""
from __future__ import annotations

import struct

import torch

F32 = torch.float32
BF16 = torch.bfloat16
E4M3_MAX = 448.0
E2M1_MAX = 6.0


def fp32_scalar(v: float) -> float:
    """The Python float v rounded to the nearest fp32 value (no tensor, no device sync)."""
    return struct.unpack("<f", struct.pack("<f", v))[0]


#: fp32(1/6): upstream's FP4 quantisers multiply amax by this reciprocal instead of dividing by 6.
INV_E2M1_MAX = fp32_scalar(1.0 / E2M1_MAX)


def bf16(x: torch.Tensor) -> torch.Tensor:
    """Round to BF16 (RNE) and return fp32 values."""
    return x.to(BF16).to(F32)


def e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round to FP8 E4M3 (RNE) and return fp32 values."""
    return x.to(torch.float8_e4m3fn).to(F32)


def pow2_ceil(v: torch.Tensor) -> torch.Tensor:
    """2^⌈log2 v⌉ for v > 0, exact (v = m·2^e with m ∈ [0.5, 1): result 2^(e−1) iff m == 0.5)."""
    m, e = torch.frexp(v.to(F32))
    e = torch.where(m == 0.5, e - 1, e)
    return torch.ldexp(torch.ones_like(v, dtype=F32), e)


def e2m1_rne(x: torch.Tensor) -> torch.Tensor:
    """Round to the E2M1 grid {0, .5, 1, 1.5, 2, 3, 4, 6} (±), ties to even mantissa, clamp ±6."""
    a = x.abs().clamp(max=E2M1_MAX)
    step = torch.where(a < 2.0, 0.5, torch.where(a < 4.0, 1.0, 2.0))
    q = torch.round(a / step) * step
    return torch.copysign(q.clamp(max=E2M1_MAX), x)


def grouped(x: torch.Tensor, group: int) -> torch.Tensor:
    """x [..., n] viewed [..., n/group, group]; raises when n is not a multiple of `group`."""
    if x.shape[-1] % group:
        raise ValueError(f"last dim {x.shape[-1]} is not a multiple of the quantisation group {group}")
    return x.reshape(*x.shape[:-1], x.shape[-1] // group, group)


def fp4_fake_quant_e4m3_scale(x: torch.Tensor, group: int = 16) -> torch.Tensor:
    """Compressed-latent FP4 round trip: E2M1 values, one E4M3 scale per 16 (spec §3.4.3):
    scale = e4m3(clamp(amax·fp32(1/6), 2⁻⁹, 448)); value = e2m1(clamp(x/scale, −6, 6))·scale."""
    g = grouped(x.to(F32), group)
    amax = g.abs().amax(dim=-1, keepdim=True)
    scale = e4m3((amax * INV_E2M1_MAX).clamp(min=2.0**-9, max=E4M3_MAX))
    q = e2m1_rne((g / scale).clamp(-E2M1_MAX, E2M1_MAX)) * scale
    return q.reshape(x.shape)


def fp4_fake_quant_ue8m0_scale(x: torch.Tensor, group: int = 32) -> torch.Tensor:
    """Indexer q/k FP4 round trip: E2M1 values, one UE8M0 scale per 32 (spec §3.4.3):
    scale = 2^⌈log2(max(amax, 6·2⁻¹²⁶)·fp32(1/6))⌉."""
    g = grouped(x.to(F32), group)
    amax = g.abs().amax(dim=-1, keepdim=True)
    scale = pow2_ceil(amax.clamp(min=E2M1_MAX * 2.0**-126) * INV_E2M1_MAX)
    q = e2m1_rne((g / scale).clamp(-E2M1_MAX, E2M1_MAX)) * scale
    return q.reshape(x.shape)


def fp8_act_fake_quant(x: torch.Tensor, group: int = 32) -> torch.Tensor:
    """Activation quantisation of FP8 linears: per (token, 32 channels) E4M3 with a UE8M0 scale
    2^⌈log2(max(amax, 1e−10)/448)⌉ (spec §3.8)."""
    g = grouped(x.to(F32), group)
    amax = g.abs().amax(dim=-1, keepdim=True).clamp(min=1e-10)
    scale = pow2_ceil(amax / E4M3_MAX)
    return (e4m3(g / scale) * scale).reshape(x.shape)


def fp8_v4_roundtrip(x: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """v4 cache layout: nope dims E4M3 with one UE8M0 per 64, scale 2^⌈log2(max(amax, 1e−4)/448)⌉;
    RoPE dims BF16 (spec §3.8)."""
    nope, rope = x[..., :-rope_dim], x[..., -rope_dim:]
    g = grouped(nope, 64)
    scale = pow2_ceil(g.abs().amax(dim=-1, keepdim=True).clamp(min=1e-4) / E4M3_MAX)
    q = (e4m3(g / scale) * scale).reshape(nope.shape)
    return torch.cat((q, bf16(rope)), dim=-1)


def fp8_v41_roundtrip(x: torch.Tensor) -> torch.Tensor:
    """v41 SWA layout: every dim E4M3 with one UE8M0 per 32, scale 2^⌈log2(max(amax/448, 1e−4))⌉."""
    g = grouped(x, 32)
    scale = pow2_ceil((g.abs().amax(dim=-1, keepdim=True) / E4M3_MAX).clamp(min=1e-4))
    return (e4m3(g / scale) * scale).reshape(x.shape)


def pair_pool(a: torch.Tensor, s: torch.Tensor, exp_dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Ratio-2 pooling of a pair, a, s [n, 2, D] fp32 → [n, D] fp32, in upstream's fp32 steps
    (`pool_pairs` = `(kv2 * score2.softmax(dim=1)).sum(dim=1)`, `dsv41_sparse.py:170-172`, and
    its bitwise Triton twin `c2_decode_pool.py:86-97`): m = max(s₀, s₁); e_i = exp(s_i − m);
    σ_i = e_i / (e₀ + e₁) (IEEE division); pooled = a₀σ₀ + a₁σ₁, products rounded before the sum.
    Every step is one fp32 operation except exp, evaluated in `exp_dtype` and rounded to fp32
    (float64: the correctly rounded fp32 exp, the device-invariant form of CUDA's `expf`)."""
    a, s = a.to(F32), s.to(F32)
    m = torch.maximum(s[:, 0], s[:, 1]).unsqueeze(1)
    e = torch.exp((s - m).to(exp_dtype)).to(F32)
    sigma = e / (e[:, 0] + e[:, 1]).unsqueeze(1)
    t = a * sigma
    return t[:, 0] + t[:, 1]


def slot_sum_fp32(weights: torch.Tensor, per_slot: torch.Tensor) -> torch.Tensor:
    """The routed sum Σ_j w_j·E_j [T, H] fp32 as upstream's MoE finalize forms it
    (`finalizeMoeRoutingKernel`, FlashInfer `cutlass_fused_moe_kernels.cuh`): from +0, the slots
    j = 0 … k−1 in order, acc ← fp32(acc + fp32(w_j·E_j)) — each product rounded before its add
    (the project's no-FMA convention, docs/reference.md "Rounding audit"). weights [T, k] fp32,
    per_slot [T, k, H] (BF16 values in any float dtype). Elementwise per token: batch invariant."""
    w, e = weights.to(F32), per_slot.to(F32)
    if w.shape != e.shape[:2]:
        raise ValueError(f"slot_sum_fp32: weights {tuple(w.shape)} do not match per_slot {tuple(e.shape)}")
    acc = torch.zeros(e.shape[0], e.shape[2], dtype=F32, device=e.device)
    for j in range(e.shape[1]):
        acc = acc + w[:, j, None] * e[:, j]
    return acc

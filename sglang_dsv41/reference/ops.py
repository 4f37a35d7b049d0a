"""Numerical building blocks of the reference (spec `model.md` §3, §3.8): the oracle's own math.

Plain PyTorch with explicit rounding points. Order-sensitive sums (dense products, RMSNorm)
are evaluated in float64 and rounded once, so the reference does not depend on how tokens are
batched or chunked, nor on the device. The rounding and fake-quantisation formulas themselves
are shared with the runtime (`sglang_dsv41.numerics`) and re-exported here. No backends, no
device dispatch: the runtime has its own implementations, tested against these.
"""
from __future__ import annotations

import torch

from ..numerics.geometry import softmax_scale  # noqa: F401  (re-exported)
from ..numerics.profile import CacheProfile
from ..numerics.rope import apply_rope_tail, bf16_rope_tail, rope_cos_sin, rope_inv_freq  # noqa: F401
from ..numerics.rounding import (BF16, E2M1_MAX, E4M3_MAX, F32, INV_E2M1_MAX, bf16, e2m1_rne,  # noqa: F401
                                 e4m3, fp4_fake_quant_e4m3_scale, fp4_fake_quant_ue8m0_scale,
                                 fp8_act_fake_quant, fp8_v4_roundtrip, fp8_v41_roundtrip, fp32_scalar,
                                 pow2_ceil)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """bf16( x·rsqrt(mean(x²) + ε)·w ), returned as fp32 values (spec §3); float64, rounded once."""
    xd = x.to(torch.float64)
    y = xd * torch.rsqrt(xd.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.to(torch.float64)
    return bf16(y.to(F32))


def _matmul_exact(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x·wᵀ accumulated in float64, returned as fp32: independent of batching, chunking, device."""
    if weight.dtype == torch.float8_e4m3fn:
        raise TypeError("exact dense product of an E4M3 weight without its tile scales: the reference "
                        "takes dequantised values")
    return (x.to(torch.float64) @ weight.to(torch.float64).t()).to(F32)


def linear_fp8(x: torch.Tensor, weight: torch.Tensor, act_quant: bool = True) -> torch.Tensor:
    """FP8 dense linear: dequantised weight [out, in], optional activation fake-quant, exact
    accumulation, BF16 output (returned as fp32 values). Spec §3.8."""
    xf = fp8_act_fake_quant(x) if act_quant else x.to(F32)
    return bf16(_matmul_exact(xf, weight))


def linear_bf16(x: torch.Tensor, weight: torch.Tensor, out_fp32: bool = False) -> torch.Tensor:
    """BF16-weight linear with exact accumulation; BF16 output unless `out_fp32`."""
    y = _matmul_exact(x, weight)
    return y if out_fp32 else bf16(y)


def matmul_fp32_exact(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x·weightᵀ accumulated in fp64 and rounded once to fp32 (router, LM head, mHC mix)."""
    return _matmul_exact(x, weight)


def swa_cache_roundtrip(kv_normed: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                        profile: CacheProfile, rope_dim: int) -> torch.Tensor:
    """What attention reads back for a token's SWA kv, from the pre-RoPE normalised kv (spec
    §3.4.1, §3.8): NONE bf16(normed) → RoPE → BF16; FP8 (v4) nope dims quantised from fp32, RoPE
    dims rotated from fp32 and stored BF16; FP4 (v41) bf16(normed) → RoPE → BF16 → E4M3 per 32."""
    kv = kv_normed.to(F32)
    if profile is CacheProfile.FP8:
        return fp8_v4_roundtrip(apply_rope_tail(kv, positions, inv_freq), rope_dim)
    row = bf16_rope_tail(bf16(kv), positions, inv_freq)
    if profile is CacheProfile.NONE:
        return row
    return fp8_v41_roundtrip(row)


def compressed_cache_roundtrip(latent_fp4: torch.Tensor, profile: CacheProfile, rope_dim: int) -> torch.Tensor:
    """What attention reads back for a compressed latent that is already FP4-rounded."""
    latent_fp4 = latent_fp4.to(F32)
    if profile is CacheProfile.FP8:
        return fp8_v4_roundtrip(latent_fp4, rope_dim)
    return bf16(latent_fp4)  # exact: FP4 values × E4M3 scales fit BF16

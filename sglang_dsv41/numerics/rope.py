"""RoPE / YaRN tables and rotation in upstream's fp32 arithmetic (spec `model.md` §3.4.2).

Rounding points and their upstream sources: docs/reference.md "Rounding audit".
"""
from __future__ import annotations

import torch

from ..config import RopeScaling, TextConfig, yarn_ramp_bounds
from .rounding import F32, bf16


def rope_inv_freq(rope_dim: int, base: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies [rope_dim/2], fp32: f_i = 1 / fp32(base^e_i), e_i = fp32(2i)/rope_dim;
    with YaRN f ← f/factor·(1 − smooth) + f·smooth, every operation an fp32 rounding in that order.
    base^e_i is the correctly rounded fp32 power (float64 pow rounded once, table built once)."""
    exponent = torch.arange(0, rope_dim, 2, dtype=F32) / rope_dim
    power = (torch.tensor(float(base), dtype=torch.float64) ** exponent.to(torch.float64)).to(F32)
    inv = 1.0 / power
    if scaling is not None and scaling.original_max_position_embeddings > 0:
        low, high = yarn_ramp_bounds(rope_dim, base, scaling.original_max_position_embeddings,
                                     scaling.beta_fast, scaling.beta_slow)
        high = high if high != low else high + 0.001
        ramp = ((torch.arange(rope_dim // 2, dtype=F32) - low) / (high - low)).clamp(0.0, 1.0)
        smooth = 1 - ramp
        inv = inv / scaling.factor * (1 - smooth) + inv * smooth
    return inv


def layer_inv_freq(cfg: TextConfig, ratio: int) -> torch.Tensor:
    """RoPE inverse frequencies of a layer (spec §3.4.2): ratio 0 → `rope_theta` without YaRN;
    ratio 1/2 → `compress_rope_theta` with the config's YaRN scaling."""
    if ratio == 0:
        return rope_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta, None)
    return rope_inv_freq(cfg.qk_rope_head_dim, cfg.compress_rope_theta, cfg.rope_scaling)


def rope_cos_sin(angle: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of fp32 angles as fp32: float64 cos/sin rounded once (the correctly rounded
    entries of upstream's complex64 table)."""
    a = angle.to(torch.float64)
    return torch.cos(a).to(F32), torch.sin(a).to(F32)


def rope_cos_sin_fp32(angle: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of fp32 angles evaluated in fp32 (torch's libm; within 2 fp32 ulps of
    `rope_cos_sin`, as upstream's GPU cosf/sinf)."""
    a = angle.to(F32)
    return torch.cos(a), torch.sin(a)


def apply_rope_tail(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                    inverse: bool = False, cos_sin=rope_cos_sin) -> torch.Tensor:
    """Rotate the last 2·len(inv_freq) dims of x (interleaved pairs) at `positions` [T]:
    angle = fp32(p·f), a' = a·c − b·s, b' = a·s + b·c in fp32 (no FMA); `inverse` uses −s.
    Returns fp32, not rounded (callers round where upstream does: `bf16_rope_tail`)."""
    rd = 2 * inv_freq.numel()
    xf = x.to(F32)
    head, tail = xf[..., :-rd], xf[..., -rd:]
    ang = positions.to(F32)[:, None] * inv_freq.to(F32)[None, :]
    cos, sin = cos_sin(ang.reshape(ang.shape[0], *([1] * (x.dim() - 2)), ang.shape[1]))
    if inverse:
        sin = -sin
    a, b = tail[..., 0::2], tail[..., 1::2]
    rot = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    return torch.cat((head, rot), dim=-1)


def bf16_rope_tail(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                   inverse: bool = False) -> torch.Tensor:
    """bf16(apply_rope_tail(x)): x's non-rotated dims must already be BF16-valued."""
    return bf16(apply_rope_tail(x, positions, inv_freq, inverse))

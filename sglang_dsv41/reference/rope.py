"""RoPE / YaRN of the reference (spec `model.md` §3.4.2), in upstream's fp32 arithmetic.

`ops` re-exports every name here (`ops.rope_inv_freq`, `ops.apply_rope_tail`, ...). Rounding
points and their upstream sources: docs/reference.md "Rounding audit".
"""
from __future__ import annotations

import torch

from ..config import RopeScaling, yarn_ramp_bounds

F32 = torch.float32


def rope_inv_freq(rope_dim: int, base: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies [rope_dim/2], fp32, as upstream computes its table in fp32
    (`kernels/ops/attention/dsv4/rope.py:50-63`, spec §3.4.2):

    f_i = 1 / fp32(base^e_i) with e_i = fp32(2i) / rope_dim in fp32; with YaRN
    ramp_i = clamp((i − low) / (high − low), 0, 1) and smooth = 1 − ramp, both fp32, then
    f ← f / factor · (1 − smooth) + f · smooth, every operation an fp32 rounding in that order.

    base^e_i is the correctly rounded fp32 power (float64 pow rounded once): device-invariant,
    equal to torch's and numpy's CPU fp32 pow for every table of the known configs. Upstream
    builds its table on the GPU, whose fp32 powf is not correctly rounded everywhere; the
    entries where that differs are listed in docs/reference.md ("RoPE table"). No mscale.
    """
    f32 = torch.float32
    exponent = torch.arange(0, rope_dim, 2, dtype=f32) / rope_dim
    power = (torch.tensor(float(base), dtype=torch.float64) ** exponent.to(torch.float64)).to(f32)
    inv = 1.0 / power
    if scaling is not None and scaling.original_max_position_embeddings > 0:
        low, high = yarn_ramp_bounds(rope_dim, base, scaling.original_max_position_embeddings,
                                     scaling.beta_fast, scaling.beta_slow)
        high = high if high != low else high + 0.001
        ramp = ((torch.arange(rope_dim // 2, dtype=f32) - low) / (high - low)).clamp(0.0, 1.0)
        smooth = 1 - ramp
        inv = inv / scaling.factor * (1 - smooth) + inv * smooth
    return inv


def rope_cos_sin(angle: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of fp32 angles as fp32 values: float64 cos/sin rounded once, i.e. the
    correctly rounded fp32 entries of upstream's complex64 table `torch.polar(1, p·f)`
    (`rope.py:65-67`; the GPU's fp32 cosf/sinf used there are within 2 fp32 ulps of these)."""
    a = angle.to(torch.float64)
    return torch.cos(a).to(F32), torch.sin(a).to(F32)


def apply_rope_tail(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                    inverse: bool = False) -> torch.Tensor:
    """Rotate the last 2·len(inv_freq) dims of x (interleaved / GPT-J pairs) at `positions`.

    x: [T, ..., D] (any float; returns fp32); positions: [T] integer. As upstream's torch path
    (`srt/layers/attention/dsv4/dsv41_sparse.py:89-98`, a complex64 product): angle = fp32(p·f),
    (c, s) = `rope_cos_sin(angle)`, and with (a, b) = (x_2i, x_2i+1) in fp32
    a' = a·c − b·s, b' = a·s + b·c — each product and the sum an fp32 rounding (no FMA);
    `inverse` uses −s (the conjugate rotation, spec §3.4.6). The result is NOT rounded to BF16:
    callers round where upstream does (`bf16_rope_tail`). Inside `fused_kernels(k)`:
    `k.apply_rope_tail` (one launch; bound in kernels/fused_elementwise.py).
    """
    fused = ops.fused_for(x, positions, inv_freq)
    if fused is not None:
        return fused.apply_rope_tail(x, positions, inv_freq, inverse)
    rd = 2 * inv_freq.numel()
    xf = x.to(F32)
    head, tail = xf[..., :-rd], xf[..., -rd:]
    ang = positions.to(F32)[:, None] * inv_freq.to(F32)[None, :]  # [T, rd/2], the fp32 angle
    cos, sin = rope_cos_sin(ang.reshape(ang.shape[0], *([1] * (x.dim() - 2)), ang.shape[1]))
    if inverse:
        sin = -sin
    a, b = tail[..., 0::2], tail[..., 1::2]
    rot = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    return torch.cat((head, rot), dim=-1)


def bf16_rope_tail(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                   inverse: bool = False) -> torch.Tensor:
    """bf16(apply_rope_tail(x)): the rotated tail rounded to BF16, as upstream's `rope_tail`
    ends in `.to(x.dtype)` for its BF16 tensors (`dsv41_sparse.py:97`). Used for q, the
    attention output, and — before the FP4 round trip — compressed latents, index keys and index
    queries (`dsv41_sparse.py:31-44`, `fp4_rope_fake_quant.py:49`). x's non-rotated dims must
    already be BF16-valued (they pass through the rounding unchanged)."""
    return ops.bf16(apply_rope_tail(x, positions, inv_freq, inverse))


# At the end: `ops` imports this module's names at its own end, so either may be imported first.
from . import ops  # noqa: E402

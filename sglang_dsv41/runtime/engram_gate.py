"""The Engram residual update of the runtime (spec `model.md` §3.3.2).

R ← bf16(R + g·value) per stream, with [keys | value] = FP8 linear of the concatenated table rows
and g = sigmoid(copysign(sqrt(max(|dot|, 1e−6)), dot)) from the doubly RMS-normalised weighted
inner product of each stream with its key. Image rows keep R. The runtime's copy of
`reference/engram.py`, tested against it (tests/test_runtime_engram_gate.py).
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from ..numerics.rounding import fp32_scalar
from .backend import ComputeBackend
from .quant_methods import apply_linear

F32, F64 = torch.float32, torch.float64
#: |dot| is clamped below by this before the square root (spec §3.3.2).
GATE_DOT_FLOOR = 1e-6


def engram_gate(residual: Tensor, keys: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float,
                acc: torch.dtype = F64) -> Tensor:
    """g [T, hc] fp32 from residual and keys [T, hc, H] — the CPU backends' `engram_gate`; CUDA
    runs the fp32 kernel `kernels.engram_gate`. Upstream's fp32 steps (w = q·k, (h·w)·key,
    rs_h·rs_k, ·rstd, ·H^−½, max, sqrt); the sum over H, the rsqrts and the sigmoid in `acc`
    (float64: rounded once, bit-identical to the reference), the sqrt as an `acc` sqrt of the
    fp32 value (float64: the correctly rounded fp32 sqrt)."""
    h, key = residual.to(F32), keys.to(F32)
    w = q_weight.to(F32) * k_weight.to(F32)
    inner = ((h * w) * key).to(acc).sum(dim=-1).to(F32)
    rstd = (torch.rsqrt(h.to(acc).pow(2).mean(dim=-1) + eps).to(F32)
            * torch.rsqrt(key.to(acc).pow(2).mean(dim=-1) + eps).to(F32))
    dot = inner * rstd * fp32_scalar(h.shape[-1] ** -0.5)
    mag = torch.sqrt(dot.abs().clamp(min=fp32_scalar(GATE_DOT_FLOOR)).to(acc)).to(F32)
    return torch.sigmoid(torch.copysign(mag, dot).to(acc)).to(F32)


def engram_update(be: ComputeBackend, R: Tensor, rows: Tensor, wkv: nn.Module, q_weight: Tensor, k_weight: Tensor,
                  eps: float, act_quant: bool, image_rows: Tensor | None) -> Tensor:
    """The residual after the Engram gate. R [T, hc, H] BF16 values; rows [T, columns, d] the
    looked-up table rows; wkv the FP8 linear layer [(hc+1)·H, columns·d] (applied through its
    quantisation method); image_rows [T] bool or None. The gate and update: `ComputeBackend.engram_residual` (one
    launch on `triton`)."""
    tokens, hc, hidden = R.shape
    kv = apply_linear(wkv, rows.reshape(tokens, -1), be, act_quant=act_quant).to(F32)
    keys = kv[:, : hc * hidden].reshape(tokens, hc, hidden)
    value = kv[:, hc * hidden:]
    return be.engram_residual(R, keys, value, q_weight, k_weight, eps, image_rows)

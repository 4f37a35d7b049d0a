"""Kernels that read the two halves of a stacked product's rows (`runtime/stacked_linear.py`) in place:
* `rms_norm_pair` (spec `model.md` §3.4.1): the attention's q_lora = RMSNorm_q(row[:split]) rounded to
  BF16 and kv = RMSNorm_kv(row[split:]) not rounded, from the stacked `wq_a | wkv`, one program per row;
* `clamped_swiglu_halves` (§3.6): the shared expert's SwiGLU of gate = row[:n], up = row[n:] from the
  stacked `w1 | w3`; with `quantise_out` written as `w2`'s activations quantised per 1×32 (BF16 q·s, the
  values `fp8_quant.fake_quantize_activations_bf16` gives: the fold tier's hand-off, `kernels.fp8_fold`).

Each evaluates the function its one-tensor kernel runs (`fused_elementwise.rms_segment` on the same lanes
and block width, `swiglu.swiglu_value`), so each output equals that kernel's on the half
alone, bit for bit (tests/test_kernels_stacked_halves.py). No host sync; CUDA-graph capturable.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import double_fp32 as DF
from .fp8_quant import INTERPRETED, _quantize_groups
from .fused_elementwise import _launch_options, _pow2_at_least, check_device, rms_segment
from .swiglu import SWIGLU_BLOCK, swiglu_value

F32 = torch.float32


@triton.jit
def _rms_norm_pair_kernel(x_ptr, stride, w1_ptr, w2_ptr, out1_ptr, out2_ptr, D1, D2, EPS_HI: tl.constexpr,
                          EPS_LO: tl.constexpr, BLOCK1: tl.constexpr, BLOCK2: tl.constexpr, LOG2_1: tl.constexpr,
                          LOG2_2: tl.constexpr, ROUND1: tl.constexpr, ROUND2: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    rms_segment(x_ptr + row * stride, w1_ptr, out1_ptr + row * D1, D1, EPS_HI, EPS_LO, BLOCK1, LOG2_1, ROUND1)
    rms_segment(x_ptr + row * stride + D1, w2_ptr, out2_ptr + row * D2, D2, EPS_HI, EPS_LO, BLOCK2, LOG2_2, ROUND2)


def rms_norm_pair(x: Tensor, split: int, first_weight: Tensor, second_weight: Tensor, eps: float,
                  round_first: bool = True, round_second: bool = False) -> tuple[Tensor, Tensor]:
    """(`rms_norm(x[:, :split], first_weight, eps, round_first)`, `rms_norm(x[:, split:], second_weight,
    eps, round_second)`) of x [T, D] (fp32 or BF16, unit stride along D) in one launch; fp32 outputs."""
    if x.dim() != 2 or not 0 < split < x.shape[1]:
        raise ValueError(f"rms_norm_pair: x {tuple(x.shape)} split at {split}: expected [T, D] with 0 < split < D")
    D1, D2 = split, x.shape[1] - split
    if first_weight.shape != (D1,) or second_weight.shape != (D2,):
        raise ValueError(f"rms_norm_pair: weights {tuple(first_weight.shape)} / {tuple(second_weight.shape)} for "
                         f"halves of {D1} / {D2}")
    b1, b2 = _pow2_at_least(D1), _pow2_at_least(D2)
    if max(b1, b2) > 4096:
        raise ValueError(f"rms_norm_pair: halves of {D1} / {D2} exceed its 4096-wide blocks")
    check_device("rms_norm_pair", x, first_weight, second_weight)
    if x.stride(1) != 1:
        x = x.contiguous()
    T = x.shape[0]
    first = torch.empty(T, D1, dtype=F32, device=x.device)
    second = torch.empty(T, D2, dtype=F32, device=x.device)
    if T:
        eps_hi, eps_lo = DF.split_constant(float(eps))
        _rms_norm_pair_kernel[(T,)](x, x.stride(0), first_weight.contiguous(), second_weight.contiguous(), first,
                                    second, D1, D2, EPS_HI=eps_hi, EPS_LO=eps_lo, BLOCK1=b1, BLOCK2=b2,
                                    LOG2_1=b1.bit_length() - 1, LOG2_2=b2.bit_length() - 1, ROUND1=round_first,
                                    ROUND2=round_second, **_launch_options(4))
    return first, second


@triton.jit
def _swiglu_halves_kernel(y_ptr, out_ptr, n, stride, limit, BLOCK: tl.constexpr, QUANT: tl.constexpr,
                          INTERPRET: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = offs < n
    g = tl.load(y_ptr + row * stride + offs, mask=live, other=1.0).to(tl.float32)  # dead lanes pass the screen
    u = tl.load(y_ptr + row * stride + n + offs, mask=live, other=1.0).to(tl.float32)
    v = swiglu_value(g, u, limit)
    if QUANT:                                     # BLOCK and n are multiples of 32: whole groups per program
        q, s = _quantize_groups(tl.reshape(v, (BLOCK // 32, 32)), INTERPRET)
        v = tl.reshape(q.to(tl.float32) * s[:, None], (BLOCK,)).to(tl.bfloat16)
    tl.store(out_ptr + row * n + offs, v, mask=live)


def clamped_swiglu_halves(y: Tensor, limit: float, quantise_out: bool = False) -> Tensor:
    """`swiglu.clamped_swiglu(y[:, :n], y[:, n:], limit)` of y [T, 2n] (fp32 or BF16, unit
    stride along the row) in one launch, without copying the halves; fp32 [T, n] out, or with
    `quantise_out` (n a multiple of 32) those values quantised per 1×32 as BF16 [T, n]."""
    if y.dim() != 2 or y.shape[1] % 2:
        raise ValueError(f"clamped_swiglu_halves: y {tuple(y.shape)}: expected [T, 2n]")
    T, n = y.shape[0], y.shape[1] // 2
    if quantise_out and n % 32:
        raise ValueError(f"clamped_swiglu_halves: quantise_out needs whole 32-column groups, got n = {n}")
    check_device("clamped_swiglu_halves", y)
    if y.stride(1) != 1:
        y = y.contiguous()
    out = torch.empty(T, n, dtype=torch.bfloat16 if quantise_out else F32, device=y.device)
    if T and n:
        block = min(SWIGLU_BLOCK, _pow2_at_least(n))      # lanes per program (`swiglu_value`'s screen)
        if quantise_out:
            block = max(block, 32)
        _swiglu_halves_kernel[(T, triton.cdiv(n, block))](y, out, n, y.stride(0), float(limit), BLOCK=block,
                                                          QUANT=quantise_out, INTERPRET=INTERPRETED,
                                                          **_launch_options())
    return out

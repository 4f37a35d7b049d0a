"""FP8 operand conversions of the W8A8 GEMM (`kernels/fp8_w8a8.py`; spec `model.md` §2.3, §3.8).

* `quantize_activations(x)` → (q E4M3, s fp32): per (row, 32 columns) s = 2^⌈log2(max(amax, 1e−10)/448)⌉
  (UE8M0), q = e4m3(x/s), round to nearest even — exactly `reference.ops.fp8_act_fake_quant`'s
  values q·s (s from amax's bits: amax = m·2^e, m ∈ [1, 2), gives e − 8, plus 1 when m > 1.75 =
  448/2^8; the fp32 quotient amax/448 the reference rounds keeps that decision);
* `fake_quantize_activations_bf16(x)`: those values q·s as BF16 (exact: E4M3 times 2^≥−42);
* `dequantize_weight_bf16(values, scales)`: E4M3 · 32×32 tile scale as BF16 (exact for scales
  2^-124…2^119, `fp8_linear.scales_are_bf16_exact`).

The device helpers (`_quantize_groups`, `_rne_bf16`) are shared with the GEMM kernel, so the fused
quantisation inside it gives the same values. Triton's interpreter (TRITON_INTERPRET=1) rounds
fp32 → E4M3 / BF16 wrongly in some cases (Triton 3.6), so under it (`INTERPRETED`) the helpers round
with integer arithmetic; compiled kernels use the hardware conversions. CPU tensors without the
interpreter raise (`check_device`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.interpreter import InterpretedFunction

from sglang_dsv41.kernels.fused_elementwise import check_device

TILE = 32
FP8 = torch.float8_e4m3fn
QUANT_BLOCK_R = 64
DEQUANT_BLOCK = 64


@triton.jit
def _rne_e4m3(v):
    """fp32 → nearest E4M3 value (ties to even) as fp32, for |v| ≤ 448, by integer arithmetic."""
    e = ((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = tl.maximum(e, -6)                                          # E4M3 subnormal spacing 2^-9
    ulp = ((e + 124) << 23).to(tl.float32, bitcast=True)           # 2^(e-3)
    t = v / ulp                                                    # exact: |t| < 16
    return ((t + 12582912.0) - 12582912.0) * ulp                   # 1.5·2^23: RNE to an integer


@triton.jit
def _rne_bf16(v):
    """fp32 → nearest BF16 value (ties to even) as fp32, for finite v, by integer arithmetic."""
    b = v.to(tl.int32, bitcast=True)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _quantize_groups(xv, INTERPRET: tl.constexpr):
    """xv [R, 32] fp32 → (E4M3 values [R, 32] — fp32-valued under the interpreter —, scales [R])."""
    amax = tl.maximum(tl.max(tl.abs(xv), axis=1), 1e-10)
    bits = amax.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 135 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)   # ⌈log2(amax/448)⌉
    scale = ((e + 127) << 23).to(tl.float32, bitcast=True)
    inv = ((127 - e) << 23).to(tl.float32, bitcast=True)
    v = xv * inv[:, None]                                          # exact (power of two), |v| ≤ 448
    if INTERPRET:
        q = _rne_e4m3(v)
    else:
        q = v.to(tl.float8e4nv)
    return q, scale


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, s_ptr, R, BLOCK_R: tl.constexpr, FAKE_BF16: tl.constexpr,
                     INTERPRET: tl.constexpr):
    """x viewed as [R, 32] contiguous groups → q [R, 32] E4M3 and s [R] fp32, or (FAKE_BF16) the
    values q·s in BF16 (exact: an E4M3 value times a power of two ≥ 2^-42)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, 32)
    ok = rows < R
    offs = rows.to(tl.int64)[:, None] * 32 + cols[None, :]
    q, s = _quantize_groups(tl.load(x_ptr + offs, mask=ok[:, None], other=0.0).to(tl.float32), INTERPRET)
    if FAKE_BF16:
        tl.store(q_ptr + offs, (q.to(tl.float32) * s[:, None]).to(tl.bfloat16), mask=ok[:, None])
    else:
        tl.store(q_ptr + offs, q.to(tl.float8e4nv), mask=ok[:, None])
        tl.store(s_ptr + rows, s, mask=ok)


@triton.jit
def _dequantize_weight_kernel(w_ptr, ws_ptr, out_ptr, N, K, stride_wn, stride_wsn,
                              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out [N, K] BF16 = values · tile scale (exact for scales 2^-124…2^119, `fp8_linear` doc)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    ok = (offs_n < N)[:, None] & (offs_k < K)[None, :]
    v = tl.load(w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :], mask=ok, other=0.0)
    sc = tl.load(ws_ptr + (offs_n // 32).to(tl.int64)[:, None] * stride_wsn + (offs_k // 32)[None, :], mask=ok,
                 other=0.0)
    tl.store(out_ptr + offs_n.to(tl.int64)[:, None] * K + offs_k[None, :], (v.to(tl.float32) * sc).to(tl.bfloat16),
             mask=ok)


INTERPRETED = isinstance(_quantize_kernel, InterpretedFunction)


def quantize_activations(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [M, K] (bf16/fp32, K a multiple of 32) → (q [M, K] E4M3, s [M, K/32] fp32 powers of two):
    x ≈ q·s per 32-column group, exactly `reference.ops.fp8_act_fake_quant`'s values. One pass."""
    if x.dim() != 2 or x.shape[1] % TILE or x.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"quantize_activations: x must be [M, K] bf16/fp32 with K a multiple of {TILE}, "
                         f"got {x.dtype} {tuple(x.shape)}")
    check_device("quantize_activations", x)
    x = x.contiguous()
    M, K = x.shape
    q = torch.empty(M, K, dtype=FP8, device=x.device)
    s = torch.empty(M, K // TILE, dtype=torch.float32, device=x.device)
    R = M * K // TILE
    if R:
        _quantize_kernel[(triton.cdiv(R, QUANT_BLOCK_R),)](x, q, s, R, BLOCK_R=QUANT_BLOCK_R, FAKE_BF16=False,
                                                           INTERPRET=INTERPRETED)
    return q, s


def fake_quantize_activations_bf16(x: Tensor) -> Tensor:
    """x [M, K] → the quantised activations q·s as BF16 [M, K] (exactly `reference.ops.
    fp8_act_fake_quant`'s values). One pass."""
    if x.dim() != 2 or x.shape[1] % TILE or x.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"fake_quantize_activations_bf16: x must be [M, K] bf16/fp32 with K a multiple of {TILE}, "
                         f"got {x.dtype} {tuple(x.shape)}")
    check_device("fake_quantize_activations_bf16", x)
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
    R = x.numel() // TILE
    if R:
        _quantize_kernel[(triton.cdiv(R, QUANT_BLOCK_R),)](x, out, out, R, BLOCK_R=QUANT_BLOCK_R, FAKE_BF16=True,
                                                           INTERPRET=INTERPRETED)
    return out


def dequantize_weight_bf16(values: Tensor, scales: Tensor) -> Tensor:
    """values [N, K] E4M3 · their 32×32 tile scales → BF16 [N, K], exact when every scale is
    2^s with −124 ≤ s ≤ 119 (`fp8_linear.scales_are_bf16_exact`, checked at load time). One pass:
    1 B read, 2 B written per element."""
    N, K = values.shape
    out = torch.empty(N, K, dtype=torch.bfloat16, device=values.device)
    if out.numel():
        _dequantize_weight_kernel[(triton.cdiv(N, DEQUANT_BLOCK), triton.cdiv(K, DEQUANT_BLOCK))](
            values, scales, out, N, K, values.stride(0), scales.stride(0), BLOCK_N=DEQUANT_BLOCK, BLOCK_K=DEQUANT_BLOCK)
    return out


__all__ = ["FP8", "INTERPRETED", "TILE", "check_device", "dequantize_weight_bf16",
           "fake_quantize_activations_bf16", "quantize_activations"]

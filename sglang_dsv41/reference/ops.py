"""Numerical building blocks shared by every part of the reference (spec `model.md` §3, §3.8).

Everything here is plain PyTorch on fp32 math with explicit rounding points, so each function
states exactly where values are rounded (to BF16, E4M3, E2M1, ...). The reference model is
assembled from these; the runtime kernels are tested against them.

Rounding conventions
--------------------
* `bf16(x)`: round-to-nearest-even to BF16 (torch's cast), returned as fp32 values.
* UE8M0 scales are exact powers of two: `pow2_ceil(v) = 2^⌈log2 v⌉` computed with `frexp`,
  never with a floating `log2` (which misrounds at exact powers of two).
* E4M3 casts use torch's `float8_e4m3fn` conversion (round-to-nearest-even; callers keep
  inputs within ±448 by construction of the scale).
"""
from __future__ import annotations

import contextlib
import contextvars
import enum
import math
import struct
from typing import Iterator, Protocol

import torch


F32 = torch.float32
BF16 = torch.bfloat16
E4M3_MAX = 448.0
E2M1_MAX = 6.0


def fp32_scalar(v: float) -> float:
    """The Python float v rounded to the nearest fp32 value (no tensor, no device sync)."""
    return struct.unpack("<f", struct.pack("<f", v))[0]


#: fp32(1/6): upstream's FP4 quantisers multiply amax by this reciprocal instead of dividing by 6
#: (`kernels/ops/quantization/fp4_fake_quant.py:30-32,58`, `fp4_rope_fake_quant.py:56,60`).
INV_E2M1_MAX = fp32_scalar(1.0 / E2M1_MAX)


# ---- rounding primitives ------------------------------------------------------------------

def bf16(x: torch.Tensor) -> torch.Tensor:
    """Round to BF16 (RNE) and return fp32 values. (fp32 input inside `fused_kernels(k)`, when k
    accepts the tensor: `k.bf16`, bit-identical.)"""
    if x.dtype == F32:
        fused = fused_for(x)
        if fused is not None:
            return fused.bf16(x)
    return x.to(BF16).to(F32)


def e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 values to FP8 E4M3 (RNE) and return fp32 values. (Inside `fused_kernels(k)`:
    `k.e4m3` for fp32 input it accepts, bit-identical.)"""
    if x.dtype == F32:
        fused = fused_for(x)
        if fused is not None:
            return fused.e4m3(x)
    return x.to(torch.float8_e4m3fn).to(F32)


def pow2_ceil(v: torch.Tensor) -> torch.Tensor:
    """2^⌈log2 v⌉ for v > 0, exact (v = m·2^e with m ∈ [0.5, 1): result 2^(e−1) iff m == 0.5)."""
    m, e = torch.frexp(v.to(F32))
    e = torch.where(m == 0.5, e - 1, e)
    return torch.ldexp(torch.ones_like(v, dtype=F32), e)


def e2m1_rne(x: torch.Tensor) -> torch.Tensor:
    """Round to the E2M1 grid {0, .5, 1, 1.5, 2, 3, 4, 6} (±), ties to even mantissa, clamp ±6.

    On the grid, spacing is 0.5 below 2, 1 in [2, 4) and 2 in [4, 6]; rounding |x|/step to the
    nearest integer with ties-to-even gives exactly the even-mantissa tie rule (spec §3.4.3).
    """
    a = x.abs().clamp(max=E2M1_MAX)
    step = torch.where(a < 2.0, 0.5, torch.where(a < 4.0, 1.0, 2.0))
    q = torch.round(a / step) * step
    return torch.copysign(q.clamp(max=E2M1_MAX), x)


def _grouped(x: torch.Tensor, group: int) -> torch.Tensor:
    if x.shape[-1] % group:
        raise ValueError(f"last dim {x.shape[-1]} is not a multiple of the quantisation group {group}")
    return x.reshape(*x.shape[:-1], x.shape[-1] // group, group)


# ---- model-intrinsic FP4 round trips (spec §3.4.3, §3.4.4) ---------------------------------

def fp4_fake_quant_e4m3_scale(x: torch.Tensor, group: int = 16) -> torch.Tensor:
    """Compressed-latent FP4 round trip: E2M1 values, one E4M3 scale per 16 (spec §3.4.3).

    scale = e4m3(clamp(amax·fp32(1/6), 2⁻⁹, 448)); value = e2m1(clamp(x/scale, −6, 6))·scale.
    amax is multiplied by the fp32 reciprocal of 6, as upstream's quantiser does; for BF16-valued
    inputs (every model caller's, spec §3.4.3 after the BF16 rounding of the rotated tail) this
    equals amax/6 after the E4M3 rounding (tests/test_reference_rounding.py).
    """
    fused = fused_for(x)
    if fused is not None:
        return fused.fp4_fake_quant_e4m3_scale(x, group)
    g = _grouped(x.to(F32), group)
    amax = g.abs().amax(dim=-1, keepdim=True)
    scale = e4m3((amax * INV_E2M1_MAX).clamp(min=2.0**-9, max=E4M3_MAX))
    q = e2m1_rne((g / scale).clamp(-E2M1_MAX, E2M1_MAX)) * scale
    return q.reshape(x.shape)


def fp4_fake_quant_ue8m0_scale(x: torch.Tensor, group: int = 32) -> torch.Tensor:
    """Indexer q/k FP4 round trip: E2M1 values, one UE8M0 scale per 32, no Hadamard (spec §3.4.3).

    scale = 2^⌈log2(max(amax, 6·2⁻¹²⁶)·fp32(1/6))⌉ (the fp32 reciprocal, as upstream).
    """
    fused = fused_for(x)
    if fused is not None:
        return fused.fp4_fake_quant_ue8m0_scale(x, group)
    g = _grouped(x.to(F32), group)
    amax = g.abs().amax(dim=-1, keepdim=True)
    scale = pow2_ceil(amax.clamp(min=E2M1_MAX * 2.0**-126) * INV_E2M1_MAX)
    q = e2m1_rne((g / scale).clamp(-E2M1_MAX, E2M1_MAX)) * scale
    return q.reshape(x.shape)


# ---- norms and linears --------------------------------------------------------------------

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """bf16( x·rsqrt(mean(x²) + ε)·w ), returned as fp32 values (spec §3).

    Evaluated in float64 and rounded once (the reference's device-invariance convention, see
    `_matmul_exact`): CPU and CUDA give identical bits. Inside `fused_kernels(k)`: `k.rms_norm`
    (one launch; equal up to the rare one-ulp flips stated in `kernels/fused_elementwise.py`)."""
    fused = fused_for(x, weight)
    if fused is not None:
        return fused.rms_norm(x, weight, eps, True)
    xd = x.to(torch.float64)
    y = xd * torch.rsqrt(xd.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.to(torch.float64)
    return bf16(y.to(F32))


def fp8_act_fake_quant(x: torch.Tensor, group: int = 32) -> torch.Tensor:
    """Activation quantisation of FP8 linears: per (token, 32 channels) E4M3 with a UE8M0
    scale 2^⌈log2(max(amax, 1e−10)/448)⌉ (spec §3.8). Inside `fused_kernels(k)`:
    `k.fp8_act_fake_quant` (bit-identical)."""
    fused = fused_for(x)
    if fused is not None:
        return fused.fp8_act_fake_quant(x, group)
    g = _grouped(x.to(F32), group)
    amax = g.abs().amax(dim=-1, keepdim=True).clamp(min=1e-10)
    scale = pow2_ceil(amax / E4M3_MAX)
    return (e4m3(g / scale) * scale).reshape(x.shape)


class DenseBackend(Protocol):
    """How the dense helpers below (`linear_fp8`, `linear_bf16`, `matmul_fp32_exact`; also
    `compressor.linear_fp32_out`) evaluate their product x·weightᵀ.

    `matmul(x, weight)` returns an fp32 approximation of x·weightᵀ (x [..., in] fp32 holding the
    helper's already-quantised activation, weight [out, in]); the helper then rounds it exactly as
    it rounds the float64 product (BF16 or fp32). Implementations state their error bound
    (`runtime/dense_ops.py`)."""

    def matmul(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor: ...


_DENSE_BACKEND: contextvars.ContextVar[DenseBackend | None] = contextvars.ContextVar(
    "sglang_dsv41_dense_backend", default=None)


@contextlib.contextmanager
def dense_backend(backend: DenseBackend | None) -> Iterator[None]:
    """Evaluate the dense helpers' products with `backend` inside the block (context-local:
    contextvars; restored on exit, also after an exception). `None` = the exact float64 product
    (the default). The reference (the oracle) never sets a backend; only the runtime's CUDA
    forward does (`runtime/dense_ops.py`)."""
    token = _DENSE_BACKEND.set(backend)
    try:
        yield
    finally:
        _DENSE_BACKEND.reset(token)


def current_dense_backend() -> DenseBackend | None:
    """The backend set by the innermost `dense_backend` block (None = exact float64)."""
    return _DENSE_BACKEND.get()


class FusedKernels(Protocol):
    """One-launch replacements of the elementwise / per-row helpers (`bf16`, `e4m3`,
    `fp8_act_fake_quant`, `fp4_fake_quant_*`, `rms_norm`, `apply_rope_tail`; also
    `attention.rms_norm_fp32`, `moe.clamped_swiglu` and the selection of `moe.route`).

    Each method returns what the helper of the same name returns (same shape, fp32 values) with the
    bound its implementation states (`runtime/fused_ops.py`, `kernels/fused_elementwise.py`:
    bit-identical, or float64-evaluated and rounded once with rare one-ulp flips). `accepts(t)` says
    whether the implementation runs on t's device; the helpers use it only when every tensor
    argument is accepted and otherwise run their own code."""

    def accepts(self, x: torch.Tensor) -> bool: ...
    def bf16(self, x: torch.Tensor) -> torch.Tensor: ...
    def e4m3(self, x: torch.Tensor) -> torch.Tensor: ...
    def fp8_act_fake_quant(self, x: torch.Tensor, group: int) -> torch.Tensor: ...
    def fp4_fake_quant_e4m3_scale(self, x: torch.Tensor, group: int) -> torch.Tensor: ...
    def fp4_fake_quant_ue8m0_scale(self, x: torch.Tensor, group: int) -> torch.Tensor: ...
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, round_bf16: bool) -> torch.Tensor: ...
    def apply_rope_tail(self, x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                        inverse: bool) -> torch.Tensor: ...
    def clamped_swiglu(self, gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor: ...
    def route_select(self, scores: torch.Tensor, bias: torch.Tensor, top_k: int, renorm_eps: float,
                     bias_vl: torch.Tensor | None, image_rows: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor]: ...


_FUSED_KERNELS: contextvars.ContextVar[FusedKernels | None] = contextvars.ContextVar(
    "sglang_dsv41_fused_kernels", default=None)


@contextlib.contextmanager
def fused_kernels(kernels: FusedKernels | None) -> Iterator[None]:
    """Run the helpers listed in `FusedKernels` through `kernels` inside the block, for tensors
    it accepts (context-local: contextvars; restored on exit, also after an exception). `None` =
    the reference code (the default). The reference (the oracle) never sets it; only the
    runtime's CUDA forward does (`runtime/fused_ops.py`)."""
    token = _FUSED_KERNELS.set(kernels)
    try:
        yield
    finally:
        _FUSED_KERNELS.reset(token)


def current_fused_kernels() -> FusedKernels | None:
    """The implementation set by the innermost `fused_kernels` block (None = reference code)."""
    return _FUSED_KERNELS.get()


def fused_for(*tensors: torch.Tensor) -> FusedKernels | None:
    """The current fused implementation if it accepts every one of `tensors`, else None."""
    fused = _FUSED_KERNELS.get()
    if fused is None or not all(fused.accepts(t) for t in tensors):
        return None
    return fused


def _matmul_exact(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x·wᵀ accumulated in float64, returned as fp32.

    Upstream accumulates in fp32, whose summation order depends on the batch shape (a 1-row
    and a 32-row call can differ in the last bit). The reference instead computes the
    (nearly) exact product and rounds once, so its results do not depend on how tokens are
    batched or chunked; the runtime's fp32-accumulating kernels are compared to it with a
    stated tolerance. Inside a `dense_backend(b)` block the product is `b.matmul` instead.
    """
    backend = _DENSE_BACKEND.get()
    if backend is not None:
        return backend.matmul(x, weight)
    if weight.dtype == torch.float8_e4m3fn:     # the CUDA runtime's in-place FP8 form: codes without scales
        raise TypeError("exact dense product of an E4M3 weight without its tile scales: only a dense backend "
                        "(runtime/dense_ops.py) multiplies FP8 weights; the reference takes dequantised values")
    return (x.to(torch.float64) @ weight.to(torch.float64).t()).to(F32)


def linear_fp8(x: torch.Tensor, weight: torch.Tensor, act_quant: bool = True) -> torch.Tensor:
    """FP8 dense linear: dequantised weight [out, in], optional activation fake-quant, exact
    accumulation, BF16 output (returned as fp32 values). Spec §3.8."""
    xf = fp8_act_fake_quant(x) if act_quant else x.to(F32)
    return bf16(_matmul_exact(xf, weight))


def linear_bf16(x: torch.Tensor, weight: torch.Tensor, out_fp32: bool = False) -> torch.Tensor:
    """BF16-weight linear with exact accumulation; BF16 output unless `out_fp32` (router,
    compressor projections produce fp32)."""
    y = _matmul_exact(x, weight)
    return y if out_fp32 else bf16(y)


def matmul_fp32_exact(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x·weightᵀ accumulated in fp64 and rounded once to fp32 (the correctly rounded fp32 dot
    product for BF16/FP8-valued operands, whose products are exact in fp64). Unlike an fp32
    GEMM it does not depend on how many rows share the call or on the device, so chunked and
    one-shot forwards agree bit for bit. Used where an fp32 result is consumed unrounded
    (router logits, LM-head logits, mHC mix). Inside a `dense_backend(b)` block: `b.matmul`."""
    return _matmul_exact(x, weight)


# ---- KV-cache quantisation profiles (spec §3.8) -------------------------------------------

class CacheProfile(str, enum.Enum):
    """How the KV caches are stored, i.e. what attention reads back (spec §3.8).

    * NONE: BF16 caches (the model as trained, no cache quantisation).
    * FP8:  upstream's default "v4" layout: nope dims E4M3 with one UE8M0 per 64, RoPE dims
            BF16 — for SWA and compressed caches alike (584 B/token at Flash widths).
    * FP4:  the "v41" layout: SWA all dims E4M3 with one UE8M0 per 32; compressed latents in
            FP4 (exactly the model-intrinsic FP4 values); 890 B/token global KV at Flash.
    Index keys are FP4 in every profile (they are FP4 by construction).
    """

    NONE = "none"
    FP8 = "fp8"
    FP4 = "fp4"


def _fp8_v4_roundtrip(x: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """v4 layout: nope dims E4M3 with one UE8M0 per 64, scale 2^⌈log2(max(amax, 1e−4)/448)⌉ —
    upstream's floor is on amax (`main_norm_rope.cuh:431`, `store.cuh:68`); RoPE dims BF16."""
    nope, rope = x[..., :-rope_dim], x[..., -rope_dim:]
    g = _grouped(nope, 64)
    scale = pow2_ceil(g.abs().amax(dim=-1, keepdim=True).clamp(min=1e-4) / E4M3_MAX)
    q = (e4m3(g / scale) * scale).reshape(nope.shape)
    return torch.cat((q, bf16(rope)), dim=-1)


def _fp8_v41_roundtrip(x: torch.Tensor) -> torch.Tensor:
    """v41 SWA layout: every dim E4M3 with one UE8M0 per 32, scale 2^⌈log2(max(amax/448, 1e−4))⌉
    (`kv_layout.cuh:172-186`, computed there from amax's bits: equal, since the fp32 quotient
    amax/448 never rounds across a power of two)."""
    g = _grouped(x, 32)
    scale = pow2_ceil((g.abs().amax(dim=-1, keepdim=True) / E4M3_MAX).clamp(min=1e-4))
    return (e4m3(g / scale) * scale).reshape(x.shape)


def swa_cache_roundtrip(kv_normed: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                        profile: CacheProfile, rope_dim: int) -> torch.Tensor:
    """What attention reads back for a token's SWA kv, from the **pre-RoPE** normalised kv
    (fp32 values of RMSNorm_kv_norm, not rounded): rotate and store as upstream's kernel for
    the profile's layout does (spec §3.4.1, §3.8):

    * NONE (BF16 cache, `fused_norm_rope.cuh:132,157-163`): bf16(normed) → RoPE → BF16;
    * FP8 (v4 layout, `main_norm_rope.cuh:413-434`): the nope dims are quantised from the fp32
      normed values; the RoPE dims are rotated from the fp32 values and stored BF16;
    * FP4 (v41 layouts, `main_norm_rope.cuh:393-409`): bf16(normed) → RoPE → BF16 → E4M3 per 32.
    """
    kv = kv_normed.to(F32)
    if profile is CacheProfile.FP8:
        return _fp8_v4_roundtrip(apply_rope_tail(kv, positions, inv_freq), rope_dim)
    row = bf16_rope_tail(bf16(kv), positions, inv_freq)
    if profile is CacheProfile.NONE:
        return row
    return _fp8_v41_roundtrip(row)


def compressed_cache_roundtrip(latent_fp4: torch.Tensor, profile: CacheProfile, rope_dim: int) -> torch.Tensor:
    """What attention reads back for a compressed latent that is already FP4-rounded."""
    latent_fp4 = latent_fp4.to(F32)
    if profile is CacheProfile.FP8:
        return _fp8_v4_roundtrip(latent_fp4, rope_dim)
    return bf16(latent_fp4)  # exact: FP4 values × E4M3 scales fit BF16


def softmax_scale(head_dim: int) -> float:
    """Attention softmax scale head_dim^−1/2; no YaRN mscale anywhere (spec §3.4.2)."""
    return 1.0 / math.sqrt(head_dim)


# RoPE lives in `rope.py` (it uses the rounding helpers above); re-exported here, where every
# caller has always found it.
from .rope import apply_rope_tail, bf16_rope_tail, rope_cos_sin, rope_inv_freq  # noqa: E402,F401

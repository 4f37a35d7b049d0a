"""One-launch Triton versions of the reference's elementwise / per-row chains (spec `model.md` §3, §3.4, §3.8),
and the rounding helpers (device functions) and launch helpers the other kernels share.

Each function here computes exactly what the named reference function computes, in one kernel launch
(RoPE: `rope`; SwiGLU: `swiglu`):

=========================  =======================================================  =========================
function                   replaces                                                 result vs the reference
=========================  =======================================================  =========================
`round_bf16`               `ops.bf16` (fp32 input)                                  bit-identical
`round_e4m3`               `ops.e4m3` (fp32 input)                                  bit-identical
`fp8_act_fake_quant`       `ops.fp8_act_fake_quant` (per-32 UE8M0 + E4M3)           bit-identical
`fp4_fake_quant`           `ops.fp4_fake_quant_e4m3_scale` / `_ue8m0_scale`          bit-identical
`rms_norm`                 `ops.rms_norm` / `attention.rms_norm_fp32`               see "fp64 results"
=========================  =======================================================  =========================

Rounding is done arithmetically, never by Triton casts whose semantics differ from torch's:
* BF16: round-to-nearest-even on the fp32 bits (add 0x7FFF + lsb, clear the low half) — what
  torch's cast does (c10 `round_to_nearest_even`); NaN stays NaN. Triton's interpreter truncates
  its fp32→bf16 casts, so this also makes the CPU (interpreter) results exact.
* E4M3 (torch `.to(float8_e4m3fn)`): RNE on the E4M3 grid (quantum 2^(e−3), at least 2⁻⁹), then
  any magnitude that rounds above 448 — i.e. |v| > 464, plus ±inf and NaN — becomes NaN (torch's
  conversion has no saturation; Triton's `cvt.rn.satfinite` would give 448, so it is not used).
  Integer rounding uses (r + 2²³) − 2²³ on |r| < 2²², which is RNE in fp32 hardware and numpy.
* UE8M0 `pow2_ceil(v)` (v ≥ 2⁻¹²⁶, which every caller's clamp guarantees): v itself when its
  mantissa bits are zero (m == 0.5 in frexp terms), else 2^(⌊log2 v⌋+1) — from the exponent bits.
* fp32 divisions use `div_rn` (Triton's `/` on fp32 is `div.full.f32`, not correctly rounded);
  divisions by powers of two are multiplications by the exact reciprocal. Launches pass
  `enable_fp_fusion=False` so no a·b+c becomes an FMA.

fp64 results. Where the reference evaluates in float64 and rounds once (rms_norm; SwiGLU in `swiglu`,
the routing weights' Σ in `route_select`, RoPE's cos/sin in `rope`) the kernels evaluate the same formula in
double-fp32 (`double_fp32`: pairs of fp32, exact products and sums, ≲ 2⁻⁴⁴ relative error per result;
exp by Cody–Waite reduction and a degree-12 Taylor polynomial in double-fp32) and round once — no
float64 in these kernels. Their fp32 (then BF16) results equal the reference's except where the exact
value lies within ~2⁻⁴⁴ relative of an fp32 rounding boundary (probability ~2⁻²⁰ per element): rare
one-ulp flips (fp32 ulp for fp32 outputs, BF16 ulp for BF16 outputs). Domains: rms_norm and routing
weights for finite inputs whose squares / products stay normal in fp32; SwiGLU and cos/sin: their modules.

Batch invariance: one program per row (token or token×head) or per block of 32-/16-groups; block
sizes depend only on the row width, never on the number of rows. No host synchronisation, no
host→device copy: every function is CUDA-graph capturable.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.interpreter import InterpretedFunction

from . import double_fp32 as DF

F32 = torch.float32
GROUPS_PER_PROGRAM = 16          # quantisation groups per program (fp8 / fp4 fake quant)
_MAGIC_RNE = 8388608.0           # 2^23: (r + 2^23) − 2^23 rounds |r| < 2^22 to an integer, ties to even


# ---- rounding primitives (device functions) ------------------------------------------------

@triton.jit
def _round_bf16(x):
    """fp32 → nearest BF16 (ties to even), returned as fp32; NaN stays NaN."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
    return tl.where(x != x, x, rounded.to(tl.float32, bitcast=True))


@triton.jit
def _rne_int(r):
    """Round |r| < 2^22 to an integer, ties to even (fp32 hardware rounding)."""
    return (r + 8388608.0) - 8388608.0


@triton.jit
def _pow2(biased_exp):
    """2^(biased_exp − 127) as fp32 for biased_exp in [1, 254] (int32)."""
    return (biased_exp.to(tl.uint32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_rne(v):
    """torch's fp32 → float8_e4m3fn → fp32: RNE, |rounded| > 448 (or inf / NaN in) → NaN."""
    bits = v.to(tl.uint32, bitcast=True)
    sign = bits & 0x80000000
    mag = bits ^ sign
    a = mag.to(tl.float32, bitcast=True)
    exp_field = (mag >> 23).to(tl.int32)
    q_exp = tl.maximum(tl.minimum(exp_field, 254), 121) - 3      # quantum 2^(e−3), at least 2^−9
    n = _rne_int(a * _pow2(254 - q_exp))                         # a / quantum, exact (power of two)
    q = n * _pow2(q_exp)
    out = (q.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    return tl.where((q > 448.0) | (a != a), float("nan"), out)


@triton.jit
def _pow2_ceil(v):
    """2^⌈log2 v⌉ for fp32 v ≥ 2^−126 (exact powers of two map to themselves)."""
    bits = v.to(tl.uint32, bitcast=True)
    exact = (bits & 0x7FFFFF) == 0
    up = ((bits >> 23) + 1) << 23
    return tl.where(exact, bits & 0x7F800000, up).to(tl.float32, bitcast=True)


@triton.jit
def _e2m1_rne(x):
    """Nearest value of the E2M1 grid {0, .5, 1, 1.5, 2, 3, 4, 6} (±), ties to even, clamp ±6."""
    a = tl.minimum(tl.abs(x), 6.0)
    inv_step = tl.where(a < 2.0, 2.0, tl.where(a < 4.0, 1.0, 0.5))
    step = tl.where(a < 2.0, 0.5, tl.where(a < 4.0, 1.0, 2.0))
    q = tl.minimum(_rne_int(a * inv_step) * step, 6.0)
    sign = x.to(tl.uint32, bitcast=True) & 0x80000000
    return (q.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)


# ---- kernels ---------------------------------------------------------------------------------

@triton.jit
def _round_bf16_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = offs < n
    tl.store(out_ptr + offs, _round_bf16(tl.load(x_ptr + offs, mask=live, other=0.0)), mask=live)


@triton.jit
def _round_e4m3_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = offs < n
    tl.store(out_ptr + offs, _e4m3_rne(tl.load(x_ptr + offs, mask=live, other=0.0)), mask=live)


@triton.jit
def _group_quant_kernel(x_ptr, out_ptr, n_groups, GROUP: tl.constexpr, GPP: tl.constexpr, MODE: tl.constexpr):
    """MODE 0: FP8 activation (UE8M0 per GROUP, E4M3 values); 1: FP4 with E4M3 scales;
    2: FP4 with UE8M0 scales. One program = GPP consecutive groups of a contiguous tensor.
    FP4 scales take amax·fp32(1/6) (`ops.INV_E2M1_MAX`, upstream's reciprocal), not amax/6."""
    INV6 = 0.1666666716337204                                    # fp32(1/6), exact as an fp32 constant
    g = tl.program_id(0).to(tl.int64) * GPP + tl.arange(0, GPP)
    live = g < n_groups
    offs = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    x = tl.load(x_ptr + offs, mask=live[:, None], other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    if MODE == 0:
        scale = _pow2_ceil(tl.math.div_rn(tl.maximum(amax, 1e-10), 448.0))
        inv = _pow2(254 - ((scale.to(tl.uint32, bitcast=True) >> 23).to(tl.int32)))
        q = _e4m3_rne(x * inv[:, None]) * scale[:, None]
    elif MODE == 1:
        scale = _e4m3_rne(tl.minimum(tl.maximum(amax * INV6, 0.001953125), 448.0))
        ratio = tl.math.div_rn(x, tl.broadcast_to(scale[:, None], (GPP, GROUP)))
        q = _e2m1_rne(tl.minimum(tl.maximum(ratio, -6.0), 6.0)) * scale[:, None]
    else:
        scale = _pow2_ceil(tl.maximum(amax, 7.052966104933725e-38) * INV6)
        inv = _pow2(254 - ((scale.to(tl.uint32, bitcast=True) >> 23).to(tl.int32)))
        q = _e2m1_rne(tl.minimum(tl.maximum(x * inv[:, None], -6.0), 6.0)) * scale[:, None]
    tl.store(out_ptr + offs, q, mask=live[:, None])


@triton.jit
def rms_row(x, w, D, EPS_HI: tl.constexpr, EPS_LO: tl.constexpr, LOG2_D: tl.constexpr, ROUND_BF16: tl.constexpr):
    """One row held as fp32 lanes x, w (zeros past D): x·(1/sqrt(Σx²/D + ε))·w in double-fp32,
    rounded once to fp32 (then BF16). Every RMSNorm kernel calls this, so they agree bit for bit."""
    sq_h, sq_l = DF.two_prod(x, x)
    ss_h, ss_l = DF.df_tree_sum(sq_h, sq_l, LOG2_D)
    m_h, m_l = DF.df_div_f(ss_h, ss_l, D.to(tl.float32))
    m_h, m_l = DF.df_add(m_h, m_l, EPS_HI, EPS_LO)
    r_h, r_l = DF.df_rsqrt(m_h, m_l)
    y_h, y_l = DF.df_mul_f(r_h, r_l, x)
    y_h, y_l = DF.df_mul_f(y_h, y_l, w)
    y = y_h + y_l
    if ROUND_BF16:
        y = _round_bf16(y)
    return y


@triton.jit
def rms_segment(x_ptr, w_ptr, out_ptr, D, EPS_HI: tl.constexpr, EPS_LO: tl.constexpr, BLOCK_D: tl.constexpr,
                LOG2_D: tl.constexpr, ROUND_BF16: tl.constexpr):
    """Loads D values at x_ptr and the weight at w_ptr, stores `rms_row` of them at out_ptr."""
    d = tl.arange(0, BLOCK_D)
    live = d < D
    x = tl.load(x_ptr + d, mask=live, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + d, mask=live, other=0.0).to(tl.float32)
    tl.store(out_ptr + d, rms_row(x, w, D, EPS_HI, EPS_LO, LOG2_D, ROUND_BF16), mask=live)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, D, EPS_HI: tl.constexpr, EPS_LO: tl.constexpr, BLOCK_D: tl.constexpr,
                     LOG2_D: tl.constexpr, ROUND_BF16: tl.constexpr):
    """One row: `rms_segment`."""
    row = tl.program_id(0).to(tl.int64)
    rms_segment(x_ptr + row * D, w_ptr, out_ptr + row * D, D, EPS_HI, EPS_LO, BLOCK_D, LOG2_D, ROUND_BF16)


# ---- launchers -------------------------------------------------------------------------------

#: True when the kernels were built for Triton's CPU interpreter (TRITON_INTERPRET=1 at import).
INTERPRETED = isinstance(_round_bf16_kernel, InterpretedFunction)
_ELEMENTWISE_BLOCK = 1024
#: Elements per program below _ELEMENTWISE_WIDE_MIN elements: small launches (decode) spread over
#: more programs, since each element's arithmetic is the same whatever its program (the interpreter,
#: whose cost is per program, keeps the wide block).
_ELEMENTWISE_SMALL_BLOCK = _ELEMENTWISE_BLOCK if INTERPRETED else 128
_ELEMENTWISE_WIDE_MIN = 128 * _ELEMENTWISE_BLOCK


def _launch_options(num_warps: int = 4) -> dict:
    """Compiled launches: no FMA contraction (the reference rounds every product); the
    interpreter takes no launch options."""
    return {} if INTERPRETED else {"num_warps": num_warps, "enable_fp_fusion": False}




def check_device(name: str, *tensors: Tensor) -> None:
    """All tensors on one device, and a CUDA one unless Triton's interpreter runs (tests)."""
    dev = tensors[0].device
    if any(t.device != dev for t in tensors):
        raise ValueError(f"{name}: tensors on several devices {sorted({str(t.device) for t in tensors})}")
    if dev.type != "cuda" and not INTERPRETED:
        raise RuntimeError(f"{name}: tensors on {dev} need a CUDA device, or TRITON_INTERPRET=1 set before "
                           "triton is first imported (Triton's CPU interpreter)")


def elementwise_block(n: int) -> int:
    """Elements per program of a one-element-per-lane kernel over n elements."""
    return _ELEMENTWISE_BLOCK if n >= _ELEMENTWISE_WIDE_MIN else _ELEMENTWISE_SMALL_BLOCK


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _elementwise(name: str, kernel, x: Tensor) -> Tensor:
    """Launch a one-input fp32 elementwise `kernel` over x (a new fp32 tensor of x's shape)."""
    check_device(name, x)
    if x.dtype != F32:
        raise ValueError(f"{name}: fp32 input expected, got {x.dtype} (other dtypes round differently)")
    x = x.contiguous()
    out = torch.empty_like(x)
    n = x.numel()
    if n:
        block = elementwise_block(n)
        kernel[(triton.cdiv(n, block),)](x, out, n, BLOCK=block, **_launch_options())
    return out


def round_bf16(x: Tensor) -> Tensor:
    """`ops.bf16` of an fp32 tensor: BF16 (RNE) values as a new fp32 tensor; bit-identical."""
    return _elementwise("round_bf16", _round_bf16_kernel, x)


def round_e4m3(x: Tensor) -> Tensor:
    """`ops.e4m3` of an fp32 tensor (torch's float8_e4m3fn cast and back); bit-identical."""
    return _elementwise("round_e4m3", _round_e4m3_kernel, x)


def _group_quant(name: str, x: Tensor, group: int, mode: int) -> Tensor:
    check_device(name, x)
    if x.dim() == 0 or x.shape[-1] % group:
        raise ValueError(f"last dim {tuple(x.shape)[-1:]} is not a multiple of the quantisation group {group}")
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=F32, device=x.device)
    n_groups = x.numel() // group
    if n_groups:
        _group_quant_kernel[(triton.cdiv(n_groups, GROUPS_PER_PROGRAM),)](
            x, out, n_groups, GROUP=group, GPP=GROUPS_PER_PROGRAM, MODE=mode, **_launch_options())
    return out


def fp8_act_fake_quant(x: Tensor, group: int = 32) -> Tensor:
    """`ops.fp8_act_fake_quant`: per-`group` UE8M0 scale 2^⌈log2(max(amax, 1e−10)/448)⌉, E4M3
    values (torch's rounding incl. NaN above 464); fp32 out; bit-identical."""
    if group & (group - 1):
        raise ValueError(f"fp8_act_fake_quant: group {group} must be a power of two")
    return _group_quant("fp8_act_fake_quant", x, group, 0)


def fp4_fake_quant(x: Tensor, group: int, scale: str) -> Tensor:
    """`ops.fp4_fake_quant_e4m3_scale` (scale="e4m3", group 16) or `ops.fp4_fake_quant_ue8m0_scale`
    (scale="ue8m0", group 32): E2M1 values (RNE, ±6) times the group scale; bit-identical."""
    modes = {"e4m3": 1, "ue8m0": 2}
    if scale not in modes:
        raise ValueError(f"fp4_fake_quant: scale must be one of {sorted(modes)}, got {scale!r}")
    if group & (group - 1):
        raise ValueError(f"fp4_fake_quant: group {group} must be a power of two")
    return _group_quant("fp4_fake_quant", x, group, modes[scale])


def rms_norm(x: Tensor, weight: Tensor, eps: float, round_bf16: bool = True) -> Tensor:
    """`ops.rms_norm` (round_bf16) / `attention.rms_norm_fp32` (not): x·rsqrt(mean(x²)+ε)·w in
    double-fp32, rounded once to fp32 (then BF16); fp32 out. Bound: module doc, "fp64 results"."""
    check_device("rms_norm", x, weight)
    D = x.shape[-1]
    if weight.shape != (D,):
        raise ValueError(f"rms_norm: weight {tuple(weight.shape)} for rows of {D}")
    block = _pow2_at_least(D)
    if block > 16384:
        raise ValueError(f"rms_norm: rows of {D} exceed the one-block limit 16384")
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=F32, device=x.device)
    rows = x.numel() // D if D else 0
    if rows:
        eps_hi, eps_lo = DF.split_constant(float(eps))
        _rms_norm_kernel[(rows,)](x, weight.contiguous(), out, D, EPS_HI=eps_hi, EPS_LO=eps_lo, BLOCK_D=block,
                                  LOG2_D=block.bit_length() - 1,
                                  ROUND_BF16=round_bf16, **_launch_options(8 if block >= 4096 else 4))
    return out


__all__ = ["INTERPRETED", "fp4_fake_quant", "fp8_act_fake_quant",
           "rms_norm", "round_bf16", "round_e4m3"]

"""Fused Triton kernels of the mHC hyper-connections (spec `model.md` §3.2; semantics =
`sglang_dsv41.reference.mhc`, whose functions these replace one for one on CUDA tensors).

Four ops, 1–2 launches each (the reference spends ~600 tiny float64 torch kernels per layer).
The residual R [T, hc, H] holds BF16 values (§3.2) and may be held as fp32 or torch.bfloat16 (the
runtime's CUDA path: `runtime/mhc_ops.py`): every kernel widens it to fp32 as it loads it, and
`hc_residual_update` writes R's dtype. The stream ops and the `rows` coefficients give the same bits from either;
compiled, the `dot` / `fused` / `tc` coefficients differed in the last bits between the two (H100, session 32;
the cause, presumably the reduction layout of a 2- against a 4-byte load, is not confirmed), each within the bound.
Everything is fp32 (issue 21: no float64 on the GPU path); the reference evaluates the
coefficients and the norm in float64 and rounds once, so those two ops are bounded, not
bit-identical (tests/test_kernels_mhc.py):

* `hc_coefficients` (2 launches). The partial dots, grid (⌈T/BLOCK_T⌉, ⌈hc·H/128⌉): a program
  holds one 128-column slice of F [hc·(2+hc), hc·H] (24 × 128 fp32 = 12 KB at Flash) and forms,
  for each of its tokens, the fp32 partial dots F[:, slice]·x[slice] and the partial Σx² of that
  slice. Two kernels (`MIX_KERNELS`, chosen per call; the runtime picks by token count, `runtime/mhc_ops.py`): `dot` (`_hc_mix_dot_kernel`,
  BLOCK_T = 32) — one fp32 `tl.dot` (input_precision "ieee": FMA, no TF32) of the [32, 128]
  token tile with the slice; `rows` (`_hc_mix_partials_kernel`, BLOCK_T = 16) — a loop over
  the tokens, each a [32, 128] product reduced by `tl.sum` (a 128-lane reduction per token and
  slice: slow at prefill row counts, docs/performance.md "Session 13"). The two sum a slice in
  different orders (bits differ; both within COEFFICIENT_BOUND, tests). `fused`
  (`kernels/mhc_decode.py`, decode-sized T): partials over 512-column splits and the
  coefficients below in ONE launch (the last split of a token block to arrive sums the splits in
  fixed order; int32 arrival counters, left zero). `tc` (opt-in, for prefill row counts):
  `_hc_mix_dot_kernel` on BF16 tensor cores over 512-column slices of 64 tokens — x as BF16
  (exact: the residual holds BF16 values; a BF16 R as loaded), F split into three BF16 parts whose sum is F exactly,
  so every product is exact and only the fp32 accumulation errs (each 32-column step's
  3 × 32 products in a fresh MMA accumulator, then added to the slice's sum): the compensated
  single-precision class of upstream's split-TF32 / split-BF16×3 mix, not bitwise `dot`'s.
  At T = 1 the 1.5 MB F read is spread over 160 programs (Flash).
  `_hc_coefficients_kernel`, one program per token: with `dot` one warp adding the partials 32
  chunks a step (the 4 × 4 Sinkhorn in warp shuffles); with `rows` four warps, all chunks in one
  `tl.sum`.
  `_hc_coefficients_kernel` adds the partials in a fixed order (block shapes fixed by hc·H only),
  then in fp32 (IEEE division and
  square root, the device's exp): m = dot·(1/√(Σx²/(hc·H) + rms_eps)), pre = σ(α₀m + b) + hc_eps,
  post = 2σ(α₁m + b), comb = the finite `iters`-step Sinkhorn of α₂m + b (row softmax with the
  row max subtracted, +ε, column normalise, then (iters − 1)×(row, column)). Bound
  (COEFFICIENT_BOUND = 2⁻¹⁴, absolute; the coefficients lie in [0, 2]): each fp32 dot is within
  ≈ (K/128 + 7)·2⁻²⁴·Σ|F·x| of the exact one (partial sums over 128 columns, then a tree), the
  rsqrt, sigmoid and each Sinkhorn normalisation (sums of hc = 4 terms) add a few fp32 ulps, and
  σ, softmax and the normalisations are contractions (derivatives ≤ 1), so for |α| ≤ 1 and
  Σ|F·x|·inv_rms ≤ 2⁸ the coefficients move by ≪ 2⁻¹⁴. Measured under the interpreter (T ≤ 20,
  H ≤ 4096): ≤ 2⁻²²·⁴; α × 1.001 moves them by 2⁻¹⁰·⁵ (the test's mutation check).
* `hc_sublayer_input` (1 launch, one program per token over the whole row): bf16(Σ_j pre_j·R_j)
  with IEEE fp32 multiplies and adds in stream order j = 0, 1, … (stream 0 as is when
  `carried_pre` is None), then RMSNorm in fp32: x·(1/√(Σx²/H + eps))·w, rounded to BF16. The
  weighted sum is bit-identical to the reference; the norm's fp32 factor is within a few fp32
  ulps of the reference's float64 one, so the BF16 result is the reference's or one BF16 ulp
  from it (a rounding-boundary flip).
* `hc_residual_update` (1 launch, grid (T, ⌈H/256⌉)): R'_k = bf16(post_k·y + Σ_j comb_jk·R_j),
  fp32 multiply then add in the reference's order (post·y first, then j = 0, 1, …), compiled with
  `enable_fp_fusion=False` (no FMA contraction): bit-identical to the reference on the same
  coefficients.
* `hc_collapse` / `hc_weighted_sum` (1 launch, grid (T, ⌈H/256⌉)): bf16(Σ_j pre_j·R_j), bit-identical.

Rounding to BF16 is done on the fp32 bit pattern (round to nearest even; NaN kept), not with a
Triton cast, so the interpreter (which truncates BF16 casts) gives the compiled kernel's bits.
The eps constants are constexprs (rounded to fp32; 1e-20 is a normal fp32 value).

Batch invariance: every token is computed by the same code on the same tile shapes — block
sizes depend on hc and H only, never on T — so a token's result does not depend on how many
tokens share the call. No host sync, no host→device copy: CUDA-graph capturable.

Triton's interpreter (TRITON_INTERPRET=1 set before triton is first imported) runs the same
kernels on CPU tensors (tests); without it, CPU tensors raise.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.interpreter import InterpretedFunction

from sglang_dsv41.kernels.fp8_quant import _quantize_groups
from sglang_dsv41.kernels.mhc_coef import REG_HC, REG_NUM_WARPS, launch_regs
from sglang_dsv41.kernels.mhc_decode import FUSED_NUM_WARPS, _hc_params, _sigmoid, _slice_partials, launch_fused


F32, BF16 = torch.float32, torch.bfloat16
#: Columns of F per program of the partial-dot kernel (fixed: the fp32 partials do not depend on T).
MIX_BLOCK_K = 128
#: Tokens per program of the partial-dot kernels (F's slice is loaded once for them): `rows`, `dot`.
MIX_BLOCK_T = 16
MIX_DOT_BLOCK_T = 32
#: Columns per chained dot step of `_hc_mix_dot_kernel` (keeps its operands in registers).
MIX_DOT_SUB_K = 32
#: `tc`: `_hc_mix_dot_kernel` on BF16 tensor cores (split-BF16×3 F), wider slices and token tiles
MIX_TC_BLOCK_K = 512
MIX_TC_BLOCK_T = 64
MIX_TC_SUB_K = 32
MIX_TC_NUM_WARPS = 4        # faster than 8 despite spilling (docs/performance.md "Session 34"); a ceiling in the build test
#: `_hc_mix_dot_kernel`'s launch per mix: (columns per slice, tokens per program, columns per step,
#: warps, split-BF16×3 tensor-core dots)
DOT_LAUNCHES = {"dot": (MIX_BLOCK_K, MIX_DOT_BLOCK_T, MIX_DOT_SUB_K, 4, False),
                "tc": (MIX_TC_BLOCK_K, MIX_TC_BLOCK_T, MIX_TC_SUB_K, MIX_TC_NUM_WARPS, True)}
#: the partial-dot kernels (module doc); the first is the default; `fused` = `kernels.mhc_decode` (one launch)
MIX_KERNELS = ("dot", "rows", "fused", "tc")
#: with `dot`: partial-sum chunks per step and warps of the coefficient kernel (`rows`: all chunks, 4 warps)
COEFF_CHUNKS_BLOCK = 32
COEFF_NUM_WARPS = 1
#: the coefficient kernels after `dot` / `rows`: `tile` (`_hc_coefficients_kernel`, the default),
#: `registers` (`kernels.mhc_coef`: one lane per token, hc = 4); `fused` has its own
COEFF_KERNELS = ("tile", "registers")
#: Columns per program of the element-wise stream kernels (residual update, collapse).
STREAM_BLOCK_H = 256
#: Largest row the one-program-per-token sublayer-input kernel takes (next power of two of H).
MAX_ROW_BLOCK = 16384
#: |coefficient − reference| bound of `hc_coefficients` (absolute; module doc)
COEFFICIENT_BOUND = 2.0 ** -14


@triton.jit
def _bf16_round(x):
    """fp32 → nearest-even BF16 value, kept in fp32 (bit arithmetic; NaN passes through)."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return tl.where(x != x, x, rounded.to(tl.float32, bitcast=True))


@triton.jit
def _hc_mix_partials_kernel(x_ptr, f_ptr, part_ptr, T, K, stride_xt, NUM_CHUNKS,
                            ROWS: tl.constexpr, ROWS_PAD: tl.constexpr, SLOT: tl.constexpr,
                            BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr):
    """part[t, c, r] = Σ_{k in chunk c} F[r, k]·x[t, k] (r < ROWS) and part[t, c, ROWS] = Σ x²,
    fp32, for the ≤ BLOCK_T tokens of this program's token block."""
    tb = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    k = c * BLOCK_K + tl.arange(0, BLOCK_K)
    k_ok = k < K
    r = tl.arange(0, ROWS_PAD)
    r_ok = r < ROWS
    f = tl.load(f_ptr + r[:, None] * K + k[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
    t0 = tb * BLOCK_T
    for i in range(0, tl.minimum(BLOCK_T, T - t0)):
        t = t0 + i
        x = tl.load(x_ptr + t * stride_xt + k, mask=k_ok, other=0.0).to(tl.float32)
        dots = tl.sum(f * x[None, :], axis=1)
        sumsq = tl.sum(x * x, axis=0)
        out = part_ptr + (t * NUM_CHUNKS + c) * SLOT
        tl.store(out + r, dots, mask=r_ok)
        tl.store(out + ROWS, sumsq)


@triton.jit
def _hc_mix_dot_kernel(x_ptr, f_ptr, part_ptr, T, K, stride_xt, NUM_CHUNKS,
                       ROWS: tl.constexpr, ROWS_PAD: tl.constexpr, SLOT: tl.constexpr,
                       BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, SUB_K: tl.constexpr,
                       SPLIT3: tl.constexpr, INTERPRET: tl.constexpr):
    """`_hc_mix_partials_kernel`'s partials for BLOCK_T tokens at once: fp32 dots (FMA, `ieee`; or
    with SPLIT3 split-BF16×3 tensor-core dots, `tc`) of the [BLOCK_T, SUB_K] token tiles with F's
    slice, chained over the slice's SUB_K-column steps; Σx² per token by `tl.sum` per step, added
    in step order. A token's partials depend on its row only (fixed tile shapes; padded rows are
    zeros)."""
    _slice_partials(x_ptr, f_ptr, part_ptr, T, K, stride_xt, tl.program_id(0), tl.program_id(1), NUM_CHUNKS,
                    ROWS, ROWS_PAD, SLOT, BLOCK_T, BLOCK_K, SUB_K, SPLIT3, INTERPRET)


@triton.jit
def _hc_coefficients_kernel(part_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, K, NUM_CHUNKS, iters,
                            HC: tl.constexpr, SLOT: tl.constexpr, CHUNKS_BLOCK: tl.constexpr,
                            RMS_EPS: tl.constexpr, HC_EPS: tl.constexpr):
    """One token: fixed-order sum of the partials (a `tl.sum` per CHUNKS_BLOCK chunks, the block
    sums added in chunk order), then rsqrt / sigmoid / Sinkhorn in fp32."""
    t = tl.program_id(0).to(tl.int64)      # token offsets beyond 2^31 elements
    ROWS: tl.constexpr = HC * (2 + HC)
    j = tl.arange(0, HC)
    sumsq = tl.zeros([CHUNKS_BLOCK], dtype=tl.float32).sum(axis=0)
    pre_dot = tl.zeros([HC], dtype=tl.float32)
    post_dot = tl.zeros([HC], dtype=tl.float32)
    comb_dot = tl.zeros([HC, HC], dtype=tl.float32)
    for c0 in range(0, NUM_CHUNKS, CHUNKS_BLOCK):
        c = c0 + tl.arange(0, CHUNKS_BLOCK)
        c_ok = c < NUM_CHUNKS
        p = part_ptr + t * NUM_CHUNKS * SLOT + c * SLOT
        sumsq = sumsq + tl.sum(tl.load(p + ROWS, mask=c_ok, other=0.0), axis=0)
        pre_dot = pre_dot + tl.sum(tl.load(p[:, None] + j[None, :], mask=c_ok[:, None], other=0.0), axis=0)
        post_dot = post_dot + tl.sum(tl.load(p[:, None] + HC + j[None, :], mask=c_ok[:, None], other=0.0), axis=0)
        comb_ptrs = p[:, None, None] + 2 * HC + j[None, :, None] * HC + j[None, None, :]
        comb_dot = comb_dot + tl.sum(tl.load(comb_ptrs, mask=c_ok[:, None, None], other=0.0), axis=0)

    mean = tl.div_rn(sumsq, K.to(tl.float32))
    inv_rms = tl.div_rn(1.0, tl.sqrt_rn(mean + RMS_EPS))
    a0, a1, a2, b_pre, b_post, b_comb = _hc_params(base_ptr, scale_ptr, HC)

    pre = _sigmoid(a0 * (pre_dot * inv_rms) + b_pre) + HC_EPS
    post = 2.0 * _sigmoid(a1 * (post_dot * inv_rms) + b_post)
    logits = a2 * (comb_dot * inv_rms) + b_comb                      # [j, k]
    e = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    m = tl.div_rn(e, tl.broadcast_to(tl.sum(e, axis=1)[:, None], (HC, HC))) + HC_EPS
    m = tl.div_rn(m, tl.broadcast_to(tl.sum(m, axis=0)[None, :] + HC_EPS, (HC, HC)))
    for _ in range(1, iters):
        m = tl.div_rn(m, tl.broadcast_to(tl.sum(m, axis=1)[:, None] + HC_EPS, (HC, HC)))
        m = tl.div_rn(m, tl.broadcast_to(tl.sum(m, axis=0)[None, :] + HC_EPS, (HC, HC)))
    tl.store(pre_ptr + t * HC + j, pre)
    tl.store(post_ptr + t * HC + j, post)
    tl.store(comb_ptr + t * HC * HC + j[:, None] * HC + j[None, :], m)


@triton.jit
def _weighted_sum(r_ptr, pre_ptr, t, H, offs, mask, HC: tl.constexpr):
    """Σ_j pre[t, j]·R[t, j, offs] in fp32, j = 0, 1, … (multiply, then add; caller disables FMA)."""
    acc = tl.load(pre_ptr + t * HC) * tl.load(r_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    for j in tl.static_range(1, HC):
        acc = acc + tl.load(pre_ptr + t * HC + j) * tl.load(r_ptr + j * H + offs, mask=mask, other=0.0).to(tl.float32)
    return acc


@triton.jit
def _hc_sublayer_input_kernel(r_ptr, pre_ptr, w_ptr, out_ptr, q_ptr, H, stride_rt, stride_ot,
                              HC: tl.constexpr, HAS_PRE: tl.constexpr, BLOCK: tl.constexpr,
                              RMS_EPS: tl.constexpr, QUANT: tl.constexpr, INTERPRET: tl.constexpr):
    """One token: x = bf16(Σ_j pre_j·R_j) (or R_0), out = bf16(x·(1/√(mean x² + eps))·w) in fp32; QUANT:
    also q = out quantised per 1×32 (BF16 q·s, `fp8_quant`'s values) at q_ptr, same row stride."""
    t = tl.program_id(0).to(tl.int64)      # token offsets beyond 2^31 elements
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    r = r_ptr + t * stride_rt
    if HAS_PRE:
        x = _bf16_round(_weighted_sum(r, pre_ptr, t, H, offs, mask, HC))
    else:
        x = tl.load(r + offs, mask=mask, other=0.0).to(tl.float32)
    mean = tl.div_rn(tl.sum(x * x, axis=0), H.to(tl.float32))
    inv_rms = tl.div_rn(1.0, tl.sqrt_rn(mean + RMS_EPS))
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = _bf16_round((x * inv_rms) * w)
    tl.store(out_ptr + t * stride_ot + offs, y, mask=mask)
    if QUANT:                                   # H is a multiple of 32: the masked tail is whole zero groups
        q, s = _quantize_groups(tl.reshape(y, (BLOCK // 32, 32)), INTERPRET)
        tl.store(q_ptr + t * stride_ot + offs, tl.reshape(q.to(tl.float32) * s[:, None], (BLOCK,)).to(tl.bfloat16),
                 mask=mask)


@triton.jit
def _hc_weighted_sum_kernel(r_ptr, pre_ptr, out_ptr, H, stride_rt, stride_ot,
                            HC: tl.constexpr, BLOCK: tl.constexpr):
    """out[t, h] = bf16(Σ_j pre_j·R_j) for one BLOCK of columns."""
    t = tl.program_id(0).to(tl.int64)      # token offsets beyond 2^31 elements
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < H
    acc = _weighted_sum(r_ptr + t * stride_rt, pre_ptr, t, H, offs, mask, HC)
    tl.store(out_ptr + t * stride_ot + offs, _bf16_round(acc), mask=mask)


@triton.jit
def _hc_residual_update_kernel(r_ptr, y_ptr, post_ptr, comb_ptr, out_ptr, H, stride_rt, stride_yt, stride_ot,
                               HC: tl.constexpr, BLOCK: tl.constexpr):
    """out[t, k, h] = bf16(post_k·y + Σ_j comb_jk·R_j) for one BLOCK of columns, all k at once."""
    t = tl.program_id(0).to(tl.int64)      # token offsets beyond 2^31 elements
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < H
    k = tl.arange(0, HC)
    y = tl.load(y_ptr + t * stride_yt + offs, mask=mask, other=0.0).to(tl.float32)
    post = tl.load(post_ptr + t * HC + k)
    acc = post[:, None] * y[None, :]
    for j in tl.static_range(HC):
        rj = tl.load(r_ptr + t * stride_rt + j * H + offs, mask=mask, other=0.0).to(tl.float32)
        cj = tl.load(comb_ptr + t * HC * HC + j * HC + k)
        acc = acc + cj[:, None] * rj[None, :]
    y = _bf16_round(acc).to(out_ptr.dtype.element_ty)       # exact in fp32 or BF16 (a BF16 value)
    tl.store(out_ptr + t * stride_ot + k[:, None] * H + offs[None, :], y, mask=mask[None, :])


#: True when these kernels were built for Triton's interpreter (TRITON_INTERPRET=1 at import).
INTERPRETED = isinstance(_hc_residual_update_kernel, InterpretedFunction)


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _check_device(name: str, *tensors: Tensor) -> torch.device:
    dev = tensors[0].device
    if dev.type != "cuda" and not INTERPRETED:
        raise RuntimeError(f"{name}: {dev} tensors need Triton's interpreter (TRITON_INTERPRET=1 set before triton "
                           "is first imported); the compiled kernels run on CUDA")
    if INTERPRETED and not isinstance(tl.max, InterpretedFunction):
        raise RuntimeError("TRITON_INTERPRET=1 was set after triton was imported: set it before the first "
                           "`import triton`")
    if any(t.device != dev for t in tensors):
        raise ValueError(f"{name}: all inputs must be on one device, got {[str(t.device) for t in tensors]}")
    return dev


def _check_residual(name: str, residual: Tensor) -> tuple[int, int, int]:
    if residual.dim() != 3:
        raise ValueError(f"{name}: residual must be [T, hc, H], got {tuple(residual.shape)}")
    T, hc, H = residual.shape
    if hc < 1 or hc & (hc - 1):
        raise ValueError(f"{name}: hc_mult must be a power of two for these kernels, got {hc}")
    if residual.dtype not in (F32, BF16):
        raise TypeError(f"{name}: residual must be float32 or bfloat16 (BF16 values), got {residual.dtype}")
    return T, hc, H


def _launch_options() -> dict:
    """Compiled-kernel options: separate fp32 multiply and add (the reference's rounding)."""
    return {} if INTERPRETED else {"enable_fp_fusion": False}


def _coefficient_rows(name: str, coeff: Tensor, T: int, shape: tuple[int, ...]) -> Tensor:
    if tuple(coeff.shape) != (T, *shape):
        raise ValueError(f"{name}: coefficient shape {tuple(coeff.shape)}, expected {(T, *shape)}")
    return coeff.to(F32).contiguous()


def hc_coefficients(residual: Tensor, fn: Tensor, base: Tensor, scale: Tensor, *,
                    rms_eps: float, hc_eps: float, sinkhorn_iters: int,
                    mix: str = MIX_KERNELS[0], counters: Tensor | None = None,
                    coeff: str = COEFF_KERNELS[0]) -> tuple[Tensor, Tensor, Tensor]:
    """(pre [T, hc], post [T, hc], comb [T, hc, hc]) fp32 of one hyper-connection from the residual
    entering it (spec §3.2); fp32 inside, each value within COEFFICIENT_BOUND of the reference.
    `mix`: the partial-dot kernel (MIX_KERNELS, module doc); `counters`: with `fused`, the arrival
    counters (`mhc_decode.fused_counters`; None: zeroed per call); `coeff`: the coefficient
    kernel after `dot` / `rows` (COEFF_KERNELS; unused with `fused`)."""
    if mix not in MIX_KERNELS:
        raise ValueError(f"hc_coefficients: mix must be one of {MIX_KERNELS}, got {mix!r}")
    if coeff not in COEFF_KERNELS:
        raise ValueError(f"hc_coefficients: coeff must be one of {COEFF_KERNELS}, got {coeff!r}")
    T, hc, H = _check_residual("hc_coefficients", residual)
    if coeff == "registers" and mix != "fused" and hc != REG_HC:
        raise ValueError(f"hc_coefficients: coeff='registers' needs hc_mult = {REG_HC}, got {hc}")
    rows, K = hc * (2 + hc), hc * H
    if tuple(fn.shape) != (rows, K):
        raise ValueError(f"hc_coefficients: fn has shape {tuple(fn.shape)}, expected {(rows, K)}")
    if base.numel() != rows or scale.numel() != 3:
        raise ValueError(f"hc_coefficients: base needs {rows} values and scale 3, got {base.numel()}, {scale.numel()}")
    if sinkhorn_iters < 1:
        raise ValueError(f"Sinkhorn needs at least one iteration, got {sinkhorn_iters}")
    dev = _check_device("hc_coefficients", residual, fn, base, scale)
    pre = torch.empty(T, hc, dtype=F32, device=dev)
    post = torch.empty(T, hc, dtype=F32, device=dev)
    comb = torch.empty(T, hc, hc, dtype=F32, device=dev)
    if T == 0:
        return pre, post, comb
    x = residual.reshape(T, K)
    if x.stride(1) != 1:
        x = x.contiguous()
    f = fn.to(F32).contiguous()
    if mix == "fused":
        opts = _launch_options()
        if not INTERPRETED:
            opts["num_warps"] = FUSED_NUM_WARPS
        launch_fused(x, f, base.to(F32).contiguous(), scale.to(F32).contiguous(), pre, post, comb, hc=hc,
                     rms_eps=rms_eps, hc_eps=hc_eps, sinkhorn_iters=sinkhorn_iters, counters=counters, opts=opts)
        return pre, post, comb
    dot = DOT_LAUNCHES.get(mix)
    num_chunks = triton.cdiv(K, dot[0] if dot else MIX_BLOCK_K)
    slot = _pow2_at_least(rows + 1)
    partials = torch.empty(T, num_chunks, slot, dtype=F32, device=dev)
    opts = _launch_options()
    if not INTERPRETED:
        opts["num_warps"] = 4
    if dot:
        block_k, block_t, sub_k, warps, split3 = dot
        if not INTERPRETED:
            opts["num_warps"] = warps
        _hc_mix_dot_kernel[(triton.cdiv(T, block_t), num_chunks)](
            x, f, partials, T, K, x.stride(0), num_chunks, ROWS=rows, ROWS_PAD=max(16, _pow2_at_least(rows)),
            SLOT=slot, BLOCK_K=block_k, BLOCK_T=block_t, SUB_K=sub_k, SPLIT3=split3, INTERPRET=INTERPRETED, **opts)
    else:
        _hc_mix_partials_kernel[(triton.cdiv(T, MIX_BLOCK_T), num_chunks)](
            x, f, partials, T, K, x.stride(0), num_chunks, ROWS=rows, ROWS_PAD=_pow2_at_least(rows), SLOT=slot,
            BLOCK_K=MIX_BLOCK_K, BLOCK_T=MIX_BLOCK_T, **opts)
    if coeff == "registers":
        opts = _launch_options()
        if not INTERPRETED:
            opts["num_warps"] = REG_NUM_WARPS
        launch_regs(partials, base.to(F32).contiguous(), scale.to(F32).contiguous(), pre, post, comb, K=K,
                    num_chunks=num_chunks, slot=slot, rms_eps=rms_eps, hc_eps=hc_eps, sinkhorn_iters=sinkhorn_iters,
                    opts=opts)
        return pre, post, comb
    opts = _launch_options()
    if not INTERPRETED:         # `dot`: one warp a token (the 4×4 Sinkhorn in warp shuffles); `rows`: as before
        opts["num_warps"] = COEFF_NUM_WARPS if dot else 4
    _hc_coefficients_kernel[(T,)](
        partials, base.to(F32).contiguous(), scale.to(F32).contiguous(), pre, post, comb, K, num_chunks,
        sinkhorn_iters, HC=hc, SLOT=slot,
        CHUNKS_BLOCK=COEFF_CHUNKS_BLOCK if dot else _pow2_at_least(num_chunks),
        RMS_EPS=float(rms_eps), HC_EPS=float(hc_eps), **opts)
    return pre, post, comb


def hc_sublayer_input(residual: Tensor, carried_pre: Tensor | None, norm_weight: Tensor,
                      rms_eps: float, out_dtype: torch.dtype = F32,
                      quantised: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """x_in = RMSNorm(bf16(Σ_j pre_j·R_j)) with the lagged pre, or RMSNorm(R_0) when `carried_pre`
    is None (spec §3.2): [T, H] BF16 values, each the reference's or one BF16 ulp from it (module
    doc), held in fp32 or in `out_dtype` torch.bfloat16. `quantised` (H a multiple of 32): also those
    values quantised per 1×32 as BF16 [T, H] from the same launch — (x_in, quantised x_in) — for the FP8
    linears that read it (`ComputeBackend.quantised_handoff`)."""
    if out_dtype not in (F32, torch.bfloat16):
        raise ValueError(f"hc_sublayer_input: out_dtype {out_dtype} (float32 or bfloat16)")
    T, hc, H = _check_residual("hc_sublayer_input", residual)
    if quantised and H % 32:
        raise ValueError(f"hc_sublayer_input: quantised needs whole 32-column groups, got H = {H}")
    if norm_weight.shape != (H,):
        raise ValueError(f"hc_sublayer_input: norm weight {tuple(norm_weight.shape)}, expected {(H,)}")
    block = _pow2_at_least(H)
    if block > MAX_ROW_BLOCK:
        raise ValueError(f"hc_sublayer_input: H = {H} exceeds the one-program row limit {MAX_ROW_BLOCK}")
    inputs = (residual, norm_weight) if carried_pre is None else (residual, norm_weight, carried_pre)
    dev = _check_device("hc_sublayer_input", *inputs)
    out = torch.empty(T, H, dtype=out_dtype, device=dev)
    q = torch.empty(T, H, dtype=torch.bfloat16, device=dev) if quantised else out
    if T:
        r = residual.contiguous()
        pre = r if carried_pre is None else _coefficient_rows("hc_sublayer_input", carried_pre, T, (hc,))
        opts = _launch_options()
        if not INTERPRETED:
            opts["num_warps"] = max(1, min(16, block // 256))
        _hc_sublayer_input_kernel[(T,)](
            r, pre, norm_weight.contiguous(), out, q, H, r.stride(0), out.stride(0),
            HC=hc, HAS_PRE=carried_pre is not None, BLOCK=block, RMS_EPS=float(rms_eps), QUANT=quantised,
            INTERPRET=INTERPRETED, **opts)
    return (out, q) if quantised else out


def hc_weighted_sum(residual: Tensor, pre: Tensor) -> Tensor:
    """bf16(Σ_j pre_j·R_j) in fp32, j = 0, 1, … : [T, hc, H], [T, hc] → [T, H] fp32 (bit-identical)."""
    T, hc, H = _check_residual("hc_weighted_sum", residual)
    dev = _check_device("hc_weighted_sum", residual, pre)
    out = torch.empty(T, H, dtype=F32, device=dev)
    if T == 0:
        return out
    r = residual.contiguous()
    p = _coefficient_rows("hc_weighted_sum", pre, T, (hc,))
    opts = _launch_options()
    if not INTERPRETED:
        opts["num_warps"] = 4
    _hc_weighted_sum_kernel[(T, triton.cdiv(H, STREAM_BLOCK_H))](
        r, p, out, H, r.stride(0), out.stride(0), HC=hc, BLOCK=STREAM_BLOCK_H, **opts)
    return out


def hc_collapse(residual: Tensor, last_pre: Tensor) -> Tensor:
    """Final stream reduction h = bf16(Σ_j pre_j·R_j) with the last ffn-hc's pre (spec §3.2)."""
    return hc_weighted_sum(residual, last_pre)


def hc_residual_update(residual: Tensor, sublayer_out: Tensor, post: Tensor, comb: Tensor,
                       out_dtype: torch.dtype | None = None) -> Tensor:
    """R'_k = bf16(post_k·y + Σ_j comb_jk·R_j), fp32 multiply-then-add in the reference's order:
    [T, hc, H] BF16 values, bit-identical to the reference (spec §3.2), held in `out_dtype` (float32
    or bfloat16; None: R's dtype)."""
    T, hc, H = _check_residual("hc_residual_update", residual)
    out_dtype = residual.dtype if out_dtype is None else out_dtype
    if out_dtype not in (F32, BF16):
        raise ValueError(f"hc_residual_update: out_dtype {out_dtype} (float32 or bfloat16)")
    if sublayer_out.shape != (T, H):
        raise ValueError(f"hc_residual_update: sublayer output {tuple(sublayer_out.shape)}, expected {(T, H)}")
    dev = _check_device("hc_residual_update", residual, sublayer_out, post, comb)
    out = torch.empty(T, hc, H, dtype=out_dtype, device=dev)
    if T == 0:
        return out
    r = residual.contiguous()
    y = sublayer_out.contiguous()
    post = _coefficient_rows("hc_residual_update", post, T, (hc,))
    comb = _coefficient_rows("hc_residual_update", comb, T, (hc, hc))
    opts = _launch_options()
    if not INTERPRETED:
        opts["num_warps"] = 4
    _hc_residual_update_kernel[(T, triton.cdiv(H, STREAM_BLOCK_H))](
        r, y, post, comb, out, H, r.stride(0), y.stride(0), out.stride(0), HC=hc, BLOCK=STREAM_BLOCK_H, **opts)
    return out

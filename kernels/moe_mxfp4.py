"""Routed experts with MXFP4 weights on Hopper (W4A16) — spec `model.md` §2.3, §3.6, §3.8.

What it computes (the routed term of `reference.moe.moe_sublayer`, for given routing):

    out[t] = bf16( s · Σ_j w[t,j] · E_{ids[t,j]}(x[t]) ),   s = routed_scaling_factor (1.5)
    E(x)   = bf16( W2 · h ),  h = bf16( silu(min(g, L)) · clamp(u, −L, L) ),
    g, u   = bf16(W1·x), bf16(W3·x),  L = swiglu_limit (10)

with BF16 activations and MXFP4 weights (E2M1, low nibble = even element, one UE8M0 scale per
32 inputs). The weighted sum is formed in fp32 in slot order, each product rounded before its add
(upstream's finalize, `numerics.rounding.slot_sum_fp32`), then rounded to BF16, as in the reference,
so with the same per-slot BF16 expert outputs the result is bit-identical to it (s = 1, as the
runtime calls it with the factor folded into the fp32 weights).
Where it differs from `reference.moe`: both GEMMs accumulate in fp32 on tensor cores (the
reference: fp64, rounded once), and silu(g)·u is evaluated in fp32 (reference: fp64). Either
can move g, u, h or E by one BF16 ulp in rare elements. Hopper's BF16 MMA does not round each
fp32 accumulation step to nearest (it aligns and truncates), so such flips are ~10× more frequent
than an IEEE-fp32 emulation predicts. Accuracy contract (`routed_error_bound`, derivation there):
per element |out − ref| ≤ ulp(ref) + s·Σ_j w_j·ulp(E_j), and ≤ 2 % of outputs differ.

Accuracy analysis (Flash shape E=12, H=5120, I=2304, top-6; the GPU test's exact inputs,
emulated on CPU): the former bound max |Δ| ≤ 2⁻⁶·RMS(row) was mis-derived. One flip of the
*final* BF16 rounding moves an output by ulp(ref) ≤ 2⁻⁷·|ref|, and |ref| reaches 4.5·RMS(row)
(per-slot |E_j| reach 61 at RMS ≈ 12), so a single, unavoidable 1-ulp flip at |ref| ∈ [16, 32)
is 0.125/RMS(row) ≈ 0.0164–0.0171 > 2⁻⁶ for the rows of T = 5 and 64 (RMS 7.3–9.5). The H200
failures (0.0163 at T=5 = 0.125/RMS of row 2, 0.0167 at T=64) are exactly such flips.
Emulations (T = 1/5/64): fp32-RNE accumulation → max |Δ|/RMS 0.003/0.005/0.015, 0.02–0.09 %
differ; truncating accumulation of 16- or 4-product chunks (Hopper-like) → 0.004–0.017,
0.2–1.2 % differ (the H200 measured 0.5 % at T=8). Every case uses ≤ 76 % of the element bound
(RNE ≤ 58 %). No sign of a real deviation: the worst elements are single ±1-ulp flips of one
expert output or of the final rounding, not scale-, interleave- or padding-sized errors.

Decision — reuse `triton_kernels.matmul_ogs` (shipped in sgl-kernel 0.4.5; SGLang serves
gpt-oss's MXFP4 experts on Hopper with it, `--moe-runner-backend triton_kernel`), driven from
here with our own routing data, our own fused SwiGLU epilogue and our own combine kernel:

* Format: the checkpoint's MXFP4 is `triton_kernels`' native mxfp4 (same nibble order, same
  E2M1 table, one UE8M0 byte per 32 along K). Loading is a transpose + padding + the Hopper
  swizzles (`HopperMXValueLayout` / `HopperMXScaleLayout`, pure torch, invertible — so the
  conversion is testable exhaustively on CPU, `dequantize_prepared`). No re-quantisation.
* Math on SM90: the kernel upcasts E2M1·2^s to BF16 in registers (exact) and runs BF16 tensor-core
  dots (`tl.dot`) with fp32 accumulation — exactly the W4A16 semantics of spec §3.8 (Hopper).
  Eager calls also pay ~20 small launches (routing plan, index casts); the benchmark reports
  CUDA-graph replay times next to eager ones.
* Routing stays ours (sqrt-softplus, lower-id ties, bias-free renormalised weights): the GEMMs
  only take a ragged expert grouping (`RoutingPlan`), built here from `topk_ids`.
* SwiGLU: the GEMM1 epilogue takes any Triton function (`FusedActivation`). gpt-oss's own
  (`x·σ(αx)·(u+1)`, no BF16 rounding) does not match; ours rounds g/u to BF16 (RNE), clamps g
  above and u both sides, silu·u in fp32, rounds h to BF16 — §3.6 order. g/u rows are
  interleaved (row 2i = W1[i], 2i+1 = W3[i]) so one N tile holds matching gate/up columns.
* Combine: GEMM2 runs unweighted (per-slot BF16 outputs, as the reference); `_combine_kernel`
  then forms bf16(fp32(s·R)), R the fp32 slot-order sum of w_j·E_j — the reference's finalize,
  bit for bit (s = 1).
  (matmul_ogs' own `gammas` + reduce would scale before BF16 rounding: a different rounding.)

Rejected (evidence from the installed sources):
* Marlin (`sgl_kernel.moe_wna16_marlin_gemm`, stock SGLang's DeepSeek-V4 FP4-expert path on
  SM90 via `Mxfp4MarlinMoEMethod` + `fused_marlin_moe(clamp_limit=…)`): precompiled and tuned for
  small M, but its weight repack (`gptq_marlin_repack`) is CUDA-only (nothing testable on CPU),
  its SwiGLU (`swiglu_limit_func`) is unfused torch in BF16 (silu rounded before the product),
  and router weights are applied before BF16 rounding inside GEMM2. First alternative if the
  benchmark shows this path far from memory bandwidth at T ≤ 8 — `benchmarks/moe_mxfp4.py`
  times it next to this path.
* FlashInfer `cutlass_fused_moe(use_w4_group_scaling=True)` (SM90 W4A16): its swiglu
  (α = 1, β = 0, limit = 10) would fit, but the module is nvcc-JIT-built at first use (CUDA ≥ 12.8
  for FP4; even its weight-interleave helper loads that module) and its fused finalize is
  non-deterministic by default. `trtllm_fp4_block_scale_moe` and DeepGEMM fp8×fp4 are SM100-only
  (MXFP8 activations: not Hopper's W4A16). `SGLANG_DSV4_FP4_DEQUANT` (FP4→FP8 W8A8) changes the
  numerics (activation quantisation).
* Our own grouped GEMM: unnecessary while matmul_ogs fits; it would redo the swizzle/upcast work.

Revisit by the numbers of `benchmarks/moe_mxfp4.py` (H200): achieved GB/s of expert bytes per
call vs measured copy bandwidth at T ∈ {1, 8, 64, 256}, vs a BF16-dequantised baseline and vs
Marlin. Hopper (SM 9.x) only: `routed_experts_mxfp4` raises elsewhere (SM100 would use the MXFP8
path of spec §3.8; the swizzles above are Hopper's).
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor
from triton_kernels.matmul_ogs import (FlexCtx, FnSpecs, FusedActivation, PrecisionConfig,
                                       matmul_ogs)
from triton_kernels.numerics import InFlexData
from triton_kernels.tensor import Tensor as TKTensor

# launch flags (kernels/moe_mxfp4_flags.py), load-time conversion (kernels/moe_mxfp4_weights.py) and the
# routing plan (kernels/moe_routing_plan.py), re-exported: callers import them from here
from sglang_dsv41.kernels.moe_mxfp4_flags import (DECODE_FLAG_KEYS, DECODE_FLAG_MAX_TOKENS, DECODE_FLAGS_ENV,
                                                 PREFILL_FLAGS_ENV, decode_flags, decode_flags_scope, launch_flags,
                                                 parse_decode_flags, prefill_flags, with_decode_flags)
from sglang_dsv41.kernels.moe_mxfp4_weights import (HIDDEN_ALIGN, INTERMEDIATE_ALIGN, PREPARE_CHUNK, SCALE_NUM_WARPS,
                                                   UE8M0_ONE, PreparedMxfp4Experts, dequantize_prepared,
                                                   prepare_mxfp4_experts, prepare_mxfp4_stacked)
from sglang_dsv41.kernels.moe_routing_plan import FUSED_ORDER_MAX_SLOTS, RoutingPlan, make_routing_plan


# ---------------------------------------------------------------------------------------------
# Triton device code: BF16 rounding, the fused SwiGLU epilogue, the weighted combine
# ---------------------------------------------------------------------------------------------
@triton.jit
def round_to_bf16(x):
    """fp32 → the nearest BF16 value (ties to even), kept in fp32; NaN stays NaN. Explicit bit
    arithmetic so the result is the same compiled and in Triton's interpreter (which truncates)."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return tl.where(x != x, x, rounded.to(tl.float32, bitcast=True))


#: `repr` of the fused SwiGLU: triton_kernels names GEMM1's kernel `<its matmul_ogs repr>_<this>`
#: (no dots: a dotted name is cut to its last part, hiding the GEMM)
GEMM1_ACTIVATION_NAME = "dsv41_clamped_swiglu"


@triton.jit(repr=lambda _: GEMM1_ACTIVATION_NAME)
def clamped_swiglu_tile(acc, limit):
    """GEMM1 epilogue: acc [M, 2n] fp32 with columns (g0, u0, g1, u1, …) → h [M, n] =
    bf16(silu(min(bf16(g), L)) · clamp(bf16(u), −L, L)) in fp32 (spec §3.6; NaN propagates)."""
    g, u = tl.split(tl.reshape(acc, (acc.shape[0], acc.shape[1] // 2, 2)))
    g = round_to_bf16(g)
    u = round_to_bf16(u)
    g = tl.where(g > limit, limit, g)
    u = tl.where(u > limit, limit, tl.where(u < -limit, -limit, u))
    return round_to_bf16(g / (1.0 + tl.exp(-g)) * u)


@triton.jit
def _combine_kernel(Y, stride_y, SlotRows, Weights, Out, stride_out, Shared, stride_shared, scale, H,
                    TOP_K: tl.constexpr, BLOCK_H: tl.constexpr, ADD_SHARED: tl.constexpr):
    """Out[t, :H] = bf16(fp32(scale · R)), R = Σ_j Weights[t, j] · Y[SlotRows[t·k + j], :H] in fp32
    in slot order from +0, each product rounded before its add (`numerics.rounding.slot_sum_fp32`,
    upstream's finalize); `+ 0.0` keeps the compiler from contracting product and add into an FMA.
    ADD_SHARED: Out = bf16(Shared + that) instead (the MoE sublayer's finalize, `moe_ops._finalize`)."""
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    acc = tl.full([BLOCK_H], 0.0, tl.float32)
    for j in tl.static_range(TOP_K):
        row = tl.load(SlotRows + t * TOP_K + j).to(tl.int64)
        w = tl.load(Weights + t * TOP_K + j).to(tl.float32)
        y = tl.load(Y + row * stride_y + cols, mask=mask, other=0.0).to(tl.float32)
        p = y * w
        p = p + 0.0
        acc = acc + p
    v = round_to_bf16(acc * scale)
    if ADD_SHARED:
        v = round_to_bf16(tl.load(Shared + t.to(tl.int64) * stride_shared + cols, mask=mask, other=0.0).to(tl.float32)
                          + v)
    tl.store(Out + t.to(tl.int64) * stride_out + cols, v.to(Out.dtype.element_ty), mask=mask)


COMBINE_BLOCK_H = 1024
ROUTED_DIFF_FRACTION_BOUND = 0.02   # of outputs that may differ from the reference (routed_error_bound)


def bf16_ulp(v: Tensor) -> Tensor:
    """Spacing of the BF16 grid at |v| (8 significant bits): 2^(⌊log2|v|⌋ − 7); subnormal
    spacing 2^−133 at |v| < 2^−126."""
    a = v.float().abs().clamp(min=2.0 ** -126)
    return torch.ldexp(torch.ones_like(a), torch.frexp(a)[1] - 8)


def routed_error_bound(ref: Tensor, per_slot: Tensor, topk_weights: Tensor, routed_scale: float) -> Tensor:
    """Per-element bound B[t, c] on |routed_experts_mxfp4 − reference| (module docstring).

    ref [T, H]: the reference output bf16(fp32(s·Σ_j w_j·E_j)); per_slot [T, k, H]: the
    reference's per-slot BF16 expert outputs E_j; topk_weights [T, k]. Returns fp32 [T, H]

        B = ulp(ref) + s·Σ_j w_j·ulp(E_j) + 4(k + 1)·2⁻²⁴·s·Σ_j w_j·|E_j|.

    Derivation. The kernel's E'_j and the reference's E_j are BF16 roundings of two values A'_j,
    A_j that differ by accumulation order/precision (fp32 truncating tensor-core sums vs fp64)
    and by the rare 1-ulp flips of g, u, h that this propagates: |A' − A| ≪ ulp(E), so E'_j ≠ E_j
    only where A_j lies near a rounding boundary, and then E'_j − E_j = ±ulp(E_j). The combine
    is the reference's finalize (the fp32 slot-order sum), so with S = s·Σ w_j E_j the exact sums
    differ by at most s·Σ_j w_j·ulp(E_j); each fp32 chain (k products, each of a possibly rounded
    w·s, k sums and a final ·s, each rounding off by ≤ 2⁻²⁴ of the magnitude sum) is within
    2(k + 1)·2⁻²⁴·s·Σ_j w_j|E_j| of its exact sum, and the final rounding to BF16 adds at most ½ulp on each side (ulp(ref) in
    total). This is tight: one term alone reaches 0.125/RMS(row) at |ref| ∈
    [16, 32), so no fixed multiple of RMS(row) below ~2⁻⁵ bounds it at the Flash shape.
    The differing fraction ≈ P(E flip)·E[s·Σ w_j ulp(E_j)/ulp(ref)]/2 ≈ 1 %·2.4/2 with Hopper's
    truncating accumulation over K = 5120/2304 (CPU emulation: ≤ 1.2 %), bounded by
    ROUTED_DIFF_FRACTION_BOUND = 2 %.
    """
    w = topk_weights.to(torch.float64).unsqueeze(-1)
    per_expert = (w * bf16_ulp(per_slot).to(torch.float64)).sum(dim=1) * float(routed_scale)
    k = per_slot.shape[1]
    chains = 4 * (k + 1) * 2.0 ** -24 * (w * per_slot.to(torch.float64).abs()).sum(dim=1) * float(routed_scale)
    return (bf16_ulp(ref).to(torch.float64) + per_expert + chains).float()


def _exact_fp32(v: float, what: str) -> float:
    v = float(v)
    if float(np.float32(v)) != v:
        raise ValueError(f"{what} = {v!r} is not exactly representable in fp32 (the kernels take fp32 scalars)")
    return v


def combine_routed(y_rows: Tensor, plan: RoutingPlan, topk_weights: Tensor, routed_scale: float,
                   hidden: int, shared: Tensor | None = None) -> Tensor:
    """[T, hidden] bf16 = bf16(fp32(routed_scale · R)), R = Σ_j w[t,j] · y_rows[slot_rows[t·k+j]] in fp32
    in slot order (the reference's finalize for routed_scale = 1, as the runtime calls it).
    `y_rows` [T·k, ≥hidden] BF16 per-slot expert outputs in grouped order. With `shared` [T, hidden]
    (the shared expert's output): fp32 [T, hidden] = bf16(shared + that), the MoE sublayer's result in
    the same launch (bit for bit `bf16(shared + combine_routed(...).float())`)."""
    T, k = plan.n_tokens, plan.top_k
    if tuple(topk_weights.shape) != (T, k) or topk_weights.dtype != torch.float32:
        raise ValueError(f"topk_weights must be fp32 [{T}, {k}], got {topk_weights.dtype} {tuple(topk_weights.shape)}")
    if y_rows.shape[0] != T * k or y_rows.shape[1] < hidden or y_rows.stride(1) != 1:
        raise ValueError(f"y_rows must be [{T * k}, ≥{hidden}] with unit column stride, got {tuple(y_rows.shape)}")
    if shared is not None and (tuple(shared.shape) != (T, hidden) or shared.stride(1) != 1
                               or shared.device != y_rows.device):
        raise ValueError(f"shared must be [{T}, {hidden}] with unit column stride on {y_rows.device}, got "
                         f"{tuple(shared.shape)} on {shared.device}")
    out = torch.empty(T, hidden, dtype=torch.bfloat16 if shared is None else torch.float32, device=y_rows.device)
    if T:
        grid = (T, triton.cdiv(hidden, COMBINE_BLOCK_H))
        _combine_kernel[grid](y_rows, y_rows.stride(0), plan.slot_rows, topk_weights.contiguous(), out,
                              out.stride(0), out if shared is None else shared,
                              0 if shared is None else shared.stride(0),
                              _exact_fp32(routed_scale, "routed_scale"), hidden,
                              TOP_K=k, BLOCK_H=COMBINE_BLOCK_H, ADD_SHARED=shared is not None)
    return out


# ---------------------------------------------------------------------------------------------
# The routed-experts call
# ---------------------------------------------------------------------------------------------
@lru_cache(maxsize=8)
def clamped_swiglu_activation(swiglu_limit: float) -> FusedActivation:
    """`matmul_ogs` fused activation for interleaved gate/up columns (halves N)."""
    return FusedActivation(FnSpecs("dsv41_clamped_swiglu", clamped_swiglu_tile, ("limit",), reduction_n=2),
                           (_exact_fp32(swiglu_limit, "swiglu_limit"),))


def _mx_precision(scale: TKTensor) -> PrecisionConfig:
    return PrecisionConfig(weight_scale=scale, flex_ctx=FlexCtx(rhs_data=InFlexData()),
                           out_dtype=torch.bfloat16)


def _check_call(x: Tensor, topk_ids: Tensor, experts: PreparedMxfp4Experts) -> None:
    if x.dim() != 2 or x.dtype != torch.bfloat16 or x.shape[1] != experts.hidden:
        raise ValueError(f"x must be bf16 [T, {experts.hidden}], got {x.dtype} {tuple(x.shape)}")
    if not x.is_cuda or torch.cuda.get_device_capability(x.device)[0] != 9:
        raise RuntimeError("routed_experts_mxfp4 runs on Hopper GPUs (SM 9.x) only (spec §3.8 W4A16 path)")
    if experts.w13.storage.data.device != x.device:
        raise ValueError(f"experts live on {experts.w13.storage.data.device}, x on {x.device}")
    if topk_ids.shape[0] != x.shape[0] or topk_ids.device != x.device:
        raise ValueError("topk_ids must be [T, k] on x's device")


def routed_expert_outputs(x: Tensor, topk_ids: Tensor, experts: PreparedMxfp4Experts, *, swiglu_limit: float,
                          allow_absent: bool = False, check_ids: bool = True) -> tuple[Tensor, RoutingPlan]:
    """Per-slot expert outputs: (y [T·k, H_pad] bf16 in grouped order, plan); slot s = t·k + j has
    E_{ids[t,j]}(x[t]) = y[plan.slot_rows[s], :H] (module docstring: E(x), W4A16).

    With `allow_absent`, ids −1 mark slots not computed here (`make_routing_plan`); their rows of
    y are unwritten memory and must be masked by the caller. T ≥ 1."""
    _check_call(x, topk_ids, experts)
    plan = make_routing_plan(topk_ids, experts.n_experts, allow_absent=allow_absent, check_ids=check_ids)
    xp = x.contiguous()
    if experts.hidden_padded != experts.hidden:
        xp = F.pad(xp, (0, experts.hidden_padded - experts.hidden))
    with decode_flags_scope(launch_flags(x.shape[0])):     # SGLANG_DSV41_MOE_DECODE_FLAGS / _PREFILL_FLAGS
        h = matmul_ogs(xp, experts.w13, None, plan.routing_data(), gather_indx=plan.gather(),
                       precision_config=_mx_precision(experts.w13_scale),
                       fused_activation=clamped_swiglu_activation(swiglu_limit))
        y = matmul_ogs(h, experts.w2, None, plan.routing_data(), precision_config=_mx_precision(experts.w2_scale))
    return y, plan


def routed_experts_mxfp4(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, experts: PreparedMxfp4Experts,
                         *, swiglu_limit: float, routed_scale: float, check_ids: bool = True) -> Tensor:
    """bf16 [T, H] = bf16(routed_scale · Σ_j w[t,j] · E_{ids[t,j]}(x[t])) (module docstring).

    x [T, H] bf16 (CUDA, SM 9.x); topk_ids [T, k] integer ids into `experts`; topk_weights
    [T, k] fp32 (renormalised router weights, without routed_scale).
    """
    _check_call(x, topk_ids, experts)
    if topk_weights.device != x.device:
        raise ValueError("topk_weights must be [T, k] on x's device")
    if x.shape[0] == 0:
        return x.new_empty(0, experts.hidden)
    y, plan = routed_expert_outputs(x, topk_ids, experts, swiglu_limit=swiglu_limit, check_ids=check_ids)
    return combine_routed(y, plan, topk_weights, routed_scale, experts.hidden)


__all__ = ["COMBINE_BLOCK_H", "DECODE_FLAGS_ENV", "DECODE_FLAG_KEYS", "DECODE_FLAG_MAX_TOKENS", "decode_flags",
           "GEMM1_ACTIVATION_NAME", "PREFILL_FLAGS_ENV", "launch_flags", "prefill_flags",
           "decode_flags_scope", "parse_decode_flags", "with_decode_flags", "HIDDEN_ALIGN", "INTERMEDIATE_ALIGN", "PREPARE_CHUNK", "PreparedMxfp4Experts",
           "ROUTED_DIFF_FRACTION_BOUND", "RoutingPlan", "SCALE_NUM_WARPS", "UE8M0_ONE", "bf16_ulp",
           "clamped_swiglu_activation", "clamped_swiglu_tile", "combine_routed", "dequantize_prepared",
           "FUSED_ORDER_MAX_SLOTS", "make_routing_plan", "prepare_mxfp4_experts", "prepare_mxfp4_stacked", "round_to_bf16",
           "routed_error_bound", "routed_expert_outputs", "routed_experts_mxfp4"]

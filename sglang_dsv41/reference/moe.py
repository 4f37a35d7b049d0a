"""Mixture-of-experts sublayer: sqrt-softplus router with noaux_tc bias, SwiGLU experts
(spec `model.md` §3.6, §3.8, §8 items 11–13, §11 item 14, §12 "Routing ties").

Invariants:

* Router logits = x·W_gateᵀ with BF16 inputs/weights and **fp32** output; scores
  s_e = sqrt(softplus(logit_e)), softplus(z) = z if z > 20 else log1p(exp(z)) (fp32).
* Selection uses s_e + bias_e (bias = `gate.bias_vl` for image-token rows when the model has
  vision, else `gate.bias`); top-k with the **explicit** rule: NaN ranks first, then larger
  value, ties → lower expert id (not `torch.topk`'s unspecified order).
* Weights use the bias-free scores: w_k = s_{e_k} / (Σ_k s_{e_k} + 1e−20).
* Expert E(x) = W2·[silu(min(g, L)) ⊙ clamp(u, −L, L)] with g = W1·x, u = W3·x rounded to
  BF16 before the clamp, silu and product in fp32, L = swiglu_limit; the product is rounded to
  BF16 (it is the input activation of the down GEMM) and the down GEMM outputs BF16.
* Routed experts: MXFP4 weights (dequantised fp32 here) with BF16 activations — the Hopper
  W4A16 path (spec §3.8); `act_quant` never applies to them. The shared expert is an FP8
  dense linear (`ops.linear_fp8`, activation quantisation per `act_quant`).
* y = bf16(S(x) + bf16(Σ_k fp32(w_k·s)·E_{e_k}(x))), s = routed_scaling_factor folded into the
  fp32 routing weights as upstream's MXFP4 MoE paths do (`moe_fused_gate` APPLY_SCALE), the
  routed sum in fp32 in slot order as upstream's finalize (`numerics.rounding.slot_sum_fp32`).
* Reductions and transcendentals (logits, softplus, Σ_k s_k, silu·u) are
  evaluated in fp64 and rounded once to fp32 — the fp32 formula's value free of fp32 rounding
  noise — so routing and outputs do not depend on chunking, BLAS, reduction order or the
  device's libm. The elementwise IEEE steps upstream takes on those fp32 values (sqrt of the
  fp32 softplus, + 1e−20, the division, × s) are fp32 operations (audit: docs/reference.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch
import torch.nn.functional as F_
from torch import Tensor

from ..config import TextConfig
from ..numerics.rounding import slot_sum_fp32
from .ops import F32, bf16, fp32_scalar, linear_bf16, linear_fp8, matmul_fp32_exact

F64 = torch.float64

SOFTPLUS_THRESHOLD = 20.0
RENORM_EPS = 1e-20


@dataclass(frozen=True)
class Routing:
    """Router decision for T tokens: experts [T, k] (long), weights [T, k] fp32 (renormalised,
    bias-free, without routed_scaling_factor), scores [T, E] fp32 (sqrt-softplus, no bias)."""

    experts: Tensor
    weights: Tensor
    scores: Tensor


def sqrt_softplus(logits: Tensor) -> Tensor:
    """s = sqrt(softplus(z)) with softplus(z) = z if z > 20 else log1p(exp(z)) (§3.6): softplus
    in fp64 rounded once to fp32, then the fp32 sqrt of that value (upstream
    `moe_fused_gate.py:199-202`: `sqrt(sp)` on the fp32 softplus). The fp32 sqrt is taken as a
    float64 sqrt rounded to fp32 — the correctly rounded fp32 sqrt (an exact fp32 sqrt lies
    ≥ 2⁻⁵⁰ relative from an fp32 midpoint); torch's CPU fp32 `sqrt` is not correctly rounded."""
    z = logits.to(F64)
    soft = torch.where(z > SOFTPLUS_THRESHOLD, z, torch.log1p(torch.exp(z.clamp(max=SOFTPLUS_THRESHOLD))))
    return torch.sqrt(soft.to(F32).to(F64)).to(F32)


def topk_lower_id_on_ties(values: Tensor, k: int) -> Tensor:
    """Indices [T, k] of the k best entries of each row of `values` [T, E] (spec §3.6, §12).

    Ranking: NaN first (lower id first among NaNs), then larger value, ties → lower id.
    Implemented as k explicit selection rounds so the rule is visible and backend-independent.
    """
    T, E = values.shape
    if not 1 <= k <= E:
        raise ValueError(f"top-k of {k} out of {E} experts")
    v = values.to(F32)
    ids = torch.arange(E, device=v.device).expand(T, E)
    is_nan = torch.isnan(v)
    taken = torch.zeros(T, E, dtype=torch.bool, device=v.device)
    chosen = []
    for _ in range(k):
        free = ~taken
        free_nan = free & is_nan
        # best finite/inf value among the free non-NaN entries of each row
        masked = torch.where(free & ~is_nan, v, torch.full_like(v, -torch.inf))
        best = masked.max(dim=-1, keepdim=True).values
        at_best = free & ~is_nan & (v == best)          # (−inf == −inf holds, so all-−inf rows work)
        any_nan = free_nan.any(dim=-1, keepdim=True)
        candidates = torch.where(any_nan, free_nan, at_best)
        pick = torch.where(candidates, ids, torch.full_like(ids, E)).min(dim=-1).values
        chosen.append(pick)
        taken.scatter_(1, pick.unsqueeze(-1), True)     # (no host→device copy: CUDA-graph safe)
    return torch.stack(chosen, dim=-1)


def route(x: Tensor, gate_weight: Tensor, bias: Tensor, top_k: int,
          bias_vl: Tensor | None = None, image_rows: Tensor | None = None) -> Routing:
    """Router of spec §3.6. x [T, H] bf16-valued; gate_weight [E, H]; bias/bias_vl [E] fp32;
    image_rows [T] bool selects `bias_vl` (pass both or neither)."""
    if (bias_vl is None) != (image_rows is None):
        raise ValueError("route: pass bias_vl and image_rows together (vision models) or neither")
    scores = sqrt_softplus(matmul_fp32_exact(x, gate_weight))
    row_bias = bias.to(F32).expand_as(scores)
    if bias_vl is not None:
        row_bias = torch.where(image_rows.unsqueeze(-1), bias_vl.to(F32).expand_as(scores), row_bias)
    experts = topk_lower_id_on_ties(scores + row_bias, top_k)
    chosen = scores.gather(-1, experts)
    weights = chosen / renorm_denominator(chosen)
    return Routing(experts=experts, weights=weights, scores=scores)


def renorm_denominator(chosen: Tensor) -> Tensor:
    """fp32(Σ_k s_k) + 1e−20 in fp32, [T, 1]: the sum of the k selected fp32 scores in fp64,
    rounded once (order-free), then upstream's fp32 add (`moe_fused_gate.py:276-281`); the
    weights are the fp32 quotients s_k / this."""
    return chosen.to(F64).sum(dim=-1, keepdim=True).to(F32) + fp32_scalar(RENORM_EPS)


def clamped_swiglu(gate: Tensor, up: Tensor, limit: float) -> Tensor:
    """bf16( silu(min(bf16(g), L)) ⊙ clamp(bf16(u), −L, L) ) (spec §3.6); the fp32 silu/product
    is evaluated in fp64 and rounded once (to BF16)."""
    g = bf16(gate).clamp(max=limit).to(F64)
    u = bf16(up).clamp(min=-limit, max=limit).to(F64)
    return bf16((F_.silu(g) * u).to(F32))


def routed_expert(x: Tensor, w1: Tensor, w2: Tensor, w3: Tensor, limit: float) -> Tensor:
    """One MXFP4 routed expert, W4A16: BF16 activations, dequantised weights, BF16 outputs."""
    h = clamped_swiglu(linear_bf16(x, w1), linear_bf16(x, w3), limit)
    return linear_bf16(h, w2)


def shared_expert(x: Tensor, w1: Tensor, w2: Tensor, w3: Tensor, limit: float, act_quant: bool) -> Tensor:
    """The shared expert: FP8 dense weights, activation quantisation per `act_quant` (§3.8)."""
    h = clamped_swiglu(linear_fp8(x, w1, act_quant), linear_fp8(x, w3, act_quant), limit)
    return linear_fp8(h, w2, act_quant)


def moe_sublayer(cfg: TextConfig, w: Mapping[str, Tensor], prefix: str, x: Tensor, *,
                 image_rows: Tensor | None, act_quant: bool,
                 n_experts: int | None = None, top_k: int | None = None) -> Tensor:
    """MoE output y = S(x) + Σ_k fp32(w_k·routed_scaling_factor)·E_{e_k}(x) (spec §3.6), the sum
    in fp32 in slot order (selection order) as upstream's finalize.

    `prefix` is the layer's weight prefix (`layers.3.` or, for DSpark stages, `mtp.0.`);
    reads `{prefix}ffn.*`. `image_rows` [T] bool enables the `gate.bias_vl` row bias (pass it
    only when the model has vision; None = text-only routing). `n_experts`/`top_k` default to
    the main model's (DSpark stages pass their own).
    """
    p = f"{prefix}ffn."
    E = cfg.n_routed_experts if n_experts is None else n_experts
    k = cfg.num_experts_per_tok if top_k is None else top_k
    limit = cfg.swiglu_limit
    bias_vl = w[p + "gate.bias_vl"] if image_rows is not None else None
    routing = route(x, w[p + "gate.weight"], w[p + "gate.bias"], k, bias_vl=bias_vl, image_rows=image_rows)
    if routing.scores.shape[-1] != E:
        raise ValueError(f"{p}gate.weight has {routing.scores.shape[-1]} experts, expected {E}")

    T, H = x.shape
    per_slot = torch.zeros(T, k, H, dtype=F64, device=x.device)   # E_{e_k}(x_t), BF16 values
    for e in torch.unique(routing.experts).tolist():
        rows, slot = torch.nonzero(routing.experts == e, as_tuple=True)
        per_slot[rows, slot] = routed_expert(x[rows], w[f"{p}experts.{e}.w1.weight"],
                                             w[f"{p}experts.{e}.w2.weight"],
                                             w[f"{p}experts.{e}.w3.weight"], limit).to(F64)
    scaled = routing.weights * fp32_scalar(cfg.routed_scaling_factor)      # fp32, as the top-k kernel
    routed = bf16(slot_sum_fp32(scaled, per_slot))                          # upstream's finalize order
    shared = shared_expert(x, w[p + "shared_experts.w1.weight"], w[p + "shared_experts.w2.weight"],
                           w[p + "shared_experts.w3.weight"], limit, act_quant)
    return bf16(shared + routed)

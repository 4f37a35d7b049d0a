"""The router's selection as one Triton launch a token (spec `model.md` §3.6; semantics = `reference.moe.route`).

| function | from | result vs the reference |
|---|---|---|
| `route_select` | the scores (bias, top-k, renorm) | top-k exact; weights per `fused_elementwise` "fp64 results" |
| `route_softplus` | the fp32 softplus (its sqrt, the routed scale) | the same, scores the correctly rounded sqrt |
| `route_logits` | the logits (torch's CUDA fp32 softplus) | the same; softplus below |

Selection: K rounds over scores + bias (NaN first, then the larger value, ties to the lower id, i.e.
`topk_lower_id_on_ties`); the vision bias replaces the bias on image rows. Weights = chosen / (fp32(Σ chosen) +
eps), Σ in double-fp32 rounded once, the add and the division in fp32 as upstream's gate. Launches compile without
FMA contraction and with `div_rn` / `sqrt_rn` (the rounding rules of `kernels.fused_elementwise`).

Softplus (`route_logits`): torch's fp32 `F.softplus` on CUDA (z if z > 20, else log1pf(expf(z))) through libdevice's
`expf` / `log1pf`, launched with `enable_reflect_ftz=False` (Triton's default flushes libdevice's subnormals, torch's
build does not): the GPU tests compare the bits. Triton's interpreter has no libdevice, so there the launcher evaluates
that softplus in torch and the kernel starts from it (`route_softplus`).

One program a token, so a row's bits never depend on the batch; no host sync, CUDA-graph capturable.
"""
from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra import libdevice

from . import double_fp32 as DF
from .fused_elementwise import INTERPRETED, check_device

F32 = torch.float32


@triton.jit
def _route_select_kernel(score_ptr, bias_ptr, vl_bias_ptr, image_ptr, expert_ptr, weight_ptr, E,
                         scores_out_ptr, scaled_ptr, scale,
                         K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, HAS_VL: tl.constexpr,
                         RENORM_EPS: tl.constexpr, SQRT: tl.constexpr, SCALED: tl.constexpr,
                         SOFTPLUS: tl.constexpr = False, THRESHOLD: tl.constexpr = 20.0):
    """One token: K selection rounds over scores + bias (NaN first, then larger value, ties to
    the lower id), then weights = chosen / (fp32(Σ chosen) + eps): Σ in double-fp32 rounded once to
    fp32, the add and the division in fp32 (IEEE, `div_rn`) as upstream's gate (docs/reference.md).
    SQRT: the input is the softplus and the scores are its correctly rounded fp32 square root (`sqrt_rn`,
    stored to scores_out); SCALED: also stores fp32(weights · scale); SOFTPLUS (with SQRT, compiled only): the
    input is the logits, and the softplus is torch's fp32 one (module doc, "Softplus")."""
    t = tl.program_id(0).to(tl.int64)
    ids = tl.arange(0, BLOCK_E)
    live = ids < E
    s = tl.load(score_ptr + t * E + ids, mask=live, other=0.0)
    if SOFTPLUS:
        s = tl.where(s > THRESHOLD, s, libdevice.log1p(libdevice.exp(s)))
    if SQRT:
        s = tl.sqrt_rn(s)
        tl.store(scores_out_ptr + t * E + ids, s, mask=live)
    bias = tl.load(bias_ptr + ids, mask=live, other=0.0)
    if HAS_VL:
        vl = tl.load(vl_bias_ptr + ids, mask=live, other=0.0)
        is_image = tl.load(image_ptr + t + 0 * ids) != 0
        bias = tl.where(is_image, vl, bias)
    v = s + bias
    is_nan = v != v
    free = live
    slot = tl.arange(0, BLOCK_K)
    experts = tl.zeros((BLOCK_K,), tl.int64)
    chosen = tl.zeros((BLOCK_K,), tl.float32)
    total_h = tl.zeros((1,), tl.float32)
    total_l = tl.zeros((1,), tl.float32)
    for j in tl.static_range(K):
        free_nan = free & is_nan
        best = tl.max(tl.where(free & ~is_nan, v, float("-inf")), axis=0)
        at_best = free & ~is_nan & (v == best)
        any_nan = tl.max(free_nan.to(tl.int32), axis=0) > 0
        cand = tl.where(any_nan, free_nan, at_best)
        pick = tl.min(tl.where(cand, ids, BLOCK_E), axis=0)
        free = free & (ids != pick)
        value = tl.sum(tl.where(ids == pick, s, 0.0), axis=0)
        experts = tl.where(slot == j, pick.to(tl.int64), experts)
        chosen = tl.where(slot == j, value, chosen)
        total_h, total_l = DF.df_add_f(total_h, total_l, value)
    denom = (total_h + total_l) + tl.full((1,), RENORM_EPS, tl.float32)
    weights = tl.math.div_rn(chosen, tl.broadcast_to(denom, (BLOCK_K,)))
    tl.store(expert_ptr + t * K + slot, experts, mask=slot < K)
    tl.store(weight_ptr + t * K + slot, weights, mask=slot < K)
    if SCALED:
        tl.store(scaled_ptr + t * K + slot, weights * scale, mask=slot < K)


def _route_options(softplus: float | None) -> dict:
    """The routing launch's options (none under the interpreter): 4 warps, no FMA contraction; with the softplus, its
    constants and libdevice without flushing subnormals (module doc, "Softplus")."""
    if INTERPRETED:
        return {}
    opts = {"num_warps": 4, "enable_fp_fusion": False}
    if softplus is None:
        return opts
    return opts | {"SOFTPLUS": True, "THRESHOLD": softplus, "enable_reflect_ftz": False}


def route_select(scores: Tensor, bias: Tensor, top_k: int, renorm_eps: float,
                 bias_vl: Tensor | None = None, image_rows: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """`moe.route` after `scores = sqrt_softplus(logits)` ([T, E] fp32): experts [T, k] int64 =
    `topk_lower_id_on_ties(scores + row_bias, k)` (exact: comparisons only) and weights [T, k]
    fp32 = chosen / (fp32(Σ chosen) + renorm_eps), the Σ in double-fp32 rounded once, the rest fp32."""
    _, experts, weights, _ = _route(scores, bias, top_k, renorm_eps, bias_vl, image_rows, sqrt=False, scale=None)
    return experts, weights


def route_softplus(softplus: Tensor, bias: Tensor, top_k: int, renorm_eps: float, routed_scale: float,
                   bias_vl: Tensor | None = None, image_rows: Tensor | None = None
                   ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`route_select` from the fp32 softplus of the router logits, in the same launch: (scores [T, E] =
    the correctly rounded fp32 sqrt of `softplus` — torch's fp32 sqrt on CUDA —, experts, weights, and
    fp32(weights · fp32(routed_scale)) — `moe_ops.scaled_weights`)."""
    return _route(softplus, bias, top_k, renorm_eps, bias_vl, image_rows, sqrt=True, scale=_fp32_scale(routed_scale))


def route_logits(logits: Tensor, bias: Tensor, top_k: int, renorm_eps: float, routed_scale: float,
                 threshold: float, bias_vl: Tensor | None = None, image_rows: Tensor | None = None
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`route_softplus` from the fp32 router logits [T, E]: their softplus (`threshold`: torch's; module doc,
    "Softplus") in the same launch on a GPU; under the interpreter, torch's `F.softplus` first."""
    if INTERPRETED:
        soft = torch.nn.functional.softplus(logits.to(F32), beta=1.0, threshold=threshold)
        return route_softplus(soft, bias, top_k, renorm_eps, routed_scale, bias_vl, image_rows)
    return _route(logits, bias, top_k, renorm_eps, bias_vl, image_rows, sqrt=True, scale=_fp32_scale(routed_scale),
                  softplus=float(threshold))


def _fp32_scale(routed_scale: float) -> float:
    scale = struct.unpack("<f", struct.pack("<f", routed_scale))[0]
    if scale != routed_scale:
        raise ValueError(f"routed_scale {routed_scale!r} is not exactly representable in fp32")
    return scale


def _route(scores: Tensor, bias: Tensor, top_k: int, renorm_eps: float, bias_vl: Tensor | None,
           image_rows: Tensor | None, *, sqrt: bool, scale: float | None,
           softplus: float | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    check_device("route_select", scores, bias)
    T, E = scores.shape
    if not 1 <= top_k <= E:
        raise ValueError(f"top-k of {top_k} out of {E} experts")
    if (bias_vl is None) != (image_rows is None):
        raise ValueError("route_select: pass bias_vl and image_rows together or neither")
    scores = scores.to(F32).contiguous()
    experts = torch.empty(T, top_k, dtype=torch.int64, device=scores.device)
    weights = torch.empty(T, top_k, dtype=F32, device=scores.device)
    out_scores = torch.empty_like(scores) if sqrt else scores
    scaled = torch.empty_like(weights) if scale is not None else weights
    has_vl = bias_vl is not None
    vl = bias_vl.to(F32).contiguous() if has_vl else bias
    image = image_rows.contiguous().view(torch.uint8) if has_vl else experts
    if T:
        _route_select_kernel[(T,)](scores, bias.to(F32).contiguous(), vl, image, experts, weights, E, out_scores,
                                   scaled, 1.0 if scale is None else scale, K=top_k,
                                   BLOCK_K=triton.next_power_of_2(top_k), BLOCK_E=triton.next_power_of_2(E), HAS_VL=has_vl,
                                   RENORM_EPS=float(renorm_eps), SQRT=sqrt, SCALED=scale is not None,
                                   **_route_options(softplus))
    return out_scores, experts, weights, scaled


__all__ = ["route_logits", "route_select", "route_softplus"]

"""The MoE sublayer, implemented per device (spec `model.md` §3.6, §3.8).

`moe_sublayer(cfg, weights, prefix, x, *, image_rows, act_quant, experts=None, reduce=None)`
dispatches on `x.device` — explicitly, never as a fallback:

| x on | routing, shared expert | routed experts |
|---|---|---|
| CPU  | reference (`reference.moe.route`, `shared_expert`) | reference `routed_expert` per expert (float64), weights dequantised fp32 (`{prefix}ffn.experts.{e}.w1/w2/w3.weight`) |
| CUDA | reference (the same torch math on the GPU) | `kernels.moe_mxfp4` (Triton `matmul_ogs`, MXFP4 W4A16) on the weights kept MXFP4: `weights[routed_experts_key(prefix)]` (`RoutedExpertsMxfp4`, prepared once at load by `runtime.weights`) |

Any other device raises; a CUDA call without prepared experts (or a CPU call without the
dequantised ones) raises with the reason.

Expert parallelism. `experts` = the expert ids this process holds (None = all). The routed
partial P[t] = Σ over the slots j of token t whose expert is held here of w[t,j]·E_{e_j}(x[t])
is formed in float64; `reduce` (e.g. an all-reduce over the expert shards) maps P to the sum over
all shards; then the reference's finalize: y = bf16(S(x) + bf16(fp32(s · P))), s =
routed_scaling_factor. With experts=None and reduce=None this is plain TP1.

Numerics.
* CPU, experts=None, reduce=None: bit-identical to `reference.moe.moe_sublayer` (same calls in
  the same order).
* CPU, split over shards with reduce = Σ of the shards' P: each product w·E is exact in float64
  (24 + 8 significant bits) and the masked slots add exact zeros, so P_A + P_B equals the
  unsplit Σ_j except when the k products of a token span more than ~18 binades (then they differ
  by ≤ 2⁻⁵² relative before the fp32 rounding) — in practice bit-identical (tested).
* CUDA: routing and the shared expert are the reference's torch math (float64, rounded once);
  the routed experts are the kernel's (fp32 tensor-core accumulation, `kernels/moe_mxfp4.py`).
  Per output element, against the reference on the same inputs and routing (`moe_error_bound`):

      |y − y_ref| ≤ ulp(y_ref) + ulp(R_ref) + s·Σ_j w_j·ulp(E_j)

  where R_ref = bf16(fp32(s·Σ_j w_j E_j)) is the reference's routed term and E_j its per-slot BF16
  expert outputs: `routed_error_bound` (= ulp(R_ref) + s·Σ_j w_j·ulp(E_j), derived in
  `kernels/moe_mxfp4.py`) bounds |R − R_ref|, and the final bf16(S + R) can flip by one more ulp
  of the output. At most `ROUTED_DIFF_FRACTION_BOUND` (2 %) of the outputs differ (an output can
  only differ where its routed term does). This is the bound of a call outside
  `runtime.dense_ops.dense_math`; inside it (the CUDA forward) the router logits and the shared
  expert's GEMMs run on tensor cores and their own bound (`dense_ops.error_bound`) adds to S.
  TP1 uses the kernel's fused fp64 combine (`routed_experts_mxfp4`); the expert-parallel path
  takes the per-slot outputs (`routed_expert_outputs`, slots of other shards never computed)
  and forms P in torch float64 — the same finalize up to float64 summation order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch
from torch import Tensor

from ..config import TextConfig
from ..reference.moe import route, routed_expert, shared_expert
from ..reference.ops import F32, bf16

F64 = torch.float64
#: The weights-mapping key suffix of a layer's prepared MXFP4 routed experts (not a checkpoint name).
PREPARED_EXPERTS_SUFFIX = "ffn.experts.mxfp4"

RoutedReduce = Callable[[Tensor], Tensor]


def routed_experts_key(prefix: str) -> str:
    """Key of the prepared routed experts of the layer with weight prefix `prefix` (`layers.3.`)."""
    return f"{prefix}{PREPARED_EXPERTS_SUFFIX}"


@dataclass(frozen=True)
class RoutedExpertsMxfp4:
    """One layer's routed experts in the kernel layout (`kernels.moe_mxfp4.PreparedMxfp4Experts`),
    holding the global expert ids `expert_ids` in that order; `local_index[e]` = position of
    global expert e in `expert_ids`, −1 if not held (int32, on the experts' device)."""

    prepared: object            # kernels.moe_mxfp4.PreparedMxfp4Experts (imported lazily: Triton)
    expert_ids: tuple[int, ...]
    n_routed_experts: int
    local_index: Tensor

    @classmethod
    def build(cls, prepared, expert_ids: Sequence[int], n_routed_experts: int,
              device: torch.device) -> "RoutedExpertsMxfp4":
        ids = tuple(int(e) for e in expert_ids)
        if len(set(ids)) != len(ids) or any(not 0 <= e < n_routed_experts for e in ids):
            raise ValueError(f"expert ids must be distinct ids in 0..{n_routed_experts - 1}, got {ids[:8]}…")
        if prepared.n_experts != len(ids):
            raise ValueError(f"{prepared.n_experts} prepared experts for {len(ids)} expert ids")
        index = torch.full((n_routed_experts,), -1, dtype=torch.int32)
        index[list(ids)] = torch.arange(len(ids), dtype=torch.int32)
        return cls(prepared, ids, n_routed_experts, index.to(device))


def _held_experts(experts: Sequence[int] | None, n: int) -> tuple[int, ...]:
    ids = tuple(range(n)) if experts is None else tuple(int(e) for e in experts)
    if not ids or len(set(ids)) != len(ids) or any(not 0 <= e < n for e in ids):
        raise ValueError(f"experts must be distinct ids in 0..{n - 1}, got {list(ids)[:8]}")
    return ids


def _finalize(cfg: TextConfig, partial: Tensor, shared: Tensor) -> Tensor:
    """Reference finalize of a float64 routed sum: bf16(S + bf16(fp32(s·P)))."""
    routed = bf16((cfg.routed_scaling_factor * partial).to(F32))
    return bf16(shared + routed)


def _moe_cpu(cfg: TextConfig, w: Mapping[str, Tensor], prefix: str, x: Tensor, image_rows: Tensor | None,
             act_quant: bool, experts: Sequence[int] | None, reduce: RoutedReduce | None) -> Tensor:
    """The reference's float64 math (`reference.moe.moe_sublayer`), restricted to held experts."""
    p = f"{prefix}ffn."
    E, k, limit = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.swiglu_limit
    held = _held_experts(experts, E)
    bias_vl = w[p + "gate.bias_vl"] if image_rows is not None else None
    routing = route(x, w[p + "gate.weight"], w[p + "gate.bias"], k, bias_vl=bias_vl, image_rows=image_rows)
    if routing.scores.shape[-1] != E:
        raise ValueError(f"{p}gate.weight has {routing.scores.shape[-1]} experts, expected {E}")
    missing = [e for e in held if f"{p}experts.{e}.w1.weight" not in w]
    if missing:
        raise KeyError(f"{p}experts.{missing[0]}.w1.weight: the CPU MoE needs the routed experts dequantised "
                       f"(load with experts_mxfp4=False); {len(missing)} held expert(s) missing")
    T, H = x.shape
    per_slot = torch.zeros(T, k, H, dtype=F64, device=x.device)
    held_set = set(held)
    for e in torch.unique(routing.experts).tolist():
        if e not in held_set:
            continue
        rows, slot = torch.nonzero(routing.experts == e, as_tuple=True)
        per_slot[rows, slot] = routed_expert(x[rows], w[f"{p}experts.{e}.w1.weight"], w[f"{p}experts.{e}.w2.weight"],
                                             w[f"{p}experts.{e}.w3.weight"], limit).to(F64)
    partial = (routing.weights.to(F64).unsqueeze(-1) * per_slot).sum(dim=1)
    if reduce is not None:
        partial = reduce(partial)
    shared = shared_expert(x, w[p + "shared_experts.w1.weight"], w[p + "shared_experts.w2.weight"],
                           w[p + "shared_experts.w3.weight"], limit, act_quant)
    return _finalize(cfg, partial, shared)


def _moe_cuda(cfg: TextConfig, w: Mapping[str, Tensor], prefix: str, x: Tensor, image_rows: Tensor | None,
              act_quant: bool, experts: Sequence[int] | None, reduce: RoutedReduce | None) -> Tensor:
    """Reference routing + shared expert; routed experts through the MXFP4 kernel."""
    from ..kernels import moe_mxfp4 as mx

    p = f"{prefix}ffn."
    E, k, limit, s = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.swiglu_limit, cfg.routed_scaling_factor
    key = routed_experts_key(prefix)
    held_ref = w.get(key)
    if not isinstance(held_ref, RoutedExpertsMxfp4):
        raise KeyError(f"{key}: the CUDA MoE needs the routed experts prepared in MXFP4 at load "
                       "(runtime.weights.runtime_weights with experts_mxfp4=True)")
    held = _held_experts(experts, E)
    if held != held_ref.expert_ids:
        raise ValueError(f"{key}: prepared experts {held_ref.expert_ids[:8]}… differ from the experts "
                         f"passed {held[:8]}…")
    bias_vl = w[p + "gate.bias_vl"] if image_rows is not None else None
    routing = route(x, w[p + "gate.weight"], w[p + "gate.bias"], k, bias_vl=bias_vl, image_rows=image_rows)
    if routing.scores.shape[-1] != E:
        raise ValueError(f"{p}gate.weight has {routing.scores.shape[-1]} experts, expected {E}")
    shared = shared_expert(x, w[p + "shared_experts.w1.weight"], w[p + "shared_experts.w2.weight"],
                           w[p + "shared_experts.w3.weight"], limit, act_quant)
    T, H = x.shape
    xb = x.to(torch.bfloat16)                       # x holds BF16 values: exact
    if experts is None and reduce is None:
        routed = mx.routed_experts_mxfp4(xb, routing.experts, routing.weights, held_ref.prepared,
                                         swiglu_limit=limit, routed_scale=s).to(F32)
        return bf16(shared + routed)
    local = held_ref.local_index[routing.experts]                       # [T, k], −1 = other shard
    partial = torch.zeros(T, H, dtype=F64, device=x.device)
    if T:
        y, plan = mx.routed_expert_outputs(xb, local, held_ref.prepared, swiglu_limit=limit, allow_absent=True)
        per_slot = y[plan.slot_rows.long(), :H].view(T, k, H).to(F64)
        contrib = routing.weights.to(F64).unsqueeze(-1) * per_slot
        partial = torch.where((local >= 0).unsqueeze(-1), contrib, 0.0).sum(dim=1)   # unwritten rows masked
    if reduce is not None:
        partial = reduce(partial)
    return _finalize(cfg, partial, shared)


def moe_sublayer(cfg: TextConfig, weights: Mapping[str, Tensor], prefix: str, x: Tensor, *,
                 image_rows: Tensor | None, act_quant: bool, experts: Sequence[int] | None = None,
                 reduce: RoutedReduce | None = None) -> Tensor:
    """MoE output y = S(x) + s·Σ_k w_k·E_{e_k}(x) of the layer with weight prefix `prefix` for x
    [T, hidden] (BF16 values in fp32), on x's device (module docstring: dispatch, expert
    parallelism, numerics). `image_rows` [T] bool selects `gate.bias_vl` (vision models only)."""
    if x.device.type == "cpu":
        return _moe_cpu(cfg, weights, prefix, x, image_rows, act_quant, experts, reduce)
    if x.device.type == "cuda":
        return _moe_cuda(cfg, weights, prefix, x, image_rows, act_quant, experts, reduce)
    raise RuntimeError(f"sglang-dsv41: no MoE implementation for device '{x.device}' (CPU: torch reference "
                       "path; CUDA: MXFP4 Triton kernels)")


def moe_error_bound(ref_out: Tensor, ref_routed: Tensor, per_slot: Tensor, topk_weights: Tensor,
                    routed_scale: float) -> Tensor:
    """Per-element bound on |CUDA moe_sublayer − reference| (module docstring), fp32 [T, H]:
    ulp(y_ref) + ulp(R_ref) + s·Σ_j w_j·ulp(E_j). `ref_out` = reference y, `ref_routed` = its
    routed term R_ref, `per_slot` [T, k, H] its per-slot expert outputs, `topk_weights` [T, k]."""
    from ..kernels.moe_mxfp4 import bf16_ulp, routed_error_bound

    return bf16_ulp(ref_out) + routed_error_bound(ref_routed, per_slot, topk_weights, routed_scale)

"""The MoE sublayer of the runtime, one implementation per device (spec `model.md` §3.6, §3.8).

`moe_for(device)` picks, once per model:

| device | routing, shared expert | routed experts |
|---|---|---|
| CPU  | `route` / `shared_expert` through their linear layers' methods (`quant_methods.apply_linear`) | `routed_expert` per expert on dequantised fp32 weights (`{prefix}ffn.experts.{e}.w1/w2/w3.weight`) |
| CUDA | the same on the Triton backend | `kernels.moe_mxfp4` (Triton `matmul_ogs`, MXFP4 W4A16) on `weights[routed_experts_key(prefix)]` (`RoutedExpertsMxfp4`, prepared once at load) |

The runtime's copy of `reference/moe.py`, tested against it (tests/test_runtime_moe_ops.py).

Routed sum. y = bf16(S(x) + bf16(R)), R = Σ_j w'[t,j]·E_{e_j}(x[t]) in fp32 in slot order
(`numerics.rounding.slot_sum_fp32`, upstream's finalize), w' = fp32(w·s) (s = routed_scaling_factor
folded into the fp32 routing weights, as upstream's MXFP4 MoE paths do).

Expert parallelism. `experts` = the expert ids this process holds (None = all). The routed partial
is the per-slot expert outputs [T, k, H] (BF16 values in the backend's `acc`) of the slots whose
expert is held here, −0.0 elsewhere; `reduce` sums it over the shards — exact, since each slot is
held by exactly one shard — and R is formed after it, so the split equals TP 1 bit for bit on
every backend (tested). The all-reduce carries k values per hidden element instead of one.

CUDA bound against the reference on the same inputs and routing (`moe_error_bound`):
|y − y_ref| ≤ ulp(y_ref) + ulp(R_ref) + s·Σ_j w_j·ulp(E_j) + 4(k + 1)·2⁻²⁴·s·Σ_j w_j·|E_j|
(`routed_error_bound`, derived in `kernels/moe_mxfp4.py`),
plus the dense products' GEMM bound on the router logits and shared expert.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch
from torch import Tensor, nn

from ..config import TextConfig
from ..numerics.rounding import bf16, slot_sum_fp32
from .backend import ComputeBackend
from .overlap import INLINE, InlineStream, SideStream
from .quant_methods import apply_linear
from .stacked_linear import SHARED_STACKED

F32, F64 = torch.float32, torch.float64
SOFTPLUS_THRESHOLD = 20.0
RENORM_EPS = 1e-20
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


@dataclass(frozen=True)
class Routing:
    """experts [T, k] long, weights [T, k] fp32 (renormalised, bias-free), scores [T, E] fp32,
    scaled [T, k] fp32 = fp32(weights · fp32(routed_scale)): the routed scaling factor folded into the fp32
    routing weights (upstream's top-k kernel with apply_routed_scaling_factor_on_output)."""

    experts: Tensor
    weights: Tensor
    scores: Tensor
    scaled: Tensor


def softplus_fp32(logits: Tensor, acc: torch.dtype = F64) -> Tensor:
    """softplus(z) = z if z > 20 else log1p(exp(z)), evaluated in `acc` (the backend's: float64 only on
    `exact`) and rounded to fp32. CUDA fp32: `F.softplus`, one kernel of this `where` with the same expf /
    log1pf (tested)."""
    z = logits.to(acc)
    if z.is_cuda and acc == F32:
        return torch.nn.functional.softplus(z, beta=1.0, threshold=SOFTPLUS_THRESHOLD)
    return torch.where(z > SOFTPLUS_THRESHOLD, z, torch.log1p(torch.exp(z.clamp(max=SOFTPLUS_THRESHOLD)))).to(F32)


def sqrt_softplus(logits: Tensor, acc: torch.dtype = F64) -> Tensor:
    """s = sqrt(softplus(z)): the fp32 softplus (`softplus_fp32`), then its sqrt evaluated in `acc` and
    rounded to fp32 (upstream's gate takes the sqrt of the fp32 softplus; float64: the correctly rounded
    fp32 sqrt, which torch's CPU fp32 sqrt is not). Elementwise: batch invariant."""
    return torch.sqrt(softplus_fp32(logits, acc).to(acc)).to(F32)


def route(be: ComputeBackend, x: Tensor, gate: nn.Module, bias: Tensor, top_k: int,
          bias_vl: Tensor | None = None, image_rows: Tensor | None = None, routed_scale: float = 1.0) -> Routing:
    """Router (spec §3.6): scores = sqrt_softplus(fp32 logits of the `gate` linear layer);
    selection on scores + bias (`bias_vl` on image rows), ties → lower id; weights renormalised
    without the bias, and scaled by `routed_scale`. After the gate's product, one backend call
    (`ComputeBackend.route_logits`: one launch on `triton`, softplus included)."""
    if (bias_vl is None) != (image_rows is None):
        raise ValueError("route: pass bias_vl and image_rows together (vision models) or neither")
    logits = apply_linear(gate, x, be, out_fp32=True)
    scores, experts, weights, scaled = be.route_logits(logits, bias, top_k, RENORM_EPS, routed_scale, bias_vl,
                                                       image_rows)
    return Routing(experts=experts, weights=weights, scores=scores, scaled=scaled)


def routed_expert(be: ComputeBackend, x: Tensor, w1: Tensor, w2: Tensor, w3: Tensor, limit: float) -> Tensor:
    """One routed expert, W4A16 on dequantised weights: BF16 activations and outputs."""
    h = be.clamped_swiglu(be.linear_bf16(x, w1), be.linear_bf16(x, w3), limit)
    return be.linear_bf16(h, w2)


def shared_expert(be: ComputeBackend, x: Tensor, w1: nn.Module, w2: nn.Module, w3: nn.Module, limit: float,
                  act_quant: bool, w13: nn.Module | None = None) -> Tensor:
    """The shared expert of whole (unsharded) FP8 linear layers, activation quantisation per
    `act_quant` (§3.8); `w13`: the stacked w1 | w3 (`runtime/stacked_linear.py`), one product, whose
    SwiGLU writes `w2`'s activations quantised where the backend asks (`quantised_handoff`: the same
    values `w2` would quantise them to); sharded: `TensorParallel.shared_expert`."""
    handoff = False
    if w13 is not None:
        handoff = act_quant and be.quantised_handoff(x.numel() // x.shape[-1])
        h = be.clamped_swiglu_halves(apply_linear(w13, x, be, act_quant=act_quant, bf16_out=True), limit,
                                     quantise_out=handoff)
    else:
        h = be.clamped_swiglu(apply_linear(w1, x, be, act_quant=act_quant),
                              apply_linear(w3, x, be, act_quant=act_quant), limit)
    return apply_linear(w2, h, be, act_quant=act_quant, bf16_out=True, x_quantised=handoff)


def _held_experts(experts: Sequence[int] | None, n: int) -> tuple[int, ...]:
    ids = tuple(range(n)) if experts is None else tuple(int(e) for e in experts)
    if not ids or len(set(ids)) != len(ids) or any(not 0 <= e < n for e in ids):
        raise ValueError(f"experts must be distinct ids in 0..{n - 1}, got {list(ids)[:8]}")
    return ids


#: the shared expert of a layer's parallel linears, x → (output, is it a partial in `acc`)
#: (`TensorParallel.shared_expert`); None: the whole layers `shared_experts.w1/w2/w3` of `w`
SharedExpert = Callable[[Tensor], tuple[Tensor, bool]]


def _shared(be: ComputeBackend, w: Mapping[str, Tensor], p: str, x: Tensor, limit: float, act_quant: bool,
            shared: SharedExpert | None) -> tuple[Tensor, bool]:
    if shared is not None:
        return shared(x)
    return shared_expert(be, x, w[p + "shared_experts.w1"], w[p + "shared_experts.w2"],
                         w[p + "shared_experts.w3"], limit, act_quant, w.get(p + SHARED_STACKED)), False


def _reduce(be: ComputeBackend, per_slot: Tensor, shared: Tensor, shared_partial: bool,
            reduce: RoutedReduce | None) -> tuple[Tensor, Tensor]:
    """(per-slot expert outputs [T, k, H] summed over ranks, shared expert output BF16): a sharded
    shared expert's partial goes through the same all-reduce as the routed one (one collective)."""
    if not shared_partial:
        return (per_slot if reduce is None else reduce(per_slot)), shared
    if reduce is None:
        raise ValueError("a row-parallel shared expert needs the TP all-reduce")
    k = per_slot.shape[1]
    both = reduce(torch.cat([per_slot.to(be.acc), shared.to(be.acc).unsqueeze(1)], dim=1))
    return both[:, :k], be.linear_fp8_finish(both[:, k])


def _finalize(weights: Tensor, per_slot: Tensor, shared: Tensor) -> Tensor:
    """Reference finalize: bf16(S + bf16(R)), R = the fp32 slot-order sum of w'·E."""
    return bf16(shared + bf16(slot_sum_fp32(weights, per_slot)))


def _moe_cpu(be: ComputeBackend, cfg: TextConfig, w: Mapping[str, Tensor], prefix: str, x: Tensor,
             image_rows: Tensor | None, act_quant: bool, experts: Sequence[int] | None,
             reduce: RoutedReduce | None, shared: SharedExpert | None = None,
             side: SideStream | InlineStream = INLINE) -> Tensor:
    """Per held expert on dequantised weights; the routed partial in `be.acc` (`side`: unused, CPU)."""
    p = f"{prefix}ffn."
    E, k, limit = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.swiglu_limit
    held = _held_experts(experts, E)
    bias_vl = w[p + "gate.bias_vl"] if image_rows is not None else None
    routing = route(be, x, w[p + "gate"], w[p + "gate.bias"], k, bias_vl=bias_vl, image_rows=image_rows,
                    routed_scale=cfg.routed_scaling_factor)
    if routing.scores.shape[-1] != E:
        raise ValueError(f"{p}gate.weight has {routing.scores.shape[-1]} experts, expected {E}")
    missing = [e for e in held if f"{p}experts.{e}.w1.weight" not in w]
    if missing:
        raise KeyError(f"{p}experts.{missing[0]}.w1.weight: the CPU MoE needs the routed experts dequantised "
                       f"(load with experts_mxfp4=False); {len(missing)} held expert(s) missing")
    T, H = x.shape
    per_slot = torch.full((T, k, H), -0.0, dtype=be.acc, device=x.device)   # −0.0: the all-reduce's identity
    held_set = set(held)
    for e in torch.unique(routing.experts).tolist():
        if e not in held_set:
            continue
        rows, slot = torch.nonzero(routing.experts == e, as_tuple=True)
        per_slot[rows, slot] = routed_expert(be, x[rows], w[f"{p}experts.{e}.w1.weight"],
                                             w[f"{p}experts.{e}.w2.weight"],
                                             w[f"{p}experts.{e}.w3.weight"], limit).to(be.acc)
    shared_out, shared_partial = _shared(be, w, p, x, limit, act_quant, shared)
    return _finalize(routing.scaled, *_reduce(be, per_slot, shared_out, shared_partial, reduce))


def _moe_cuda(be: ComputeBackend, cfg: TextConfig, w: Mapping[str, Tensor], prefix: str, x: Tensor,
              image_rows: Tensor | None, act_quant: bool, experts: Sequence[int] | None,
              reduce: RoutedReduce | None, shared: SharedExpert | None = None,
              side: SideStream | InlineStream = INLINE) -> Tensor:
    """Routing + shared expert on the backend; routed experts through the MXFP4 kernel. The shared
    expert is forked to `side` (`runtime/overlap.py`) and joined before the routed sum is final: on a
    single rank its output goes into the combine's launch (`combine_routed(shared=)`, `_finalize`'s
    rounding), sharded or expert-parallel calls finalise in torch after the reduction."""
    from ..kernels import moe_mxfp4 as mx

    p = f"{prefix}ffn."
    E, k, limit = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.swiglu_limit
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
    pending_shared = side.fork(_shared, be, w, p, x, limit, act_quant, shared)
    routing = route(be, x, w[p + "gate"], w[p + "gate.bias"], k, bias_vl=bias_vl, image_rows=image_rows,
                    routed_scale=cfg.routed_scaling_factor)
    if routing.scores.shape[-1] != E:
        raise ValueError(f"{p}gate.weight has {routing.scores.shape[-1]} experts, expected {E}")
    T, H = x.shape
    xb = x.to(torch.bfloat16)                       # x holds BF16 values: exact
    weights = routing.scaled
    if experts is None and reduce is None and not pending_shared.result[1]:     # host flag: no device read
        if T == 0:
            return bf16(side.join(pending_shared)[0])
        y, plan = mx.routed_expert_outputs(xb, routing.experts, held_ref.prepared, swiglu_limit=limit,
                                           check_ids=False)                     # ids < E: the router's
        shared_out, _ = side.join(pending_shared)
        # bf16(S + bf16(R)) in the combine's launch (`_finalize`'s rounding, no cast / add / round launches)
        return mx.combine_routed(y, plan, weights, 1.0, H, shared=shared_out.contiguous())   # S: fp32 or BF16
    local = held_ref.local_index[routing.experts]                       # [T, k], −1 = other shard
    per_slot = torch.full((T, k, H), -0.0, dtype=be.acc, device=x.device)
    if T:
        y, plan = mx.routed_expert_outputs(xb, local, held_ref.prepared, swiglu_limit=limit, allow_absent=True,
                                           check_ids=False)                # local_index values: −1 … held − 1
        per_slot = torch.where((local >= 0).unsqueeze(-1), y[plan.slot_rows.long(), :H].view(T, k, H).to(be.acc),
                               per_slot)                                   # unwritten rows masked
    return _finalize(weights, *_reduce(be, per_slot, *side.join(pending_shared), reduce))


MoeSublayer = Callable[..., Tensor]


def moe_for(device: torch.device) -> MoeSublayer:
    """The MoE implementation of a model on `device` (module doc); any other device raises. Its
    call: (be, cfg, weights, prefix, x, image_rows, act_quant, experts, reduce, shared=None, side=INLINE)
    → y [T, hidden]."""
    if device.type == "cpu":
        return _moe_cpu
    if device.type == "cuda":
        return _moe_cuda
    raise RuntimeError(f"sglang-dsv41: no MoE implementation for device '{device}' (CPU: torch; CUDA: MXFP4 "
                       "Triton kernels)")


def moe_error_bound(ref_out: Tensor, ref_routed: Tensor, per_slot: Tensor, topk_weights: Tensor,
                    routed_scale: float) -> Tensor:
    """Per-element bound on |CUDA moe_sublayer − reference| (module docstring), fp32 [T, H]:
    ulp(y_ref) + ulp(R_ref) + s·Σ_j w_j·ulp(E_j). `ref_out` = reference y, `ref_routed` = its
    routed term R_ref, `per_slot` [T, k, H] its per-slot expert outputs, `topk_weights` [T, k]."""
    from ..kernels.moe_mxfp4 import bf16_ulp, routed_error_bound

    return bf16_ulp(ref_out) + routed_error_bound(ref_routed, per_slot, topk_weights, routed_scale)

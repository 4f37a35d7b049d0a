"""Compute backends of the runtime forward, chosen once per model by device (spec `model.md` §3, §3.8).

A backend implements the primitives every layer calls — rounding, fake quantisation, RMSNorm,
RoPE, SwiGLU, routing selection and the dense product x·wᵀ — and the linears built from them.
Layers hold one backend and never dispatch per call; `backend_for(device, weights)` picks it:

| name | device | arithmetic |
|---|---|---|
| `torch` | CPU (serving default) | fp32 torch: products, norms, softmaxes and sums in fp32, BF16 rounding points as the model; judged by tolerance against the reference (docs/runtime.md "Numerics contract") |
| `exact` | CPU (`--enable-deterministic-inference`, tests) | float64-evaluated sums rounded once: bit-identical to the reference, batch invariant |
| `triton` | CUDA | one-launch Triton kernels (`kernels.fused_elementwise`, `kernels.engram_gate`) and tensor-core products (`dense_ops.BlockedBf16Gemm`: serving rows in one GEMM, deterministic rows in 128-row blocks, `bf16_gemm_for`); FP8 dense linears by `fp8_gemm` (below) |

`acc` is the dtype the runtime's torch reductions outside the primitives use with this backend
(attention on CPU, index scores, mHC coefficients, pair pooling, routed sums, router
sqrt-softplus): float64 only on `exact`; fp32 on `torch` and `triton` (issue 21: no float64 on
the GPU path; bounded by the numerics contract, docs/runtime.md).

FP8 dense linears on `triton` (`fp8_gemm`, FP8_GEMMS; spec §3.8, issue 21). Every choice uses the
reference's operands — activations quantised per 1×32 to E4M3 with UE8M0 scales (`wo_a`: BF16, not
quantised), E4M3 weights with their tile scales — and differs only in how the products are summed:
* `w8a8_fold` (serving default since its H100 run, docs/performance.md "Session 29"): as `w8a8_f16`, but 1–16 rows on the
  scale-folded BF16 MMA tier (`kernels.fp8_fold`: 128 columns per MMA, exact products, fp32 sums; the same
  bound). Not batch invariant;
* `w8a8_f16` (the serving default from session 11 to 28): `kernels.fp8_w8a8` at
  every row count — the activation quantisation fused into the GEMM, E4M3 operands widened to
  f16 on the tensor cores (exact products, fp32 sums), split-K at decode summed inside the launch;
  from BF16_GEMM_MIN_ROWS rows its prefill form; `wo_a` one grouped launch. Not batch invariant;
* `tiered` (opt-in; the default until session 11): below `kernels.fp8_w8a8.BF16_GEMM_MIN_ROWS` rows
  the `w8a16` kernel, from there the BF16-copy cuBLAS form of `kernels.fp8_w8a8` (prefill);
* `w8a16` (`--enable-deterministic-inference`): `kernels.fp8_linear` at every row count — the
  fake-quantised activations as BF16 times the dequantised tile, one fixed launch configuration
  (row invariant), `wo_a` one launch per group. Bound: dense_ops GEMM_BOUND;
* `fp8_mma` (opt-in): as `w8a8_f16`, but 17–128 rows on Hopper's FP8 MMA (E4M3 `wgmma`, ~14-bit
  sums per 32 products: DeepGEMM block32's accumulation class). Below the end-to-end contract
  (docs/runtime.md "Numerics contract"), hence not the default;
* `w8a8_gemv` (opt-in: slower on the H100, docs/performance.md "Session 28"): as `w8a8_f16`, but 1–4 rows
  on the CUDA-core GEMV tier (`kernels.fp8_gemv`: x quantised once, exact products, fp32 sums; the same bound);
Weights not held as E4M3 tiles (BF16 copies, fp32) go through `matmul` in either mode: on `triton`
by `bf16_gemm_for` — cuBLAS GEMMs (`whole`, the serving default; `blocked`, row invariant, with
deterministic inference), or fewer than 129 rows of a BF16 weight on `kernels.bf16_linear` (`triton`).

BF16_OUT: the runtime holds activations in the backend's dtype (fp32 / float64) with BF16 values
where the model rounds. Where a BF16 result feeds only readers that take BF16 (the query heads, the
attention output, `wo_a`'s output: `runtime/attention_math.py`; `wo_b`'s and the shared expert's:
`runtime/tensor_parallel.py`; the mHC sublayer inputs: `runtime/mhc_ops.py`), the call passes
`bf16_out` and `triton` returns a torch.bfloat16 tensor of the same values: at an 8K prefill that
skips the fp32 copies of q and o (1 GB each) and the casts around them. The CPU backends keep their
dtype. Kernels that load an input as fp32 take these BF16 tensors as they are (`_widened_in_kernel`).

The registry (`BACKENDS`) maps names to classes; an unknown device or name raises.
"""
from __future__ import annotations

import os
from abc import ABC, abstractmethod
from typing import Mapping

import torch
import torch.nn.functional as F_
from torch import Tensor

from ..numerics import rounding as R
from ..numerics.rope import apply_rope_tail, rope_cos_sin_fp32

F32, F64, BF16 = torch.float32, torch.float64, torch.bfloat16
#: FP8 dense-linear arithmetics of the CUDA backend (module doc), and the variable that picks one
FP8_GEMMS = ("w8a8_f16", "tiered", "w8a16", "fp8_mma", "w8a8_gemv", "w8a8_fold")
FP8_GEMM_ENV = "SGLANG_DSV41_FP8_GEMM"
#: BF16 / fp32-weight products on CUDA (`bf16_gemm_for`): `whole` (serving default: a batch in one cuBLAS
#: GEMM, `dense_ops.BlockedBf16Gemm.whole_rows`) | `triton` (opt-in: fewer than 129 rows on
#: `kernels.bf16_linear`, more as `whole`; no faster on the H200, docs/performance.md "Session 24") |
#: `blocked` (deterministic: 128-row blocks, row invariant) | `direct` (opt-in: any batch in one cuBLAS GEMM on the
#: activation as given, no padded copy)
BF16_GEMMS, BF16_GEMM_ENV = ("blocked", "whole", "triton", "direct"), "SGLANG_DSV41_BF16_GEMM"


class ComputeBackend(ABC):
    """The primitives of the runtime math (module doc). Tensors hold fp32 values unless stated."""

    name: str = ""
    #: True when sums are evaluated exactly (float64) and the forward is batch invariant
    deterministic: bool = False
    #: dtype of the runtime's own torch reductions on this backend (module doc)
    acc: torch.dtype = F64

    @abstractmethod
    def bf16(self, x: Tensor) -> Tensor: ...
    @abstractmethod
    def fp8_act_fake_quant(self, x: Tensor) -> Tensor: ...
    @abstractmethod
    def fp4_fake_quant_e4m3_scale(self, x: Tensor) -> Tensor: ...
    @abstractmethod
    def fp4_fake_quant_ue8m0_scale(self, x: Tensor) -> Tensor: ...
    @abstractmethod
    def rms_norm(self, x: Tensor, weight: Tensor, eps: float, round_bf16: bool = True) -> Tensor: ...
    @abstractmethod
    def apply_rope_tail(self, x: Tensor, positions: Tensor, inv_freq: Tensor, inverse: bool = False) -> Tensor: ...
    @abstractmethod
    def clamped_swiglu(self, gate: Tensor, up: Tensor, limit: float) -> Tensor: ...
    @abstractmethod
    def route_select(self, scores: Tensor, bias: Tensor, top_k: int, renorm_eps: float,
                     bias_vl: Tensor | None, image_rows: Tensor | None) -> tuple[Tensor, Tensor]: ...
    @abstractmethod
    def matmul(self, x: Tensor, weight: Tensor) -> Tensor:
        """fp32 x·weightᵀ; x [..., K] holds the already-quantised activation, weight [N, K]."""

    # ---- built from the primitives -------------------------------------------------------------
    def bf16_rope_tail(self, x: Tensor, positions: Tensor, inv_freq: Tensor, inverse: bool = False,
                       bf16_out: bool = False, round_input: bool = False) -> Tensor:
        """bf16(RoPE(x)), or with `round_input` bf16(RoPE(bf16(x))). `bf16_out`: the caller also takes a
        torch.bfloat16 tensor (the same values), which a backend may return to save bytes (BF16_OUT,
        module doc); this one keeps its dtype."""
        return self.bf16(self.apply_rope_tail(self.bf16(x) if round_input else x, positions, inv_freq, inverse))

    def bf16_rope_tail_into(self, x: Tensor, positions: Tensor, inv_freq: Tensor, cache: Tensor, rows: Tensor) -> None:
        """cache[rows] = bf16(RoPE(bf16(x))) in the cache's dtype (`bf16_rope_tail` with `round_input`): the NONE
        profile's SWA cache write (`attention_math.write_swa_roundtrip`)."""
        cache[rows] = self.bf16_rope_tail(x, positions, inv_freq, bf16_out=True, round_input=True).to(cache.dtype)

    def rms_norm_pair(self, x: Tensor, split: int, first_weight: Tensor, second_weight: Tensor,
                      eps: float) -> tuple[Tensor, Tensor]:
        """(rms_norm(x[:, :split], first_weight) rounded to BF16, rms_norm(x[:, split:], second_weight) not
        rounded): q_lora and kv from the stacked `wq_a | wkv` product (§3.4.1, `runtime/stacked_linear.py`)."""
        return (self.rms_norm(x[:, :split], first_weight, eps),
                self.rms_norm(x[:, split:], second_weight, eps, round_bf16=False))

    def route_logits(self, logits: Tensor, bias: Tensor, top_k: int, renorm_eps: float, routed_scale: float,
                     bias_vl: Tensor | None, image_rows: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The router after its fp32 logits (§3.6): (scores = fp32 sqrt, evaluated in `acc`, of the fp32 softplus
        `moe_ops.softplus_fp32`, experts, weights — `route_select` —, fp32(weights · fp32(routed_scale)))."""
        from .moe_ops import softplus_fp32

        scores = torch.sqrt(softplus_fp32(logits, self.acc).to(self.acc)).to(F32)
        experts, weights = self.route_select(scores, bias, top_k, renorm_eps, bias_vl, image_rows)
        return scores, experts, weights, weights.to(F32) * R.fp32_scalar(routed_scale)

    def clamped_swiglu_halves(self, y: Tensor, limit: float, quantise_out: bool = False) -> Tensor:
        """clamped_swiglu(y[:, :n], y[:, n:]) of y [T, 2n]: the shared expert's SwiGLU from the stacked
        `w1 | w3` product (§3.6, `runtime/stacked_linear.py`); `quantise_out`: those values quantised per
        1×32 (`fp8_act_fake_quant`) for `w2` (`quantised_handoff`)."""
        n = y.shape[1] // 2
        h = self.clamped_swiglu(y[:, :n], y[:, n:], limit)
        return self.fp8_act_fake_quant(h) if quantise_out else h

    def linear_fp8(self, x: Tensor, weight: Tensor, act_quant: bool = True, bf16_out: bool = False,
                   x_quantised: bool = False) -> Tensor:
        """FP8 dense linear (spec §3.8): activation fake-quant, product, BF16 output (`bf16_out`: as
        `bf16_rope_tail`'s). `x_quantised`: x holds activations quantised already (`quantised_handoff`);
        quantising them again gives the same values, which is what this default does."""
        xf = self.fp8_act_fake_quant(x) if act_quant else x.to(F32)
        return self.bf16(self.matmul(xf, weight))

    def matmul_acc(self, x: Tensor, weight: Tensor) -> Tensor:
        """x·weightᵀ in `acc`, not rounded further (a row-parallel partial product); default the
        fp32 `matmul`."""
        return self.matmul(x, weight)

    def linear_fp8_partial(self, x: Tensor, weight: Tensor, act_quant: bool = True) -> Tensor:
        """A row-parallel shard of `linear_fp8` (x and weight hold this rank's input columns,
        split on 32-wide activation blocks): the product in `acc`; the ranks' sum through
        `linear_fp8_finish` is `linear_fp8` of the whole (exactly on the float64 backend)."""
        xf = self.fp8_act_fake_quant(x) if act_quant else x.to(F32)
        return self.matmul_acc(xf, weight)

    def linear_fp8_finish(self, summed: Tensor) -> Tensor:
        """BF16 output of an all-reduced row-parallel partial (`linear_fp8_partial`)."""
        return self.bf16(summed.to(F32))

    def linear_bf16(self, x: Tensor, weight: Tensor, out_fp32: bool = False) -> Tensor:
        """BF16-weight linear; BF16 output unless `out_fp32`."""
        y = self.matmul(x, weight)
        return y if out_fp32 else self.bf16(y)

    def linear_bf16_grouped(self, x: Tensor, weight: Tensor, groups: int, bf16_out: bool = False,
                            quantise_out: bool = False) -> Tensor:
        """Grouped BF16-arithmetic linear (`wo_a`, spec §3.4.6): x [T, groups·K], weight
        [groups·r, K]; output columns g·r … (g+1)·r − 1 = linear_bf16(x[:, g·K …], weight[g·r …]).
        BF16 output [T, groups·r] (`bf16_out`: as `bf16_rope_tail`'s). Default: one `linear_bf16` per group.
        `quantise_out`: the output's values quantised per 1×32 (`fp8_act_fake_quant`), for a consumer that
        passes `x_quantised` (`quantised_handoff`)."""
        r, K = _group_shape(x, weight, groups)
        y = torch.cat([self.linear_bf16(x[:, g * K:(g + 1) * K], weight[g * r:(g + 1) * r])
                       for g in range(groups)], dim=1)
        return self.fp8_act_fake_quant(y) if quantise_out else y

    def quantised_handoff(self, rows: int) -> bool:
        """Whether a producer should write its output quantised for the FP8 linear that reads it at `rows`
        rows (`quantise_out` → `x_quantised`): only where that saves the consumer work, i.e. never here;
        `TritonBackend`: its fold tier. The values, hence the results, are the same either way."""
        return False

    def engram_gate(self, residual: Tensor, keys: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float) -> Tensor:
        """g [T, hc] fp32 (spec §3.3.2) from residual and keys [T, hc, H]: the torch formula in
        `acc` (runtime/engram_gate.py)."""
        from .engram_gate import engram_gate

        return engram_gate(residual, keys, q_weight, k_weight, eps, self.acc)

    def engram_residual(self, residual: Tensor, keys: Tensor, value: Tensor, q_weight: Tensor, k_weight: Tensor,
                        eps: float, image_rows: Tensor | None) -> Tensor:
        """R' = bf16(R + g·value) per stream (§3.3.2; g = `engram_gate`, value [T, H]), R itself on image rows, in
        R's dtype."""
        gate = self.engram_gate(residual, keys, q_weight, k_weight, eps)
        updated = R.bf16(residual.to(F32) + gate[:, :, None] * value[:, None, :])
        if image_rows is not None:
            updated = torch.where(image_rows.to(torch.bool)[:, None, None], residual.to(F32), updated)
        return updated.to(residual.dtype)

    def compressed_entries(self, selection: Tensor, layout, ratio: int) -> Tensor:
        """[N, K] entry indices of a top-k selection of compressed positions [N, K] (−1 = none) of the batch
        `layout` (`runtime/batch.BatchLayout`): `attention.compressed_entries`, in torch."""
        from .attention import compressed_entries

        return compressed_entries(selection, layout, ratio)

    def write_packed_entries(self, latent_rows: Tensor, key_rows: Tensor, source, layout, entry_idx: Tensor,
                             latents: Tensor, keys: Tensor) -> None:
        """Packed FP4 entries of (latents [n, D], keys [n, Dk]) of kv source `source` (`kv_layout.KvSource`
        of `layout`) written at `entry_idx` [n] (−1 = none) into the two row buffers (spec §3.4.3,
        contract §1–§2): `kv_layout.encode_entries`, then `write_source_entries`."""
        from .kv_layout import encode_entries, write_source_entries

        write_source_entries(latent_rows, key_rows, source, entry_idx, encode_entries(layout, latents, keys))

    def pair_latents(self, a: Tensor, s: Tensor, layout, caches, source: int, norm_weight: Tensor,
                     eps: float) -> tuple[Tensor, Tensor, Tensor]:
        """(latents [N, D], entry indices [N] (−1 = none), RoPE positions [N]) of the ratio-2 pairs ending at
        every token of `layout` (kv source `source`, a, s its fp32 `wkv` / `wgate` outputs; spec §3.4.3):
        `pair_ring.pair_latents_torch`."""
        from .pair_ring import pair_latents_torch

        return pair_latents_torch(self, a, s, layout, caches, source, norm_weight, eps)

    def store_pending_pairs(self, a: Tensor, s: Tensor, layout, caches, source: int) -> None:
        """After `pair_latents`: the requests' pending first tokens into the pair ring
        (`pair_ring.store_pending_torch`)."""
        from .pair_ring import store_pending_torch

        store_pending_torch(a, s, layout, caches, source)

    def swa_window(self, layout, caches, window: int) -> tuple[Tensor, Tensor]:
        """(SWA slots [N, window] int64 of every token's sliding window, −1 before position 0; SWA rows [N] of
        the tokens' own slots) of `layout` in `caches` (spec §3.4.5): `attention.swa_window_torch`."""
        from .attention import swa_window_torch

        return swa_window_torch(layout, caches, window)

    def engram_ring_rows(self, hasher, ids: Tensor, layout, ring) -> list[Tensor]:
        """Row ids [N, columns] per Engram layer of `layout`'s remapped `ids` from the request rows' history
        ring (`engram_history.EngramHistoryRing`), then the ring advanced (spec §3.3.1):
        `engram_rows.ring_rows_torch`."""
        from .engram_rows import ring_rows_torch

        return ring_rows_torch(hasher, ids, layout, ring)

    def finish(self, ok: bool = True) -> None:
        """Called after each forward, `ok` False when it raised (e.g. to report or drop a deferred
        audit); nothing by default."""


def _group_shape(x: Tensor, weight: Tensor, groups: int) -> tuple[int, int]:
    """(rows per group r, columns per group K) of a grouped product; bad shapes raise."""
    if groups < 1 or weight.dim() != 2 or weight.shape[0] % groups or x.dim() != 2 \
            or x.shape[1] != groups * weight.shape[1]:
        raise ValueError(f"grouped linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not form "
                         f"{groups} groups (x [T, groups·K], weight [groups·r, K])")
    return weight.shape[0] // groups, weight.shape[1]


def topk_lower_id_on_ties(values: Tensor, k: int) -> Tensor:
    """Indices [T, k] of the k best entries per row: NaN first, then larger value, ties → lower id
    (spec §3.6, §12), by k explicit selection rounds (no host sync)."""
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
        masked = torch.where(free & ~is_nan, v, torch.full_like(v, -torch.inf))
        best = masked.max(dim=-1, keepdim=True).values
        at_best = free & ~is_nan & (v == best)
        candidates = torch.where(free_nan.any(dim=-1, keepdim=True), free_nan, at_best)
        pick = torch.where(candidates, ids, torch.full_like(ids, E)).min(dim=-1).values
        chosen.append(pick)
        taken.scatter_(1, pick.unsqueeze(-1), True)
    return torch.stack(chosen, dim=-1)


class ExactTorchBackend(ComputeBackend):
    """CPU, float64-evaluated and rounded once: bit-identical to the reference's helpers."""

    name = "exact"
    deterministic = True

    def bf16(self, x: Tensor) -> Tensor:
        return R.bf16(x)

    def fp8_act_fake_quant(self, x: Tensor) -> Tensor:
        return R.fp8_act_fake_quant(x)

    def fp4_fake_quant_e4m3_scale(self, x: Tensor) -> Tensor:
        return R.fp4_fake_quant_e4m3_scale(x)

    def fp4_fake_quant_ue8m0_scale(self, x: Tensor) -> Tensor:
        return R.fp4_fake_quant_ue8m0_scale(x)

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float, round_bf16: bool = True) -> Tensor:
        xd = x.to(F64)
        y = (xd * torch.rsqrt(xd.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.to(F64)).to(F32)
        return R.bf16(y) if round_bf16 else y

    def apply_rope_tail(self, x: Tensor, positions: Tensor, inv_freq: Tensor, inverse: bool = False) -> Tensor:
        return apply_rope_tail(x, positions, inv_freq, inverse)

    def clamped_swiglu(self, gate: Tensor, up: Tensor, limit: float) -> Tensor:
        g = R.bf16(gate).clamp(max=limit).to(F64)
        u = R.bf16(up).clamp(min=-limit, max=limit).to(F64)
        return R.bf16((F_.silu(g) * u).to(F32))

    def route_select(self, scores: Tensor, bias: Tensor, top_k: int, renorm_eps: float,
                     bias_vl: Tensor | None, image_rows: Tensor | None) -> tuple[Tensor, Tensor]:
        row_bias = bias.to(F32).expand_as(scores)
        if bias_vl is not None:
            row_bias = torch.where(image_rows.unsqueeze(-1), bias_vl.to(F32).expand_as(scores), row_bias)
        experts = topk_lower_id_on_ties(scores + row_bias, top_k)
        chosen = scores.gather(-1, experts)
        denom = chosen.to(F64).sum(dim=-1, keepdim=True).to(F32) + R.fp32_scalar(renorm_eps)
        return experts, chosen / denom                    # fp32 add and division (as upstream's gate)

    def matmul(self, x: Tensor, weight: Tensor) -> Tensor:
        if weight.dtype == torch.float8_e4m3fn:
            raise TypeError("the exact CPU backend multiplies dequantised weights; got an E4M3 weight")
        return self.matmul_acc(x, weight).to(F32)

    def matmul_acc(self, x: Tensor, weight: Tensor) -> Tensor:
        if weight.dtype == torch.float8_e4m3fn:
            raise TypeError("the exact CPU backend multiplies dequantised weights; got an E4M3 weight")
        return x.to(F64) @ weight.to(F64).t()


class FastTorchBackend(ExactTorchBackend):
    """CPU serving: the same formulas in fp32 (no float64 anywhere in the forward); products on
    fp32 weights through the CPU BLAS. Not bit-identical to the reference: bounded by the
    numerics contract (docs/runtime.md, tests/test_runtime_numerics_contract.py)."""

    name = "torch"
    deterministic = False
    acc = F32

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float, round_bf16: bool = True) -> Tensor:
        xf = x.to(F32)
        y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps) * weight
        return R.bf16(y) if round_bf16 else y

    def apply_rope_tail(self, x: Tensor, positions: Tensor, inv_freq: Tensor, inverse: bool = False) -> Tensor:
        return apply_rope_tail(x, positions, inv_freq, inverse, cos_sin=rope_cos_sin_fp32)

    def clamped_swiglu(self, gate: Tensor, up: Tensor, limit: float) -> Tensor:
        return R.bf16(F_.silu(R.bf16(gate).clamp(max=limit)) * R.bf16(up).clamp(min=-limit, max=limit))

    def route_select(self, scores: Tensor, bias: Tensor, top_k: int, renorm_eps: float,
                     bias_vl: Tensor | None, image_rows: Tensor | None) -> tuple[Tensor, Tensor]:
        row_bias = bias.expand_as(scores)
        if bias_vl is not None:
            row_bias = torch.where(image_rows.unsqueeze(-1), bias_vl.expand_as(scores), row_bias)
        experts = torch.topk(scores + row_bias, top_k, dim=-1, sorted=False).indices
        chosen = scores.gather(-1, experts)
        return experts, chosen / (chosen.sum(dim=-1, keepdim=True) + renorm_eps)

    def matmul(self, x: Tensor, weight: Tensor) -> Tensor:
        if weight.dtype == torch.float8_e4m3fn:
            raise TypeError("the CPU backend multiplies dequantised weights; got an E4M3 weight")
        return x.to(F32) @ weight.t()

    def matmul_acc(self, x: Tensor, weight: Tensor) -> Tensor:
        return self.matmul(x, weight)


class TensorCoreProducts:
    """Mixin: dense products on `self.dense` (`dense_ops.BlockedBf16Gemm`), whose input audit
    `finish` reports (raises on an inexact BF16 input) or discards after a failed forward."""

    dense: object

    def matmul(self, x: Tensor, weight: Tensor) -> Tensor:
        return self.dense.matmul(x, weight)

    def finish(self, ok: bool = True) -> None:
        if ok:
            self.dense.raise_if_inputs_inexact()
        else:
            self.dense.discard_audit()


class TritonBackend(TensorCoreProducts, ComputeBackend):
    """CUDA: `kernels.fused_elementwise` (one launch per primitive; bit-identical or rare
    one-ulp flips, bounds stated there), the fp32 Engram gate kernel, the tensor-core dense
    products of `dense` (`dense_ops.BlockedBf16Gemm`, GEMM_BOUND) and FP8 linears by `fp8_gemm`
    (module doc). torch reductions outside the primitives run in fp32 (`acc`).
    `device_types=("cpu",)` is for tests under Triton's interpreter."""

    name = "triton"
    acc = F32

    def __init__(self, dense, device_types: tuple[str, ...] = ("cuda",), fp8_gemm: str = "w8a8_f16") -> None:
        from ..kernels import engram_gate as eg
        from ..kernels import fused_elementwise as fe

        if "cpu" in device_types and not fe.INTERPRETED:
            raise ValueError("TritonBackend on CPU tensors needs Triton's interpreter (TRITON_INTERPRET=1)")
        if fp8_gemm not in FP8_GEMMS:
            raise ValueError(f"TritonBackend: fp8_gemm must be one of {FP8_GEMMS}, got {fp8_gemm!r}")
        self.fe, self.eg, self.dense, self.device_types = fe, eg, dense, tuple(device_types)
        self.fp8_gemm = fp8_gemm
        self._engram_constants: dict = {}                   # (hasher id, device) → (hasher, token map, constants)

    def _w8a8_operand(self, weight: Tensor, x: Tensor):
        """The E4M3 tiles (`dense_ops.Fp8Weight`) of `weight` when this product runs
        `kernels.fp8_w8a8` (`w8a8_f16`, `fp8_mma`, `w8a8_gemv`, `w8a8_fold`; `tiered` from BF16_GEMM_MIN_ROWS rows of `x`),
        else None (the `w8a16` kernel, or a weight the dense products hold as BF16 / fp32)."""
        from ..kernels.fp8_w8a8 import BF16_GEMM_MIN_ROWS

        rows = x.numel() // max(x.shape[-1], 1)
        if self.fp8_gemm == "w8a16" or (self.fp8_gemm == "tiered" and rows < BF16_GEMM_MIN_ROWS):
            return None
        fp8_operand = getattr(self.dense, "fp8_operand", None)      # test doubles hold no E4M3 tiles
        return None if fp8_operand is None else fp8_operand(weight)

    def linear_fp8(self, x: Tensor, weight: Tensor, act_quant: bool = True, bf16_out: bool = False,
                   x_quantised: bool = False) -> Tensor:
        w = self._w8a8_operand(weight, x)
        if w is None:
            return super().linear_fp8(x, weight, act_quant)
        return self.dense.w8a8(x, w, act_quant=act_quant, groups=1, fp8_mma=self.fp8_gemm == "fp8_mma",
                               gemv=self.fp8_gemm == "w8a8_gemv", fold=self.fp8_gemm == "w8a8_fold",
                               out_dtype=BF16 if bf16_out else F32, x_quantised=x_quantised and act_quant)

    def linear_bf16_grouped(self, x: Tensor, weight: Tensor, groups: int, bf16_out: bool = False,
                            quantise_out: bool = False) -> Tensor:
        _group_shape(x, weight, groups)
        w = self._w8a8_operand(weight, x)
        if w is None:
            return super().linear_bf16_grouped(x, weight, groups, quantise_out=quantise_out)
        return self.dense.w8a8(x, w, act_quant=False, groups=groups, gemv=self.fp8_gemm == "w8a8_gemv",
                               fold=self.fp8_gemm == "w8a8_fold", out_dtype=BF16 if bf16_out else F32,
                               quantise_out=quantise_out)

    def quantised_handoff(self, rows: int) -> bool:
        """True for the fold tier's rows (`w8a8_fold`, ≤ FOLD_CONFIG.block_m): its consumer then multiplies x
        as loaded instead of quantising it in registers (`kernels.fp8_fold` module doc)."""
        from ..kernels.fp8_w8a8 import FOLD_CONFIG

        return self.fp8_gemm == "w8a8_fold" and 0 < rows <= FOLD_CONFIG.block_m

    def engram_gate(self, residual: Tensor, keys: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float) -> Tensor:
        return self.eg.engram_gate(residual, keys, q_weight, k_weight, eps)

    def engram_residual(self, residual: Tensor, keys: Tensor, value: Tensor, q_weight: Tensor, k_weight: Tensor,
                        eps: float, image_rows: Tensor | None) -> Tensor:
        """One launch (`kernels.engram_gate.engram_residual`: the gate, then the update's torch bits for that g)."""
        return self.eg.engram_residual(residual, keys, value, q_weight, k_weight, eps, image_rows)[0]

    def bf16(self, x: Tensor) -> Tensor:
        return self.fe.round_bf16(x.to(F32))

    def fp8_act_fake_quant(self, x: Tensor) -> Tensor:
        return self.fe.fp8_act_fake_quant(_widened_in_kernel(x), 32)

    def fp4_fake_quant_e4m3_scale(self, x: Tensor) -> Tensor:
        return self.fe.fp4_fake_quant(_widened_in_kernel(x), 16, "e4m3")

    def fp4_fake_quant_ue8m0_scale(self, x: Tensor) -> Tensor:
        return self.fe.fp4_fake_quant(_widened_in_kernel(x), 32, "ue8m0")

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float, round_bf16: bool = True) -> Tensor:
        return self.fe.rms_norm(x, weight, eps, round_bf16)

    def rms_norm_pair(self, x: Tensor, split: int, first_weight: Tensor, second_weight: Tensor,
                      eps: float) -> tuple[Tensor, Tensor]:
        from ..kernels.stacked_halves import rms_norm_pair

        return rms_norm_pair(x, split, first_weight, second_weight, eps)

    def clamped_swiglu_halves(self, y: Tensor, limit: float, quantise_out: bool = False) -> Tensor:
        from ..kernels.stacked_halves import clamped_swiglu_halves

        return clamped_swiglu_halves(y, limit, quantise_out)

    def apply_rope_tail(self, x: Tensor, positions: Tensor, inv_freq: Tensor, inverse: bool = False) -> Tensor:
        return self.fe.apply_rope_tail(x, positions, inv_freq, inverse)

    def bf16_rope_tail(self, x: Tensor, positions: Tensor, inv_freq: Tensor, inverse: bool = False,
                       bf16_out: bool = False, round_input: bool = False) -> Tensor:
        """RoPE and the BF16 rounding(s) in one launch (the kernel's `round_bf16` / `round_input`: the
        same bits as `bf16(apply_rope_tail(bf16(x)))`, tests/test_kernels_fused_elementwise.py), one
        pass over x instead of two or three — at prefill x is q ([T, heads, head_dim], 1 GB in fp32 at
        8K Flash tokens); `bf16_out`: written as BF16 (BF16_OUT, module doc)."""
        return self.fe.apply_rope_tail(x, positions, inv_freq, inverse, round_bf16=True,
                                       out_dtype=BF16 if bf16_out else F32, round_input=round_input)

    def bf16_rope_tail_into(self, x: Tensor, positions: Tensor, inv_freq: Tensor, cache: Tensor, rows: Tensor) -> None:
        """One launch: the rows written at their cache rows by the RoPE kernel (its `into`), no scatter launch."""
        self.fe.apply_rope_tail(x, positions, inv_freq, round_bf16=True, out_dtype=cache.dtype, round_input=True,
                                into=(cache, rows))

    def clamped_swiglu(self, gate: Tensor, up: Tensor, limit: float) -> Tensor:
        return self.fe.clamped_swiglu(gate, up, limit)

    def compressed_entries(self, selection: Tensor, layout, ratio: int) -> Tensor:
        """One launch (`kernels.entry_index`: integer arithmetic, the torch formula's values)."""
        from ..kernels.entry_index import compressed_entry_index

        return compressed_entry_index(selection, layout.token_req, layout.req_rows, layout.req_to_token, ratio)

    def write_packed_entries(self, latent_rows: Tensor, key_rows: Tensor, source, layout, entry_idx: Tensor,
                             latents: Tensor, keys: Tensor) -> None:
        """One launch (`kernels.entry_pack`: the same bytes as the torch encoder; entry −1 writes nothing)."""
        from ..kernels.entry_pack import write_packed_entries

        write_packed_entries(latent_rows, key_rows, (source.latent.offset, source.latent.share),
                             (source.key.offset, source.key.share), source.ratio, entry_idx, latents, keys)

    def swa_window(self, layout, caches, window: int) -> tuple[Tensor, Tensor]:
        """One launch (`kernels.swa_window`: the torch path's integers)."""
        from ..kernels.swa_window import swa_window

        return swa_window(layout.positions, layout.token_req, layout.req_rows, layout.req_to_token,
                          caches.swa_slot_of, layout.out_slots, window)

    def engram_ring_rows(self, hasher, ids: Tensor, layout, ring) -> list[Tensor]:
        """Two launches (`kernels.engram_rows`: the torch path's rows and ring, integer arithmetic); the
        hash constants stacked on the ids' device once per hasher."""
        from ..kernels.engram_rows import advance_ring, engram_ring_rows
        from .engram_rows import hash_constants

        key = (id(hasher), ids.device)
        consts = self._engram_constants.get(key)
        if consts is None or consts[0] is not hasher:
            consts = self._engram_constants[key] = (hasher, hasher.token_map.to(ids.device),
                                                    *(c.to(ids.device) for c in hash_constants(hasher)))
        rows = engram_ring_rows(ids, layout.positions, layout.token_req, layout.starts, layout.prefix_lens,
                                layout.req_rows, ring.ids, *consts[1:], heads=hasher.n_heads,
                                pad_id=hasher.pad_token_id, image_id=hasher.image_token_id)
        advance_ring(ids, layout.starts, layout.extend_lens, layout.prefix_lens, layout.req_rows, layout.out_slots,
                     ring.ids, ring.end, live_only=layout.static)
        return list(rows.unbind(0))

    def pair_latents(self, a: Tensor, s: Tensor, layout, caches, source: int, norm_weight: Tensor,
                     eps: float) -> tuple[Tensor, Tensor, Tensor]:
        """One launch (`kernels.pair_state.pair_latents`: the torch path's values, exp correctly rounded)."""
        from ..kernels.pair_state import pair_latents

        return pair_latents(a, s, layout.positions, layout.token_req, layout.prefix_lens, layout.req_rows,
                            layout.out_slots, caches.pair_kv[source], caches.pair_score[source], norm_weight, eps)

    def store_pending_pairs(self, a: Tensor, s: Tensor, layout, caches, source: int) -> None:
        """One launch (`kernels.pair_state.store_pending_pairs`: the torch path's ring)."""
        from ..kernels.pair_state import store_pending_pairs

        store_pending_pairs(a, s, layout.positions, layout.out_slots, layout.starts, layout.extend_lens,
                            layout.req_rows, caches.pair_kv[source], caches.pair_score[source],
                            caches.pair_position[source])

    def route_select(self, scores: Tensor, bias: Tensor, top_k: int, renorm_eps: float,
                     bias_vl: Tensor | None, image_rows: Tensor | None) -> tuple[Tensor, Tensor]:
        return self.fe.route_select(scores, bias, top_k, renorm_eps, bias_vl, image_rows)

    def route_logits(self, logits: Tensor, bias: Tensor, top_k: int, renorm_eps: float, routed_scale: float,
                     bias_vl: Tensor | None, image_rows: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """One launch (`kernels.fused_elementwise.route_logits`: torch's CUDA fp32 softplus and sqrt bits)."""
        from .moe_ops import SOFTPLUS_THRESHOLD

        return self.fe.route_logits(logits, bias, top_k, renorm_eps, routed_scale, SOFTPLUS_THRESHOLD, bias_vl,
                                    image_rows)



def _widened_in_kernel(x: Tensor) -> Tensor:
    """x for a kernel that loads its input as fp32: BF16 (BF16_OUT) as is — widening is exact — and
    any other dtype as fp32."""
    return x if x.dtype in (F32, BF16) else x.to(F32)


BACKENDS: dict[str, type[ComputeBackend]] = {"torch": FastTorchBackend, "exact": ExactTorchBackend,
                                             "triton": TritonBackend}


def kernel_choice(env: str, choices: tuple[str, ...], default: str | None = None) -> str:
    """The value of `env` (`default`, else the first of `choices`, when unset); an unknown value raises."""
    chosen = os.environ.get(env, "").strip().lower() or default or choices[0]
    if chosen not in choices:
        raise ValueError(f"{env}={chosen!r}: expected one of {choices}")
    return chosen


def fp8_gemm_for(deterministic: bool) -> str:
    """The CUDA backend's FP8 linear arithmetic (module doc): SGLANG_DSV41_FP8_GEMM when set (an
    unknown value raises), else `w8a16` when `deterministic` (row invariant), else `w8a8_fold`."""
    return kernel_choice(FP8_GEMM_ENV, FP8_GEMMS, "w8a16" if deterministic else "w8a8_fold")


def bf16_gemm_for(deterministic: bool) -> str:
    """The CUDA backend's BF16-weight product rows (BF16_GEMMS): SGLANG_DSV41_BF16_GEMM when set, else
    `blocked` when `deterministic`, else `whole`; an unknown value, or `whole` / `triton` / `direct` with
    `deterministic`, raises."""
    chosen = kernel_choice(BF16_GEMM_ENV, BF16_GEMMS, "blocked" if deterministic else "whole")
    if chosen != "blocked" and deterministic:
        raise ValueError(f"{BF16_GEMM_ENV}={chosen} is not row invariant: not with --enable-deterministic-inference")
    return chosen


def backend_for(device: torch.device, weights: Mapping[str, object], deterministic: bool = True) -> ComputeBackend:
    """The backend of a model whose weights live on `device`: CPU → `exact` when `deterministic`,
    else `torch` (fp32); CUDA → `triton` over a dense-weight cache built now (E4M3 weights in
    place), FP8 linears by `fp8_gemm_for(deterministic)`, BF16-weight rows by
    `bf16_gemm_for(deterministic)`; any other device raises."""
    from .dense_ops import BlockedBf16Gemm, DenseWeightCache, check_weights_for_cpu

    if device.type == "cpu":
        check_weights_for_cpu(weights)
        return ExactTorchBackend() if deterministic else FastTorchBackend()
    if device.type == "cuda":
        rows = bf16_gemm_for(deterministic)
        dense = BlockedBf16Gemm(DenseWeightCache.from_weights(weights), whole_rows=rows != "blocked",
                                triton_rows=rows == "triton", unpadded=rows == "direct")
        return TritonBackend(dense,
                             fp8_gemm=fp8_gemm_for(deterministic))
    raise RuntimeError(f"sglang-dsv41: no compute backend for device '{device}' (CPU: exact torch; CUDA: Triton)")

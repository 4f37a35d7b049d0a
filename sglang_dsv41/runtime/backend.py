"""Compute backends of the runtime forward, chosen once per model by device (spec `model.md` §3, §3.8).

A backend implements the primitives every layer calls — rounding, fake quantisation, RMSNorm,
RoPE, SwiGLU, routing selection and the dense product x·wᵀ — and the linears built from them.
Layers hold one backend and never dispatch per call; `backend_for(device, weights)` picks it:

| name | device | arithmetic |
|---|---|---|
| `torch` | CPU (serving default) | fp32 torch: products, norms, softmaxes and sums in fp32, BF16 rounding points as the model; judged by tolerance against the reference (docs/runtime.md "Numerics contract") |
| `exact` | CPU (`--enable-deterministic-inference`, tests) | float64-evaluated sums rounded once: bit-identical to the reference, batch invariant |
| `triton` | CUDA | one-launch Triton kernels (`kernels.fused_elementwise`, `kernels.rope`, `kernels.swiglu`, `kernels.engram_gate`) and tensor-core products (`dense_ops.BlockedBf16Gemm`: serving rows in one GEMM, deterministic rows in 128-row blocks, `bf16_gemm_for`); FP8 dense linears by `fp8_gemm` (`runtime/triton_backend.py`) |

`acc` is the dtype the runtime's torch reductions outside the primitives use with this backend
(attention on CPU, index scores, mHC coefficients, pair pooling, routed sums, router
sqrt-softplus): float64 only on `exact`; fp32 on `torch` and `triton` (issue 21: no float64 on
the GPU path; bounded by the numerics contract, docs/runtime.md).

The CUDA backend, `TritonBackend`, and its FP8 / BF16 product choices live in `runtime/triton_backend.py`.
`backend_for` picks one backend per model; an unknown device raises.
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
#: FP8 dense-linear arithmetics of the CUDA backend (`runtime/triton_backend.py` module doc), and the variable that picks one
FP8_GEMMS = ("w8a8_f16", "tiered", "w8a16", "fp8_mma", "w8a8_gemv", "w8a8_fold")
FP8_GEMM_ENV = "SGLANG_DSV41_FP8_GEMM"
#: BF16 / fp32-weight products on CUDA (`bf16_gemm_for`): `direct` (serving default: any batch in one cuBLAS
#: GEMM on the activation as given, no padded copy; docs/performance.md "Session 35") |
#: `whole` (a batch of more than one block in one cuBLAS GEMM, smaller ones in a padded block,
#: `dense_ops.BlockedBf16Gemm.whole_rows`) | `triton` (opt-in: fewer than 129 rows on `kernels.bf16_linear`,
#: more as `whole`; no faster on the H200, "Session 24") | `blocked` (deterministic: 128-row blocks, row invariant)
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
                       bf16_out: bool = False, round_input: bool = False, may_overwrite: bool = False) -> Tensor:
        """bf16(RoPE(x)), or with `round_input` bf16(RoPE(bf16(x))). `bf16_out`: the caller also takes a
        torch.bfloat16 tensor (the same values), which a backend may return to save bytes
        (`runtime/triton_backend.py` BF16_OUT); this one keeps its dtype. `may_overwrite`: the caller
        never reads x again, so a backend may return x rotated in place (this one does not)."""
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
        """The router after its fp32 logits (§3.6): (scores = `moe_ops.sqrt_softplus` in `acc`, experts, weights —
        `route_select` —, fp32(weights · fp32(routed_scale)))."""
        from .moe_ops import sqrt_softplus

        scores = sqrt_softplus(logits, self.acc)
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


def kernel_choice(env: str, choices: tuple[str, ...], default: str | None = None) -> str:
    """The value of `env` (`default`, else the first of `choices`, when unset); an unknown value raises."""
    chosen = os.environ.get(env, "").strip().lower() or default or choices[0]
    if chosen not in choices:
        raise ValueError(f"{env}={chosen!r}: expected one of {choices}")
    return chosen


def fp8_gemm_for(deterministic: bool) -> str:
    """The CUDA backend's FP8 linear arithmetic (`runtime/triton_backend.py` module doc): SGLANG_DSV41_FP8_GEMM when set (an
    unknown value raises), else `w8a16` when `deterministic` (row invariant), else `w8a8_fold`."""
    return kernel_choice(FP8_GEMM_ENV, FP8_GEMMS, "w8a16" if deterministic else "w8a8_fold")


def bf16_gemm_for(deterministic: bool) -> str:
    """The CUDA backend's BF16-weight product rows (BF16_GEMMS): SGLANG_DSV41_BF16_GEMM when set, else
    `blocked` when `deterministic`, else `direct`; an unknown value, or `whole` / `triton` / `direct` with
    `deterministic`, raises."""
    chosen = kernel_choice(BF16_GEMM_ENV, BF16_GEMMS, "blocked" if deterministic else "direct")
    if chosen != "blocked" and deterministic:
        raise ValueError(f"{BF16_GEMM_ENV}={chosen} is not row invariant: not with --enable-deterministic-inference")
    return chosen


def backend_for(device: torch.device, weights: Mapping[str, object], deterministic: bool = True) -> ComputeBackend:
    """The backend of a model whose weights live on `device`: CPU → `exact` when `deterministic`,
    else `torch` (fp32); CUDA → `triton` over a dense-weight cache built now (E4M3 weights in
    place), FP8 linears by `fp8_gemm_for(deterministic)`, BF16-weight rows by
    `bf16_gemm_for(deterministic)`; any other device raises."""
    from .dense_ops import BlockedBf16Gemm, check_weights_for_cpu
    from .dense_weights import DenseWeightCache

    if device.type == "cpu":
        check_weights_for_cpu(weights)
        return ExactTorchBackend() if deterministic else FastTorchBackend()
    if device.type == "cuda":
        rows = bf16_gemm_for(deterministic)
        dense = BlockedBf16Gemm(DenseWeightCache.from_weights(weights), whole_rows=rows != "blocked",
                                triton_rows=rows == "triton", unpadded=rows == "direct")
        from .triton_backend import TritonBackend

        return TritonBackend(dense, fp8_gemm=fp8_gemm_for(deterministic))
    raise RuntimeError(f"sglang-dsv41: no compute backend for device '{device}' (CPU: exact torch; CUDA: Triton)")

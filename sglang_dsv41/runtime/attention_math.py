"""Per-token math of the attention sublayer on a compute backend (spec `model.md` §3.4.1–§3.4.6).

The runtime's own copy of the reference's projections, compressor latents and indexer query
(`reference/attention.py`, `compressor.py`, `indexer.py`); each is tested against its reference
namesake (tests/test_runtime_math_vs_reference.py). Values come from the mapping `w` under the
layer's `prefix`: norms and sinks as tensors, each linear as its SGLang layer under its prefix
(`w[prefix + "wq_a"]`), applied through its quantisation method (`quant_methods.apply_linear`);
`be` is the model's `ComputeBackend`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import torch
from torch import Tensor

from ..config import TextConfig
from ..numerics.profile import CacheProfile
from ..numerics.rounding import fp8_v4_roundtrip, fp8_v41_roundtrip, fp32_scalar, pair_pool
from .backend import ComputeBackend
from .quant_methods import apply_linear
from .stacked_linear import STACKED

F32 = torch.float32


def project_q_kv(be: ComputeBackend, cfg: TextConfig, w: Mapping[str, Tensor], prefix: str, x: Tensor,
                 positions: Tensor, inv_freq: Tensor, act_quant: bool, n_heads: int) -> tuple[Tensor, Tensor, Tensor]:
    """(q_lora [T, q_lora_rank], q [T, n_heads, head_dim] RoPE'd, kv [T, head_dim] fp32 pre-RoPE):
    q_lora = RMSNorm(wq_a·x), q = wq_b·q_lora (BF16), kv = RMSNorm_kv(wkv·x) not rounded (§3.4.1).
    `n_heads` = the heads this rank holds (the rows of its `wq_b`)."""
    q_lora, kv = project_q_lora_kv(be, cfg, w, prefix, x, act_quant)
    return q_lora, query_heads(be, cfg, w, prefix, q_lora, positions, inv_freq, act_quant, n_heads), kv


def project_q_lora_kv(be: ComputeBackend, cfg: TextConfig, w: Mapping[str, Tensor], prefix: str, x: Tensor,
                      act_quant: bool, x_quantised: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(q_lora, kv) of `project_q_kv`: the parts the compressor, the indexer and the SWA write need.
    With the stacked `wq_a | wkv` layer under `prefix + "wqkv_a"` (`runtime/stacked_linear.py`): one
    product (BF16 values, held as BF16 where the backend offers it) and one `rms_norm_pair`; it reads
    `x_quantised` (x's values quantised per 1×32, `ComputeBackend.quantised_handoff`) when given."""
    stacked = w.get(prefix + STACKED)
    if stacked is not None:
        if x_quantised is not None:
            y = apply_linear(stacked, x_quantised, be, act_quant=act_quant, bf16_out=True, x_quantised=True)
        else:
            y = apply_linear(stacked, x, be, act_quant=act_quant, bf16_out=True)
        return be.rms_norm_pair(y, stacked.stacked_rows[0], w[prefix + "q_norm.weight"], w[prefix + "kv_norm.weight"],
                                cfg.rms_norm_eps)
    q_lora = be.rms_norm(apply_linear(w[prefix + "wq_a"], x, be, act_quant=act_quant), w[prefix + "q_norm.weight"],
                         cfg.rms_norm_eps)
    kv = be.rms_norm(apply_linear(w[prefix + "wkv"], x, be, act_quant=act_quant), w[prefix + "kv_norm.weight"],
                     cfg.rms_norm_eps, round_bf16=False)
    return q_lora, kv


def query_heads(be: ComputeBackend, cfg: TextConfig, w: Mapping[str, Tensor], prefix: str, q_lora: Tensor,
                positions: Tensor, inv_freq: Tensor, act_quant: bool, n_heads: int) -> Tensor:
    """q of `project_q_kv`: wq_b·q_lora (BF16) with RoPE on its tail, [T, n_heads, head_dim]; read first
    by the attention itself, which reads BF16 (held as BF16 where the backend offers it: BF16_OUT in
    `runtime/triton_backend.py`)."""
    q = apply_linear(w[prefix + "wq_b"], q_lora, be, act_quant=act_quant,
                     bf16_out=True).reshape(q_lora.shape[0], n_heads, cfg.head_dim)
    return be.bf16_rope_tail(q, positions, inv_freq, bf16_out=True, may_overwrite=True)


def swa_cache_roundtrip(be: ComputeBackend, kv: Tensor, positions: Tensor, inv_freq: Tensor,
                        profile: CacheProfile, rope_dim: int) -> Tensor:
    """What attention reads back for a token's SWA kv (§3.4.1, §3.8): NONE bf16 → RoPE → BF16 (held as
    BF16 where the backend offers it: the SWA cache is BF16; BF16_OUT in `runtime/triton_backend.py`);
    FP8 (v4) rotated from fp32, nope dims E4M3 per 64; FP4 (v41) the NONE row, E4M3 per 32."""
    kv = kv.to(F32)
    if profile is CacheProfile.FP8:
        return fp8_v4_roundtrip(be.apply_rope_tail(kv, positions, inv_freq), rope_dim)
    none = profile is CacheProfile.NONE
    row = be.bf16_rope_tail(kv, positions, inv_freq, round_input=True, bf16_out=none)
    return row if none else fp8_v41_roundtrip(row)


def write_swa_roundtrip(be: ComputeBackend, swa_rows: Tensor, rows: Tensor, kv: Tensor, positions: Tensor,
                        inv_freq: Tensor, profile: CacheProfile, rope_dim: int) -> None:
    """swa_rows[rows] = `swa_cache_roundtrip`(kv) (the SWA cache write of a layer's tokens, §3.4.1, §3.8). The NONE
    profile's row is written where the backend rotates it (`ComputeBackend.bf16_rope_tail_into`: one launch on
    `triton`, no separate scatter)."""
    if profile is CacheProfile.NONE:
        be.bf16_rope_tail_into(kv.to(F32), positions, inv_freq, swa_rows, rows)
    else:
        swa_rows[rows] = swa_cache_roundtrip(be, kv, positions, inv_freq, profile, rope_dim).to(swa_rows.dtype)


def output_projection(be: ComputeBackend, cfg: TextConfig, w: Mapping[str, Tensor], prefix: str, o: Tensor,
                      positions: Tensor, inv_freq: Tensor, act_quant: bool,
                      wo_b: Callable[..., Tensor] | None = None) -> Tensor:
    """o [T, local heads, head_dim] → inverse RoPE (BF16) → per-group `wo_a` (BF16 out) of the
    groups held (its grouped method: one launch on CUDA) → `wo_b` (§3.4.6): the given
    projection of the held groups' outputs (the model's row-parallel layer, all-reduced:
    `TensorParallel.row_parallel`, called as wo_b(u, x_quantised=…)), else the layer `w[prefix + "wo_b"]`
    (whole). The BF16 values between the steps may be held as BF16 (BF16_OUT in `runtime/triton_backend.py`);
    where the backend asks (`quantised_handoff`), `wo_a` writes them quantised for `wo_b` — the values
    `wo_b` would quantise them to, so its result keeps its bits."""
    T, r = o.shape[0], cfg.o_lora_rank
    group_width = cfg.heads_per_group * cfg.head_dim
    groups = o.shape[1] * o.shape[2] // group_width
    wo_a = w[prefix + "wo_a"]
    rows = wo_a.weight.shape[0]
    if rows != groups * r:
        raise ValueError(f"{prefix}wo_a.weight has {rows} rows for {groups} groups × {r}")
    o = be.bf16_rope_tail(o, positions, inv_freq, inverse=True, bf16_out=True,
                          may_overwrite=True).reshape(T, groups * group_width)
    handoff = act_quant and be.quantised_handoff(T)                 # `wo_a` writes wo_b's quantised x
    u = apply_linear(wo_a, o, be, bf16_out=True, quantise_out=handoff)
    if wo_b is not None:
        return wo_b(u, x_quantised=handoff)
    return apply_linear(w[prefix + "wo_b"], u, be, act_quant=act_quant, bf16_out=True, x_quantised=handoff)


def ratio1_latents(be: ComputeBackend, cfg: TextConfig, w: Mapping[str, Tensor], prefix: str, x: Tensor) -> Tensor:
    """[T, head_dim] BF16-valued pre-RoPE latents, one per token (§3.4.3, ratio 1)."""
    return be.rms_norm(apply_linear(w[prefix + "compressor.wkv"], x, be), w[prefix + "compressor.norm.weight"],
                       cfg.rms_norm_eps)


def pair_scores(be: ComputeBackend, w: Mapping[str, Tensor], prefix: str, x: Tensor) -> tuple[Tensor, Tensor]:
    """(a, s): the fp32 `wkv` and `wgate` outputs a ratio-2 pair is pooled from (§3.4.3)."""
    return (apply_linear(w[prefix + "compressor.wkv"], x, be, out_fp32=True),
            apply_linear(w[prefix + "compressor.wgate"], x, be, out_fp32=True))


def pair_latents(be: ComputeBackend, a_first: Tensor, s_first: Tensor, a_second: Tensor, s_second: Tensor,
                 norm_weight: Tensor, eps: float) -> Tensor:
    """Pre-RoPE latents of ratio-2 pairs: σ = per-dimension softmax over the pair, pooled =
    a₁σ₁ + a₂σ₂ in upstream's fp32 steps (`numerics.rounding.pair_pool`; exp in `be.acc`:
    correctly rounded on `exact`, fp32 elsewhere — elementwise, batch invariant),
    latent = RMSNorm(bf16(pooled)) with `compressor.norm.weight` (§3.4.3)."""
    pooled = pair_pool(torch.stack((a_first, a_second), dim=1), torch.stack((s_first, s_second), dim=1),
                       be.acc)
    return be.rms_norm(be.bf16(pooled), norm_weight, eps)


def rope_entry_values(be: ComputeBackend, cfg: TextConfig, w: Mapping[str, Tensor], prefix: str, latents: Tensor,
                      rope_positions: Tensor, inv_freq: Tensor) -> tuple[Tensor, Tensor]:
    """(bf16(RoPE(latent)), bf16(RoPE(RMSNorm_k(indexer.wk·latent)))): the values right before
    the FP4 round trips of a compressed entry (§3.4.3)."""
    roped = be.bf16_rope_tail(latents, rope_positions, inv_freq)
    k = be.rms_norm(apply_linear(w[prefix + "indexer.wk"], latents, be), w[prefix + "indexer.k_norm.weight"],
                    cfg.rms_norm_eps)
    return roped, be.bf16_rope_tail(k, rope_positions, inv_freq)


@dataclass
class IndexQuery:
    """Per-token indexer query: FP4 (UE8M0) heads [T, heads, d] and head weights [T, heads]."""

    q: Tensor
    head_weights: Tensor


def index_query(be: ComputeBackend, cfg: TextConfig, w: Mapping[str, Tensor], prefix: str, x: Tensor,
                q_lora: Tensor, positions: Tensor, inv_freq: Tensor, act_quant: bool) -> IndexQuery:
    """q = FP4_UE8M0(bf16(RoPE(indexer.wq_b·q_lora))), weights = bf16(bf16(weights_proj·x)·
    fp32(d^−1/2·heads^−1/2)) (§3.4.4)."""
    T = x.shape[0]
    q = apply_linear(w[prefix + "indexer.wq_b"], q_lora, be, act_quant=act_quant, bf16_out=True)
    q = be.fp4_fake_quant_ue8m0_scale(be.bf16_rope_tail(q.reshape(T, cfg.index_n_heads, cfg.index_head_dim),
                                                        positions, inv_freq))
    scale = fp32_scalar(cfg.index_head_dim ** -0.5 * cfg.index_n_heads ** -0.5)
    head_weights = be.bf16(apply_linear(w[prefix + "indexer.weights_proj"], x, be) * scale)
    return IndexQuery(q=q, head_weights=head_weights)

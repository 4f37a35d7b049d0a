"""The attention sublayer of DeepSeek-V4.1 (spec `model.md` §3.4, §3.5, §3.8; roles §1.3).

One call = one layer on one chunk of one request:

1. projections (§3.4.1): q_lora = RMSNorm_q_norm(wq_a·x) (BF16); q = wq_b·q_lora viewed
   [T, heads, head_dim], RoPE'd on the last qk_rope_head_dim dims (BF16, no per-head norm);
   kv = RMSNorm_kv_norm(wkv·x) kept fp32, then rotated and stored as the profile's cache layout
   does (`ops.swa_cache_roundtrip`: BF16 before and after RoPE, except the v4 layout, which
   rotates and quantises from fp32; §3.8) — attention reads back this value, for the current
   token too;
2. RoPE per layer (§3.4.2): ratio 0 → `rope_theta`, no YaRN; ratio 1/2 → `compress_rope_theta`
   + YaRN for every RoPE of the layer (q, kv, compressed kv, indexer q/k);
3. kv sources write compressed latents + index keys (`compressor.py`); indexer layers select
   compressed positions (`indexer.py`); other compressed layers reuse the latest same-ratio
   indexer's selection of this forward (`ChunkScratch`);
4. attention (§3.4.5): keys = SWA kv at positions max(0, p−W+1)..p (W = `sliding_window`) ∪
   the selected compressed latents of the source; one softmax over the union plus a per-head
   sink logit; scale head_dim^−1/2; K = V; output rounded to BF16;
5. output (§3.4.6): inverse RoPE at the query position (BF16) → per-group wo_a (BF16 GEMM,
   BF16 out) → flatten group-major → wo_b (FP8 linear).

Invariant: processing a prompt in chunks of any sizes (including one token at a time, and
ratio-2 pairs straddling chunks) gives the same outputs and caches as one shot. The state keeps
every past entry (no eviction); the window is applied at read time.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import torch
from torch import Tensor

from ..config import LayerRole, TextConfig
from ..numerics.geometry import swa_key_positions
from ..numerics.rope import layer_inv_freq
from . import ops
from .compressor import PendingPairToken, compress_chunk
from .indexer import run_indexer


# ---- state ----------------------------------------------------------------------------------

@dataclass
class AttentionState:
    """One request's attention caches for every layer (grows chunk by chunk).

    * `length`: tokens fully processed (all layers ran and `advance` was called);
    * `swa_kv[layer]`: [length, head_dim] read-back SWA kv (profile applied) of every layer;
    * `compressed_kv[src]`, `index_keys[src]`: [⌊length/ratio⌋, ·] per kv-source layer;
    * `pending[src]`: first token of an incomplete ratio-2 pair (None when complete / ratio 1).
    During a forward each layer appends its chunk, so its caches are `length + T` long until
    `advance(T)` commits the chunk.
    """

    length: int
    profile: ops.CacheProfile
    swa_kv: dict[int, Tensor]
    compressed_kv: dict[int, Tensor]
    index_keys: dict[int, Tensor]
    pending: dict[int, PendingPairToken | None]

    @classmethod
    def empty(cls, cfg: TextConfig, profile: ops.CacheProfile,
              device: torch.device | str = "cpu") -> "AttentionState":
        f32 = torch.float32
        return cls(
            length=0,
            profile=ops.CacheProfile(profile),
            swa_kv={i: torch.empty(0, cfg.head_dim, dtype=f32, device=device) for i in range(cfg.num_hidden_layers)},
            compressed_kv={i: torch.empty(0, cfg.head_dim, dtype=f32, device=device) for i in cfg.kv_source_layer_ids},
            index_keys={i: torch.empty(0, cfg.index_head_dim, dtype=f32, device=device) for i in cfg.kv_source_layer_ids},
            pending={i: None for i in cfg.kv_source_layer_ids},
        )

    def clone(self) -> "AttentionState":
        """Deep copy (e.g. to fork a request from a cached prefix)."""
        return AttentionState(
            length=self.length,
            profile=self.profile,
            swa_kv={k: v.clone() for k, v in self.swa_kv.items()},
            compressed_kv={k: v.clone() for k, v in self.compressed_kv.items()},
            index_keys={k: v.clone() for k, v in self.index_keys.items()},
            pending={k: (None if v is None else v.clone()) for k, v in self.pending.items()},
        )

    def advance(self, n_tokens: int) -> None:
        """Commit a chunk of `n_tokens` once every layer has processed it."""
        target = self.length + n_tokens
        behind = [i for i, kv in self.swa_kv.items() if kv.shape[0] != target]
        if behind:
            raise ValueError(f"AttentionState.advance({n_tokens}): layers {behind} do not hold {target} "
                             "tokens (each layer must process the chunk exactly once before advance)")
        self.length = target


@dataclass
class Selection:
    """Compressed positions chosen by an indexer for this chunk's queries."""

    indices: Tensor   # [T, index_topk] positions in `kv_source`'s compressed cache, ascending, −1 padded
    kv_source: int


@dataclass
class ChunkScratch:
    """Per-forward (one chunk) results reused by later layers of the same forward.

    * `selections[layer]`: the selection of each indexer layer that ran in this forward
      (non-indexer compressed layers read `selections[role.selection_from]` — the latest
      same-ratio indexer, spec §1.3);
    * `candidate_blocks[layer]`: blocks published by the candidate source for this chunk's queries.
    """

    selections: dict[int, Selection] = field(default_factory=dict)
    candidate_blocks: dict[int, Tensor] = field(default_factory=dict)


# ---- reusable pieces (also for the DSpark draft's SWA-only stages) ---------------------------

def _w(w: Mapping[str, Tensor], key: str) -> Tensor:
    if key not in w:
        raise KeyError(f"attention weights: missing '{key}'")
    return w[key]


def rms_norm_fp32(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """fp32(x)·rsqrt(mean(x²)+ε)·fp32(w) **without** the BF16 output rounding (the kv path
    normalises, rotates and quantises in registers, spec §3.4.1)."""
    xd = x.to(torch.float64)  # float64, rounded once: device-invariant (ops convention)
    return (xd * torch.rsqrt(xd.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.to(torch.float64)).to(torch.float32)


def project_q(cfg: TextConfig, w: Mapping[str, Tensor], prefix: str, x: Tensor, positions: Tensor,
              inv_freq: Tensor, act_quant: bool) -> tuple[Tensor, Tensor]:
    """(q_lora [T, q_lora_rank] BF16-valued, q [T, heads, head_dim] BF16-valued, RoPE'd)."""
    q_lora = ops.rms_norm(ops.linear_fp8(x, _w(w, prefix + "wq_a.weight"), act_quant),
                          _w(w, prefix + "q_norm.weight"), cfg.rms_norm_eps)
    q = ops.linear_fp8(q_lora, _w(w, prefix + "wq_b.weight"), act_quant)
    q = q.reshape(x.shape[0], cfg.num_attention_heads, cfg.head_dim)
    return q_lora, ops.bf16_rope_tail(q, positions, inv_freq)


def project_kv(cfg: TextConfig, w: Mapping[str, Tensor], prefix: str, x: Tensor, positions: Tensor,
               inv_freq: Tensor, act_quant: bool) -> Tensor:
    """kv [T, head_dim] fp32 = RMSNorm_kv_norm(wkv·x), **not rotated** and not rounded: the
    rotation and its roundings belong to the cache store (`ops.swa_cache_roundtrip(kv, positions,
    inv_freq, profile, rope_dim)`), which rounds differently per layout. (`positions`, `inv_freq`
    are unused here; kept so the projection helpers share one signature.)"""
    return rms_norm_fp32(ops.linear_fp8(x, _w(w, prefix + "wkv.weight"), act_quant),
                         _w(w, prefix + "kv_norm.weight"), cfg.rms_norm_eps)


def project_q_kv(cfg: TextConfig, w: Mapping[str, Tensor], prefix: str, x: Tensor, positions: Tensor,
                 inv_freq: Tensor, act_quant: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(q_lora, q, kv) of §3.4.1; `prefix` is e.g. "layers.3.attn." or "mtp.0.attn."."""
    q_lora, q = project_q(cfg, w, prefix, x, positions, inv_freq, act_quant)
    return q_lora, q, project_kv(cfg, w, prefix, x, positions, inv_freq, act_quant)


def attend_with_sink(q: Tensor, keys: Tensor, sink: Tensor, valid: Tensor | None = None) -> Tensor:
    """Softmax attention with a per-head sink logit in the denominator (spec §3.4.5).

    q [T, heads, D]; keys [T, S, D] = each query's own key set (K = V); valid [T, S] bool
    (None = all valid); sink [heads] (raw logit; −∞ = plain softmax). Scale D^−1/2:
    o_h = Σ_j e^{s_j} k_j / (Σ_j e^{s_j} + e^{sink_h}), evaluated in float64 (the exact value,
    independent of evaluation order and batch size; kernels use fp32 and are compared with a
    tolerance) and rounded once to BF16. Returns [T, heads, D] BF16-valued fp32.
    """
    T, S, D = keys.shape
    if valid is None:
        valid = torch.ones(T, S, dtype=torch.bool, device=keys.device)
    f64 = torch.float64
    qf, kf = q.to(f64), keys.to(f64)
    logits = torch.einsum("thd,tsd->ths", qf, kf) * ops.softmax_scale(D)
    logits = torch.where(valid[:, None, :], logits, -torch.inf)
    sink_logit = sink.to(f64)[None, :].expand(T, -1)  # [T, heads]
    m = torch.maximum(logits.amax(dim=2), sink_logit)  # [T, heads]
    if not bool(torch.isfinite(m).all()):
        raise ValueError("attend_with_sink: a query has no valid key and a −∞ sink (empty softmax)")
    p = torch.exp(logits - m[:, :, None])
    denom = p.sum(dim=2) + torch.exp(sink_logit - m)
    o = torch.einsum("ths,tsd->thd", p, kf) / denom[:, :, None]
    return ops.bf16(o)


def output_projection(cfg: TextConfig, w: Mapping[str, Tensor], prefix: str, o: Tensor, positions: Tensor,
                      inv_freq: Tensor, act_quant: bool) -> Tensor:
    """o [T, heads, head_dim] → inverse RoPE (query position, BF16) → per-group wo_a (BF16 GEMM,
    rows [g·o_lora, (g+1)·o_lora)) → flatten group-major → wo_b (FP8). Returns [T, hidden]."""
    T = o.shape[0]
    G, r = cfg.o_groups, cfg.o_lora_rank
    o = ops.bf16_rope_tail(o, positions, inv_freq, inverse=True)
    o_groups = o.reshape(T, G, cfg.heads_per_group * cfg.head_dim)
    wo_a = _w(w, prefix + "wo_a.weight")
    u = torch.cat([ops.linear_bf16(o_groups[:, g], wo_a[g * r:(g + 1) * r]) for g in range(G)], dim=1)
    return ops.linear_fp8(u, _w(w, prefix + "wo_b.weight"), act_quant)


def _gather(cache: Tensor, idx: Tensor) -> tuple[Tensor, Tensor]:
    """cache rows at idx ([T, S], −1 = none) → (keys [T, S, D] zero where absent, valid [T, S])."""
    valid = idx >= 0
    keys = cache[idx.clamp(min=0)] if cache.shape[0] else cache.new_zeros(*idx.shape, cache.shape[1])
    return torch.where(valid[:, :, None], keys, 0.0), valid


# ---- the sublayer ---------------------------------------------------------------------------

def _check_positions(positions: Tensor, x: Tensor, state: AttentionState) -> None:
    T = positions.shape[0]
    if positions.device != x.device or x.shape[0] != T:
        raise ValueError(f"attention: positions ({T} on {positions.device}) must match x "
                         f"({x.shape[0]} rows on {x.device})")
    want = torch.arange(state.length, state.length + T, device=positions.device)
    if T == 0 or not torch.equal(positions.to(torch.int64), want):
        raise ValueError(f"attention: positions must be state.length + arange(T) = {state.length}..."
                         f"{state.length + T - 1}, got {positions.tolist()[:4]}... (T={T})")


def _append(store: dict[int, Tensor], key: int, rows: Tensor, expected_before: int, what: str) -> None:
    have = store[key].shape[0]
    if have != expected_before:
        raise ValueError(f"attention: {what} of layer {key} holds {have} entries, expected {expected_before} "
                         "(layer already processed this chunk, or the state missed a chunk)")
    store[key] = torch.cat((store[key], rows.to(store[key])))


def _update_compressed(cfg: TextConfig, role: LayerRole, w: Mapping[str, Tensor], prefix: str, x: Tensor,
                       positions: Tensor, state: AttentionState, inv_freq: Tensor) -> None:
    src = role.layer
    entries, pending = compress_chunk(cfg, w, prefix, role.ratio, x, positions, state.pending[src],
                                      inv_freq, state.profile)
    before = state.length // role.ratio
    _append(state.compressed_kv, src, entries.latents, before, "compressed kv")
    _append(state.index_keys, src, entries.index_keys, before, "index keys")
    state.pending[src] = pending


def _selection(cfg: TextConfig, role: LayerRole, w: Mapping[str, Tensor], prefix: str, x: Tensor,
               q_lora: Tensor, positions: Tensor, state: AttentionState, scratch: ChunkScratch,
               inv_freq: Tensor, act_quant: bool) -> Selection:
    src = role.kv_source
    assert src is not None
    if role.runs_indexer:
        blocks = None
        if role.candidate_consumer:
            cand = cfg.candidate_source_layer_id
            if src != cand:
                raise ValueError(f"layer {role.layer}: candidate consumer reads kv source {src} but the "
                                 f"candidate blocks index layer {cand}'s cache")
            if cand not in scratch.candidate_blocks:
                raise ValueError(f"layer {role.layer}: candidate source {cand} has not run in this forward")
            blocks = scratch.candidate_blocks[cand]
        result = run_indexer(cfg, role, w, prefix, x, q_lora, positions, state.index_keys[src], inv_freq,
                             act_quant, blocks)
        if result.blocks is not None:
            scratch.candidate_blocks[role.layer] = result.blocks
        sel = Selection(result.selection, src)
        scratch.selections[role.layer] = sel
        return sel
    from_layer = role.selection_from
    if from_layer is None or from_layer not in scratch.selections:
        raise ValueError(f"layer {role.layer}: no selection of indexer layer {from_layer} in this forward")
    sel = scratch.selections[from_layer]
    if sel.kv_source != src or sel.indices.shape[0] != x.shape[0]:
        raise ValueError(f"layer {role.layer}: selection of layer {from_layer} indexes kv source "
                         f"{sel.kv_source} for {sel.indices.shape[0]} queries; this layer reads {src} "
                         f"for {x.shape[0]}")
    return sel


def attention_sublayer(cfg: TextConfig, role: LayerRole, w: Mapping[str, Tensor], layer: int, x: Tensor,
                       positions: Tensor, state: AttentionState, scratch: ChunkScratch,
                       profile: ops.CacheProfile, act_quant: bool) -> Tensor:
    """One attention sublayer on one chunk (spec §3.4). x [T, hidden] (after the hc combine and
    attn_norm), positions [T] = state.length + arange(T). Appends this chunk's caches to
    `state`, records indexer results in `scratch`, returns [T, hidden] BF16-valued (after wo_b)."""
    if role.layer != layer:
        raise ValueError(f"attention_sublayer: role is for layer {role.layer}, called for layer {layer}")
    if ops.CacheProfile(profile) is not state.profile:
        raise ValueError(f"attention_sublayer: profile {profile} differs from the state's {state.profile}")
    _check_positions(positions, x, state)
    prefix = f"layers.{layer}.attn."
    inv_freq = layer_inv_freq(cfg, role.ratio).to(x.device)

    q_lora, q, kv = project_q_kv(cfg, w, prefix, x, positions, inv_freq, act_quant)
    _append(state.swa_kv, layer,
            ops.swa_cache_roundtrip(kv, positions, inv_freq, state.profile, cfg.qk_rope_head_dim),
            state.length, "SWA kv")
    keys, valid = _gather(state.swa_kv[layer], swa_key_positions(positions, cfg.sliding_window))

    if role.ratio > 0:
        if role.computes_latents:
            _update_compressed(cfg, role, w, prefix, x, positions, state, inv_freq)
        sel = _selection(cfg, role, w, prefix, x, q_lora, positions, state, scratch, inv_freq, act_quant)
        c_keys, c_valid = _gather(state.compressed_kv[sel.kv_source], sel.indices)
        keys, valid = torch.cat((keys, c_keys), dim=1), torch.cat((valid, c_valid), dim=1)

    o = attend_with_sink(q, keys, _w(w, prefix + "attn_sink"), valid)
    return output_projection(cfg, w, prefix, o, positions, inv_freq, act_quant)

"""The attention sublayer over a packed SGLang batch, caches in slot buffers (spec §3.4, §3.5).

The math is the reference's (`sglang_dsv41.reference.attention` / `compressor` / `indexer` /
`ops`), called on tensors; only the cache storage and addressing differ. Attention and the
indexer selection run through `attention_ops` (CPU: the reference's float64 math; CUDA: the
Triton kernels), so this sublayer reads the same on both devices:

1. `project_q_kv` for every token of the batch at once (per-token math), the SWA read-back
   (`ops.swa_cache_roundtrip`) written to SGLang's pool row of the token's slot;
2. kv sources: ratio 1 → `ratio1_latents` for the whole batch; ratio 2 → every even-position
   token's fp32 `wkv` / `wgate` outputs go to the pair-state rows of its slot, and every
   odd-position token p completes the pair (p−1, p) with its first token's state read from the
   slot of p−1 (written just now, or by an earlier chunk / a prefix-cache owner); stored latents
   and index keys (`stored_latents`, `index_keys`) go to the slot of the completing token (ratio
   2: the odd token 2g+1; ratio 1: the token itself). Whole batch, no per-request loop;
3. indexer layers: `attention_ops.select` (keys = the source's index keys of compressed positions
   0..⌊seq_len/ratio⌋−1, read from their slots — exactly the keys the reference state holds
   after the source ran on this chunk); other compressed layers reuse the latest same-ratio
   indexer's selection of this forward (`ForwardScratch`, spec §1.3);
4. slots per query = its SWA window (positions p−W+1..p, oldest first) then its selected
   compressed entries (−1 = none); `attention_ops.attend`; `output_projection`.

Batch independence: every query's keys come only from its own request's slots.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import torch
from torch import Tensor

from ..config import LayerRole, TextConfig
from ..reference import ops
from ..reference.attention import layer_inv_freq, swa_key_positions
from ..reference.compressor import index_keys, linear_fp32_out, ratio1_latents, stored_latents
from . import attention_ops
from .batch import BatchLayout
from .cache import RuntimeCaches, entry_positions
from .tensor_parallel import SINGLE, TensorParallel

__all__ = ["ForwardScratch", "attention_sublayer", "entry_positions"]


@dataclass
class ForwardScratch:
    """Indexer results of this forward, reused by later layers (spec §1.3).

    `selections[layer]`: [N, index_topk] compressed positions (request-local, −1 padded) for every
    token of the batch; `blocks[layer]`: [N, candidate_topk_blocks] candidate blocks the candidate
    source published for every token's query (−1 padded).
    """

    selections: dict[int, Tensor] = field(default_factory=dict)
    blocks: dict[int, Tensor] = field(default_factory=dict)


def _pair_latents(cfg: TextConfig, w: Mapping[str, Tensor], prefix: str, a_first: Tensor, s_first: Tensor,
                  a_second: Tensor, s_second: Tensor) -> Tensor:
    """Pre-RoPE latents of ratio-2 pairs from their tokens' fp32 `wkv` (a) and `wgate` (s)
    outputs: σ = per-dimension softmax over the pair (float64), pooled = a₁σ₁ + a₂σ₂ rounded once
    to fp32, latent = RMSNorm_norm(bf16(pooled)) — `reference.compressor.ratio2_latents`' pooling,
    row by row (spec §3.4.3)."""
    sigma = torch.softmax(torch.stack((s_first, s_second), dim=1).to(torch.float64), dim=1)
    a = torch.stack((a_first, a_second), dim=1).to(torch.float64)
    pooled = (a[:, 0] * sigma[:, 0] + a[:, 1] * sigma[:, 1]).to(torch.float32)
    return ops.rms_norm(ops.bf16(pooled), w[prefix + "compressor.norm.weight"], cfg.rms_norm_eps)


def _write_compressed(cfg: TextConfig, role: LayerRole, w: Mapping[str, Tensor], prefix: str, x: Tensor,
                      layout: BatchLayout, caches: RuntimeCaches, inv_freq: Tensor) -> None:
    """Compressed latents + index keys of a kv-source layer for the whole batch (spec §3.4.3).

    Ratio 2 without data-dependent shapes: every token computes a candidate entry (odd p: the
    pair (p−1, p)); rows are written through `torch.where`, so an even token's slot keeps its
    latent / index-key rows and an odd token's slot keeps its pair-state rows."""
    src, ratio, pos, out = role.layer, role.ratio, layout.positions, layout.out_slots
    if ratio == 1:
        latents = ratio1_latents(cfg, w, prefix, x)
        caches.write_compressed(src, out, stored_latents(cfg, latents, pos, inv_freq, caches.profile),
                                index_keys(cfg, w, prefix, latents, pos, inv_freq))
        return
    if ratio != 2:
        raise ValueError(f"layer {src}: compress ratio {ratio} is not a V4.1 ratio (1 or 2)")
    a = linear_fp32_out(x, w[prefix + "compressor.wkv.weight"])
    s = linear_fp32_out(x, w[prefix + "compressor.wgate.weight"])
    even = ((pos % 2) == 0)[:, None]
    caches.write_pair_state(src, out, torch.where(even, a, caches.pair_kv[src][out]),
                            torch.where(even, s, caches.pair_score[src][out]))
    first_pos = (pos - 1).clamp(min=0)                   # odd p: the pair's first token p − 1
    first = layout.slots_at(layout.token_req, first_pos)
    latents = _pair_latents(cfg, w, prefix, caches.pair_kv[src][first], caches.pair_score[src][first], a, s)
    stored = stored_latents(cfg, latents, first_pos, inv_freq, caches.profile)
    keys = index_keys(cfg, w, prefix, latents, first_pos, inv_freq)
    caches.write_compressed(src, out,
                            torch.where(even, caches.latents[src][out].to(torch.float32), stored),
                            torch.where(even, caches.index_keys[src][out].to(torch.float32), keys))


def _selection(cfg: TextConfig, role: LayerRole, w: Mapping[str, Tensor], prefix: str, x: Tensor,
               q_lora: Tensor, layout: BatchLayout, caches: RuntimeCaches, scratch: ForwardScratch,
               inv_freq: Tensor, act_quant: bool) -> Tensor:
    """[N, index_topk] selected compressed positions of this layer's queries (spec §3.4.4)."""
    if not role.runs_indexer:
        from_layer = role.selection_from
        if from_layer not in scratch.selections:
            raise RuntimeError(f"layer {role.layer}: indexer layer {from_layer} did not run in this forward")
        return scratch.selections[from_layer]
    published = None
    if role.candidate_consumer:
        cand = cfg.candidate_source_layer_id
        if cand not in scratch.blocks:
            raise RuntimeError(f"layer {role.layer}: candidate source {cand} did not run in this forward")
        published = scratch.blocks[cand]
    selection, blocks = attention_ops.select(cfg, role, w, prefix, x, q_lora, layout, caches, inv_freq,
                                             act_quant, published)
    scratch.selections[role.layer] = selection
    if role.candidate_source:
        assert blocks is not None
        scratch.blocks[role.layer] = blocks
    return selection


def _request_slots(layout: BatchLayout, positions: Tensor) -> Tensor:
    """Slots of each query's own request at `positions` [N, n] (−1 = none → −1)."""
    valid = positions >= 0
    slots = layout.slots_at(layout.token_req[:, None].expand_as(positions), positions.clamp(min=0))
    return torch.where(valid, slots, -1)


def attention_sublayer(cfg: TextConfig, role: LayerRole, w: Mapping[str, Tensor], x: Tensor,
                       layout: BatchLayout, caches: RuntimeCaches, scratch: ForwardScratch,
                       act_quant: bool, tp: TensorParallel = SINGLE) -> Tensor:
    """One attention sublayer on the whole batch; x [N, hidden] → [N, hidden] (BF16 values).
    Under tensor parallelism (`runtime/tensor_parallel.py`) q, attention and the grouped `wo_a`
    run for this rank's heads only; everything else (caches, compressor, indexer) is replicated."""
    layer = role.layer
    prefix = f"layers.{layer}.attn."
    pos = layout.positions
    inv_freq = layer_inv_freq(cfg, role.ratio).to(x.device)

    q_lora, q, kv = tp.project_q_kv(cfg, w, prefix, x, pos, inv_freq, act_quant)
    caches.write_swa(layer, layout.out_slots, ops.swa_cache_roundtrip(kv, caches.profile, cfg.qk_rope_head_dim))
    swa_slots = _request_slots(layout, swa_key_positions(pos, cfg.sliding_window))      # [N, W]

    comp_cache = comp_slots = None
    if role.ratio > 0:
        if role.computes_latents:
            _write_compressed(cfg, role, w, prefix, x, layout, caches, inv_freq)
        selection = _selection(cfg, role, w, prefix, x, q_lora, layout, caches, scratch, inv_freq, act_quant)
        comp_positions = torch.where(selection >= 0, entry_positions(selection, role.ratio), -1)
        comp_slots = _request_slots(layout, comp_positions)                              # [N, index_topk]
        comp_cache = caches.latents[role.kv_source]

    o = attention_ops.attend(q, w[prefix + "attn_sink"], caches.swa[layer], swa_slots, comp_cache, comp_slots)
    return tp.output_projection(cfg, w, prefix, o, pos, inv_freq, act_quant)

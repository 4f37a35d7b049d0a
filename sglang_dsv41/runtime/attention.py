"""The attention sublayer over a packed SGLang batch, caches in slot buffers (spec §3.4, §3.5).

The math is the reference's (`sglang_dsv41.reference.attention` / `compressor` / `indexer` /
`ops`), called on tensors; only the cache storage and addressing differ:

1. `project_q_kv` for every token of the batch at once (per-token math), the SWA read-back
   (`ops.swa_cache_roundtrip`) written to SGLang's pool row of the token's slot;
2. kv sources: ratio 1 → `ratio1_latents` for the whole batch; ratio 2 → `ratio2_latents` per
   request, with the pending even token of a pair read from the pair-state rows of its slot
   (written for every even-position token, so any later chunk or prefix hit can complete it);
   stored latents / index keys (`stored_latents`, `index_keys`) go to the slot of the token that
   completes the entry (ratio 2: the odd token 2g+1; ratio 1: the token itself);
3. indexer layers: per request, `run_indexer` against the source's index keys of compressed
   positions 0..⌊seq_len/ratio⌋−1 gathered from their slots (exactly the keys the reference state
   holds after the source ran on this chunk); other compressed layers reuse the latest same-ratio
   indexer's selection of this forward (`ForwardScratch`, spec §1.3);
4. keys per query = its SWA window (positions p−W+1..p, oldest first) then its selected compressed
   entries, gathered from slots; `attend_with_sink`; `output_projection`.

Batch independence: every query's keys come only from its own request's slots.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import torch
from torch import Tensor

from ..config import LayerRole, TextConfig
from ..reference import ops
from ..reference.attention import (attend_with_sink, layer_inv_freq, output_projection, project_q_kv,
                                   swa_key_positions)
from ..reference.compressor import (PendingPairToken, index_keys, linear_fp32_out, ratio1_latents,
                                    ratio2_latents, stored_latents)
from ..reference.indexer import run_indexer
from .batch import BatchLayout
from .cache import RuntimeCaches


@dataclass
class ForwardScratch:
    """Indexer results of this forward, reused by later layers (spec §1.3).

    `selections[layer]`: [N, index_topk] compressed positions (request-local, −1 padded) for every
    token of the batch; `blocks[layer][b]`: candidate blocks published for request b's queries.
    """

    selections: dict[int, Tensor] = field(default_factory=dict)
    blocks: dict[int, list[Tensor]] = field(default_factory=dict)


def entry_positions(compressed: Tensor, ratio: int) -> Tensor:
    """Absolute position of the token whose slot holds compressed entry j: j·ratio + ratio − 1."""
    return compressed * ratio + (ratio - 1)


def _write_compressed(cfg: TextConfig, role: LayerRole, w: Mapping[str, Tensor], prefix: str, x: Tensor,
                      layout: BatchLayout, caches: RuntimeCaches, inv_freq: Tensor) -> None:
    """Compressed latents + index keys of a kv-source layer for the whole batch (spec §3.4.3)."""
    src, ratio, pos = role.layer, role.ratio, layout.positions
    if ratio == 1:
        latents = ratio1_latents(cfg, w, prefix, x)
        caches.write_compressed(src, layout.out_slots,
                                stored_latents(cfg, latents, pos, inv_freq, caches.profile),
                                index_keys(cfg, w, prefix, latents, pos, inv_freq))
        return
    if ratio != 2:
        raise ValueError(f"layer {src}: compress ratio {ratio} is not a V4.1 ratio (1 or 2)")
    even = (pos % 2) == 0
    if bool(even.any()):  # pair state of every even-position token (spec §3.4.3 pooling inputs)
        xe = x[even]
        caches.write_pair_state(src, layout.out_slots[even],
                                linear_fp32_out(xe, w[prefix + "compressor.wkv.weight"]),
                                linear_fp32_out(xe, w[prefix + "compressor.wgate.weight"]))
    all_latents, all_pos, all_req = [], [], []
    for b in range(layout.num_requests):
        rows = layout.token_range(b)
        pos_b = pos[rows]
        pending = None
        first = int(pos_b[0])
        if first % 2:
            slot = layout.request_slots(b, pos_b[:1] - 1)
            pending = PendingPairToken(first - 1, caches.pair_kv[src][slot[0]], caches.pair_score[src][slot[0]])
        latents, rope_pos, _ = ratio2_latents(cfg, w, prefix, x[rows], pos_b, pending)
        if latents.shape[0]:
            all_latents.append(latents)
            all_pos.append(rope_pos)
            all_req.append(torch.full_like(rope_pos, b))
    if not all_latents:
        return
    latents, rope_pos, req = torch.cat(all_latents), torch.cat(all_pos), torch.cat(all_req)
    slots = layout.slots_at(req, rope_pos + 1)            # the pair's odd token completes it
    caches.write_compressed(src, slots, stored_latents(cfg, latents, rope_pos, inv_freq, caches.profile),
                            index_keys(cfg, w, prefix, latents, rope_pos, inv_freq))


def _select(cfg: TextConfig, role: LayerRole, w: Mapping[str, Tensor], prefix: str, x: Tensor,
            q_lora: Tensor, layout: BatchLayout, caches: RuntimeCaches, scratch: ForwardScratch,
            inv_freq: Tensor, act_quant: bool) -> Tensor:
    """[N, index_topk] selected compressed positions of this layer's queries (spec §3.4.4)."""
    src, ratio = role.kv_source, role.ratio
    assert src is not None
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
    selections, blocks = [], []
    for b in range(layout.num_requests):
        rows = layout.token_range(b)
        n_entries = int(layout.seq_lens[b]) // ratio
        entry_slots = layout.request_slots(b, entry_positions(torch.arange(n_entries, device=x.device), ratio))
        keys = caches.index_keys[src][entry_slots].to(torch.float32)
        result = run_indexer(cfg, role, w, prefix, x[rows], q_lora[rows], layout.positions[rows], keys,
                             inv_freq, act_quant, None if published is None else published[b])
        selections.append(result.selection)
        blocks.append(result.blocks)
    selection = torch.cat(selections)
    scratch.selections[role.layer] = selection
    if role.candidate_source:
        scratch.blocks[role.layer] = blocks
    return selection


def attention_sublayer(cfg: TextConfig, role: LayerRole, w: Mapping[str, Tensor], x: Tensor,
                       layout: BatchLayout, caches: RuntimeCaches, scratch: ForwardScratch,
                       act_quant: bool) -> Tensor:
    """One attention sublayer on the whole batch; x [N, hidden] → [N, hidden] (BF16 values)."""
    layer = role.layer
    prefix = f"layers.{layer}.attn."
    pos = layout.positions
    inv_freq = layer_inv_freq(cfg, role.ratio).to(x.device)

    q_lora, q, kv = project_q_kv(cfg, w, prefix, x, pos, inv_freq, act_quant)
    caches.write_swa(layer, layout.out_slots, ops.swa_cache_roundtrip(kv, caches.profile, cfg.qk_rope_head_dim))

    window = swa_key_positions(pos, cfg.sliding_window)                       # [N, W], −1 = none
    valid = window >= 0
    slots = layout.slots_at(layout.token_req[:, None].expand_as(window), window.clamp(min=0))
    keys = caches.gather(caches.swa[layer], slots, valid)

    if role.ratio > 0:
        if role.computes_latents:
            _write_compressed(cfg, role, w, prefix, x, layout, caches, inv_freq)
        selection = _select(cfg, role, w, prefix, x, q_lora, layout, caches, scratch, inv_freq, act_quant)
        c_valid = selection >= 0
        c_pos = entry_positions(selection.clamp(min=0), role.ratio)
        c_slots = layout.slots_at(layout.token_req[:, None].expand_as(c_pos), c_pos)
        c_keys = caches.gather(caches.latents[role.kv_source], c_slots, c_valid)
        keys, valid = torch.cat((keys, c_keys), dim=1), torch.cat((valid, c_valid), dim=1)

    o = attend_with_sink(q, keys, w[prefix + "attn_sink"], valid)
    return output_projection(cfg, w, prefix, o, pos, inv_freq, act_quant)

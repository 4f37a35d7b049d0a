"""The attention sublayer over a packed SGLang batch (spec §3.4, §3.5; phase-2 contracts §1–§4).

The per-token math is `attention_math` on the model's compute backend; the cache storage and
addressing are `runtime/cache.py`'s. Attention and the indexer selection run through the
model's `attention_ops` implementation (CPU: float64 torch; CUDA: the Triton kernels):

1. `project_q_kv` for every token of the batch at once (per-token math; the query heads forked
   to the side stream, `runtime/overlap.py`); the SWA read-back
   (`swa_cache_roundtrip`) goes to `swa[layer][swa_slot_of[slot]]` (`RuntimeCaches.write_swa_rows`);
2. kv sources write packed FP4 entries (`kv_layout`): ratio 1 → every token completes entry
   e = its slot; ratio 2 → the odd-position token p completes the pair (p−1, p), entry
   e = slot(p) // 2, pooled from its own fp32 `wkv` / `wgate` outputs and its first token's —
   taken from the batch when p−1 is in it, else from the request's pair ring
   (`RuntimeCaches.pending_pair`); after the layer every request whose last batch token is
   at an even position stores that token's outputs there (spec §3.4.3) — in a DSpark verify
   batch every even position of the block does (`store_block_pairs`). Whole batch, no
   per-request loop; even tokens write "no entry" (−1, the padding-page sink);
3. indexer layers: `attention_ops.select` (keys = the source's FP4 index keys of compressed
   positions 0..⌊seq_len/ratio⌋−1, entry slot(j·r + r − 1) // r — exactly the keys the reference
   state holds after the source ran on this chunk); other compressed layers reuse the latest
   same-ratio indexer's selection of this forward (`ForwardScratch`, spec §1.3);
4. keys per query = its SWA window (positions p−W+1..p, oldest first, as SWA slots) then its
   selected compressed entries (−1 = none); `attention_ops.attend`; `output_projection`.

Batch independence: every query's keys come only from its own request's slots and pair state.
Checks that need the values of device tensors (a stale pair state, an SWA slot freed inside the
window) run on CPU only and never for a static (CUDA-graph) layout (`BatchLayout.host_checks`) —
the CUDA path adds no host synchronisation.

CUDA-graph padding tokens (`BatchLayout.live_tokens` false: slot 0, row 0, position 0) write
nothing a live request reads: their pair-state writes are masked (the rows keep their values),
their compressed entries go to "no entry" (−1, the padding-page sink), and their SWA kv and token
id land in SWA slot `swa_slot_of[0]`, SGLang's padding slot (never in a live window).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import torch
from torch import Tensor, nn

from ..config import LayerRole, TextConfig
from ..numerics.geometry import swa_key_positions
from ..numerics.rope import layer_inv_freq
from .attention_math import (output_projection, pair_scores, project_q_lora_kv, query_heads,
                             ratio1_latents, rope_entry_values)
from .attention_ops import AttentionOps
from .backend import ComputeBackend
from .batch import BatchLayout
from .cache import RuntimeCaches
from .kv_layout import entry_positions
from .overlap import INLINE, InlineStream, SideStream
from .pair_ring import check_pair_state, store_verify_pairs
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
    #: RoPE inverse frequencies per compress ratio, already on the forward's device (a CUDA
    #: graph cannot copy host tensors to the device); filled on first use when not given.
    inv_freq: dict[int, Tensor] = field(default_factory=dict)
    #: The batch's entry-index table per compress ratio (CUDA indexer), built by the first
    #: indexer layer of that ratio in this forward and reused by the others; key `ratio` for a table
    #: with every column written, `(ratio, "entries")` for one written up to each request's entries
    #: (`KernelAttentionOps.entry_table`).
    entry_tables: dict = field(default_factory=dict)
    #: BF16 workspaces of decoded compressed entries per kv source (CUDA serving prefill:
    #: `attention_prefill`), made by the first layer reading that source in this forward.
    workspaces: dict[int, Tensor] = field(default_factory=dict)
    #: (BF16 decoded index keys, their rows per compressed position) per kv source (CUDA prefill:
    #: `attention_prefill.key_workspace`), made by the first indexer layer reading that source.
    key_workspaces: dict[int, tuple[Tensor, Tensor]] = field(default_factory=dict)
    #: The batch's SWA window slots [N, window] and its tokens' own SWA rows [N]: the same for
    #: every layer (one window size; the full → SWA slot map changes only between forwards), made
    #: by the first layer of this forward (`_swa_window`).
    swa_window: tuple[Tensor, Tensor] | None = None
    #: The CUDA indexer's query tiles per query chunk (`KernelAttentionOps.select`): the same
    #: for every indexer layer of this forward.
    query_tiles: dict = field(default_factory=dict)
    #: Compressed entry indices [N, index_topk] (−1 = none) per (selection layer, ratio): the same
    #: for every layer reading that selection (`_compressed_entries`).
    comp_entries: dict[tuple[int, int], Tensor] = field(default_factory=dict)
    #: What `AttentionOps.attend` derives from (kv source, entries) alone — the decode's gathered
    #: BF16 rows — shared by the layers that read the same source with the same entries.
    attend_memo: dict = field(default_factory=dict)


def _write_packed(be: ComputeBackend, cfg: TextConfig, w: Mapping[str, Tensor], prefix: str, latents: Tensor,
                  rope_positions: Tensor, inv_freq: Tensor, caches: RuntimeCaches, src: int, entry_idx: Tensor) -> None:
    """The packed entries of pre-RoPE latents written at `entry_idx` (−1 = none): the encoders take the
    values right before the reference's FP4 fake quantisation — `attention_math.rope_entry_values`
    (the BF16-rounded RoPE'd latent and index key) — so the decoded entries are the reference's
    stored latents and index keys bit for bit (spec §3.4.3; cache profiles NONE / FP4, whose
    compressed read-back is the FP4 value itself, spec §3.8)."""
    roped, k = rope_entry_values(be, cfg, w, prefix, latents, rope_positions, inv_freq)
    caches.write_values(be, src, entry_idx, roped, k)


def _write_compressed(be: ComputeBackend, cfg: TextConfig, role: LayerRole, w: Mapping[str, Tensor], prefix: str, x: Tensor,
                      layout: BatchLayout, caches: RuntimeCaches, inv_freq: Tensor) -> None:
    """Packed entries of a kv-source layer for the whole batch (spec §3.4.3, contract §2, §4).

    Ratio 2 without data-dependent shapes: every token computes a candidate entry (odd p: the
    pair (p−1, p)); only odd tokens write theirs (even tokens write entry −1, the sink)."""
    src, ratio, pos, out = role.layer, role.ratio, layout.positions, layout.out_slots
    live = layout.live_tokens
    if ratio == 1:
        latents = ratio1_latents(be, cfg, w, prefix, x)
        _write_packed(be, cfg, w, prefix, latents, pos, inv_freq, caches, src, torch.where(live, out, -1))
        return
    if ratio != 2:
        raise ValueError(f"layer {src}: compress ratio {ratio} is not a V4.1 ratio (1 or 2)")
    a, s = pair_scores(be, w, prefix, x)
    if layout.host_checks:
        check_pair_state(layout, caches, src)
    latents, entries, first_pos = be.pair_latents(a, s, layout, caches, src, w[prefix + "compressor.norm.weight"],
                                                  cfg.rms_norm_eps)
    _write_packed(be, cfg, w, prefix, latents, first_pos, inv_freq, caches, src, entries)
    if layout.verify_width:
        store_verify_pairs(a, s, layout, caches, src)
    else:
        be.store_pending_pairs(a, s, layout, caches, src)


def _selection(be: ComputeBackend, ops: AttentionOps, cfg: TextConfig, role: LayerRole, w: Mapping[str, Tensor],
               prefix: str, x: Tensor, q_lora: Tensor, layout: BatchLayout, caches: RuntimeCaches,
               scratch: ForwardScratch, inv_freq: Tensor, act_quant: bool) -> Tensor:
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
    selection, blocks = ops.select(be, cfg, role, w, prefix, x, q_lora, layout, caches, inv_freq,
                                   act_quant, published, scratch.entry_tables, query_tiles=scratch.query_tiles,
                                   key_workspaces=scratch.key_workspaces)
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


def attention_sublayer(be: ComputeBackend, ops: AttentionOps, cfg: TextConfig, role: LayerRole,
                       w: Mapping[str, Tensor], x: Tensor, layout: BatchLayout, caches: RuntimeCaches,
                       scratch: ForwardScratch, act_quant: bool, tp: TensorParallel = SINGLE,
                       wo_b: nn.Module | None = None, side: SideStream | InlineStream = INLINE,
                       x_quantised: Tensor | None = None) -> Tensor:
    """One attention sublayer on the whole batch; x [N, hidden] → [N, hidden] (BF16 values).
    The query heads (wq_b, RoPE) are forked to `side` (`runtime/overlap.py`): only the attention reads
    them, after the SWA write, the compressor and the indexer.
    Under tensor parallelism (`runtime/tensor_parallel.py`) q, attention and the grouped `wo_a`
    run for this rank's heads only, `wo_b` is the row-parallel layer over those groups' outputs
    (`TensorParallel.row_parallel`: one all-reduce); everything else (caches, compressor,
    indexer) is replicated. Without `wo_b` (TP 1 only) the weight is read from `w`. `x_quantised`: x's
    values quantised per 1×32, for the stacked `wq_a | wkv` (`ComputeBackend.quantised_handoff`)."""
    if wo_b is None and tp.size > 1:
        raise ValueError("attention_sublayer: tensor parallel size > 1 needs the row-parallel wo_b layer")
    layer = role.layer
    prefix = f"layers.{layer}.attn."
    pos = layout.positions
    inv_freq = scratch.inv_freq.get(role.ratio)
    if inv_freq is None or inv_freq.device != x.device:
        inv_freq = scratch.inv_freq[role.ratio] = layer_inv_freq(cfg, role.ratio).to(x.device)

    q_lora, kv = project_q_lora_kv(be, cfg, w, prefix, x, act_quant, x_quantised)
    q = side.fork(query_heads, be, cfg, w, prefix, q_lora, pos, inv_freq, act_quant, len(tp.plan(cfg).heads))
    caches.wait_for_layer(layer, global_rows=role.ratio > 0)          # HiCache load-back has landed
    swa_slots, out_rows = _swa_window(be, layer, cfg, layout, caches, scratch)
    caches.write_swa_rows(be, layer, out_rows, kv, pos, inv_freq, cfg.qk_rope_head_dim)

    packed = comp_entries = workspace = None
    if role.ratio > 0:
        if role.computes_latents:
            _write_compressed(be, cfg, role, w, prefix, x, layout, caches, inv_freq)
        selection = _selection(be, ops, cfg, role, w, prefix, x, q_lora, layout, caches, scratch, inv_freq, act_quant)
        comp_entries = _compressed_entries(be, role, selection, layout, scratch)
        packed = caches.packed(role.kv_source)
        workspace = ops.prefill_workspace(layout, packed, role.kv_source, role.ratio, selection, scratch,
                                          swa_slots)

    extra = {} if workspace is None else {"workspace": workspace}
    o = ops.attend(side.join(q), w[prefix + "attn_sink"], caches.swa[layer], swa_slots, packed, comp_entries,
                   memo=scratch.attend_memo, **extra)
    project = None if wo_b is None else (lambda u, x_quantised=False: tp.row_parallel(wo_b, u, be, act_quant,
                                                                                      x_quantised))
    return output_projection(be, cfg, w, prefix, o, pos, inv_freq, act_quant, wo_b=project)


def compressed_entries(selection: Tensor, layout: BatchLayout, ratio: int) -> Tensor:
    """[N, K] entry indices (slot // ratio of the token completing each compressed position, −1 = none) of
    a selection [N, K] (spec §3.4.3, contract §2): the torch formula `ComputeBackend.compressed_entries`
    defaults to."""
    comp_positions = torch.where(selection >= 0, entry_positions(selection, ratio), -1)
    comp_slots = _request_slots(layout, comp_positions)
    return torch.where(comp_slots >= 0, comp_slots // ratio, -1)


def _compressed_entries(be: ComputeBackend, role: LayerRole, selection: Tensor, layout: BatchLayout,
                        scratch: ForwardScratch) -> Tensor:
    """`be.compressed_entries` of `selection`, made once per (selection layer, ratio) and forward
    (`ForwardScratch.comp_entries`)."""
    key = (role.selection_from, role.ratio)
    entries = scratch.comp_entries.get(key)
    if entries is None:
        entries = scratch.comp_entries[key] = be.compressed_entries(selection, layout, role.ratio)
    return entries


def _swa_window(be: ComputeBackend, layer: int, cfg: TextConfig, layout: BatchLayout, caches: RuntimeCaches,
                scratch: ForwardScratch) -> tuple[Tensor, Tensor]:
    """(SWA slots [N, window] of every query's window, SWA rows [N] of the batch's own tokens),
    made once per forward (`ForwardScratch.swa_window`); on CPU the window is checked then, elsewhere
    `ComputeBackend.swa_window` makes it."""
    if scratch.swa_window is None:
        if layout.host_checks:
            full, swa_slots, own_rows = _window_slots(layout, caches, cfg.sliding_window)
            _check_window(layer, full, swa_slots, layout)
            scratch.swa_window = (swa_slots, own_rows)
        else:
            scratch.swa_window = be.swa_window(layout, caches, cfg.sliding_window)
    return scratch.swa_window


def _window_slots(layout: BatchLayout, caches: RuntimeCaches, window: int) -> tuple[Tensor, Tensor, Tensor]:
    """(full slots [N, window] of every query's window, their SWA slots — both −1 before position 0 —, SWA rows
    [N] of the batch's own tokens)."""
    full = _request_slots(layout, swa_key_positions(layout.positions, window))
    return full, caches.swa_slots(full), caches.swa_rows(layout.out_slots)


def swa_window_torch(layout: BatchLayout, caches: RuntimeCaches, window: int) -> tuple[Tensor, Tensor]:
    """(SWA slots [N, window] of every query's window, −1 before position 0; SWA rows [N] of the batch's own
    tokens) in torch: `ComputeBackend.swa_window`."""
    return _window_slots(layout, caches, window)[1:]


def _check_window(layer: int, window: Tensor, swa_slots: Tensor, layout: BatchLayout) -> None:
    """CPU only: every position of a query's SWA window has a live SWA slot (SGLang maps a
    freed one to 0, its padding slot)."""
    dead = (window >= 0) & (swa_slots <= 0)
    if bool(dead.any()):
        t, k = (int(v) for v in torch.nonzero(dead)[0])
        raise RuntimeError(f"sglang-dsv41: layer {layer}: the SWA window of the token at position "
                           f"{int(layout.positions[t])} needs full slot {int(window[t, k])}, which has no live SWA "
                           f"slot (swa_slot_of = {int(swa_slots[t, k])}; freed by the SWA radix cache?)")

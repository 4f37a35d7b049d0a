"""Where each token of an SGLang forward batch lives: its request, position and cache slot.

SGLang 0.5.17 packs a batch as consecutive per-request runs of tokens (extend, decode or mixed).
For request b: `req_pool_indices[b]` is its row of `req_to_token_pool.req_to_token` (position →
KV slot), `seq_lens[b]` its length **after** this forward, and it contributes `extend_len[b]`
tokens (1 in decode) at positions `prefix_len[b] .. seq_lens[b] − 1`, whose slots are
`out_cache_loc` (already written into `req_to_token` by the scheduler).

Invariant checked here (the torch path depends on it): every request's tokens are contiguous in
the batch and sit at consecutive absolute positions starting at its prefix length, and
`out_cache_loc` equals the request's `req_to_token` row at those positions, and those slots are
aligned in groups of `SLOT_GROUP` (packed compressed entries, contract §2). Anything else
(draft modes, a mismatched slot map) raises instead of computing garbage.

DSpark verify (`TARGET_VERIFY`, docs/dspark.md "Target verify"): SGLang's DSPARK worker runs the
target once over w = γ+1 tokens per request [anchor, d_0 … d_{γ−1}] at positions P..P+w−1, P =
`seq_lens` (the committed length; the slots of the window are already in `req_to_token`). Its
layout is an extend of w tokens per request (`verify_lens` ≤ w of a ragged layout under
`SGLANG_RAGGED_VERIFY_MODE` compact / cap-accept: adaptive verification) with `verify_width` = w
(CUDA graphs: `static_verify_layout`, `static_ragged_verify_layout`): the forward
then keeps every draft position's ratio-2 pending pair and stages the block's Engram ids instead
of advancing the history (`runtime/engram_history.py`); the worker's commit applies them.

Static decode layouts (CUDA graphs). `static_decode_layout` builds the layout of a decode batch
that SGLang's decode graph runner captures or replays: one token per request, every shape a
function of the batch size only, `max_seq_len` a static bound (the width of `req_to_token`), no
value check and no host synchronisation. The runner pads a batch to the captured size with
requests at row 0 (SGLang's padding row of `req_to_token`), position 0, seq_len 1 (our backend's
fill value) and out_cache_loc 0 (the padding page); such *padding tokens* are recognised by
their slot (`BatchLayout.live_tokens`: slot ≥ SLOT_GROUP) and the forward masks every write
they would make to request state (`runtime/attention.py`); their other writes land in the
padding page / SWA slot 0 / the "no entry" sink, which no live query reads.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

#: SGLang forward modes the torch path serves (by `ForwardMode.name`).
SUPPORTED_MODES = ("EXTEND", "DECODE", "MIXED", "IDLE", "TARGET_VERIFY")
#: Slots come in aligned groups of the largest V4.1 compress ratio (2): the r tokens of one
#: compressed entry hold its packed bytes (contract §2), so SGLang's page_size must be even.
SLOT_GROUP = 2


@dataclass(frozen=True)
class BatchLayout:
    """Per-request and per-token addressing of one forward batch (all int64, on the model device).

    * `req_rows[b]`: row of `req_to_token` of request b; `prefix_lens[b]`, `extend_lens[b]`,
      `seq_lens[b]` = prefix + extend; `starts[b]`: index of its first token in the batch.
    * `positions[t]`, `token_req[t]` (request index of token t; non-decreasing — every constructor
      here lays requests' runs out in request order, which the indexer's query tiles rely on),
      `out_slots[t]` (slot of token t).
    * `req_to_token`: SGLang's [rows, max_context] int32 position → slot table.
    * `max_seq_len`: max(seq_lens) as a host int (0 without requests), read once per forward so
      per-layer code sizes its tensors without synchronising with the device; in a static layout
      a static bound ≥ every seq_len (`req_to_token`'s width).
    * `static`: built by `static_decode_layout` / `static_verify_layout` /
      `static_ragged_verify_layout` (CUDA graphs): unchecked, may hold padding tokens, and the
      forward's value checks (host syncs) are skipped.
    * `engram_history`: int64 [B, K] ids before each request's chunk from the host
      (`runtime/engram_history.py`), or None: the forward reads its per-request ring.
    * `verify_width`: w of a DSpark verify batch (module doc; its tokens are speculative), 0
      otherwise.
    """

    req_rows: Tensor
    prefix_lens: Tensor
    extend_lens: Tensor
    seq_lens: Tensor
    starts: Tensor
    positions: Tensor
    token_req: Tensor
    out_slots: Tensor
    req_to_token: Tensor
    max_seq_len: int
    static: bool = False
    engram_history: Tensor | None = None
    verify_width: int = 0

    @property
    def live_tokens(self) -> Tensor:
        """[N] bool: token is a real one, not a CUDA-graph padding token (slot in the padding page
        0..SLOT_GROUP−1, where SGLang points padded tokens; `make_layout` refuses such slots)."""
        return self.out_slots >= SLOT_GROUP

    @property
    def live_requests(self) -> Tensor:
        """[B] bool: the request's last token is live and it has tokens (a zero-length request — a
        prefill graph's unused request slot — would otherwise see the previous request's last
        token as its own)."""
        return self.live_tokens[self.last_tokens] & (self.extend_lens > 0)

    @property
    def host_checks(self) -> bool:
        """Run the forward's value checks (they synchronise with the host): CPU, non-static only."""
        return not self.static and self.positions.device.type == "cpu"

    @property
    def num_requests(self) -> int:
        return int(self.req_rows.numel())

    @property
    def num_tokens(self) -> int:
        return int(self.positions.numel())

    def token_range(self, b: int) -> slice:
        start = int(self.starts[b])
        return slice(start, start + int(self.extend_lens[b]))

    def slots_at(self, token_req: Tensor, positions: Tensor) -> Tensor:
        """Slots of (request index, absolute position) pairs, any shape; positions must be ≥ 0."""
        rows = self.req_rows[token_req]
        return self.req_to_token[rows, positions].to(torch.int64)

    @property
    def last_tokens(self) -> Tensor:
        """[B] batch index of each request's last token."""
        return self.starts + self.extend_lens - 1

    def request_slots(self, b: int, positions: Tensor) -> Tensor:
        """Slots of request b at absolute `positions` (1-D, ≥ 0)."""
        return self.req_to_token[self.req_rows[b], positions].to(torch.int64)


def make_layout(req_rows: Tensor, prefix_lens: Tensor, extend_lens: Tensor, positions: Tensor,
                out_slots: Tensor, req_to_token: Tensor, slot_group: int = SLOT_GROUP,
                engram_history: Tensor | None = None) -> BatchLayout:
    """A checked `BatchLayout` (see the module invariant); all index tensors on one device.

    Also checks the slot alignment of packed compressed entries (contract §2): the token at
    position p sits in slot s with s ≡ p (mod `slot_group`), in the same aligned group as the
    slot of position p − p mod `slot_group`, and never in the padding slots 0..slot_group−1 —
    what SGLang's paged allocator gives when page_size is a multiple of `slot_group`."""
    device = positions.device
    req_rows, prefix_lens, extend_lens = (x.to(device=device, dtype=torch.int64).reshape(-1)
                                          for x in (req_rows, prefix_lens, extend_lens))
    B = int(req_rows.numel())
    starts = torch.cumsum(extend_lens, 0) - extend_lens
    N = int(extend_lens.sum()) if B else 0
    pos = positions.to(torch.int64).reshape(-1)
    if pos.numel() != N:
        raise RuntimeError(f"sglang-dsv41: batch has {pos.numel()} positions but requests extend {N} tokens")
    token_req = torch.repeat_interleave(torch.arange(B, device=device), extend_lens, output_size=N)
    expected = prefix_lens[token_req] + (torch.arange(N, device=device) - starts[token_req])
    if not torch.equal(pos, expected):
        raise RuntimeError("sglang-dsv41: token positions are not each request's consecutive positions "
                           f"from its prefix length (got {pos[:8].tolist()}…, expected "
                           f"{expected[:8].tolist()}…)")
    out_slots = out_slots.to(device=device, dtype=torch.int64).reshape(-1)
    seq_lens = prefix_lens + extend_lens
    if engram_history is not None:
        if engram_history.dim() != 2 or engram_history.shape[0] != B:
            raise RuntimeError(f"sglang-dsv41: Engram history of shape {tuple(engram_history.shape)} for a batch "
                               f"of {B} requests")
        engram_history = engram_history.to(device=device, dtype=torch.int64)
    layout = BatchLayout(req_rows=req_rows, prefix_lens=prefix_lens, extend_lens=extend_lens,
                         seq_lens=seq_lens, starts=starts, positions=pos, token_req=token_req,
                         out_slots=out_slots, req_to_token=req_to_token,
                         max_seq_len=int(seq_lens.max()) if B else 0, engram_history=engram_history)
    if N:
        mapped = layout.slots_at(token_req, pos)
        first_of_group = layout.slots_at(token_req, pos - pos % slot_group)
        aligned = (out_slots % slot_group == pos % slot_group) & (out_slots - pos % slot_group == first_of_group) \
            & (out_slots >= slot_group)
        if not bool(torch.logical_and(mapped == out_slots, aligned).all()):   # the one host sync
            if not torch.equal(mapped, out_slots):
                raise RuntimeError("sglang-dsv41: out_cache_loc disagrees with req_to_token at the batch's "
                                   "positions (the slot map must be written before the forward)")
            bad = int(torch.nonzero(~aligned)[0, 0])
            raise RuntimeError(
                f"sglang-dsv41: token at position {int(pos[bad])} of request row {int(req_rows[token_req[bad]])} "
                f"has slot {int(out_slots[bad])}, but packed compressed entries need the {slot_group} tokens of "
                f"positions {slot_group}j..{slot_group}j+{slot_group - 1} in slots {slot_group}e..{slot_group}e+"
                f"{slot_group - 1}, outside the padding slots 0..{slot_group - 1}: SGLang's page_size must be a "
                f"multiple of {slot_group} (contract §2)")
    return layout


def static_decode_layout(req_rows: Tensor, seq_lens: Tensor, positions: Tensor, out_slots: Tensor,
                         req_to_token: Tensor) -> BatchLayout:
    """The layout of a decode batch inside a CUDA graph (module docstring, "Static decode
    layouts"): token b = request b at position seq_lens[b] − 1; no checks, no host sync, shapes
    from the batch size; `max_seq_len` = `req_to_token.shape[1]` (static bound). Callers guarantee
    what `make_layout` would check for live tokens (SGLang's decode batches satisfy it)."""
    device = positions.device
    pos = positions.to(torch.int64).reshape(-1)
    B = pos.numel()
    req_rows, seq_lens = (x.to(device=device, dtype=torch.int64).reshape(-1) for x in (req_rows, seq_lens))
    slots = out_slots.to(device=device, dtype=torch.int64).reshape(-1)
    if req_rows.numel() != B or seq_lens.numel() != B or slots.numel() != B:
        raise RuntimeError(f"sglang-dsv41 static decode layout: {B} positions, {req_rows.numel()} request rows, "
                           f"{seq_lens.numel()} seq_lens, {slots.numel()} out slots (one token per request)")
    index = torch.arange(B, device=device)
    ones = torch.ones_like(seq_lens)
    return BatchLayout(req_rows=req_rows, prefix_lens=seq_lens - ones, extend_lens=ones, seq_lens=seq_lens,
                       starts=index, positions=pos, token_req=index, out_slots=slots, req_to_token=req_to_token,
                       max_seq_len=int(req_to_token.shape[1]), static=True)


def static_verify_layout(req_rows: Tensor, seq_lens: Tensor, positions: Tensor, out_slots: Tensor,
                         req_to_token: Tensor, width: int) -> BatchLayout:
    """The layout of a DSpark verify batch inside a CUDA graph: request b's w tokens are
    b·w..b·w+w−1 at positions seq_lens[b]..seq_lens[b]+w−1; unchecked and sync-free like
    `static_decode_layout` (padding requests: row 0, slot 0, masked by `live_tokens`)."""
    device = positions.device
    pos = positions.to(torch.int64).reshape(-1)
    req_rows, seq_lens = (x.to(device=device, dtype=torch.int64).reshape(-1) for x in (req_rows, seq_lens))
    slots = out_slots.to(device=device, dtype=torch.int64).reshape(-1)
    B = req_rows.numel()
    if width < 1 or pos.numel() != B * width or seq_lens.numel() != B or slots.numel() != B * width:
        raise RuntimeError(f"sglang-dsv41 static verify layout: {pos.numel()} positions, {B} request rows, "
                           f"{seq_lens.numel()} seq_lens, {slots.numel()} out slots for width {width}")
    widths = torch.full_like(seq_lens, width)
    return BatchLayout(req_rows=req_rows, prefix_lens=seq_lens, extend_lens=widths, seq_lens=seq_lens + widths,
                       starts=torch.arange(B, device=device) * width, positions=pos,
                       token_req=torch.arange(B * width, device=device) // width, out_slots=slots,
                       req_to_token=req_to_token, max_seq_len=int(req_to_token.shape[1]), static=True,
                       verify_width=width)


def _flat_int64(device: torch.device, *tensors: Tensor) -> tuple[Tensor, ...]:
    """Each tensor as a flat int64 tensor on `device` (the static layouts' inputs; no host sync)."""
    return tuple(t.to(device=device, dtype=torch.int64).reshape(-1) for t in tensors)


def static_ragged_verify_layout(req_rows: Tensor, seq_lens: Tensor, verify_lens: Tensor, positions: Tensor,
                                out_slots: Tensor, req_to_token: Tensor, width: int) -> BatchLayout:
    """The layout of a DSpark verify batch with per-request verify lengths (adaptive verification,
    `SGLANG_RAGGED_VERIFY_MODE=compact`) inside a CUDA graph: request b's `verify_lens[b]` ≤ w
    tokens are consecutive from exclusive-cumsum(verify_lens)[b], at positions seq_lens[b]..;
    the batch is padded to the graph tier with tokens at slot 0 (position 0), which SGLang's
    runner (`padded_to_bucket(cap=w)`) hands to padding requests (row 0) or to the last real
    request up to w tokens each; the rest belong to no request (ghosts, token_req clamped to the
    last) — all masked by `live_tokens`. Unchecked and sync-free like `static_verify_layout`;
    `verify_lens` is the runner's device buffer, refreshed per replay."""
    device = positions.device
    pos, req_rows, seq_lens, lens, slots = _flat_int64(device, positions, req_rows, seq_lens, verify_lens, out_slots)
    B, N = req_rows.numel(), pos.numel()
    if width < 1 or B < 1 or seq_lens.numel() != B or lens.numel() != B or slots.numel() != N:
        raise RuntimeError(f"sglang-dsv41 static ragged verify layout: {N} positions, {B} request rows, "
                           f"{seq_lens.numel()} seq_lens, {lens.numel()} verify lens, {slots.numel()} out slots "
                           f"(width {width})")
    ends = torch.cumsum(lens, 0)
    token_req = torch.searchsorted(ends, torch.arange(N, device=device), right=True).clamp(max=B - 1)
    return BatchLayout(req_rows=req_rows, prefix_lens=seq_lens, extend_lens=lens, seq_lens=seq_lens + lens,
                       starts=ends - lens, positions=pos, token_req=token_req, out_slots=slots,
                       req_to_token=req_to_token, max_seq_len=int(req_to_token.shape[1]), static=True,
                       verify_width=width)


def static_extend_layout(req_rows: Tensor, seq_lens: Tensor, extend_lens: Tensor, positions: Tensor,
                         out_slots: Tensor, req_to_token: Tensor,
                         engram_history: Tensor | None = None) -> BatchLayout:
    """The layout of an extend batch padded to a token bucket (a prefill CUDA graph; prototype,
    not wired into the server: docs/prefill_graphs.md): request b's `extend_lens[b]` tokens
    are consecutive from exclusive-cumsum(extend_lens)[b], at positions seq_lens[b] −
    extend_lens[b]..seq_lens[b] − 1 (`seq_lens` after the forward, SGLang's convention); tokens
    past every request are padding at slot 0 / position 0 (SGLang's prefill runners zero the
    padded tail of input_ids, positions and out_cache_loc), token_req clamped to the last
    request, masked by `live_tokens`. Zero-length requests (the `full` backend's unused request
    slots: row 0, seq_len 0, after the live ones) write no request state (`live_requests`).
    Unchecked and sync-free like `static_decode_layout` (`max_seq_len` = `req_to_token`'s width)."""
    device = positions.device
    pos, req_rows, seq_lens, lens, slots = _flat_int64(device, positions, req_rows, seq_lens, extend_lens, out_slots)
    B, N = req_rows.numel(), pos.numel()
    if B < 1 or seq_lens.numel() != B or lens.numel() != B or slots.numel() != N:
        raise RuntimeError(f"sglang-dsv41 static extend layout: {N} positions, {B} request rows, "
                           f"{seq_lens.numel()} seq_lens, {lens.numel()} extend lens, {slots.numel()} out slots")
    if engram_history is not None:
        if engram_history.dim() != 2 or engram_history.shape[0] != B:
            raise RuntimeError(f"sglang-dsv41: Engram history of shape {tuple(engram_history.shape)} for a batch "
                               f"of {B} requests")
        engram_history = engram_history.to(device=device, dtype=torch.int64)
    ends = torch.cumsum(lens, 0)
    token_req = torch.searchsorted(ends, torch.arange(N, device=device), right=True).clamp(max=B - 1)
    return BatchLayout(req_rows=req_rows, prefix_lens=seq_lens - lens, extend_lens=lens, seq_lens=seq_lens,
                       starts=ends - lens, positions=pos, token_req=token_req, out_slots=slots,
                       req_to_token=req_to_token, max_seq_len=int(req_to_token.shape[1]), static=True,
                       engram_history=engram_history)


def verify_lens_of(forward_batch) -> tuple[Tensor | None, int]:
    """(per-request verify lengths of a ragged layout or None, w = tokens per request) of a
    TARGET_VERIFY batch's spec info."""
    spec = getattr(forward_batch, "spec_info", None)
    width = int(getattr(spec, "draft_token_num", 0) or 0)
    if width < 1:
        raise RuntimeError("sglang-dsv41: a TARGET_VERIFY batch without its verify width (spec_info.draft_token_num)")
    ragged = getattr(spec, "ragged_verify_layout", None)
    return (None if ragged is None else ragged.verify_lens), width


def layout_from_forward_batch(forward_batch, positions: Tensor, req_to_token: Tensor, *,
                              static: bool = False, engram_history: Tensor | None = None) -> BatchLayout:
    """The `BatchLayout` of an SGLang `ForwardBatch` (extend, decode, mixed or idle); `static`
    (decode / idle batches of SGLang's CUDA-graph runner only): `static_decode_layout`;
    `engram_history`: the batch's host-built history (non-static layouts only)."""
    mode = forward_batch.forward_mode
    if static and mode.is_target_verify():
        ragged, width = verify_lens_of(forward_batch)
        if ragged is not None:
            return static_ragged_verify_layout(forward_batch.req_pool_indices, forward_batch.seq_lens, ragged,
                                               positions, forward_batch.out_cache_loc, req_to_token, width)
        return static_verify_layout(forward_batch.req_pool_indices, forward_batch.seq_lens, positions,
                                    forward_batch.out_cache_loc, req_to_token, width)
    if static:
        if not (mode.is_decode() or mode.is_idle()):
            raise RuntimeError(f"sglang-dsv41: a static (CUDA-graph) layout is for decode batches, got {mode.name}")
        return static_decode_layout(forward_batch.req_pool_indices, forward_batch.seq_lens, positions,
                                    forward_batch.out_cache_loc, req_to_token)
    if mode.name not in SUPPORTED_MODES:
        raise RuntimeError(f"sglang-dsv41 torch path: forward mode {mode.name} is not supported "
                           f"(supported: {', '.join(SUPPORTED_MODES)}; speculative decoding and "
                           "split prefill need the later kernel phase)")
    device = positions.device
    seq_lens = forward_batch.seq_lens.to(device=device, dtype=torch.int64)
    if mode.is_target_verify():
        ragged, width = verify_lens_of(forward_batch)
        extend_lens = torch.full_like(seq_lens, width) if ragged is None else ragged.to(device, torch.int64)
        layout = make_layout(forward_batch.req_pool_indices, seq_lens, extend_lens, positions,
                             forward_batch.out_cache_loc, req_to_token)
        return replace(layout, verify_width=width)
    if mode.is_decode() or mode.is_idle():
        extend_lens = torch.ones_like(seq_lens)
    else:
        extend_lens = forward_batch.extend_seq_lens.to(device=device, dtype=torch.int64)
    return make_layout(forward_batch.req_pool_indices, seq_lens - extend_lens, extend_lens, positions,
                       forward_batch.out_cache_loc, req_to_token,
                       engram_history=engram_history)

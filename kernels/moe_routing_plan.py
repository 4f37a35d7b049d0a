"""The routing plan of the routed experts: slots grouped by expert, and triton_kernels' tile schedule
(spec `model.md` §3.6; used by `kernels/moe_mxfp4.py`, which re-exports the public names).

Slot s = t·k + j of T tokens with k experts each. The plan is the stable sort of the slots by
expert id (−1, "not held here", after every expert), the per-expert counts, and the
`RaggedTensorMetadata` matmul_ogs reads: offsets of each expert's rows and of its 16…128-row tiles,
and the tile schedule. At decode sizes (≤ FUSED_ORDER_MAX_SLOTS slots, on CUDA) all of it is one
`_routing_order_kernel` launch; above, torch's stable sort and triton_kernels' own schedule (two
launches on CUDA), with the same result bit for bit (tests/test_kernels_moe_mxfp4.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton_kernels.matmul_ogs import GatherIndx, RoutingData
from triton_kernels.tensor import make_ragged_tensor_metadata, make_ragged_tensor_metadata_torch
from triton_kernels.tensor_details.ragged_tensor import RaggedTensorMetadata

@dataclass(frozen=True)
class RoutingPlan:
    """Slots s = t·k + j grouped by expert (stable: ascending s within an expert).
    `sorted_slots[r]` = slot at grouped row r; `slot_rows[s]` = its grouped row;
    `expert_counts[e]` = rows of expert e; `ragged` = the kernel's tile schedule."""

    sorted_slots: Tensor
    slot_rows: Tensor
    expert_counts: Tensor
    ragged: RaggedTensorMetadata
    n_tokens: int
    top_k: int
    n_experts: int

    def routing_data(self) -> RoutingData:
        return RoutingData(None, self.expert_counts, self.n_experts, self.top_k, self.ragged)

    def gather(self) -> GatherIndx:
        return GatherIndx(src_indx=self.sorted_slots, dst_indx=self.slot_rows)


#: slot counts (T·k) up to which a CUDA plan's order is one `_routing_order_kernel` launch (decode);
#: above, torch's stable sort (prefill sizes; docs/performance.md "Session 13")
FUSED_ORDER_MAX_SLOTS = 512
_FUSED_ORDER_PAD_KEY = 1 << 30       # padding lanes: after every bin, in no count


@triton.jit
def _routing_order_kernel(Ids, Order, Rows, Counts, Valid, Offs, Schedule, S, N_EXPERTS, MAX_TILES,
                          ALLOW_ABSENT: tl.constexpr, SP: tl.constexpr, CHUNK: tl.constexpr,
                          BINS: tl.constexpr, PAD: tl.constexpr, EP: tl.constexpr, SIZES: tl.constexpr,
                          FIRST_LOG2: tl.constexpr):
    """One program: key = id (−1 → N_EXPERTS with ALLOW_ABSENT); a slot's grouped row = the number of
    slots before it in (key, slot) order (the stable sort's position); Order[row] = slot; Counts[e] =
    slots of expert e < N_EXPERTS; Valid = every id in range. Then the tile schedule of those counts
    (`_ragged_schedule`)."""
    s = tl.arange(0, SP)
    s_ok = s < S
    raw = tl.load(Ids + s, mask=s_ok, other=0)
    if ALLOW_ABSENT:
        out_of_range = (raw < -1) | (raw >= N_EXPERTS)
    else:
        out_of_range = (raw < 0) | (raw >= N_EXPERTS)
    bad = tl.sum((s_ok & out_of_range).to(tl.int32), axis=0)
    ids = raw.to(tl.int32)
    key = tl.where(s_ok, tl.where(ids < 0, N_EXPERTS, ids), PAD)
    row = tl.zeros([SP], dtype=tl.int32)
    for c0 in range(0, S, CHUNK):
        o = c0 + tl.arange(0, CHUNK)
        ko = tl.load(Ids + o, mask=o < S, other=0).to(tl.int32)
        ko = tl.where(o < S, tl.where(ko < 0, N_EXPERTS, ko), PAD)
        before = (ko[None, :] < key[:, None]) | ((ko[None, :] == key[:, None]) & (o[None, :] < s[:, None]))
        row += tl.sum(before.to(tl.int32), axis=1)
    tl.store(Rows + s, row, mask=s_ok)
    tl.store(Order + row, s, mask=s_ok)
    for e0 in range(0, N_EXPERTS, BINS):
        e = e0 + tl.arange(0, BINS)
        tl.store(Counts + e, tl.sum((key[:, None] == e[None, :]).to(tl.int32), axis=0), mask=e < N_EXPERTS)
    tl.store(Valid, bad == 0)
    tl.debug_barrier()                                   # every count stored before any is read back
    _ragged_schedule(Counts, Offs, Schedule, N_EXPERTS, MAX_TILES, EP, SIZES, FIRST_LOG2)


@triton.jit
def _ragged_schedule(Counts, Offs, Schedule, N_EXPERTS, MAX_TILES, EP: tl.constexpr, SIZES: tl.constexpr,
                     FIRST_LOG2: tl.constexpr):
    """triton_kernels' `RaggedTensorMetadata` of Counts (its `make_ragged_tensor_metadata_torch`, bit for
    bit): Offs row 0 = [0] + cumsum(counts), row 1 + i = [0] + cumsum(⌈counts / 2^(FIRST_LOG2 + i)⌉);
    Schedule row i = (tile << 16) + expert for each expert's tiles in expert order, −1 after, MAX_TILES
    long. EP ≥ N_EXPERTS + 1 lanes: one pass per row."""
    e = tl.arange(0, EP)
    counts = tl.load(Counts + e, mask=e < N_EXPERTS, other=0)
    for i in tl.static_range(SIZES + 1):
        if i == 0:
            tiles = counts
        else:
            tiles = (counts + ((1 << (FIRST_LOG2 + i - 1)) - 1)) >> (FIRST_LOG2 + i - 1)
        start = tl.cumsum(tiles, 0) - tiles
        tl.store(Offs + i * (N_EXPERTS + 1) + e, start, mask=e <= N_EXPERTS)
        if i > 0:
            row = Schedule + (i - 1) * MAX_TILES
            total = tl.sum(tiles, 0)
            for p0 in range(0, MAX_TILES, EP):
                p = p0 + e
                tl.store(row + p, tl.full([EP], -1, tl.int32), mask=(p >= total) & (p < MAX_TILES))
            for j in range(0, tl.max(tiles, 0)):
                tl.store(row + start + j, (j << 16) + e, mask=(j < tiles) & (start + j < MAX_TILES))


def _block_sizes_log2() -> tuple[int, int]:
    """(first log2, count) of triton_kernels' tile sizes, which must be consecutive powers of two."""
    sizes = list(RaggedTensorMetadata.block_sizes_log2())
    if not sizes or sizes != list(range(sizes[0], sizes[0] + len(sizes))):
        raise RuntimeError(f"triton_kernels RaggedTensorMetadata.block_sizes_log2() = {sizes}: the fused routing "
                           "plan writes consecutive powers of two only (kernels/moe_routing_plan.py `_ragged_schedule`)")
    return sizes[0], len(sizes)


def _order_fused(flat: Tensor, n_experts: int,
                 allow_absent: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, RaggedTensorMetadata]:
    """(order, rows, counts int32, valid bool[1], tile schedule) of one `_routing_order_kernel` launch
    for ≤ FUSED_ORDER_MAX_SLOTS slots."""
    S, dev = flat.numel(), flat.device
    order = torch.empty(S, dtype=torch.int32, device=dev)
    rows = torch.empty_like(order)
    counts = torch.empty(n_experts, dtype=torch.int32, device=dev)
    valid = torch.empty(1, dtype=torch.bool, device=dev)
    first_log2, sizes = _block_sizes_log2()
    max_tiles = RaggedTensorMetadata.max_n_tiles(n_experts, S)
    offs = torch.empty(sizes + 1, n_experts + 1, dtype=torch.int32, device=dev)
    schedule = torch.empty(sizes, max_tiles, dtype=torch.int32, device=dev)
    sp = max(16, triton.next_power_of_2(S))
    _routing_order_kernel[(1,)](flat, order, rows, counts, valid, offs, schedule, S, n_experts, max_tiles,
                                ALLOW_ABSENT=allow_absent, SP=sp, CHUNK=32, BINS=32, PAD=_FUSED_ORDER_PAD_KEY,
                                EP=triton.next_power_of_2(n_experts + 1), SIZES=sizes, FIRST_LOG2=first_log2,
                                num_warps=4 if sp <= 128 else 8)
    return order, rows, counts, valid, RaggedTensorMetadata(counts, offs[0], offs[1:], schedule)


def _order_torch(flat: Tensor, n_experts: int, allow_absent: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The same by torch's stable sort (any size)."""
    flat = flat.to(torch.int32)
    lowest = -1 if allow_absent else 0
    valid = ((flat >= lowest) & (flat < n_experts)).all()
    key = torch.where(flat < 0, n_experts, flat) if allow_absent else flat
    order = torch.sort(key, stable=True).indices.to(torch.int32)
    rows = torch.empty_like(order)
    rows[order.long()] = torch.arange(flat.numel(), dtype=torch.int32, device=flat.device)
    counts = torch.zeros(n_experts + 1, dtype=torch.int32, device=flat.device)
    counts.scatter_add_(0, key.long().clamp(0, n_experts), torch.ones_like(key))
    return order, rows, counts[:n_experts].contiguous(), valid


def make_routing_plan(topk_ids: Tensor, n_experts: int, *, allow_absent: bool = False,
                      fused: bool | None = None, check_ids: bool = True) -> RoutingPlan:
    """Routing plan for `topk_ids` [T, k] (ids in 0..n_experts−1; checked on the device without
    a host sync). The order and the tile schedule: one `_routing_order_kernel` launch when `fused`
    (default: on CUDA at ≤ FUSED_ORDER_MAX_SLOTS slots), else torch's stable sort and triton_kernels'
    schedule (its two kernels on CUDA, its torch version on CPU; plans are only executed on CUDA) —
    the same permutation, counts and schedule.

    `allow_absent`: id −1 marks a slot whose expert is not held here (expert parallel). Such
    slots sort after every present one and are in no expert's count, so the GEMMs never compute
    them (their grouped rows of any output are left unwritten; callers mask them).

    `check_ids=False` skips the device-side range assertion (one launch): for callers whose ids are
    in range by construction (the runtime's router picks among n_experts columns)."""
    if topk_ids.dim() != 2 or topk_ids.dtype.is_floating_point:
        raise ValueError(f"topk_ids must be an integer [T, k] tensor, got {topk_ids.dtype} {tuple(topk_ids.shape)}")
    T, k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    if fused is None:
        fused = flat.is_cuda and 0 < T * k <= FUSED_ORDER_MAX_SLOTS
    if fused and T * k > FUSED_ORDER_MAX_SLOTS:
        raise ValueError(f"the fused routing order takes ≤ {FUSED_ORDER_MAX_SLOTS} slots, got {T * k}")
    if fused:
        order, rows, counts, valid, ragged = _order_fused(flat.contiguous(), n_experts, allow_absent)
    else:
        order, rows, counts, valid = _order_torch(flat.contiguous(), n_experts, allow_absent)
        ragged = (make_ragged_tensor_metadata if flat.is_cuda else make_ragged_tensor_metadata_torch)(counts, T * k)
    if check_ids:
        torch._assert_async(valid, f"topk_ids outside {-1 if allow_absent else 0}..{n_experts - 1}")
    return RoutingPlan(order, rows, counts, ragged, T, k, n_experts)


__all__ = ["FUSED_ORDER_MAX_SLOTS", "RoutingPlan", "make_routing_plan"]

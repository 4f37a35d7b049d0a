"""The indexer's per-forward tables in one launch each (spec §3.4.4): what the torch formulas
`entry_index._entry_index_table_torch` and `indexer._query_tiles_torch` compute.

* `entry_index_table`: [R, width] int64, entry j of request r = req_to_token[req_rows[r],
  min(j·ratio + ratio − 1, max_context − 1)] // ratio for j < n_entries[r], else −1.
* `query_tiles`: one program. counts[r] = the queries of request r (a histogram per 1,024 queries), starts = their
  exclusive prefix sum, tiles = ⌈counts / block_t⌉, tile_end = the inclusive prefix sum of tiles; tile i (of the
  static grid) belongs to request req = #{r: tile_end[r] ≤ i} (by bisection; clamped to R − 1) and covers queries
  [starts + (i − tile_end + tiles)·block_t, min(that + block_t, starts + counts)) of `order`; tiles past
  the last are empty (0, 0). With `grouped` (token_req non-decreasing: queries already grouped by request,
  as a `BatchLayout` holds them) `order` is the identity, written by the same launch; otherwise it is
  torch's stable argsort.

Integer arithmetic only: both equal the torch formulas exactly (tests/test_kernels_indexer_tables.py).
Tensor-only signatures; no host sync; CUDA-graph capturable.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .fused_elementwise import _launch_options, _pow2_at_least, check_device

#: entries per program of the entry table
TABLE_BLOCK = 512
#: programs per request of an unfilled entry table (each loops over every UNFILLED_PROGRAMS-th block)
UNFILLED_PROGRAMS = 16
#: queries per step of the counting pass (a histogram) and tiles per step of the owner search
LANES = 1024


@triton.jit
def _entry_table_kernel(table_ptr, table_stride, max_context, rows_ptr, n_ptr, out_ptr, width, ratio, programs,
                        BLOCK: tl.constexpr, FILL: tl.constexpr):
    """Program (r, p) writes blocks p, p + programs, … of row r: every block (FILL: −1 at j ≥ n_entries),
    else only the blocks below n_entries, the columns past it not written."""
    r = tl.program_id(0).to(tl.int64)
    n = tl.load(n_ptr + r)
    row = tl.load(rows_ptr + r).to(tl.int64)
    blocks = tl.cdiv(width if FILL else tl.minimum(n, width), BLOCK)
    for b in range(tl.program_id(1), blocks, programs):
        j = (b * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
        live = j < width
        pos = tl.minimum(j * ratio + ratio - 1, max_context - 1)
        slot = tl.load(table_ptr + row * table_stride + pos, mask=live & (j < n), other=0).to(tl.int64)
        tl.store(out_ptr + r * width + j, tl.where(j < n, slot // ratio, -1), mask=live if FILL else live & (j < n))


@triton.jit
def _query_tiles_kernel(token_req_ptr, N, R, grid, block_t, scratch_ptr, order_ptr, req_ptr, lo_ptr, hi_ptr,
                        BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, LOG2_R: tl.constexpr, BLOCK_I: tl.constexpr,
                        GROUPED: tl.constexpr):
    counts = tl.zeros((BLOCK_R,), tl.int64)
    for n0 in range(0, N, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        req = tl.load(token_req_ptr + n, mask=n < N, other=0).to(tl.int32)
        counts += tl.histogram(req, BLOCK_R, mask=n < N).to(tl.int64)
        if GROUPED:
            tl.store(order_ptr + n, n.to(tl.int64), mask=n < N)
    r = tl.arange(0, BLOCK_R)
    tiles = (counts + block_t - 1) // block_t
    tile_end = tl.cumsum(tiles, axis=0)
    starts = tl.cumsum(counts, axis=0) - counts
    total = tl.sum(tiles, axis=0)
    tl.store(scratch_ptr + r, starts)
    tl.store(scratch_ptr + BLOCK_R + r, counts)
    tl.store(scratch_ptr + 2 * BLOCK_R + r, tile_end - tiles)
    tl.store(scratch_ptr + 3 * BLOCK_R + r, tile_end)
    tl.debug_barrier()
    for i0 in range(0, grid, BLOCK_I):
        i = i0 + tl.arange(0, BLOCK_I)
        live_i = i < grid
        lo = tl.zeros((BLOCK_I,), tl.int64)                          # #{r < R: tile_end[r] ≤ i}, by bisection
        hi = tl.zeros((BLOCK_I,), tl.int64) + R
        for _ in tl.static_range(LOG2_R + 1):
            mid = (lo + hi) // 2
            end = tl.load(scratch_ptr + 3 * BLOCK_R + tl.minimum(mid, R - 1), mask=live_i, other=0)
            active = lo < hi
            go_right = active & (end <= i)
            lo = tl.where(go_right, mid + 1, lo)
            hi = tl.where(active & ~go_right, mid, hi)
        owner = tl.minimum(lo, R - 1)
        start = tl.load(scratch_ptr + owner, mask=live_i, other=0)
        count = tl.load(scratch_ptr + BLOCK_R + owner, mask=live_i, other=0)
        first = tl.load(scratch_ptr + 2 * BLOCK_R + owner, mask=live_i, other=0)
        lo_q = start + (i - first) * block_t
        hi_q = tl.minimum(lo_q + block_t, start + count)
        used = i < total
        tl.store(req_ptr + i, owner, mask=live_i)
        tl.store(lo_ptr + i, tl.where(used, lo_q, 0), mask=live_i)
        tl.store(hi_ptr + i, tl.where(used, hi_q, 0), mask=live_i)


def entry_index_table(req_to_token: Tensor, req_rows: Tensor, n_entries: Tensor, ratio: int, width: int,
                      fill: bool = True) -> Tensor:
    """[R, width] int64 entry indices (module doc; `entry_index.entry_index_table`'s values); `fill=False`
    leaves the columns j ≥ n_entries[r] unwritten (any value)."""
    if ratio < 1 or width < 0 or req_to_token.dim() != 2 or req_rows.shape != n_entries.shape or req_rows.dim() != 1:
        raise ValueError(f"entry_index_table: ratio {ratio}, width {width}, req_to_token {tuple(req_to_token.shape)}, "
                         f"req_rows {tuple(req_rows.shape)}, n_entries {tuple(n_entries.shape)}")
    check_device("entry_index_table", req_to_token, req_rows, n_entries)
    R = req_rows.shape[0]
    out = torch.empty(R, width, dtype=torch.int64, device=req_rows.device)
    if R and width:
        table = req_to_token if req_to_token.stride(1) == 1 else req_to_token.contiguous()
        programs = triton.cdiv(width, TABLE_BLOCK)
        if not fill:                  # a request's entries, not the width: a few programs loop over them
            programs = min(programs, UNFILLED_PROGRAMS)
        _entry_table_kernel[(R, programs)](
            table, table.stride(0), table.shape[1], req_rows, n_entries.to(torch.int64), out, width, ratio, programs,
            BLOCK=TABLE_BLOCK, FILL=fill, **_launch_options())
    return out


def query_tiles(token_req: Tensor, num_requests: int, block_t: int,
                grouped: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(order, tile_req, tile_lo, tile_hi) int64 (module doc; `indexer._query_tiles_torch`), the grid the static
    bound min(N, (N + R·(block_t − 1)) // block_t)."""
    if token_req.dim() != 1 or num_requests < 1 or block_t < 1:
        raise ValueError(f"query_tiles: token_req {tuple(token_req.shape)}, {num_requests} requests, block {block_t}")
    check_device("query_tiles", token_req)
    n, dev = token_req.numel(), token_req.device
    token_req = token_req.to(torch.int64)
    grid = min(n, (n + num_requests * (block_t - 1)) // block_t)
    order = torch.empty(n, dtype=torch.int64, device=dev) if grouped else torch.argsort(token_req, stable=True)
    req, lo, hi = (torch.empty(grid, dtype=torch.int64, device=dev) for _ in range(3))
    block_r = _pow2_at_least(num_requests)
    scratch = torch.empty(4 * block_r, dtype=torch.int64, device=dev)
    if n:
        _query_tiles_kernel[(1,)](token_req, n, num_requests, grid, block_t, scratch, order, req, lo, hi,
                                  BLOCK_N=LANES, BLOCK_R=block_r, LOG2_R=block_r.bit_length() - 1, BLOCK_I=LANES,
                                  GROUPED=grouped, **_launch_options())
    return order, req, lo, hi


__all__ = ["entry_index_table", "query_tiles"]

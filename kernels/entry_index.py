"""Compressed entry indices (spec §3.4.3–§3.4.4, contract §2): the packed entry index of compressed
position j of request r is the slot of the token at position j·ratio + ratio − 1 (which completes it)
divided by the ratio.

* `compressed_entry_index`: one launch over a top-k selection. For token t and column k with
  j = selection[t, k] (request-local, −1 = none): entry[t, k] = req_to_token[req_rows[token_req[t]],
  j·ratio + ratio − 1] // ratio, or −1 where j < 0 (`runtime/attention._compressed_entries`'s torch formula).
* `entry_index_table`: the indexer's [R, width] table of every j < n_entries[r] (−1 beyond): one launch
  (`indexer_tables.entry_index_table`) on CUDA or under the interpreter, else `_entry_index_table_torch`;
  `entry_slot_table`: the same gather without the division (slots).

Integer arithmetic only, so the kernels equal the torch formulas exactly (tests/test_kernels_entry_index.py,
tests/test_kernels_indexer_tables.py). Tensor-only signatures; no host sync; CUDA-graph capturable.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .fused_elementwise import INTERPRETED, _launch_options, _pow2_at_least, check_device
from .indexer_tables import entry_index_table as one_launch_entry_table

#: columns per program
BLOCK_K = 512


@triton.jit
def _entry_index_kernel(sel_ptr, sel_stride, token_req_ptr, req_rows_ptr, table_ptr, table_stride, out_ptr, K,
                        ratio, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = k < K
    j = tl.load(sel_ptr + t * sel_stride + k, mask=live, other=-1).to(tl.int64)
    row = tl.load(req_rows_ptr + tl.load(token_req_ptr + t).to(tl.int64)).to(tl.int64)
    valid = j >= 0
    pos = tl.maximum(j, 0) * ratio + ratio - 1
    slot = tl.load(table_ptr + row * table_stride + pos, mask=live & valid, other=0).to(tl.int64)
    tl.store(out_ptr + t * K + k, tl.where(valid & (slot >= 0), slot // ratio, -1), mask=live)


def compressed_entry_index(selection: Tensor, token_req: Tensor, req_rows: Tensor, req_to_token: Tensor,
                           ratio: int) -> Tensor:
    """int64 [N, K] entry indices (module doc) of `selection` [N, K] (any integer dtype, −1 = none); the
    positions must lie inside `req_to_token`'s rows (a selection never names a position past its token)."""
    if selection.dim() != 2 or token_req.shape != (selection.shape[0],) or req_to_token.dim() != 2 or ratio < 1:
        raise ValueError(f"compressed_entry_index: selection {tuple(selection.shape)}, token_req "
                         f"{tuple(token_req.shape)}, req_to_token {tuple(req_to_token.shape)}, ratio {ratio}")
    check_device("compressed_entry_index", selection, token_req, req_rows, req_to_token)
    N, K = selection.shape
    out = torch.empty(N, K, dtype=torch.int64, device=selection.device)
    if N and K:
        if selection.stride(1) != 1:
            selection = selection.contiguous()
        table = req_to_token if req_to_token.stride(1) == 1 else req_to_token.contiguous()
        block = min(BLOCK_K, _pow2_at_least(K))
        _entry_index_kernel[(N, triton.cdiv(K, block))](selection, selection.stride(0), token_req.contiguous(),
                                                        req_rows.contiguous(), table, table.stride(0), out, K,
                                                        ratio, BLOCK=block, **_launch_options(4))
    return out


def entry_slot_table(req_to_token: Tensor, req_rows: Tensor, n_entries: Tensor, ratio: int, width: int) -> Tensor:
    """[R, width] int64: slot of compressed entry j of request r — the token at position
    j·ratio + ratio − 1, which completes it (spec §3.4.3) — for j < n_entries[r], else −1."""
    if ratio < 1 or width < 0:
        raise ValueError(f"entry_slot_table: ratio {ratio}, width {width}")
    j = torch.arange(width, device=req_to_token.device)
    pos = (j * ratio + ratio - 1).clamp(max=req_to_token.shape[1] - 1)
    slots = req_to_token[req_rows.to(torch.int64)[:, None], pos[None, :]].to(torch.int64)
    return torch.where(j[None, :] < n_entries.to(torch.int64)[:, None], slots, -1)


def entry_index_table(req_to_token: Tensor, req_rows: Tensor, n_entries: Tensor, ratio: int, width: int,
                      fill: bool = True) -> Tensor:
    """[R, width] int64: packed entry index e of compressed entry j of request r — the slot of the
    token at position j·ratio + ratio − 1 (which completes it), // ratio (contracts §2) — for
    j < n_entries[r], else −1. No host sync. CUDA (or the interpreter): one launch
    (`indexer_tables.entry_index_table`); CPU: `_entry_index_table_torch` (the same values).
    `fill=False`: columns j ≥ n_entries[r] may hold any value (the launch skips them; for readers
    of j < n_entries only — a CUDA-graph layout's table is as wide as the served context)."""
    if req_to_token.is_cuda or INTERPRETED:
        return one_launch_entry_table(req_to_token, req_rows, n_entries, ratio, width, fill=fill)
    return _entry_index_table_torch(req_to_token, req_rows, n_entries, ratio, width)


def _entry_index_table_torch(req_to_token: Tensor, req_rows: Tensor, n_entries: Tensor, ratio: int,
                             width: int) -> Tensor:
    """`entry_index_table` in torch (the same gather as `entry_slot_table`)."""
    slots = entry_slot_table(req_to_token, req_rows, n_entries, ratio, width)
    return torch.where(slots >= 0, torch.div(slots, ratio, rounding_mode="floor"), -1)


__all__ = ["compressed_entry_index", "entry_index_table", "entry_slot_table"]

"""A batch's SWA windows as SWA slots in one launch (spec §3.4.5, contract §3; issue 21): what
`runtime/attention.swa_window_torch` computes in about fifteen torch launches once per forward.

Token t (request row req_rows[token_req[t]], position p) reads window positions q = p − W + 1 + k, k = 0 … W−1
(oldest first): slot s = req_to_token[row, q], SWA slot swa_slot_of[s] (int64), −1 where q < 0. Its own
token's SWA row is swa_slot_of[out_slots[t]]. Integer gathers only: the torch path's values exactly.
Tensor-only signature; no host sync; CUDA-graph capturable.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .fused_elementwise import _launch_options, _pow2_at_least, check_device


@triton.jit
def _swa_window_kernel(pos_ptr, token_req_ptr, rows_ptr, table_ptr, table_stride, map_ptr, out_slots_ptr, slots_ptr,
                       own_ptr, W, BLOCK_W: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, BLOCK_W)
    p = tl.load(pos_ptr + t)
    row = tl.load(rows_ptr + tl.load(token_req_ptr + t)).to(tl.int64)
    q = p - W + 1 + k
    valid = (q >= 0) & (k < W)
    full = tl.load(table_ptr + row * table_stride + tl.maximum(q, 0), mask=valid, other=0).to(tl.int64)
    swa = tl.load(map_ptr + tl.maximum(full, 0), mask=valid, other=0).to(tl.int64)
    tl.store(slots_ptr + t * W + k, tl.where(valid & (full >= 0), swa, -1), mask=k < W)
    tl.store(own_ptr + t, tl.load(map_ptr + tl.load(out_slots_ptr + t)).to(tl.int64))


def swa_window(positions: Tensor, token_req: Tensor, req_rows: Tensor, req_to_token: Tensor, swa_slot_of: Tensor,
               out_slots: Tensor, window: int) -> tuple[Tensor, Tensor]:
    """(SWA slots [N, window] int64 of every token's window (−1 = before position 0), SWA rows [N] int64 of the
    tokens' own slots) — module doc."""
    if window < 1 or req_to_token.dim() != 2 or positions.dim() != 1 or token_req.shape != positions.shape \
            or out_slots.shape != positions.shape:
        raise ValueError(f"swa_window: window {window}, positions {tuple(positions.shape)}, token_req "
                         f"{tuple(token_req.shape)}, out_slots {tuple(out_slots.shape)}, req_to_token "
                         f"{tuple(req_to_token.shape)}")
    check_device("swa_window", positions, token_req, req_rows, req_to_token, swa_slot_of, out_slots)
    N = positions.shape[0]
    slots = torch.empty(N, window, dtype=torch.int64, device=positions.device)
    own = torch.empty(N, dtype=torch.int64, device=positions.device)
    if N:
        table = req_to_token if req_to_token.stride(1) == 1 else req_to_token.contiguous()
        _swa_window_kernel[(N,)](positions, token_req, req_rows, table, table.stride(0), swa_slot_of.contiguous(),
                                 out_slots, slots, own, window, BLOCK_W=_pow2_at_least(window), **_launch_options())
    return slots, own


__all__ = ["swa_window"]

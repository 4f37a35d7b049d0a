"""Compressed entry indices of a top-k selection in one launch (spec §3.4.3–§3.4.4, contract §2; issue 21):
what `runtime/attention._compressed_entries` computes in about seventeen torch launches.

For token t and column k with compressed position j = selection[t, k] (request-local, −1 = none):
entry[t, k] = req_to_token[req_rows[token_req[t]], j·ratio + ratio − 1] // ratio — the slot of the token
that completes position j, divided by the ratio — or −1 where j < 0. Integer arithmetic only, so the
result equals the torch formula exactly (tests/test_kernels_entry_index.py). Tensor-only signature; no
host sync; CUDA-graph capturable.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .fused_elementwise import _launch_options, _pow2_at_least, check_device

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


__all__ = ["compressed_entry_index"]

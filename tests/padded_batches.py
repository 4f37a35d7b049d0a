"""A packed batch of requests for the glue kernels' tests: live requests, then CUDA-graph padding requests."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class PaddedBatch:
    """CPU int64 tensors: per request `prefix`, `extend`, `rows` (request rows; 0 for padding), `starts`;
    per token `token_req`, `positions`, and `out_slots` = 64 + `row_stride`·row + position (0 for padding)."""

    prefix: Tensor
    extend: Tensor
    rows: Tensor
    starts: Tensor
    token_req: Tensor
    positions: Tensor
    out_slots: Tensor


def padded_batch(prefix: list[int], extend: list[int], rows: list[int], padding: int,
                 row_stride: int = 0) -> PaddedBatch:
    """Requests at `rows` extending `extend` tokens after `prefix`, then `padding` padding requests (row 0,
    position 0, one token at slot 0, as SGLang's graph runner pads a decode batch)."""
    prefix, extend, rows = prefix + [0] * padding, extend + [1] * padding, rows + [0] * padding
    ext, req_rows = torch.tensor(extend), torch.tensor(rows)
    token_req = torch.repeat_interleave(torch.arange(len(ext)), ext)
    pos = torch.cat([torch.arange(p, p + e) for p, e in zip(prefix, extend)])
    out = torch.where(req_rows[token_req] > 0, 64 + row_stride * req_rows[token_req] + pos, 0)
    return PaddedBatch(torch.tensor(prefix), ext, req_rows, torch.cumsum(ext, 0) - ext, token_req, pos, out)

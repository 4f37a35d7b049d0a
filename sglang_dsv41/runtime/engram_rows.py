"""Engram row ids of a batch from the request rows' history ring, with the ring advanced (spec §3.3.1).

The path of forwards whose ids were validated on the device (`TorchForward.value_checks` off: CUDA
serving and static layouts) that read the ring (no host history) and are not DSpark verify batches:
`ComputeBackend.engram_ring_rows`. Its torch form is `ring_rows_torch`; `TritonBackend` runs the same in
two launches (`kernels.engram_rows`).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..engram_hash import MULTIMODAL_PAD_ID_BASE, EngramHasher
from .batch import BatchLayout
from .engram_history import EngramHistoryRing, history_tail


def static_row_ids(hasher: EngramHasher, ids: Tensor, layout: BatchLayout, history: Tensor) -> list[Tensor]:
    """`EngramHasher.row_ids` of any layout without its host-side checks (`_segments` sums extend_lens on
    the host, `compressed_window` validates ids): the n-gram window of the token at index i of its request
    b is (ids[i], ids[i−1], …, then history[b, K−1], history[b, K−2], …) — `EngramHasher.window`'s rule
    (same index clamp) — then the same blocking, pad id, token map and per-layer hash (`layer_row_ids`).
    history [B, K] holds the pad id where there is none. Bit-identical to `row_ids`
    (tests/test_runtime_cuda_graph.py, tests/test_runtime_dspark_verify.py)."""
    K, M = hasher.history_len, hasher.max_ngram
    positions, token_req = layout.positions, layout.token_req
    N = ids.shape[0]
    shifts = torch.arange(M, device=ids.device)
    index = torch.arange(N, device=ids.device)
    back = (index - layout.starts[token_req])[:, None] - shifts[None, :]              # [N, M] local index i − s
    from_hist = history[token_req[:, None], (back + K).clamp(min=0, max=K - 1)]       # [N, M]
    from_ids = ids[(index[:, None] - shifts[None, :]).clamp(min=0)]                   # [N, M]
    tok = torch.where(back >= 0, from_ids, from_hist)
    if hasher.image_token_id is not None:
        tok = torch.where(tok >= MULTIMODAL_PAD_ID_BASE, torch.full_like(tok, hasher.image_token_id), tok)
    blocked = positions[:, None] < shifts[None, :]
    if hasher.image_token_id is not None:
        blocked = blocked | (torch.cumsum((tok == hasher.image_token_id).to(torch.int32), dim=1) > 0)
    tok = torch.where(blocked, torch.full_like(tok, hasher.pad_token_id), tok)
    compressed = hasher.token_map.to(tok.device)[tok]
    return [hasher.layer_row_ids(compressed, layer) for layer in hasher.layers]


def ring_rows_torch(hasher: EngramHasher, ids: Tensor, layout: BatchLayout, ring: EngramHistoryRing) -> list[Tensor]:
    """Row ids per Engram layer of `layout`'s tokens (remapped `ids`) from the ring's history, then the
    request rows' ring advanced to the end of this batch (static layouts: padding requests write nothing)."""
    history = ring.read(layout.req_rows, layout.prefix_lens, check=False)
    tail = history_tail(history, ids, layout.starts, layout.prefix_lens, layout.extend_lens)
    ring.advance(layout.req_rows, layout.seq_lens, tail, live=layout.live_requests if layout.static else None)
    history = torch.where(history >= 0, history, torch.full_like(history, hasher.pad_token_id))
    return static_row_ids(hasher, ids, layout, history)


def hash_constants(hasher: EngramHasher) -> tuple[Tensor, Tensor, Tensor]:
    """(multipliers [L, M], primes [L, C], offsets [L, C]) int64 of every Engram layer, stacked once."""
    return tuple(torch.stack([getattr(layer, k) for layer in hasher.layers]).contiguous()
                 for k in ("multipliers", "primes", "offsets"))


__all__ = ["hash_constants", "ring_rows_torch", "static_row_ids"]

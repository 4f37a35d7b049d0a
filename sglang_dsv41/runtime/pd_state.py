"""Request-scoped state of the V4.1 pool under prefill/decode disaggregation (docs/pd.md; spec
integration.md §2.2–§2.5).

SGLang 0.5.17 moves three things of a request from prefill to decode: its KV pages (`kv_data`:
the global rows), the SWA rows of its last window (`StateType.SWA`) and one request-scoped
component, `StateType.C128_STATE`, registered from `pool.get_c128_state_buf_infos()` and indexed
by `disaggregation.utils.get_dsv4_c128_state_indices` on both sides. The V4.1 pool uses that
component for its ratio-2 pair ring, with the boundary-row rule of sglang#38922:

* item = one ring row (D fp32) of `pair_kv[s]` / `pair_score[s]` for every ratio-2 source s,
  kv then score per source (an even count: SGLang's non-MLA send halves every pointer list);
* a prompt of odd length N leaves the pair whose first token is N − 1 pending: each side sends /
  receives the row `req_row · ring + ⌊(N − 1)/2⌋ mod ring` of its own ring; an even N sends none.
  The rings of prefill and decode may differ in size (speculative settings), positions are not
  shipped (they follow from N);
* decode restores, once the transfer has landed (`PREBUILT`), what follows from the prompt ids
  alone: the pending pair's position N − 1 and the Engram history ring (the K ids before N).

Everything else of a request is in the pages SGLang already moves.
"""
from __future__ import annotations

import logging
import weakref
from typing import Sequence

import numpy as np
import torch

from .engram_history import NO_TOKEN

logger = logging.getLogger(__name__)

#: The V4.1 pool of this process that registered PD state (set at kv-manager set-up).
_pd_pool: "weakref.ReferenceType | None" = None


def boundary_rows(req_row: int, seq_len: int, ring: int) -> np.ndarray:
    """int32 ring-row indices a prompt of `seq_len` tokens sends / receives: the pending pair of
    position seq_len − 1 when seq_len is odd, else none."""
    if seq_len <= 0 or seq_len % 2 == 0:
        return np.empty((0,), dtype=np.int32)
    return np.array([int(req_row) * ring + ((seq_len - 1) // 2) % ring], dtype=np.int32)


def pair_row_buf_infos(caches) -> tuple[list[int], list[int], list[int]]:
    """(pointers, byte lengths, item lengths) of the pair ring with one ring row per item, kv then
    score of each ratio-2 source (sorted)."""
    bufs = [t for s in sorted(caches.pair_kv) for t in (caches.pair_kv[s], caches.pair_score[s])]
    return [b.data_ptr() for b in bufs], [b.nbytes for b in bufs], [b[0, 0].nbytes for b in bufs]


def set_pd_pool(pool) -> None:
    """Record the V4.1 pool whose ring the index hook uses in this process."""
    global _pd_pool
    _pd_pool = weakref.ref(pool)


def pd_pool():
    return None if _pd_pool is None else _pd_pool()


def c128_state_indices_hook(original, req_pool_idx, seq_len, *, online, ring_size):
    """AROUND `disaggregation.utils.get_dsv4_c128_state_indices` (prefill and decode): for the V4.1
    pool, the boundary row of its own pair ring; SGLang's rule for any other pool."""
    pool = pd_pool()
    if pool is None:
        return original(req_pool_idx, seq_len, online=online, ring_size=ring_size)
    return boundary_rows(req_pool_idx, seq_len, pool.runtime_caches.pair_ring_slots)


def restore_after_transfer(caches, req_rows: Sequence[int], prompts: Sequence[Sequence[int]], remap) -> None:
    """Decode side, after a transfer landed: each request row's ring marks the pending pair of an odd
    prompt length N at position N − 1 (its row arrived in the transfer; every other slot: none), and
    its Engram history ring holds the (remapped) ids before N with end = N."""
    ring = caches.pair_ring_slots
    K = caches.engram_history.history_len
    for row, ids in zip(req_rows, prompts):
        n = len(ids)
        for pos in caches.pair_position.values():
            pos[row].fill_(-1)
            if n % 2:
                pos[row, ((n - 1) // 2) % ring] = n - 1
        if K:
            tail = torch.full((K,), NO_TOKEN, dtype=torch.int64)
            take = list(ids[max(0, n - K):])
            if take:
                tail[K - len(take):] = remap(torch.as_tensor(take, dtype=torch.int64))
            caches.engram_history.ids[row] = tail.to(caches.engram_history.ids)
        caches.engram_history.end[row] = n


def prepare_for_prebuilt_hook(result, batch):
    """AFTER `ScheduleBatchDisaggregationDecodeMixin.prepare_for_prebuilt`: a decode server of the
    V4.1 pool restores each transferred request's state that follows from its prompt
    (`restore_after_transfer`). Other pools: untouched."""
    from ..numerics.geometry import language_model_ids
    from .kv_pool import DeepseekV41KVPool

    pool = batch.token_to_kv_pool_allocator.get_kvcache()
    if not isinstance(pool, DeepseekV41KVPool):
        return result
    cfg = batch.model_config.hf_config.parsed()
    restore_after_transfer(pool.runtime_caches, [int(r.req_pool_idx) for r in batch.reqs],
                           [r.origin_input_ids for r in batch.reqs], lambda ids: language_model_ids(ids, cfg))
    return result

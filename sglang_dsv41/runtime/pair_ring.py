"""Ratio-2 kv sources: the pair latents of a batch and the request's pending-pair ring, in torch (spec §3.4.3).

Every token t at position p computes the candidate entry of the pair (p − 1, p) from the fp32 `wkv` /
`wgate` outputs a, s [N, D]: the first token's a, s from the batch when p − 1 is in it, else from the
request's ring slot ⌊(p−1)/2⌋ (`RuntimeCaches.pending_pair`). Only live odd tokens write their entry
(slot // 2); the others write entry −1, the sink. After the layer, each live request whose last token
sits at an even position stores that token's a, s in its ring; one ending at an odd position empties
its slot (`RuntimeCaches.store_pending_pairs`).

This is `ComputeBackend.pair_latents` / `store_pending_pairs`' torch form (the CPU backends);
`TritonBackend` runs the same in two launches (`kernels.pair_state`), and DSpark verify batches
(`store_verify_pairs`) keep this path on every backend.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .attention_math import pair_latents as pooled_latents
from .batch import BatchLayout
from .cache import RuntimeCaches


def pair_firsts(layout: BatchLayout, caches: RuntimeCaches, source: int, a: Tensor,
                s: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(a₁, s₁ [N, D] of each token's pair, in-batch flag [N, 1], RoPE position max(p − 1, 0) [N])."""
    pos = layout.positions
    req_rows = layout.req_rows[layout.token_req]
    in_batch = (pos > layout.prefix_lens[layout.token_req])[:, None]           # token p − 1 is in the batch
    prev = (torch.arange(pos.shape[0], device=pos.device) - 1).clamp(min=0)
    first_pos = (pos - 1).clamp(min=0)
    a_held, s_held, _ = caches.pending_pair(source, req_rows, first_pos)
    return torch.where(in_batch, a[prev], a_held), torch.where(in_batch, s[prev], s_held), in_batch, first_pos


def pair_latents_torch(be, a: Tensor, s: Tensor, layout: BatchLayout, caches: RuntimeCaches, source: int,
                       norm_weight: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """(latents [N, D], entry indices [N] (−1 = none), RoPE positions [N]) of the batch's pairs."""
    a_first, s_first, _, first_pos = pair_firsts(layout, caches, source, a, s)
    latents = pooled_latents(be, a_first, s_first, a, s, norm_weight, eps)
    odd = (layout.positions % 2) == 1
    return latents, torch.where(odd & layout.live_tokens, layout.out_slots // 2, -1), first_pos


def store_pending_torch(a: Tensor, s: Tensor, layout: BatchLayout, caches: RuntimeCaches, source: int) -> None:
    """Pending first tokens of requests whose last batch token sits at an even position; padding
    requests (last token not live, or no tokens) write their rows' own values back (no change)."""
    last = layout.last_tokens
    live_req = layout.live_tokens[last] & (layout.extend_lens > 0)          # `BatchLayout.live_requests`
    pending = ((layout.positions[last] % 2) == 0) & live_req
    caches.store_pending_pairs(source, layout.req_rows, layout.positions[last], pending, live_req, a[last], s[last])


def store_verify_pairs(a: Tensor, s: Tensor, layout: BatchLayout, caches: RuntimeCaches, source: int) -> None:
    """DSpark verify: any draft position may become the committed end, so every live token keeps the
    pending pair of its compressed position (odd tokens re-write their in-batch partner's, identical
    values); the ring (≥ 2 + w slots) never lets them clobber the committed pair."""
    a_first, s_first, in_batch, _ = pair_firsts(layout, caches, source, a, s)
    pos = layout.positions
    odd = (pos % 2) == 1
    keep = layout.live_tokens & (~odd | in_batch[:, 0])
    caches.store_block_pairs(source, layout.req_rows[layout.token_req], pos - pos % 2, keep,
                             torch.where(odd[:, None], a_first, a), torch.where(odd[:, None], s_first, s))


def check_pair_state(layout: BatchLayout, caches: RuntimeCaches, source: int) -> None:
    """CPU only (`BatchLayout.host_checks`): an odd token whose first token is not in the batch needs the
    request's pending pair state of position p − 1 (a prefix hit at an odd length would not have one)."""
    pos = layout.positions
    req_rows = layout.req_rows[layout.token_req]
    _, _, stored = caches.pending_pair(source, req_rows, (pos - 1).clamp(min=0))
    stale = ((pos % 2) == 1) & (pos <= layout.prefix_lens[layout.token_req]) & (stored != pos - 1)
    if bool(stale.any()):
        t = int(torch.nonzero(stale)[0, 0])
        raise RuntimeError(
            f"sglang-dsv41: kv source {source}: the token at odd position {int(pos[t])} of request row "
            f"{int(req_rows[t])} completes a ratio-2 pair whose first token is neither in this batch nor "
            f"the request's pending pair state (holds position {int(stored[t])}); "
            "a forward must start at an even position or continue the request's previous chunk "
            "(prefix hits are page-aligned with an even page_size, contract §4)")


__all__ = ["check_pair_state", "pair_firsts", "pair_latents_torch", "store_pending_torch", "store_verify_pairs"]

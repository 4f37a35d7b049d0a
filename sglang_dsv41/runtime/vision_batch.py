"""The image rows of one SGLang extend batch (spec §3.1 item 4; issue 17 item 1).

`batch_image_rows(forward_batch, tower, cache)` returns (batch positions, span rows) for every
image-span position inside this batch's chunks: request i's chunk covers absolute positions
[prefix_i, prefix_i + extend_i) at batch offset Σ extend_<i; an item's span is its inclusive
`offsets` (set by `mm_processor`). A span straddling chunks contributes its overlap with each, so
chunked prefill across an image and a prefix hit inside or after one both place exactly the rows
the reference would. Decode batches and text requests give None.

`SpanCache` keeps the last `capacity` images' span rows by item hash, so the chunks of one image
run the tower once.

Encoder data-parallel (SGLang's `--mm-enable-dp-encoder`: the encoder replicated, the images split
over the TP ranks, the rows all-gathered): with `dp` of size > 1, the images a batch needs and the
cache lacks are assigned to ranks by `owners` (most patches first, to the least-loaded rank), each
rank encodes its own, and one `all_gather` of the rank blocks (padded to the longest) gives every
rank every image's rows. Every TP rank runs the same batch with the same cache history, so all
ranks reach the collective together with the same image list; the rows equal those of encoding
every image on one rank (the tower encodes images independently). Without `dp` every rank encodes
every image (replicated). Either way a rank's images go through `VisionTower.encode_many` together
(packed varlen ViT calls, `runtime/vision_calls.py`).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
from torch import Tensor

from .mm_processor import grid_of, preprocessed_of
from .vision import VisionTower


class SpanCache:
    def __init__(self, capacity: int = 16) -> None:
        self.capacity = capacity
        self._rows: OrderedDict[Any, Tensor] = OrderedDict()

    @staticmethod
    def key(item: Any) -> Any:
        return item.hash if item.hash is not None else id(item)

    def get(self, item: Any) -> Tensor | None:
        hit = self._rows.get(self.key(item))
        if hit is not None:
            self._rows.move_to_end(self.key(item))
        return hit

    def put(self, item: Any, rows: Tensor) -> None:
        self._rows[self.key(item)] = rows
        while len(self._rows) > self.capacity:
            self._rows.popitem(last=False)


def owners(patches: list[int], ranks: int) -> list[int]:
    """The rank that encodes each image: most patches first (ties: lower index) to the rank with
    the fewest patches so far (ties: lower rank). Deterministic, so every rank computes the same."""
    load = [0] * ranks
    out = [0] * len(patches)
    for i in sorted(range(len(patches)), key=lambda i: (-patches[i], i)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        out[i] = r
        load[r] += patches[i]
    return out


def encode_images(items: list[Any], tower: VisionTower, dp: Any = None) -> tuple[list[Tensor], int]:
    """Every item's span rows, and how many images this rank ran through the tower (module doc:
    with `dp` of size > 1 only this rank's share, then one all-gather)."""
    if dp is None or dp.size == 1 or not items:
        return tower.encode_many([preprocessed_of(it) for it in items]), len(items)
    grids = [grid_of(it) for it in items]
    owner = owners([g.num_patches for g in grids], dp.size)
    tokens = [g.num_tokens for g in grids]
    per_rank = [sum(t for t, o in zip(tokens, owner) if o == r) for r in range(dp.size)]
    longest, hidden = max(per_rank), tower.image_start.shape[-1]
    mine = tower.encode_many([preprocessed_of(it) for it, o in zip(items, owner) if o == dp.rank])
    block = torch.zeros(longest, hidden, dtype=tower.image_start.dtype, device=tower.device)
    if mine:
        local = torch.cat(mine)
        block[:local.shape[0]] = local
    gathered = dp.all_gather(block, 0)
    start = [r * longest for r in range(dp.size)]
    out = []
    for t, o in zip(tokens, owner):
        out.append(gathered[start[o]:start[o] + t])
        start[o] += t
    return out, len(mine)


def batch_image_rows(forward_batch: Any, tower: VisionTower | None, cache: SpanCache,
                     dp: Any = None) -> tuple[Tensor, Tensor] | None:
    """(positions int64 [M], rows [M, hidden]) of the batch's image-span tokens (module doc;
    `dp`: the TP group when the encoder runs data-parallel)."""
    mm_inputs = getattr(forward_batch, "mm_inputs", None)
    if not mm_inputs or not any(m is not None for m in mm_inputs):
        return None
    if forward_batch.forward_mode.name not in ("EXTEND", "MIXED"):
        return None
    if tower is None:
        raise RuntimeError("sglang-dsv41: an image request reached a model built without its vision tower "
                           "(--language-model-only)")
    pieces: list[tuple[Any, int, int, int, int, int]] = []      # item, span start/end, lo, hi, batch offset
    offset = 0
    for mm, prefix, extend in zip(mm_inputs, forward_batch.extend_prefix_lens_cpu, forward_batch.extend_seq_lens_cpu):
        prefix, extend = int(prefix), int(extend)
        for item in (mm.mm_items if mm is not None else ()):
            for start, end in item.offsets:
                lo, hi = max(start, prefix), min(end + 1, prefix + extend)
                if lo < hi:
                    pieces.append((item, start, end, lo, hi, offset - prefix))
        offset += extend
    if not pieces:
        return None
    spans: dict[Any, Tensor | None] = {}                         # hits first: the puts below may evict
    missing: dict[Any, Any] = {}
    for item, *_ in pieces:
        key = cache.key(item)
        if key not in spans:
            spans[key] = cache.get(item)
            if spans[key] is None:
                missing[key] = item
    for (key, item), encoded in zip(missing.items(), encode_images(list(missing.values()), tower, dp)[0]):
        spans[key] = encoded
        cache.put(item, encoded)
    positions: list[Tensor] = []
    rows: list[Tensor] = []
    for item, start, end, lo, hi, shift in pieces:
        span = spans[cache.key(item)]
        if span.shape[0] != end - start + 1:
            raise RuntimeError(f"sglang-dsv41: image span of {end - start + 1} tokens, the tower gave "
                               f"{span.shape[0]} rows")
        rows.append(span[lo - start:hi - start])
        positions.append(torch.arange(lo + shift, hi + shift, dtype=torch.int64))
    device = tower.device
    return torch.cat(positions).to(device), torch.cat(rows)

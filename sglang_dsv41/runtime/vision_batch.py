"""The image rows of one SGLang extend batch (spec §3.1 item 4; issue 17 item 1).

`batch_image_rows(forward_batch, tower, cache)` returns (batch positions, span rows) for every
image-span position inside this batch's chunks: request i's chunk covers absolute positions
[prefix_i, prefix_i + extend_i) at batch offset Σ extend_<i; an item's span is its inclusive
`offsets` (set by `mm_processor`). A span straddling chunks contributes its overlap with each, so
chunked prefill across an image and a prefix hit inside or after one both place exactly the rows
the reference would. Decode batches and text requests give None.

`SpanCache` keeps the last `capacity` images' span rows by item hash, so the chunks of one image
run the tower once.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
from torch import Tensor

from .mm_processor import preprocessed_of
from .vision import VisionTower


class SpanCache:
    def __init__(self, capacity: int = 16) -> None:
        self.capacity = capacity
        self._rows: OrderedDict[Any, Tensor] = OrderedDict()

    def rows(self, item: Any, tower: VisionTower) -> Tensor:
        key = item.hash if item.hash is not None else id(item)
        hit = self._rows.get(key)
        if hit is None:
            hit = tower.encode(preprocessed_of(item))
            self._rows[key] = hit
            while len(self._rows) > self.capacity:
                self._rows.popitem(last=False)
        else:
            self._rows.move_to_end(key)
        return hit


def batch_image_rows(forward_batch: Any, tower: VisionTower | None, cache: SpanCache) -> tuple[Tensor, Tensor] | None:
    """(positions int64 [M], rows [M, hidden]) of the batch's image-span tokens (module doc)."""
    mm_inputs = getattr(forward_batch, "mm_inputs", None)
    if not mm_inputs or not any(m is not None for m in mm_inputs):
        return None
    if forward_batch.forward_mode.name not in ("EXTEND", "MIXED"):
        return None
    if tower is None:
        raise RuntimeError("sglang-dsv41: an image request reached a model built without its vision tower "
                           "(--language-model-only)")
    positions: list[Tensor] = []
    rows: list[Tensor] = []
    offset = 0
    for mm, prefix, extend in zip(mm_inputs, forward_batch.extend_prefix_lens_cpu, forward_batch.extend_seq_lens_cpu):
        prefix, extend = int(prefix), int(extend)
        for item in (mm.mm_items if mm is not None else ()):
            for start, end in item.offsets:
                lo, hi = max(start, prefix), min(end + 1, prefix + extend)
                if lo >= hi:
                    continue
                span = cache.rows(item, tower)
                if span.shape[0] != end - start + 1:
                    raise RuntimeError(f"sglang-dsv41: image span of {end - start + 1} tokens, the tower gave "
                                       f"{span.shape[0]} rows")
                rows.append(span[lo - start:hi - start])
                positions.append(torch.arange(offset + lo - prefix, offset + hi - prefix, dtype=torch.int64))
        offset += extend
    if not rows:
        return None
    device = tower.device
    return torch.cat(positions).to(device), torch.cat(rows)

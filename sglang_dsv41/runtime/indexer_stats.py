"""Indexer selection statistics, sampled from eager forwards (issue 20 item 4;
docs/observability.md).

Every indexer layer picks, per query token, up to `index_topk` compressed positions (−1 padded;
spec §3.4.4). With ``--enable-metrics`` every `every`-th eager forward (prefill, and decode when
it does not replay a CUDA graph) reads its selections and sets, per indexer layer:

* ``sglang_dsv41:indexer_selected_entries{layer}`` — mean valid selections per query token;
* ``sglang_dsv41:indexer_topk_fill{layer}`` — that mean over `index_topk` (0–1): 1 means every
  query had at least `index_topk` visible compressed entries to choose from;

and counts the sampled forwards and query tokens (``indexer_sampled_forwards_total``,
``indexer_sampled_tokens_total``). A sampled forward costs one device→host copy of one small
tensor; the others cost a counter increment. Graph captures are never sampled (no host sync).
"""
from __future__ import annotations

import os
from typing import Any, Mapping

import torch
from torch import Tensor

from . import metrics

#: Environment variable: sample every N-th eager forward (default 8; 0 turns sampling off).
EVERY_ENV = "SGLANG_DSV41_INDEXER_STATS_EVERY"
DEFAULT_EVERY = 8


def sampling_interval() -> int:
    raw = os.environ.get(EVERY_ENV, str(DEFAULT_EVERY))
    try:
        every = int(raw)
    except ValueError:
        raise ValueError(f"{EVERY_ENV}={raw!r} is not an integer (sample every N-th forward; 0 = off)") from None
    if every < 0:
        raise ValueError(f"{EVERY_ENV}={every} must be ≥ 0 (0 = off)")
    return every


def selection_summary(selections: Mapping[int, Tensor]) -> tuple[list[int], Tensor]:
    """(indexer layers, fp32 [layers] mean valid selections per query token) of one forward's
    `ForwardScratch.selections` ([N, index_topk], −1 padded), computed on the device."""
    layers = sorted(selections)
    if not layers:
        return [], torch.zeros(0)
    means = [(selections[layer] >= 0).sum(dim=1, dtype=torch.float32).mean() for layer in layers]
    return layers, torch.stack(means)


class IndexerSelectionStats:
    """Sampler of one model's forwards: `observe` is called after every eager forward."""

    def __init__(self, index_topk: int, tp_rank: int, every: int | None = None,
                 enabled: bool | None = None) -> None:
        self.index_topk, self.tp_rank = index_topk, tp_rank
        self.every = sampling_interval() if every is None else every
        self._enabled = enabled
        self.forwards = 0

    @property
    def enabled(self) -> bool:
        if self._enabled is None:
            self._enabled = metrics.metrics_enabled()
        return self._enabled and self.every > 0

    def observe(self, selections: Mapping[int, Tensor], num_tokens: int) -> None:
        if not self.enabled or not selections:
            return
        self.forwards += 1
        if self.forwards % self.every:
            return
        layers, means = selection_summary(selections)
        publish(layers, means.tolist(), self.index_topk, num_tokens, self.tp_rank)


def publish(layers: list[int], means: list[float], index_topk: int, num_tokens: int, tp_rank: int) -> None:
    rank = str(tp_rank)
    selected = metrics.gauge("indexer_selected_entries", "mean valid indexer selections per query token "
                             "(sampled forwards)", "layer")
    fill = metrics.gauge("indexer_topk_fill", "mean valid indexer selections per query token / index_topk "
                         "(sampled forwards)", "layer")
    for layer, mean in zip(layers, means):
        selected.labels(rank, str(layer)).set(mean)
        fill.labels(rank, str(layer)).set(mean / index_topk)
    sampled: Any = metrics.counter("indexer_sampled_forwards", "forwards whose indexer selections were sampled")
    sampled.labels(rank).inc()
    tokens: Any = metrics.counter("indexer_sampled_tokens", "query tokens of the sampled forwards")
    tokens.labels(rank).inc(num_tokens)

"""Vocabulary-parallel embedding and LM head (issue 13 item 4; spec §3.1, §3.7).

The vocabulary is split as SGLang's `VocabParallelEmbedding` / `ParallelLMHead` split it
(`tensor_parallel.vocab_shard`: padded to a multiple of 64, equal blocks, the padding held by
nobody); each rank owns the `embed.weight` / `head.weight` rows of its block. Both are
bit-identical to TP 1:

* embedding: a rank looks up the ids it holds and writes −0.0 for the others (the additive
  identity of IEEE addition, ±0 included); SGLang's all-reduce of the rows then yields each row
  exactly once;
* head: a rank computes the logits of its block (each column is a complete dot product, no
  cross-rank sum), pads them to the common block width, and SGLang's all-gather concatenates the
  blocks in rank order; the padding columns are cut off.
"""
from __future__ import annotations

from typing import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor

from .backend import ComputeBackend
from .layers import OwnedTensors
from .tensor_parallel import ShardPlan, TensorParallel


class VocabParallelEmbedding(OwnedTensors):
    """`{prefix}weight` rows `plan.vocab`; `forward(ids)` → the full [N, hidden] rows on every rank."""

    def __init__(self, weights: Mapping[str, object], prefix: str, plan: ShardPlan, tp: TensorParallel) -> None:
        super().__init__(weights, prefix)
        self.vocab, self.tp = plan.vocab, tp

    def forward(self, ids: Tensor) -> Tensor:
        w = self["weight"]
        if self.tp.size == 1:
            return w[ids]
        held = self.vocab
        local = ids.to(torch.int64) - held.start
        owned = (local >= 0) & (local < len(held))
        if len(held):
            rows = w[local.clamp(0, len(held) - 1)]
        else:
            rows = w.new_zeros(ids.shape[0], w.shape[1])
        rows = torch.where(owned[:, None], rows, torch.full_like(rows, -0.0))
        return self.tp.all_reduce_sum(rows.contiguous())


class ParallelLMHead(OwnedTensors):
    """`{prefix}weight` rows `plan.vocab`; `forward(hidden, backend)` → fp32 logits [N, vocab_size]
    (every rank: the blocks all-gathered)."""

    def __init__(self, weights: Mapping[str, object], prefix: str, plan: ShardPlan, tp: TensorParallel,
                 vocab_size: int) -> None:
        super().__init__(weights, prefix)
        self.vocab, self.per_rank, self.vocab_size, self.tp = plan.vocab, plan.vocab_per_rank, vocab_size, tp

    def forward(self, hidden: Tensor, backend: ComputeBackend) -> Tensor:
        local = backend.matmul(hidden, self["weight"])
        if self.tp.size == 1:
            return local
        if local.shape[1] < self.per_rank:
            local = F.pad(local, (0, self.per_rank - local.shape[1]))
        return self.tp.all_gather(local, -1)[:, :self.vocab_size]

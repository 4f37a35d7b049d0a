"""Per-request state and per-call results of the reference model (spec `model.md` §3.3.1, §3.5, §4).

* `NumericsProfile`: the deployment-dependent numerics the reference can pin (spec §3.8):
  KV-cache storage (`CacheProfile` none / fp8 "v4" / fp4 "v41") and activation quantisation of
  the FP8 dense linears (per-32 UE8M0 E4M3). Routed experts are always W4A16 (Hopper, §3.8).
* `RequestState`: everything a request carries between forward calls — the attention caches of
  every layer, the Engram n-gram history (last max_ngram−1 committed ids) and the DSpark
  target features of every token forwarded with `capture=True`. Its `length` is the position
  of the next token; a chunk of T tokens occupies positions length..length+T−1.
* `ForwardOutput`: fp32 logits of every token of the chunk and, when captured, the DSpark
  features of the chunk.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .attention import AttentionState
from ..numerics.profile import CacheProfile, NumericsProfile  # noqa: F401  (re-exported)


@dataclass
class RequestState:
    """One request's carried state (grows with every forward call).

    * `attention`: SWA / compressed / index-key caches of every layer (`attention.length` tokens);
    * `engram_history`: [max_ngram−1] int64 last committed (remapped) ids, oldest first
      (pad ids before the first token; blocked by position anyway); None without Engram layers;
    * `dspark_features`: [n, len(dspark_target_layer_ids), hidden] BF16-valued stream means of
      the residual entering each target layer, for every token forwarded with `capture=True`
      (in forward order).
    """

    attention: AttentionState
    engram_history: Tensor | None
    dspark_features: Tensor

    @property
    def length(self) -> int:
        """Tokens processed so far = position of the next token."""
        return self.attention.length

    def clone(self) -> "RequestState":
        """Deep copy (fork a request, e.g. from a cached prefix or before speculative tokens)."""
        return RequestState(
            attention=self.attention.clone(),
            engram_history=None if self.engram_history is None else self.engram_history.clone(),
            dspark_features=self.dspark_features.clone(),
        )


@dataclass(frozen=True)
class ForwardOutput:
    """Result of one forward call on a chunk of T tokens.

    logits [T, vocab] fp32; captured [T, len(dspark_target_layer_ids), hidden] (BF16 values) or
    None when `capture=False`.
    """

    logits: Tensor
    captured: Tensor | None = None


def empty_features(n_targets: int, hidden: int, device: torch.device | str) -> Tensor:
    return torch.empty(0, n_targets, hidden, dtype=torch.float32, device=device)

"""The DSpark Markov head and confidence head as `nn.Module`s owning their tensors (spec
`model.md` §4 "Markov bias", "Confidence"), with the interface SGLang 0.5.17's DSpark worker calls.

* `MarkovHead` owns `markov_head.embed.weight` (markov_w1 [V, r]) and `markov_head.head.weight`
  (markov_w2 [V, r]), BF16 values. Step bias of a previous token t: markov_w2 · markov_w1[t],
  fp32 (the backend's product: correctly rounded on the exact backend). `sample_block(base_logits
  [B, γ, V], first_prev_tokens [B], hidden_states, sampler)` → (tokens [B, γ], corrected logits
  [B, γ, V] fp32): step k adds the bias of prev_k (prev_0 = the anchor, then the previous step's
  token) to base_logits[:, k] and calls `sampler(step_logits, k)` — sequential, like the
  reference's `propose_drafts`.
* `ConfidenceHead` owns `confidence_head.proj.weight` [1, H + r] fp32, no bias:
  c = sigmoid(proj([x ; markov_w1[prev]]) / T_sts), T_sts = `sts_temperatures` (1 unless SGLang's
  planner loads a calibration; a scalar or one per block position). `with_markov` is True (the
  V4.1 head always reads the Markov features).
"""
from __future__ import annotations

from typing import Callable, Mapping

import torch
from torch import Tensor, nn

from .backend import ComputeBackend
from .layers import OwnedTensors

F32 = torch.float32
StepSampler = Callable[[Tensor, int], Tensor]


class MarkovHead(OwnedTensors):
    """`{prefix}markov_head.*` (module doc). `backend` is set by the draft at load."""

    markov_head_type = "vanilla"

    def __init__(self, weights: Mapping[str, object], head_prefix: str) -> None:
        super().__init__(weights, head_prefix + "markov_head.")
        self.backend: ComputeBackend | None = None
        w1, w2 = self["embed.weight"], self["head.weight"]
        if w1.shape != w2.shape:
            raise ValueError(f"Markov head: embed {tuple(w1.shape)} and head {tuple(w2.shape)} differ")
        self.vocab_size, self.markov_rank = int(w1.shape[0]), int(w1.shape[1])

    def configure_tp_shard(self, *, lm_head: nn.Module) -> None:
        """SGLang's vocab-sharded Markov path is not used: the draft's logits are complete."""

    def get_prev_embeddings(self, token_ids: Tensor) -> Tensor:
        """markov_w1[token_ids] → [..., r] (BF16 values, fp32)."""
        ids = token_ids.to(torch.int64)
        if ids.device.type == "cpu" and ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
            raise ValueError(f"DSpark Markov head: token id outside [0, {self.vocab_size})")   # CPU only: no host sync
        return self["embed.weight"][ids]

    def step_bias(self, token_ids: Tensor) -> Tensor:
        """markov_w2 · markov_w1[token_ids] → [B, V] fp32."""
        if self.backend is None:
            raise RuntimeError("DSpark Markov head used before the draft loaded its weights")
        return self.backend.matmul(self.get_prev_embeddings(token_ids.reshape(-1)), self["head.weight"])

    def apply_step_logits(self, logits: Tensor, *, token_ids: Tensor, hidden_states: Tensor | None = None) -> Tensor:
        return logits.to(F32) + self.step_bias(token_ids)

    def sample_block(self, base_logits: Tensor, *, first_prev_tokens: Tensor, hidden_states: Tensor | None,
                     sampler: StepSampler) -> tuple[Tensor, Tensor]:
        """Sequential Markov-corrected sampling of one block per request (module doc)."""
        if base_logits.dim() != 3 or base_logits.shape[0] != first_prev_tokens.reshape(-1).shape[0]:
            raise ValueError(f"sample_block: base logits {tuple(base_logits.shape)} for "
                             f"{first_prev_tokens.numel()} anchors")
        prev = first_prev_tokens.reshape(-1).to(torch.int64)
        tokens, corrected = [], []
        for k in range(base_logits.shape[1]):
            step_logits = self.apply_step_logits(base_logits[:, k], token_ids=prev)
            prev = sampler(step_logits, k).to(torch.int64).reshape(-1)
            tokens.append(prev)
            corrected.append(step_logits)
        if not tokens:
            return torch.empty(base_logits.shape[0], 0, dtype=torch.int64, device=base_logits.device), base_logits
        return torch.stack(tokens, dim=1), torch.stack(corrected, dim=1)


class ConfidenceHead(OwnedTensors):
    """`{prefix}confidence_head.proj.weight` (module doc)."""

    with_markov = True

    def __init__(self, weights: Mapping[str, object], head_prefix: str) -> None:
        super().__init__(weights, head_prefix + "confidence_head.")
        self.register_buffer("sts_temperatures", torch.ones((), dtype=F32, device=self["proj.weight"].device),
                             persistent=False)
        self._last_confidence_raw: Tensor | None = None
        #: accumulation dtype of the product (the draft sets its backend's `acc`)
        self.acc: torch.dtype = F32

    def forward(self, hidden_states: Tensor, markov_embed_stack: Tensor) -> Tensor:
        """Raw confidence logits [..., γ] of hidden [..., H] and Markov features [..., r]
        (fp32 products summed in `acc` — the backend's: float64 rounded once on `exact`, fp32 on
        the serving backends; `proj` is a 1-row fp32 weight)."""
        proj = self["proj.weight"].to(F32)
        feats = torch.cat((hidden_states.to(F32), markov_embed_stack.to(F32)), dim=-1)
        if feats.shape[-1] != proj.shape[1]:
            raise ValueError(f"confidence proj expects {proj.shape[1]} inputs, got {feats.shape[-1]}")
        return (feats.to(self.acc) @ proj.to(self.acc).t()).squeeze(-1).to(F32)

    def apply_sts(self, confidence_raw: Tensor) -> Tensor:
        self._last_confidence_raw = confidence_raw
        return torch.sigmoid(confidence_raw.to(F32) / self.sts_temperatures.to(F32))

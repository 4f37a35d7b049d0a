"""Verification of a DSpark draft block against the target model (spec `model.md` §4 "Verification").

The target runs one TARGET_VERIFY forward over the γ+1 rows [anchor, d_0, …, d_{γ−1}] at
positions P..P+γ. Row i of its logits is the target's next-token distribution after
[…, anchor, d_0, …, d_{i−1}], i.e. the distribution of the token at position P+i+1, so row k
verifies draft d_k (k < γ) and row γ yields the bonus token.

Invariants:

* **Greedy**: accept d_k while d_k == argmax(row k) (first index on ties, like `torch.argmax`);
  the first mismatch (or the bonus row γ when every draft matched) contributes argmax of its
  row. The emitted tokens are therefore exactly what plain greedy decoding of the target emits
  — acceptance only changes how many tokens one round yields.
* **Sampling (chain rejection)** with target probabilities p (rows 0..γ) and the draft
  probabilities q (rows 0..γ−1, the distribution each d_k was drawn from): for k = 0..γ−1 draw
  u ~ U[0, 1); accept d_k iff u·q(d_k) < p(d_k); on the first rejection emit a sample of
  normalise(max(p_k − q_k, 0)) and stop; if every draft is accepted emit a sample of p_γ
  (bonus). Every emitted token is then distributed exactly as p (standard speculative sampling).
* A round always emits `accepted + 1` tokens (1..γ+1).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from .ops import F32


@dataclass(frozen=True)
class VerifyOutcome:
    """Result of verifying one draft block.

    `accepted` = number of draft tokens accepted (0..γ); `tokens` = the accepted drafts followed
    by one target token (the correction at the first rejected row, or the bonus token when all
    γ were accepted), so `len(tokens) == accepted + 1`.
    """

    accepted: int
    tokens: tuple[int, ...]


def _draft_list(draft_tokens: Sequence[int] | Tensor) -> list[int]:
    if isinstance(draft_tokens, Tensor):
        if draft_tokens.dim() != 1:
            raise ValueError(f"draft tokens must be 1-D, got shape {tuple(draft_tokens.shape)}")
        return [int(t) for t in draft_tokens.tolist()]
    return [int(t) for t in draft_tokens]


def _check_rows(name: str, rows: Tensor, n: int, vocab: int | None = None) -> None:
    if rows.dim() != 2 or rows.shape[0] != n or (vocab is not None and rows.shape[1] != vocab):
        want = f"[{n}, {vocab if vocab is not None else 'V'}]"
        raise ValueError(f"{name} has shape {tuple(rows.shape)}, expected {want}")


def verify_greedy(draft_tokens: Sequence[int] | Tensor, target_logits: Tensor) -> VerifyOutcome:
    """Greedy acceptance: d_k accepted while it equals argmax of target row k (rows [γ+1, V])."""
    drafts = _draft_list(draft_tokens)
    gamma = len(drafts)
    _check_rows("target_logits", target_logits, gamma + 1)
    choice = torch.argmax(target_logits.to(F32), dim=-1).tolist()
    accepted = 0
    while accepted < gamma and drafts[accepted] == choice[accepted]:
        accepted += 1
    return VerifyOutcome(accepted=accepted, tokens=tuple(drafts[:accepted]) + (int(choice[accepted]),))


def sample_from(probs: Tensor, generator: torch.Generator) -> int:
    """One draw from a probability vector [V] (non-negative, positive sum) with `generator`."""
    if probs.dim() != 1:
        raise ValueError(f"sample_from expects a 1-D probability vector, got shape {tuple(probs.shape)}")
    p = probs.to(F32)
    if not torch.isfinite(p).all() or (p < 0).any() or float(p.sum()) <= 0.0:
        raise ValueError("sample_from: probabilities must be finite, non-negative and not all zero")
    return int(torch.multinomial(p, 1, generator=generator).item())


def verify_chain_rejection(draft_tokens: Sequence[int] | Tensor, draft_probs: Tensor,
                           target_probs: Tensor, generator: torch.Generator) -> VerifyOutcome:
    """Chain rejection sampling (spec §4): draft_probs q [γ, V], target_probs p [γ+1, V].

    Accept d_k iff u·q(d_k) < p(d_k) with a fresh u ~ U[0, 1) per row; on the first rejection
    resample from normalise(max(p_k − q_k, 0)); if all are accepted draw the bonus from p_γ.
    """
    drafts = _draft_list(draft_tokens)
    gamma = len(drafts)
    _check_rows("target_probs", target_probs, gamma + 1)
    vocab = target_probs.shape[1]
    _check_rows("draft_probs", draft_probs, gamma, vocab)
    p = target_probs.to(F32)
    q = draft_probs.to(F32)
    for k, d in enumerate(drafts):
        if not 0 <= d < vocab:
            raise ValueError(f"draft token {d} outside the vocabulary of size {vocab}")
        u = float(torch.rand((), generator=generator))
        if u * float(q[k, d]) < float(p[k, d]):
            continue
        residual = (p[k] - q[k]).clamp(min=0.0)
        if float(residual.sum()) <= 0.0:
            # Rejection with p ≤ q everywhere means p == q up to rounding, where rejection has
            # probability 0 unless q(d) == 0 — the draft then violated its own distribution.
            raise ValueError(f"row {k}: draft token {d} rejected but max(p − q, 0) is all zero "
                             f"(q(d) = {float(q[k, d])}, p(d) = {float(p[k, d])}); was d drawn from q?")
        return VerifyOutcome(accepted=k, tokens=tuple(drafts[:k]) + (sample_from(residual, generator),))
    return VerifyOutcome(accepted=gamma, tokens=tuple(drafts) + (sample_from(p[gamma], generator),))

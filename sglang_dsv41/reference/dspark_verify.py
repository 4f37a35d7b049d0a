"""Verification of a DSpark draft block against the target model, and the speculative generation
loop built on it (spec `model.md` §4 "Verification").

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
from typing import TYPE_CHECKING, Any, Sequence

import torch
from torch import Tensor

from .dspark import DraftContext, draft_block_forward, propose_drafts
from .ops import F32

if TYPE_CHECKING:
    from .model import ReferenceModel
    from .state import RequestState


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


# ---- end-to-end speculative generation -----------------------------------------------------

@dataclass
class SpeculativeResult:
    """Output of `speculative_generate`: the generated tokens and per-round acceptance.

    `accepted_per_round[r]` = drafts accepted in verification round r (0..verify length);
    `drafted` = draft tokens verified in total; acceptance_rate = accepted / drafted.
    `state` / `context`: the target request state and the draft context KV at the end; both hold
    every committed token (the prompt, then every emitted token except the last anchor, possibly
    a few more when the final round was cut by `max_new_tokens` or a stop token).
    """

    tokens: list[int]
    accepted_per_round: list[int]
    drafted: int
    state: "RequestState"
    context: DraftContext

    @property
    def accepted(self) -> int:
        return sum(self.accepted_per_round)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


def speculative_generate(model: "ReferenceModel", prompt_ids: Sequence[int], max_new_tokens: int, *,
                         images: Sequence[Any] = (), greedy: bool = True, temperature: float = 1.0,
                         seed: int = 0, chunk: int | None = None, stop_ids: Sequence[int] = (),
                         verify_tokens: int | None = None, sts_temperature: float = 1.0) -> SpeculativeResult:
    """Generate with the DSpark draft + target verification (spec §4).

    1. Prefill the prompt (image placeholders expanded, `chunk` tokens per forward as in
       `ReferenceModel.generate`) with `capture=True`; its target features fill the draft
       context KV; the first token comes from the last prompt row.
    2. Each round: draft γ tokens from the anchor (last emitted token, position P = committed
       length); verify the first `verify_tokens` (default γ) of them with one TARGET_VERIFY
       forward over [anchor, d_0, …] on the request state; accept by `verify_greedy` or
       `verify_chain_rejection` (p = softmax(target/T), q = the draft's softmax(·/T)).
    3. Rollback (exact): the state is cloned before the verify forward; if a draft was rejected
       the clone is restored and the target re-runs only [anchor, accepted drafts], so caches,
       Engram history and captured features hold exactly the committed tokens. Those tokens'
       features are appended to the draft context KV; the correction / bonus token becomes the
       next anchor (not yet forwarded, exactly like a freshly sampled token in plain decoding).
    Stops after `max_new_tokens` tokens or at a token in `stop_ids` (included), like `generate`.
    Greedy output equals `ReferenceModel.generate(greedy=True)` token for token.
    """
    from .model import pick_token  # deferred: the verification rules above need no model

    cfg, w, nm = model.text, model.weights, model.numerics
    gamma = cfg.dspark_block_size
    n_verify = gamma if verify_tokens is None else int(verify_tokens)
    if not 1 <= n_verify <= gamma:
        raise ValueError(f"verify_tokens must be in 1..{gamma}, got {verify_tokens}")
    if max_new_tokens < 0:
        raise ValueError("max_new_tokens must be ≥ 0")
    if not greedy and not temperature > 0:
        raise ValueError(f"sampling needs temperature > 0, got {temperature}")
    gen = torch.Generator().manual_seed(seed)
    state = model.new_request()
    context = DraftContext.empty(cfg, model.device)
    result = SpeculativeResult(tokens=[], accepted_per_round=[], drafted=0, state=state, context=context)
    if max_new_tokens == 0:
        return result
    ids, spans = model.encode_images(prompt_ids, images) if images else (list(prompt_ids), [])
    before = state.dspark_features.shape[0]
    logits = model.prefill(state, ids, spans, chunk, capture=True)
    context.commit_features(cfg, w, state.dspark_features[before:], profile=nm.cache, act_quant=nm.act_quant)
    stops = {int(t) for t in stop_ids}

    def emit(tokens: Sequence[int]) -> bool:
        for t in tokens:
            result.tokens.append(int(t))
            if len(result.tokens) >= max_new_tokens or int(t) in stops:
                return True
        return False

    anchor = pick_token(logits, greedy, temperature, gen)
    if emit([anchor]):
        return result
    while True:
        block = draft_block_forward(cfg, w, context, anchor, profile=nm.cache, act_quant=nm.act_quant)
        proposal = propose_drafts(cfg, w, block.hidden, block.base_logits, anchor, greedy=greedy,
                                  temperature=temperature, generator=gen, sts_temperature=sts_temperature)
        drafts = list(proposal.tokens[:n_verify])
        saved = state.clone()
        verify = model.forward(state, [anchor] + drafts, capture=True)
        if greedy:
            outcome = verify_greedy(drafts, verify.logits)
        else:
            assert proposal.probs is not None
            target_probs = torch.softmax(verify.logits.to(F32) / temperature, dim=-1)
            outcome = verify_chain_rejection(drafts, proposal.probs[:n_verify], target_probs, gen)
        features = verify.captured
        if outcome.accepted < len(drafts):
            state = result.state = saved
            features = model.forward(state, [anchor] + drafts[:outcome.accepted], capture=True).captured
        assert features is not None and features.shape[0] == outcome.accepted + 1
        context.commit_features(cfg, w, features, profile=nm.cache, act_quant=nm.act_quant)
        result.accepted_per_round.append(outcome.accepted)
        result.drafted += len(drafts)
        if emit(outcome.tokens):
            return result
        anchor = outcome.tokens[-1]

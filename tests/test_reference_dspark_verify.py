"""DSpark verification rules (spec §4 "Verification"): greedy acceptance table and the chain
rejection sampler's output distribution."""
from __future__ import annotations

import pytest
import torch

from sglang_dsv41.reference.dspark_verify import (
    VerifyOutcome,
    sample_from,
    verify_chain_rejection,
    verify_greedy,
)

V = 8


def _logits_with_argmax(choices: list[int]) -> torch.Tensor:
    """Rows whose argmax is `choices[i]` (random elsewhere, a clear margin at the choice)."""
    g = torch.Generator().manual_seed(len(choices))
    rows = torch.randn(len(choices), V, generator=g)
    for i, c in enumerate(choices):
        rows[i, c] = rows[i].max() + 1.0
    return rows


@pytest.mark.parametrize(
    "drafts, target_argmax, accepted, tokens",
    [
        ([3, 1, 4, 1, 5], [3, 1, 4, 1, 5, 7], 5, (3, 1, 4, 1, 5, 7)),  # all accepted + bonus
        ([3, 1, 4, 1, 5], [2, 1, 4, 1, 5, 7], 0, (2,)),                # first rejected
        ([3, 1, 4, 1, 5], [3, 1, 6, 1, 5, 7], 2, (3, 1, 6)),           # middle rejected
        ([3, 1, 4, 1, 5], [3, 1, 4, 1, 0, 7], 4, (3, 1, 4, 1, 0)),     # last rejected
        ([3, 1, 4, 1, 5], [3, 2, 4, 1, 5, 7], 1, (3, 2)),              # later rows match but chain broke
        ([6], [6, 0], 1, (6, 0)),                                      # γ = 1
    ],
)
def test_greedy_acceptance_table(drafts, target_argmax, accepted, tokens):
    out = verify_greedy(drafts, _logits_with_argmax(target_argmax))
    assert out == VerifyOutcome(accepted=accepted, tokens=tokens)
    assert len(out.tokens) == out.accepted + 1


def test_greedy_ties_take_first_index_and_tensor_drafts():
    logits = torch.zeros(3, V)
    logits[0, 2] = logits[0, 5] = 1.0  # tie: index 2 wins
    logits[1, 4] = 1.0
    logits[2, 1] = 1.0
    assert verify_greedy(torch.tensor([2, 4]), logits) == VerifyOutcome(2, (2, 4, 1))
    assert verify_greedy(torch.tensor([5, 4]), logits) == VerifyOutcome(0, (2,))


def test_greedy_rejects_wrong_row_count():
    with pytest.raises(ValueError, match="expected"):
        verify_greedy([1, 2, 3], torch.zeros(3, V))


def test_chain_rejection_accepts_everything_when_q_equals_p():
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(4, V, generator=g), dim=-1)
    for _ in range(50):
        drafts = [sample_from(p[k], g) for k in range(3)]
        out = verify_chain_rejection(drafts, p[:3], p, g)
        assert out.accepted == 3 and out.tokens[:3] == tuple(drafts)


def test_chain_rejection_never_emits_a_token_outside_the_target_support():
    g = torch.Generator().manual_seed(1)
    p = torch.zeros(2, V)
    p[:, :2] = 0.5                                 # target support {0, 1}
    q = torch.zeros(1, V)
    q[0, 5] = 1.0                                  # draft always proposes 5
    for _ in range(100):
        out = verify_chain_rejection([5], q, p, g)
        assert out.accepted == 0 and out.tokens[0] in (0, 1)


# Chi-square critical values at p = 1e-3 (df = number of cells − 1).
CHI2_CRIT_1E3 = {4: 18.467, 24: 51.179}


def _chi_square(counts: torch.Tensor, expected_p: torch.Tensor, n: int) -> float:
    expected = expected_p * n
    return float(((counts - expected) ** 2 / expected).sum())


def _draft_pairs(q: torch.Tensor, n: int, g: torch.Generator) -> torch.Tensor:
    """n independent (d_0 ~ q_0, d_1 ~ q_1) draft pairs [n, 2]."""
    return torch.stack([torch.multinomial(q[0], n, replacement=True, generator=g),
                        torch.multinomial(q[1], n, replacement=True, generator=g)], dim=1)


def _emitted_pairs(n: int, p: torch.Tensor, q: torch.Tensor, seed: int) -> torch.Tensor:
    """Counts [5·5] of the first two tokens of the speculative stream over n rounds of γ = 2.

    If a round stops after one token, the second token is the next round's first target
    token at that position, i.e. a draw from p_1 (p rows do not depend on the prefix here).
    """
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(5, 5)
    for d0, d1 in _draft_pairs(q, n, g).tolist():
        toks = list(verify_chain_rejection([d0, d1], q, p, g).tokens)
        if len(toks) < 2:
            toks.append(sample_from(p[1], g))
        counts[toks[0], toks[1]] += 1
    return counts.flatten()


def test_chain_rejection_output_distribution_equals_target():
    """20k seeded rounds on a 5-token vocabulary with q ≠ p: the first two emitted tokens are
    jointly distributed as p_0 ⊗ p_1 (chi-square, p = 1e-3), while a sampler that accepts every
    draft (emitting q) fails the same test — so the test can fail."""
    p = torch.tensor([[0.40, 0.25, 0.15, 0.12, 0.08],
                      [0.05, 0.10, 0.20, 0.30, 0.35],
                      [0.20, 0.20, 0.20, 0.20, 0.20]])
    q = torch.tensor([[0.10, 0.15, 0.20, 0.25, 0.30],
                      [0.30, 0.30, 0.20, 0.10, 0.10]])
    n = 20000
    expected = torch.outer(p[0], p[1]).flatten()
    counts = _emitted_pairs(n, p, q, seed=1234)
    assert counts.sum() == n
    chi = _chi_square(counts, expected, n)
    assert chi < CHI2_CRIT_1E3[24], chi
    first = counts.reshape(5, 5).sum(dim=1)
    assert _chi_square(first, p[0], n) < CHI2_CRIT_1E3[4]
    tv = 0.5 * float((counts / n - expected).abs().sum())
    assert tv < 0.02, tv

    # negative control: a sampler that accepts every draft emits q_0 ⊗ q_1
    pairs = _draft_pairs(q, n, torch.Generator().manual_seed(1234))
    control = torch.bincount(pairs[:, 0] * 5 + pairs[:, 1], minlength=25).float()
    assert _chi_square(control, expected, n) > 10 * CHI2_CRIT_1E3[24]


def test_chain_rejection_bonus_comes_from_last_row():
    g = torch.Generator().manual_seed(3)
    p = torch.zeros(3, V)
    p[0, 1] = p[1, 2] = 1.0
    p[2, 7] = 1.0
    q = p[:2].clone()
    assert verify_chain_rejection([1, 2], q, p, g) == VerifyOutcome(2, (1, 2, 7))


def test_chain_rejection_shape_checks():
    g = torch.Generator().manual_seed(0)
    p = torch.full((3, V), 1.0 / V)
    with pytest.raises(ValueError, match="draft_probs"):
        verify_chain_rejection([1, 2], torch.full((3, V), 1.0 / V), p, g)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        verify_chain_rejection([1, V], p[:2], p, g)

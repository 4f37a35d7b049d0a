"""DSpark block (chain) rejection in the serving path (issue 16; docs/dspark.md "Verification"):
SGLang 0.5.17's sampled accept step (`AcceptSampling`, its `chain_speculative_sampling` Triton
kernel) — what `--speculative-algorithm DSPARK` runs for a request with temperature > 0 — is equal
in distribution to the oracle's `reference/dspark_verify.verify_chain_rejection` (spec model.md §4:
accept d_k iff u·q(d_k) < p(d_k), resample from normalise(max(p − q, 0)) at the first rejection,
bonus from p_γ), with and without adaptive verification's per-request verify lengths.

Both are checked against the closed form on a small vocabulary with fixed rows p_0..p_γ,
q_0..q_{γ−1} and drafts d_k ~ q_k: P(accepted = j) = Π_{k<j} a_k · (1 − a_j) (a_k = Σ min(p_k, q_k)),
P(accepted = γ) = Π a_k; the last emitted token at a rejection row j ~ normalise(max(p_j − q_j, 0)),
after γ accepted ~ p_γ. Under a verify length v (v − 1 drafts verified) the count is capped at
v − 1 and the token emitted there is the chain's own sample at row v − 1, distributed as p_{v−1}.

The oracle's check runs on CPU (4,000 rows, ~1 s). SGLang's kernel is Triton: GPU (200,000 rows),
or a manual CPU run under `TRITON_INTERPRET=1` with `SGLANG_DSV41_ACCEPT_ROWS=4000` (~80 s a case;
passed on 2026-12-02, docs/dspark.md).
"""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from sglang_dsv41.reference.dspark_verify import verify_chain_rejection

GAMMA, V = 5, 6
W = GAMMA + 1
ROWS = int(os.environ.get("SGLANG_DSV41_ACCEPT_ROWS", "200000"))
REFERENCE_ROWS = 4000
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
KERNEL = (lambda f: f) if INTERPRETED else pytest.mark.gpu


def _rows():
    g = torch.Generator().manual_seed(41)
    p = torch.softmax(torch.randn(W, V, generator=g, dtype=torch.float64) * 1.2, -1)
    q = torch.softmax(torch.randn(GAMMA, V, generator=g, dtype=torch.float64) * 1.2, -1)
    q[2] = p[2]                                    # a row the draft gets exactly right: always accepted
    return p, q


def _closed_form(p, q, cap: int = GAMMA):
    """(P(accepted = j) for j = 0..cap, distribution of the last emitted token given j)."""
    a = torch.minimum(p[:GAMMA], q).sum(-1)
    reach = torch.cat([torch.ones(1, dtype=p.dtype), torch.cumprod(a, 0)])
    counts = torch.stack([reach[j] * (1 - a[j]) if j < cap else reach[j] for j in range(cap + 1)])
    last = []
    for j in range(cap + 1):
        if j == GAMMA:
            last.append(p[GAMMA])
        elif j == cap:                             # the chain's own sample at row cap: ~ p_cap
            last.append(p[j])
        else:
            residual = (p[j] - q[j]).clamp(min=0)
            last.append(residual / residual.sum())
    return counts, torch.stack(last)


def _empirical(accepted: torch.Tensor, last: torch.Tensor, cap: int):
    counts = torch.bincount(accepted, minlength=cap + 1)[: cap + 1].to(torch.float64)
    dist = torch.zeros(cap + 1, V, dtype=torch.float64)
    dist.index_put_((accepted, last), torch.ones(accepted.numel(), dtype=torch.float64), accumulate=True)
    return counts / accepted.numel(), dist / counts.clamp(min=1)[:, None], counts


def _assert_matches(name, accepted, last, p, q, cap):
    want_counts, want_last = _closed_form(p, q, cap)
    got_counts, got_last, n = _empirical(accepted.cpu().long(), last.cpu().long(), cap)
    total = accepted.numel()
    tol = 5 * torch.sqrt(want_counts * (1 - want_counts) / total) + 3 / total     # slack: fp32 p vs q rounding
    assert bool(((got_counts - want_counts).abs() <= tol).all()), (name, got_counts, want_counts)
    for j in range(cap + 1):
        if n[j] < 200:
            continue
        tol = 5 * torch.sqrt(want_last[j] * (1 - want_last[j]) / n[j]) + 1e-9
        assert bool(((got_last[j] - want_last[j]).abs() <= tol).all()), (name, j, got_last[j], want_last[j])


def _drafts(q, rows: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.multinomial(q[k].float(), rows, replacement=True, generator=g) for k in range(GAMMA)], 1)


def test_the_reference_chain_rejection_matches_the_closed_form() -> None:
    """The oracle itself (fixes what "equal in distribution to the reference" means here)."""
    p, q = _rows()
    drafts = _drafts(q, REFERENCE_ROWS, 1)
    g = torch.Generator().manual_seed(2)
    outcomes = [verify_chain_rejection(d, q.float(), p.float(), g) for d in drafts]
    accepted = torch.tensor([o.accepted for o in outcomes])
    last = torch.tensor([o.tokens[-1] for o in outcomes])
    _assert_matches("reference", accepted, last, p, q, GAMMA)


@KERNEL
@pytest.mark.parametrize("verify_len", [W, 3], ids=["full-block", "adaptive-v3"])
def test_sglang_sampled_accept_equals_the_reference_in_distribution(verify_len: int) -> None:
    from sglang.kernels.ops.speculative.dspark.dspark_accept import AcceptSampling

    device = "cpu" if INTERPRETED else "cuda"
    p, q = _rows()
    drafts = _drafts(q, ROWS, 3)
    candidates = torch.cat([torch.zeros(ROWS, 1, dtype=torch.long), drafts], 1).to(device)
    # temperature 1: SGLang's target probabilities are softmax(logits) = p
    target_logits = p.log().float().repeat(ROWS, 1).to(device)
    draft_probs = q.float().expand(ROWS, GAMMA, V).contiguous().to(device)
    info = SimpleNamespace(temperatures=torch.ones(ROWS, 1, device=device), need_top_k_sampling=False,
                           need_top_p_sampling=False)
    cutoff = None if verify_len == W else torch.full((ROWS,), verify_len, dtype=torch.int32, device=device)
    torch.manual_seed(4)
    accepted, bonus, _ = AcceptSampling.triton(candidates=candidates, target_logits=target_logits,
                                               draft_probs=draft_probs, sampling_info=info, draft_input=None,
                                               gamma=GAMMA, verify_num_draft_tokens=W, cutoff_verify_lens=cutoff)
    assert int(accepted.max()) <= verify_len - 1
    _assert_matches(f"sglang v={verify_len}", accepted, bonus, p, q, verify_len - 1)

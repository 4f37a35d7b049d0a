"""End-to-end DSpark speculative generation on the tiny random model (spec §4): greedy speculative
output == plain greedy output, with the real draft and with scripted drafts that force full,
partial and zero acceptance (exercising the bonus token and the state rollback)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from reference_weights import random_reference_weights, tiny_config

from sglang_dsv41.reference import dspark_verify
from sglang_dsv41.reference.dspark import DraftContext, DraftProposal
from sglang_dsv41.reference.model import ReferenceModel
from sglang_dsv41.reference.state import NumericsProfile

CFG = tiny_config(vision=False)
T = CFG.text
GAMMA = T.dspark_block_size
PROMPT = [int(t) for t in torch.randint(3, 998, (41,), generator=torch.Generator().manual_seed(2))]
N_NEW = 10


@pytest.fixture(scope="module")
def model() -> ReferenceModel:
    w = random_reference_weights(CFG, seed=3, vision=False)
    return ReferenceModel(CFG, w, NumericsProfile(), engram_token_map=np.arange(T.vocab_size))


@pytest.fixture(scope="module")
def plain(model: ReferenceModel) -> list[int]:
    return model.generate(PROMPT, N_NEW + GAMMA + 1)


def test_greedy_speculative_equals_plain_greedy(model, plain):
    res = dspark_verify.speculative_generate(model, PROMPT, N_NEW)
    assert res.tokens == plain[:N_NEW]
    assert res.drafted == GAMMA * len(res.accepted_per_round)
    assert all(0 <= a <= GAMMA for a in res.accepted_per_round)
    # the tiny random draft is untrained: acceptance is low (reported, not asserted)
    print(f"tiny random model: DSpark acceptance {res.accepted}/{res.drafted} = {res.acceptance_rate:.3f}")


class ScriptedDrafts:
    """Replaces `propose_drafts`: proposes the true greedy continuation with the draft at
    `wrong_at[r]` (None = none) of round r corrupted, so round r must accept exactly that many
    drafts (or all of them)."""

    def __init__(self, plain: list[int], wrong_at: list[int | None]):
        self.plain, self.wrong_at, self.round = plain, wrong_at, 0
        self.emitted = 1            # the prefill emits the first token (the first anchor)

    def __call__(self, cfg, w, hidden, base_logits, anchor, *, greedy, temperature, generator, sts_temperature):
        assert anchor == self.plain[self.emitted - 1]
        truth = (self.plain + [0] * (GAMMA + 1))[self.emitted:self.emitted + GAMMA]
        drafts = list(truth)
        bad = self.wrong_at[self.round % len(self.wrong_at)]
        if bad is not None:
            drafts[bad] = (drafts[bad] + 1) % cfg.vocab_size
        self.round += 1
        self.emitted += (GAMMA if bad is None else bad) + 1
        zeros = torch.zeros(GAMMA)
        return DraftProposal(tokens=tuple(drafts), logits=base_logits, probs=None,
                             prev_tokens=(anchor, *drafts[:-1]), confidence=zeros)


@pytest.mark.parametrize("wrong_at", [[2, 0, None], [4, 1, 0, 3]])
def test_scripted_acceptance_and_rollback_keep_greedy_exact(model, plain, wrong_at, monkeypatch):
    script = ScriptedDrafts(plain, wrong_at)
    monkeypatch.setattr(dspark_verify, "propose_drafts", script)
    res = dspark_verify.speculative_generate(model, PROMPT, N_NEW)
    assert res.tokens == plain[:N_NEW]
    expected = [GAMMA if b is None else b for b in (wrong_at * 4)[:len(res.accepted_per_round)]]
    assert res.accepted_per_round == expected
    assert res.accepted > 0

    # rollback is exact: the committed caches/features equal those of one plain forward over
    # prompt + emitted tokens (the last emitted token is the next anchor, never forwarded)
    committed = PROMPT + res.tokens[:-1]
    n = len(committed)
    assert res.state.length >= n and res.context.length == res.state.length
    ref = model.new_request()
    model.prefill(ref, committed, capture=True)
    for layer, kv in ref.attention.swa_kv.items():
        assert torch.equal(res.state.attention.swa_kv[layer][:n], kv), layer
    assert torch.equal(res.state.dspark_features[:n], ref.dspark_features)
    ctx = DraftContext.empty(T)
    ctx.commit_features(T, model.weights, ref.dspark_features, profile=model.numerics.cache, act_quant=True)
    for a, b in zip(res.context.kv, ctx.kv):
        assert torch.equal(a[:n], b)


def test_shorter_verify_length_accepts_up_to_it(model, plain, monkeypatch):
    # draft 2 is wrong but only drafts 0..1 are verified: every round accepts both and takes
    # the bonus token of row 2 (3 tokens per round)
    monkeypatch.setattr(dspark_verify, "propose_drafts", ScriptedDrafts(plain, [2]))
    res = dspark_verify.speculative_generate(model, PROMPT, 10, verify_tokens=2)
    assert res.tokens == plain[:10]
    assert res.accepted_per_round == [2, 2, 2]
    with pytest.raises(ValueError, match="verify_tokens"):
        dspark_verify.speculative_generate(model, PROMPT, 4, verify_tokens=GAMMA + 1)


def test_stop_ids_and_max_new_tokens(model, plain):
    stop = plain[3]
    res = dspark_verify.speculative_generate(model, PROMPT, N_NEW, stop_ids=[stop])
    assert res.tokens == plain[:plain.index(stop) + 1]
    assert dspark_verify.speculative_generate(model, PROMPT, 0).tokens == []
    assert dspark_verify.speculative_generate(model, PROMPT, 1).tokens == plain[:1]


def test_sampled_speculative_generation_is_seeded(model):
    runs = [dspark_verify.speculative_generate(model, PROMPT, 5, greedy=False, temperature=0.8, seed=5)
            for _ in range(2)]
    assert runs[0].tokens == runs[1].tokens and len(runs[0].tokens) == 5
    assert all(0 <= t < T.vocab_size for t in runs[0].tokens)
    other = dspark_verify.speculative_generate(model, PROMPT, 5, greedy=False, temperature=0.8, seed=6)
    assert other.tokens != runs[0].tokens
    with pytest.raises(ValueError, match="temperature"):
        dspark_verify.speculative_generate(model, PROMPT, 4, greedy=False, temperature=0.0)


def test_greedy_speculative_with_an_image_and_chunked_prefill_equals_plain():
    """Image span in the prompt (vision tower, vl routing, Engram image blocking on the target;
    the draft routes without vl bias) and a chunked prefill whose chunks straddle the span."""
    cfg = tiny_config(vision=True)
    m = ReferenceModel(cfg, random_reference_weights(cfg, seed=4, vision=True), NumericsProfile(),
                       engram_token_map=np.arange(cfg.text.vocab_size))
    pixels = (torch.rand(84, 84, 3, generator=torch.Generator().manual_seed(8)) * 255).to(torch.uint8)
    image = Image.fromarray(pixels.numpy())
    prompt = PROMPT[:12] + [cfg.image_token_id] + PROMPT[12:30]
    plain = m.generate(prompt, 4, images=[image], chunk=7)
    res = dspark_verify.speculative_generate(m, prompt, 4, images=[image], chunk=7)
    assert res.tokens == plain
    assert res.state.length >= len(prompt) - 1 + 8 + len(plain) - 1   # span of 8 rows for 84×84

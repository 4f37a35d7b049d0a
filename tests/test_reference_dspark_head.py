"""DSpark draft head pieces (spec §4): draft context KV (base RoPE, no YaRN), Markov bias with its
sequential dependency, confidence head, sequential drafting."""
from __future__ import annotations

import pytest
import torch
from reference_weights import random_reference_weights, tiny_config

from sglang_dsv41.reference import dspark
from sglang_dsv41.reference.attention import project_kv
from sglang_dsv41.reference.ops import (
    CacheProfile,
    apply_rope_tail,
    bf16,
    linear_fp8,
    rms_norm,
    rope_inv_freq,
    swa_cache_roundtrip,
)

CFG = tiny_config(vision=False)
T = CFG.text
W = random_reference_weights(CFG, seed=7, vision=False)
GAMMA = T.dspark_block_size


def _features(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return bf16(torch.randn(n, len(T.dspark_target_layer_ids), T.hidden_size, generator=g))


def test_head_prefix_is_the_stage_owning_markov_tensors():
    assert dspark.dspark_head_prefix(T, W) == f"mtp.{T.num_nextn_predict_layers - 1}."
    moved = dict(W)
    for suffix in ("markov_head.embed.weight", "markov_head.head.weight", "confidence_head.proj.weight"):
        moved["mtp.0." + suffix] = moved.pop("mtp.2." + suffix)
    assert dspark.dspark_head_prefix(T, moved) == "mtp.0."
    moved["mtp.1.markov_head.embed.weight"] = moved["mtp.0.markov_head.embed.weight"]
    with pytest.raises(KeyError, match="exactly one"):
        dspark.dspark_head_prefix(T, moved)


def test_context_kv_matches_formula_with_base_rope_and_no_yarn():
    feats = _features(6)
    positions = torch.tensor([0, 1, 2, 50, 100, 1000])
    got = dspark.context_kv_from_features(T, W, feats, positions, profile=CacheProfile.NONE, act_quant=True)
    assert len(got) == T.num_nextn_predict_layers
    x = feats.reshape(6, -1)
    main_x = rms_norm(linear_fp8(x, W["mtp.0.main_proj.weight"], True), W["mtp.0.main_norm.weight"], T.rms_norm_eps)
    base = rope_inv_freq(T.qk_rope_head_dim, T.rope_theta, None)
    yarn_base = rope_inv_freq(T.qk_rope_head_dim, T.rope_theta, T.rope_scaling)
    yarn_compressed = rope_inv_freq(T.qk_rope_head_dim, T.compress_rope_theta, T.rope_scaling)
    assert not torch.equal(base, yarn_base)
    for s, kv in enumerate(got):
        p = f"mtp.{s}.attn."
        z = linear_fp8(main_x, W[p + "wkv.weight"], True)
        # BF16 cache: normalise → BF16 → rotate → BF16 (upstream's bf16 kv store)
        pre = z * torch.rsqrt(z.pow(2).mean(dim=-1, keepdim=True) + T.rms_norm_eps) * W[p + "kv_norm.weight"]
        assert torch.equal(kv, bf16(apply_rope_tail(bf16(pre), positions, base)))
        assert torch.equal(kv[0], bf16(pre[0]))  # position 0: no rotation
        for wrong in (yarn_base, yarn_compressed):
            assert not torch.allclose(kv[3:], bf16(apply_rope_tail(bf16(pre), positions, wrong))[3:], atol=1e-2)
        nope = T.head_dim - T.qk_rope_head_dim
        assert torch.equal(kv[:, :nope], bf16(pre[:, :nope]))  # RoPE only on the tail


def test_context_kv_applies_the_cache_profile():
    feats = _features(3, seed=1)
    pos = torch.arange(3)
    main_x = dspark.main_projection(T, W, feats, act_quant=True)
    none = dspark.context_kv_from_features(T, W, feats, pos, profile=CacheProfile.NONE, act_quant=True)
    fp8 = dspark.context_kv_from_features(T, W, feats, pos, profile=CacheProfile.FP8, act_quant=True)
    for s, (a, b) in enumerate(zip(none, fp8)):
        raw = project_kv(T, W, f"mtp.{s}.attn.", main_x, pos, dspark.draft_rope_inv_freq(T), True)
        inv = dspark.draft_rope_inv_freq(T)
        assert torch.equal(a, swa_cache_roundtrip(raw, pos, inv, CacheProfile.NONE, T.qk_rope_head_dim))
        assert torch.equal(b, swa_cache_roundtrip(raw, pos, inv, CacheProfile.FP8, T.qk_rope_head_dim))
        assert not torch.equal(a, b)


def test_draft_context_commits_in_chunks_like_one_chunk():
    feats = _features(7, seed=2)
    one = dspark.DraftContext.empty(T)
    one.commit_features(T, W, feats, profile=CacheProfile.NONE, act_quant=True)
    two = dspark.DraftContext.empty(T)
    two.commit_features(T, W, feats[:4], profile=CacheProfile.NONE, act_quant=True)
    snapshot = two.clone()
    two.commit_features(T, W, feats[4:], profile=CacheProfile.NONE, act_quant=True)
    assert one.length == two.length == 7 and snapshot.length == 4
    for a, b in zip(one.kv, two.kv):
        assert torch.equal(a, b)


def test_main_projection_rejects_wrong_feature_shape():
    with pytest.raises(ValueError, match="features"):
        dspark.main_projection(T, W, torch.zeros(2, 2, T.hidden_size), act_quant=True)


def _markov(prev: int) -> torch.Tensor:
    p = dspark.dspark_head_prefix(T, W) + "markov_head."
    return W[p + "head.weight"] @ W[p + "embed.weight"][prev]


def test_markov_bias_formula():
    assert torch.allclose(dspark.markov_bias(T, W, 17), _markov(17), atol=1e-5, rtol=0)
    assert dspark.markov_bias(T, W, 17).dtype == torch.float32
    with pytest.raises(ValueError):
        dspark.markov_bias(T, W, T.vocab_size)


def test_sequential_drafting_feeds_each_draft_into_the_next_markov_bias():
    hidden = bf16(torch.randn(GAMMA, T.hidden_size, generator=torch.Generator().manual_seed(3)))
    base = torch.zeros(GAMMA, T.vocab_size)   # drafts are decided by the Markov chain alone
    a = dspark.propose_drafts(T, W, hidden, base, anchor=5, greedy=True)
    b = dspark.propose_drafts(T, W, hidden, base, anchor=6, greedy=True)
    assert a.prev_tokens == (5,) + a.tokens[:-1]
    for k in range(GAMMA):
        assert torch.allclose(a.logits[k], _markov(a.prev_tokens[k]), atol=1e-5, rtol=0)
        assert a.tokens[k] == int(torch.argmax(a.logits[k]))
    assert a.tokens[0] != b.tokens[0]
    # changing draft_0 (through the anchor) changes step-1 logits although base_logits are equal
    assert not torch.allclose(a.logits[1], b.logits[1])
    assert a.probs is None


def test_sampled_drafts_are_seeded_and_carry_their_distribution():
    g_hidden = torch.Generator().manual_seed(4)
    hidden = bf16(torch.randn(GAMMA, T.hidden_size, generator=g_hidden))
    base = torch.randn(GAMMA, T.vocab_size, generator=g_hidden)
    runs = [dspark.propose_drafts(T, W, hidden, base, anchor=9, greedy=False, temperature=0.7,
                                  generator=torch.Generator().manual_seed(11)) for _ in range(2)]
    assert runs[0].tokens == runs[1].tokens
    q = runs[0].probs
    assert q is not None and q.shape == (GAMMA, T.vocab_size)
    assert torch.allclose(q.sum(dim=-1), torch.ones(GAMMA))
    expected = torch.softmax(runs[0].logits / 0.7, dim=-1)
    assert torch.allclose(q, expected)
    with pytest.raises(ValueError, match="Generator"):
        dspark.propose_drafts(T, W, hidden, base, anchor=9, greedy=False)


def test_confidence_head_shape_range_and_formula():
    hidden = bf16(3.0 * torch.randn(GAMMA, T.hidden_size, generator=torch.Generator().manual_seed(5)))
    prev = [1, 22, 333, 44, 5][:GAMMA]
    c = dspark.confidence(T, W, hidden, prev)
    assert c.shape == (GAMMA,) and c.dtype == torch.float32
    assert bool(((c > 0) & (c < 1)).all())
    p = dspark.dspark_head_prefix(T, W)
    feats = torch.cat((hidden, W[p + "markov_head.embed.weight"][prev]), dim=-1)
    logit = feats @ W[p + "confidence_head.proj.weight"][0]
    assert torch.allclose(c, torch.sigmoid(logit), atol=1e-6)
    hot = dspark.confidence(T, W, hidden, prev, sts_temperature=4.0)
    assert torch.allclose(hot, torch.sigmoid(logit / 4.0), atol=1e-6)
    assert bool(((hot - 0.5).abs() <= (c - 0.5).abs() + 1e-7).all())
    # the Markov feature of prev_k matters
    assert not torch.allclose(c, dspark.confidence(T, W, hidden, [7] * GAMMA))

"""DSpark stage stack (spec §4 "Block forward"): bidirectional block attention, context window of
min(P, sliding_window), stage attention = a ratio-0 attention layer's math, output head."""
from __future__ import annotations

import pytest
import torch
from reference_weights import random_reference_weights, tiny_config

from sglang_dsv41.reference import dspark
from sglang_dsv41.reference.attention import AttentionState, ChunkScratch, attention_sublayer
from sglang_dsv41.reference.ops import CacheProfile, bf16

CFG = tiny_config(vision=False)
T = CFG.text
W = random_reference_weights(CFG, seed=11, vision=False)
GAMMA = T.dspark_block_size
NONE = CacheProfile.NONE


def _context(n: int, seed: int = 0) -> dspark.DraftContext:
    g = torch.Generator().manual_seed(seed)
    feats = bf16(torch.randn(n, len(T.dspark_target_layer_ids), T.hidden_size, generator=g))
    ctx = dspark.DraftContext.empty(T)
    ctx.commit_features(T, W, feats, profile=NONE, act_quant=True)
    return ctx


def _run(ctx: dspark.DraftContext, ids: list[int]) -> dspark.BlockOutput:
    return dspark.run_stages(T, W, ctx, torch.tensor(ids), profile=NONE, act_quant=True)


def test_block_forward_shapes_and_block_ids():
    ctx = _context(12)
    out = dspark.draft_block_forward(T, W, ctx, anchor=42, profile=NONE, act_quant=True)
    assert dspark.block_token_ids(T, 42) == [42] + [T.dspark_noise_token_id] * (GAMMA - 1)
    assert out.hidden.shape == (GAMMA, T.hidden_size)
    assert out.base_logits.shape == (GAMMA, T.vocab_size) and out.base_logits.dtype == torch.float32
    assert torch.isfinite(out.base_logits).all()
    assert torch.equal(out.hidden, bf16(out.hidden))
    same = _run(ctx, dspark.block_token_ids(T, 42))
    assert torch.equal(out.base_logits, same.base_logits)
    assert ctx.length == 12  # the block never writes the context
    with pytest.raises(ValueError, match="context"):
        dspark.draft_block_forward(T, W, dspark.DraftContext.empty(T), anchor=1, profile=NONE, act_quant=True)


def test_block_rows_attend_bidirectionally():
    """Changing the last block row's token changes row 0's output — impossible with a causal mask
    (attention is the only sublayer mixing rows)."""
    ctx = _context(12)
    noise = T.dspark_noise_token_id
    a = _run(ctx, [42] + [noise] * (GAMMA - 1))
    b = _run(ctx, [42] + [noise] * (GAMMA - 2) + [17])
    assert not torch.equal(a.hidden[0], b.hidden[0])
    assert not torch.allclose(a.base_logits[0], b.base_logits[0])


def test_block_rows_see_the_last_window_context_positions_only():
    P, Wn = 12, T.sliding_window
    ctx = _context(P)
    ids = dspark.block_token_ids(T, 42)
    ref = _run(ctx, ids)
    for pos, changes in ((P - Wn - 1, False), (0, False), (P - Wn, True), (P - 1, True)):
        moved = ctx.clone()
        for s in range(T.num_nextn_predict_layers):
            moved.kv[s][pos] = -moved.kv[s][pos]
        out = _run(moved, ids)
        assert torch.equal(out.hidden, ref.hidden) is not changes, (pos, changes)


def test_short_context_is_attended_entirely():
    ctx = _context(3)
    ids = dspark.block_token_ids(T, 42)
    ref = _run(ctx, ids)
    moved = ctx.clone()
    moved.kv[0][0] = -moved.kv[0][0]
    assert not torch.equal(_run(moved, ids).hidden, ref.hidden)


def test_stage_attention_equals_a_ratio0_layer_for_a_one_row_block():
    """With one block row and the context cut to window−1 entries, the draft's key set equals a
    ratio-0 main layer's SWA set (window−1 predecessors + itself): same weights ⇒ same output."""
    assert T.compress_ratios[0] == 0
    P, Wn = 12, T.sliding_window
    w = dict(W)
    for k, v in W.items():
        if k.startswith("layers.0.attn."):
            w["mtp.0.attn." + k[len("layers.0.attn."):]] = v
    g = torch.Generator().manual_seed(5)
    x_ctx = bf16(torch.randn(P, T.hidden_size, generator=g))
    x = bf16(torch.randn(1, T.hidden_size, generator=g))
    state = AttentionState.empty(T, NONE)
    role = T.layer_roles()[0]
    attention_sublayer(T, role, w, 0, x_ctx, torch.arange(P), state, ChunkScratch(), NONE, True)
    for layer in state.swa_kv:
        if layer != 0:
            state.swa_kv[layer] = torch.zeros(P, T.head_dim)
    state.advance(P)
    context_kv = state.swa_kv[0][P - (Wn - 1):].clone()
    main = attention_sublayer(T, role, w, 0, x, torch.tensor([P]), state, ChunkScratch(), NONE, True)
    draft = dspark.stage_attention(T, w, 0, x, torch.tensor([P]), context_kv, profile=NONE, act_quant=True)
    assert torch.equal(draft, main)


def test_last_stage_norm_and_target_head_make_the_logits():
    ctx = _context(6)
    ids = dspark.block_token_ids(T, 3)
    ref = _run(ctx, ids)
    S = T.num_nextn_predict_layers
    w = dict(W)
    w[f"mtp.{S - 1}.norm.weight"] = bf16(W[f"mtp.{S - 1}.norm.weight"] * 1.5)
    out = dspark.run_stages(T, w, ctx, torch.tensor(ids), profile=NONE, act_quant=True)
    assert torch.equal(out.hidden, ref.hidden) and not torch.equal(out.base_logits, ref.base_logits)
    h = ref.hidden * torch.rsqrt(ref.hidden.pow(2).mean(-1, keepdim=True) + T.rms_norm_eps)
    h = bf16(h * W[f"mtp.{S - 1}.norm.weight"])
    assert torch.allclose(ref.base_logits, h @ W["head.weight"].t(), atol=1e-4, rtol=0)

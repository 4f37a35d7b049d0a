"""The runtime's own copies of the model math against the reference's (the oracle), sublayer piece
by piece (spec §3.2–§3.6; issue 13: one copy per side, each tested against the other).

On the exact torch backend (`ExactTorchBackend`, the deterministic tier) every piece is bit-identical
to its reference namesake: projections, SWA read-back (every cache profile), output projection,
compressor latents (ratio 1, ratio-2 pair pooling), entry values, indexer query / selection,
attention with sink, Engram update, routing and the experts.
"""
from __future__ import annotations

import pytest
import torch

from reference_weights import random_reference_weights, tiny_config
from runtime_values import with_linear_layers
from sglang_dsv41.numerics.profile import CacheProfile
from sglang_dsv41.numerics.rope import layer_inv_freq
from sglang_dsv41.reference import attention as RA
from sglang_dsv41.reference import compressor as RC
from sglang_dsv41.reference import engram as RE
from sglang_dsv41.reference import indexer as RI
from sglang_dsv41.reference import moe as RM
from sglang_dsv41.reference import ops
from sglang_dsv41.runtime import attention_math as M
from sglang_dsv41.runtime import moe_ops
from sglang_dsv41.runtime.attention_ops_torch import attend_with_sink
from sglang_dsv41.runtime.backend import ExactTorchBackend
from sglang_dsv41.runtime.engram_gate import engram_update
from sglang_dsv41.runtime.indexer_select import run_indexer_cpu

T = 11


@pytest.fixture(scope="module")
def tiny():
    cfg = tiny_config(vision=False)
    return cfg.text, with_linear_layers(random_reference_weights(cfg, seed=5, vision=False, dspark=False), cfg)


def _bf16(*shape, seed: int, scale: float = 1.0) -> torch.Tensor:
    return ops.bf16(torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale)


def _layer(t, want):
    return next(r for r in t.layer_roles() if want(r))


def test_projections_and_read_back(tiny) -> None:
    t, w = tiny
    be = ExactTorchBackend()
    role = _layer(t, lambda r: r.ratio == 2)
    p, inv = f"layers.{role.layer}.attn.", layer_inv_freq(t, role.ratio)
    x, pos = _bf16(T, t.hidden_size, seed=1), torch.arange(5, 5 + T)
    want = RA.project_q_kv(t, w, p, x, pos, inv, True)
    got = M.project_q_kv(be, t, w, p, x, pos, inv, True, t.num_attention_heads)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    for profile in CacheProfile:
        assert torch.equal(M.swa_cache_roundtrip(be, want[2], pos, inv, profile, t.qk_rope_head_dim),
                           ops.swa_cache_roundtrip(want[2], pos, inv, profile, t.qk_rope_head_dim)), profile
    o = _bf16(T, t.num_attention_heads, t.head_dim, seed=2)
    assert torch.equal(M.output_projection(be, t, w, p, o, pos, inv, True),
                       RA.output_projection(t, w, p, o, pos, inv, True))


def test_compressor_latents_and_entry_values(tiny) -> None:
    t, w = tiny
    be = ExactTorchBackend()
    for ratio in (1, 2):
        role = _layer(t, lambda r: r.computes_latents and r.ratio == ratio)
        p, inv = f"layers.{role.layer}.attn.", layer_inv_freq(t, ratio)
        x = _bf16(2 * 6, t.hidden_size, seed=3 + ratio)
        pos = torch.arange(x.shape[0])
        if ratio == 1:
            latents, rope_pos = M.ratio1_latents(be, t, w, p, x), pos
            assert torch.equal(latents, RC.ratio1_latents(t, w, p, x))
        else:
            a, s = M.pair_scores(be, w, p, x)
            latents = M.pair_latents(be, a[0::2], s[0::2], a[1::2], s[1::2],
                                     w[p + "compressor.norm.weight"], t.rms_norm_eps)
            want, rope_pos, pending = RC.ratio2_latents(t, w, p, x, pos, None)
            assert pending is None and torch.equal(latents, want)
        got = M.rope_entry_values(be, t, w, p, latents, rope_pos, inv)
        assert all(torch.equal(a, b) for a, b in zip(got, RC.rope_entry_values(t, w, p, latents, rope_pos, inv)))


def test_indexer_query_and_selection(tiny) -> None:
    t, w = tiny
    be = ExactTorchBackend()
    for role in (r for r in t.layer_roles() if r.runs_indexer and not r.candidate_consumer):
        p, inv = f"layers.{role.layer}.attn.", layer_inv_freq(t, role.ratio)
        n_pos = 40
        x, q_lora = _bf16(T, t.hidden_size, seed=6), _bf16(T, t.q_lora_rank, seed=7)
        pos = torch.arange(n_pos - T, n_pos)
        keys = ops.fp4_fake_quant_ue8m0_scale(_bf16(n_pos // role.ratio, t.index_head_dim, seed=8))
        want_q = RI.index_query(t, w, p, x, q_lora, pos, inv, True)
        got_q = M.index_query(be, t, w, p, x, q_lora, pos, inv, True)
        assert torch.equal(got_q.q, want_q.q) and torch.equal(got_q.head_weights, want_q.head_weights)
        want = RI.run_indexer(t, role, w, p, x, q_lora, pos, keys, inv, True, None)
        selection, blocks = run_indexer_cpu(t, role, got_q, pos, keys, None)
        assert torch.equal(selection, want.selection)
        assert (blocks is None) == (want.blocks is None) and (blocks is None or torch.equal(blocks, want.blocks))


def test_attention_with_sink() -> None:
    q, keys = _bf16(T, 4, 64, seed=9), _bf16(T, 13, 64, seed=10)
    sink = torch.randn(4, generator=torch.Generator().manual_seed(11))
    valid = torch.rand(T, 13, generator=torch.Generator().manual_seed(12)) > 0.3
    valid[:, 0] = True
    assert torch.equal(attend_with_sink(q, keys, sink, valid), RA.attend_with_sink(q, keys, sink, valid))


def test_engram_update(tiny) -> None:
    t, w = tiny
    layer = t.engram_layer_ids[0]
    p = f"layers.{layer}.engram."
    table = w[p + "embed.weight"]
    cols = w[p + "wkv.weight"].shape[1] // table.shape[1]
    R = _bf16(T, t.hc_mult, t.hidden_size, seed=13)
    row_ids = torch.randint(0, table.shape[0], (T, cols), generator=torch.Generator().manual_seed(14))
    image = torch.arange(T) % 4 == 0
    for image_rows in (None, image):
        want = RE.engram_residual_update(R, row_ids, table, w[p + "wkv.weight"], w[p + "q_weight"], w[p + "k_weight"],
                                         t.rms_norm_eps, image_rows=image_rows)
        got = engram_update(ExactTorchBackend(), R, table[row_ids], w[p + "wkv"], w[p + "q_weight"],
                            w[p + "k_weight"], t.rms_norm_eps, True, image_rows)
        assert torch.equal(got, want)


def test_routing_and_experts(tiny) -> None:
    t, w = tiny
    be = ExactTorchBackend()
    p = "layers.0.ffn."
    x = _bf16(T, t.hidden_size, seed=15)
    want = RM.route(x, w[p + "gate.weight"], w[p + "gate.bias"], t.num_experts_per_tok)
    got = moe_ops.route(be, x, w[p + "gate"], w[p + "gate.bias"], t.num_experts_per_tok)
    assert all(torch.equal(a, b) for a, b in ((got.experts, want.experts), (got.weights, want.weights),
                                              (got.scores, want.scores)))
    e = f"{p}experts.0."
    assert torch.equal(moe_ops.routed_expert(be, x, w[e + "w1.weight"], w[e + "w2.weight"], w[e + "w3.weight"],
                                             t.swiglu_limit),
                       RM.routed_expert(x, w[e + "w1.weight"], w[e + "w2.weight"], w[e + "w3.weight"], t.swiglu_limit))
    s = f"{p}shared_experts."
    assert torch.equal(moe_ops.shared_expert(be, x, w[s + "w1"], w[s + "w2"], w[s + "w3"],
                                             t.swiglu_limit, True),
                       RM.shared_expert(x, w[s + "w1.weight"], w[s + "w2.weight"], w[s + "w3.weight"],
                                        t.swiglu_limit, True))

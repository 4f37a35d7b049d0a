"""Whole-model reference on the tiny config with seeded random weights (spec §3, §3.2, §3.5, §7).

Chunk invariance is asserted **bit for bit**: the reference is built so a token's math does not
depend on how many tokens share a call (fp64-accumulated fp32 dot products where fp32 results
are consumed unrounded; fixed-order stream sums), so incremental decode and chunked prefill
must equal the one-shot forward exactly — logits (fp32) and greedy tokens alike.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from sglang_dsv41.reference import attention as attention_mod
from sglang_dsv41.reference import model as model_mod
from sglang_dsv41.reference import moe as moe_mod
from sglang_dsv41.reference.mhc import hc_coefficients, hc_collapse
from sglang_dsv41.reference.model import ReferenceModel
from sglang_dsv41.reference.ops import bf16, matmul_fp32_exact, rms_norm
from sglang_dsv41.reference.state import NumericsProfile

from reference_weights import TINY_TEST_COMPRESSED_VOCAB, random_reference_weights, tiny_config

CFG = tiny_config()
T_CFG = CFG.text
WEIGHTS = random_reference_weights(CFG, seed=11, dspark=False)
PROMPT = torch.randint(3, 990, (48,), generator=torch.Generator().manual_seed(12))  # > window 8, topk 4, span 12



def make_model(numerics: NumericsProfile = NumericsProfile(), weights=WEIGHTS) -> ReferenceModel:
    return ReferenceModel(CFG, weights, numerics, engram_token_map=np.arange(TINY_TEST_COMPRESSED_VOCAB))


@pytest.fixture(scope="module")
def model() -> ReferenceModel:
    return make_model()


@pytest.fixture(scope="module")
def full_logits(model: ReferenceModel) -> torch.Tensor:
    return model.forward(model.new_request(), PROMPT).logits


def test_forward_shapes_state_and_bitwise_determinism(model: ReferenceModel, full_logits: torch.Tensor) -> None:
    assert full_logits.shape == (48, T_CFG.vocab_size) and full_logits.dtype == torch.float32
    assert torch.isfinite(full_logits).all()
    state = model.new_request()
    again = make_model().forward(state, PROMPT).logits
    assert torch.equal(full_logits, again)
    assert state.length == 48
    for src in T_CFG.kv_source_layer_ids:              # ratio-2 sources: 24 pairs; ratio-1: 48 latents
        assert state.attention.compressed_kv[src].shape[0] == 48 // T_CFG.compress_ratios[src]
    assert state.engram_history.tolist() == PROMPT[-3:].tolist()


def test_incremental_decode_equals_full_forward(model: ReferenceModel, full_logits: torch.Tensor) -> None:
    state = model.new_request()
    parts = [model.forward(state, PROMPT[:20]).logits]
    parts += [model.forward(state, PROMPT[i:i + 1]).logits for i in range(20, 48)]
    inc = torch.cat(parts)
    assert torch.equal(inc, full_logits)                      # tolerance: exact (see module doc)
    assert torch.equal(inc.argmax(-1), full_logits.argmax(-1))


@pytest.mark.parametrize("splits", [(7,), (8,), (13, 30), (1, 2, 5, 11, 12, 33, 47)])
def test_chunked_prefill_equals_one_shot(model: ReferenceModel, full_logits: torch.Tensor, splits) -> None:
    """Odd split points leave a ratio-2 pair open across the chunk edge; even ones close it."""
    state = model.new_request()
    bounds = (0, *splits, 48)
    out = torch.cat([model.forward(state, PROMPT[a:b]).logits for a, b in zip(bounds[:-1], bounds[1:])])
    assert torch.equal(out, full_logits)


def test_prefill_helper_chunks(model: ReferenceModel, full_logits: torch.Tensor) -> None:
    last = model.prefill(model.new_request(), PROMPT.tolist(), chunk=5)
    assert torch.equal(last, full_logits[-1])


class _Recorder:
    """Wraps the model's building blocks to record what flows between them."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.updates: list[tuple[torch.Tensor, torch.Tensor]] = []   # (R in, R out) per hyper-connection
        self.coeffs: list = []
        self.sub_inputs: list[torch.Tensor] = []                     # attention / MoE inputs, in order
        self.engram: list[tuple[torch.Tensor, torch.Tensor]] = []
        upd, att, moe, eng = (model_mod.hc_residual_update, attention_mod.attention_sublayer,
                              moe_mod.moe_sublayer, model_mod.engram_residual_update)

        def rec_update(R, y, co):
            out = upd(R, y, co)
            self.updates.append((R.clone(), out.clone()))
            self.coeffs.append(co)
            return out

        def rec_attention(cfg, role, w, layer, x, *a, **k):
            self.sub_inputs.append(x.clone())
            return att(cfg, role, w, layer, x, *a, **k)

        def rec_moe(cfg, w, prefix, x, **k):
            self.sub_inputs.append(x.clone())
            return moe(cfg, w, prefix, x, **k)

        def rec_engram(R, *a, **k):
            out = eng(R, *a, **k)
            self.engram.append((R.clone(), out.clone()))
            return out

        monkeypatch.setattr(model_mod, "hc_residual_update", rec_update)
        monkeypatch.setattr(attention_mod, "attention_sublayer", rec_attention)
        monkeypatch.setattr(moe_mod, "moe_sublayer", rec_moe)
        monkeypatch.setattr(model_mod, "engram_residual_update", rec_engram)


def _coeffs(R: torch.Tensor, layer: int, sub: str):
    p = f"layers.{layer}.hc_{sub}_"
    return hc_coefficients(R, WEIGHTS[p + "fn"], WEIGHTS[p + "base"], WEIGHTS[p + "scale"],
                           rms_eps=T_CFG.rms_norm_eps, hc_eps=T_CFG.hc_eps, sinkhorn_iters=T_CFG.hc_sinkhorn_iters)


def _combine(R: torch.Tensor, pre: torch.Tensor, norm: str) -> torch.Tensor:
    mixed = bf16(sum(pre[:, j, None] * R[:, j] for j in range(R.shape[1])))
    return rms_norm(mixed, WEIGHTS[norm], T_CFG.rms_norm_eps)


def test_lagged_pre_engram_interplay_and_final_collapse(monkeypatch: pytest.MonkeyPatch) -> None:
    rec = _Recorder(monkeypatch)
    ids = PROMPT[:10]
    logits = make_model().forward(make_model().new_request(), ids).logits
    L = T_CFG.num_hidden_layers
    assert len(rec.updates) == 2 * L and len(rec.sub_inputs) == 2 * L
    eps = T_CFG.rms_norm_eps

    # layer 0 attention: the first hyper-connection reads stream 0 of the broadcast embedding
    R0 = WEIGHTS["embed.weight"][ids].unsqueeze(1).expand(10, 4, T_CFG.hidden_size)
    assert torch.equal(rec.updates[0][0], R0)
    assert torch.equal(rec.sub_inputs[0], rms_norm(R0[:, 0], WEIGHTS["layers.0.attn_norm.weight"], eps))

    # layer 0 MoE: combine with the attn-hc's pre (lagged), not the ffn-hc's own pre
    R1 = rec.updates[0][1]
    lagged = _combine(R1, _coeffs(R0, 0, "attn").pre, "layers.0.ffn_norm.weight")
    same_sublayer = _combine(R1, _coeffs(R1, 0, "ffn").pre, "layers.0.ffn_norm.weight")
    assert torch.equal(rec.sub_inputs[1], lagged)
    assert not torch.equal(rec.sub_inputs[1], same_sublayer)

    # layer 1 (Engram): R replaced before the attn-hc; carried pre (layer 0 ffn-hc, computed on
    # the pre-Engram residual) combines the post-Engram residual; attn-hc coefficients come
    # from the post-Engram residual
    assert 1 in T_CFG.engram_layer_ids
    R2 = rec.updates[1][1]
    eng_in, eng_out = rec.engram[0]
    assert torch.equal(eng_in, R2) and not torch.equal(eng_out, R2)
    assert torch.equal(rec.updates[2][0], eng_out)
    assert torch.equal(rec.coeffs[2].pre, _coeffs(eng_out, 1, "attn").pre)
    expect = _combine(eng_out, _coeffs(R1, 0, "ffn").pre, "layers.1.attn_norm.weight")
    assert torch.equal(rec.sub_inputs[2], expect)
    assert not torch.equal(rec.sub_inputs[2], _combine(eng_out, _coeffs(eng_out, 1, "attn").pre,
                                                       "layers.1.attn_norm.weight"))
    assert not torch.equal(rec.sub_inputs[2], _combine(R2, _coeffs(R1, 0, "ffn").pre, "layers.1.attn_norm.weight"))

    # every later sublayer: input = combine of its entering residual with the previous hc's pre
    for n in range(3, 2 * L):
        layer, sub = divmod(n, 2)
        norm = f"layers.{layer}.{'ffn' if sub else 'attn'}_norm.weight"
        R_in = rec.updates[n][0]
        assert torch.equal(rec.sub_inputs[n], _combine(R_in, rec.coeffs[n - 1].pre, norm)), n

    # final collapse with the last ffn-hc's pre, then norm and the fp32 head
    R_last_in, R_final = rec.updates[-1]
    h = rms_norm(hc_collapse(R_final, _coeffs(R_last_in, L - 1, "ffn").pre), WEIGHTS["norm.weight"], eps)
    assert torch.equal(logits, matmul_fp32_exact(h, WEIGHTS["head.weight"]))


def test_dspark_capture(monkeypatch: pytest.MonkeyPatch, full_logits: torch.Tensor) -> None:
    rec = _Recorder(monkeypatch)
    m = make_model()
    state = m.new_request()
    out = m.forward(state, PROMPT[:30], capture=True)
    targets = T_CFG.dspark_target_layer_ids
    assert out.captured.shape == (30, len(targets), T_CFG.hidden_size)
    for j, layer in enumerate(targets):
        assert layer not in T_CFG.engram_layer_ids
        entering = rec.updates[2 * layer - 1][1]               # output of layer−1's ffn-hc
        assert torch.equal(out.captured[:, j], bf16(entering.mean(dim=1)))
    assert torch.equal(out.logits, full_logits[:30])          # capturing changes nothing
    out2 = m.forward(state, PROMPT[30:31], capture=True)
    assert torch.equal(state.dspark_features, torch.cat((out.captured, out2.captured)))
    assert m.forward(state, PROMPT[31:32]).captured is None
    assert state.dspark_features.shape[0] == 31


@pytest.mark.parametrize("numerics", [NumericsProfile.parse("fp8"), NumericsProfile.parse("fp4"),
                                      NumericsProfile.parse("none", act_quant=False)])
def test_numerics_profiles_are_wired(numerics: NumericsProfile, full_logits: torch.Tensor) -> None:
    m = make_model(numerics)
    logits = m.forward(m.new_request(), PROMPT).logits
    assert torch.isfinite(logits).all()
    assert not torch.equal(logits, full_logits)
    state = m.new_request()
    chunked = torch.cat([m.forward(state, PROMPT[:17]).logits, m.forward(state, PROMPT[17:]).logits])
    assert torch.equal(chunked, logits)


def test_numerics_profile_parse_rejects_unknown() -> None:
    with pytest.raises(ValueError, match="unknown cache profile"):
        NumericsProfile.parse("int8")


def test_generate_greedy_and_seeded_sampling(model: ReferenceModel) -> None:
    prompt = PROMPT[:12].tolist()
    greedy = model.generate(prompt, 4, chunk=5)
    state = model.new_request()
    logits = model.prefill(state, prompt)
    chain = []
    for _ in range(4):
        chain.append(int(logits.argmax()))
        logits = model.forward(state, [chain[-1]]).logits[-1]
    assert greedy == chain
    assert model.generate(prompt, 4, stop_ids=[greedy[1]]) == greedy[:2]
    a = model.generate(prompt, 4, greedy=False, temperature=1.0, seed=3)
    assert a == model.generate(prompt, 4, greedy=False, temperature=1.0, seed=3)
    assert a != model.generate(prompt, 4, greedy=False, temperature=1.0, seed=4)
    with pytest.raises(ValueError):
        model.generate(prompt, 3, greedy=False, temperature=0.0)


def test_input_validation(model: ReferenceModel) -> None:
    with pytest.raises(ValueError, match="vocabulary"):
        model.forward(model.new_request(), [5, T_CFG.vocab_size])
    with pytest.raises(ValueError, match="at least one token"):
        model.forward(model.new_request(), [])
    with pytest.raises(ValueError, match="tokenizer"):
        ReferenceModel(CFG, WEIGHTS)
    missing = dict(WEIGHTS)
    del missing["layers.3.ffn.gate.bias"]
    with pytest.raises(KeyError, match="layers.3.ffn.gate.bias"):
        ReferenceModel(CFG, missing, engram_token_map=np.arange(TINY_TEST_COMPRESSED_VOCAB))

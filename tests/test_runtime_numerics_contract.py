"""The numerics contract of the CPU serving path (issue 13 item 5; docs/runtime.md "Numerics contract").

The serving backend (`FastTorchBackend`, fp32, no float64 anywhere in the forward) is judged by
tolerance against the reference, not by bit identity:

* per sublayer, on identical inputs (tiny config, random weights): each piece within
  `SUBLAYER_ULPS` BF16 ulps of its row's largest reference magnitude — projections, SWA read-back,
  output projection, compressor latents, shared expert and routed expert, Engram update, mHC
  sublayer input / residual update — and the router picks the reference's experts;
* end to end on the tiny checkpoint, teacher-forced on the reference's own greedy tokens over the
  scenario prompts (`runtime_scenarios.prompts`): top-1 agrees at ≥ `MIN_TOP1_AGREEMENT` of the
  positions and every logit is within `LOGIT_BOUND` of the reference's; free-running greedy
  agreement is printed (reported in docs/runtime.md, not asserted).
The per-sublayer check can fail (an output off by a factor 1 + 2⁻⁶ is outside it).
"""
from __future__ import annotations

import pytest
import torch

from reference_weights import random_reference_weights, tiny_config
from runtime_values import with_linear_layers
from runtime_scenarios import measure_contract, runtime_engine
from sglang_dsv41.numerics.profile import CacheProfile
from sglang_dsv41.numerics.rope import layer_inv_freq
from sglang_dsv41.reference import attention as RA
from sglang_dsv41.reference import compressor as RC
from sglang_dsv41.reference import engram as RE
from sglang_dsv41.reference import mhc as RH
from sglang_dsv41.reference import moe as RM
from sglang_dsv41.reference import ops
from sglang_dsv41.reference.model import ReferenceModel
from sglang_dsv41.runtime import attention_math as M
from sglang_dsv41.runtime import moe_ops
from sglang_dsv41.runtime.backend import FastTorchBackend
from sglang_dsv41.runtime.engram_gate import engram_update
from sglang_dsv41.runtime.forward import TorchForward
from sglang_dsv41.runtime.mhc_ops import Fp32TorchMhc

CPU = torch.device("cpu")
#: per-sublayer bound, in BF16 ulps (2⁻⁸ relative) of the row's largest reference magnitude
SUBLAYER_ULPS = 2
#: end to end (tiny checkpoint, teacher-forced): fraction of positions whose top-1 must agree, and
#: the bound on every logit's distance to the reference's
MIN_TOP1_AGREEMENT = 0.99
LOGIT_BOUND = 0.1
GREEDY_STEPS = 16
T = 13


def within_ulps(got: torch.Tensor, want: torch.Tensor, ulps: float = SUBLAYER_ULPS) -> bool:
    scale = want.abs().amax(dim=-1, keepdim=True).clamp(min=2.0**-100)
    return bool(((got - want).abs() <= ulps * 2.0**-8 * scale).all())


@pytest.fixture(scope="module")
def tiny():
    cfg = tiny_config(vision=False)
    return cfg.text, with_linear_layers(random_reference_weights(cfg, seed=5, vision=False, dspark=False), cfg)


def _bf16(*shape, seed: int) -> torch.Tensor:
    return ops.bf16(torch.randn(*shape, generator=torch.Generator().manual_seed(seed)))


def test_sublayers_within_the_stated_bound(tiny) -> None:
    t, w = tiny
    be = FastTorchBackend()
    role = next(r for r in t.layer_roles() if r.ratio == 2 and r.computes_latents)
    p, inv = f"layers.{role.layer}.attn.", layer_inv_freq(t, role.ratio)
    x, pos = _bf16(2 * 6, t.hidden_size, seed=1), torch.arange(12)
    want = RA.project_q_kv(t, w, p, x, pos, inv, True)
    got = M.project_q_kv(be, t, w, p, x, pos, inv, True, t.num_attention_heads)
    assert all(within_ulps(a, b) for a, b in zip(got, want))
    for profile in CacheProfile:
        assert within_ulps(M.swa_cache_roundtrip(be, want[2], pos, inv, profile, t.qk_rope_head_dim),
                           ops.swa_cache_roundtrip(want[2], pos, inv, profile, t.qk_rope_head_dim), 4), profile
    o = _bf16(12, t.num_attention_heads, t.head_dim, seed=2)
    assert within_ulps(M.output_projection(be, t, w, p, o, pos, inv, True), RA.output_projection(t, w, p, o, pos, inv, True))
    a, s = M.pair_scores(be, w, p, x)
    latents = M.pair_latents(be, a[0::2], s[0::2], a[1::2], s[1::2], w[p + "compressor.norm.weight"], t.rms_norm_eps)
    assert within_ulps(latents, RC.ratio2_latents(t, w, p, x, pos, None)[0])

    f = "layers.0.ffn."
    got_r = moe_ops.route(be, x, w[f + "gate"], w[f + "gate.bias"], t.num_experts_per_tok)
    want_r = RM.route(x, w[f + "gate.weight"], w[f + "gate.bias"], t.num_experts_per_tok)
    assert torch.equal(got_r.experts.sort(dim=-1).values, want_r.experts.sort(dim=-1).values)
    e, sh = f + "experts.1.", f + "shared_experts."
    assert within_ulps(moe_ops.routed_expert(be, x, w[e + "w1.weight"], w[e + "w2.weight"], w[e + "w3.weight"], 10.0),
                       RM.routed_expert(x, w[e + "w1.weight"], w[e + "w2.weight"], w[e + "w3.weight"], 10.0))
    assert within_ulps(moe_ops.shared_expert(be, x, w[sh + "w1"], w[sh + "w2"], w[sh + "w3"],
                                             t.swiglu_limit, True),
                       RM.shared_expert(x, w[sh + "w1.weight"], w[sh + "w2.weight"], w[sh + "w3.weight"],
                                        t.swiglu_limit, True))

    layer = t.engram_layer_ids[0]
    g = f"layers.{layer}.engram."
    table = w[g + "embed.weight"]
    rows = torch.randint(0, table.shape[0], (T, w[g + "wkv.weight"].shape[1] // table.shape[1]),
                         generator=torch.Generator().manual_seed(3))
    R = _bf16(T, t.hc_mult, t.hidden_size, seed=4)
    assert within_ulps(engram_update(be, R, table[rows], w[g + "wkv"], w[g + "q_weight"], w[g + "k_weight"],
                                     t.rms_norm_eps, True, None),
                       RE.engram_residual_update(R, rows, table, w[g + "wkv.weight"], w[g + "q_weight"],
                                                 w[g + "k_weight"], t.rms_norm_eps))
    h = "layers.1.hc_attn_"
    mhc = Fp32TorchMhc()
    co = mhc.coefficients(R, w[h + "fn"], w[h + "base"], w[h + "scale"], rms_eps=t.rms_norm_eps, hc_eps=t.hc_eps,
                          sinkhorn_iters=t.hc_sinkhorn_iters)
    ref_co = RH.hc_coefficients(R, w[h + "fn"], w[h + "base"], w[h + "scale"], rms_eps=t.rms_norm_eps,
                                hc_eps=t.hc_eps, sinkhorn_iters=t.hc_sinkhorn_iters)
    y = _bf16(T, t.hidden_size, seed=5)
    assert within_ulps(mhc.residual_update(R, y, co), RH.hc_residual_update(R, y, ref_co))
    norm = w["layers.1.attn_norm.weight"]
    assert within_ulps(mhc.sublayer_input(R, co.pre, norm, t.rms_norm_eps),
                       RH.hc_sublayer_input(R, ref_co.pre, norm, t.rms_norm_eps))
    assert within_ulps(mhc.collapse(R, co.pre), RH.hc_collapse(R, ref_co.pre))


def test_the_sublayer_bound_can_fail(tiny) -> None:
    """A linear's output off by four BF16 ulps (a factor 1 + 2⁻⁶) is outside the bound."""
    t, w = tiny
    x = _bf16(T, t.hidden_size, seed=6)
    want = ops.linear_fp8(x, w["layers.0.attn.wq_a.weight"])
    assert not within_ulps(want * (1 + 2.0**-6), want)


@pytest.fixture(scope="module")
def end_to_end(tiny_checkpoint):
    reference = ReferenceModel.from_checkpoint(tiny_checkpoint)
    exact = runtime_engine(tiny_checkpoint, CPU)
    fast = TorchForward(exact.cfg, exact.weights, exact.hasher, deterministic=False)
    assert isinstance(fast.backend, FastTorchBackend)
    return reference, fast


def test_teacher_forced_top1_and_logits_within_the_contract(end_to_end) -> None:
    reference, fast = end_to_end
    m = measure_contract(fast, CPU, reference, GREEDY_STEPS)
    print("\n" + m.summary("fp32 CPU path"))
    assert m.top1 >= MIN_TOP1_AGREEMENT
    assert m.worst_logit_diff <= LOGIT_BOUND, m.worst_logit_diff

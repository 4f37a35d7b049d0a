"""MoE reference (spec §3.6, §12 "Routing ties"): sqrt-softplus scores, tie rule, bias for
selection only, image-row bias, clamped SwiGLU, shared + scaled routed sum."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from sglang_dsv41.reference.moe import (
    clamped_swiglu,
    moe_sublayer,
    route,
    sqrt_softplus,
    topk_lower_id_on_ties,
)
from sglang_dsv41.reference.ops import bf16, linear_fp8

from reference_weights import random_reference_weights, tiny_config


def test_sqrt_softplus_threshold() -> None:
    z = torch.tensor([-40.0, -3.0, 0.0, 5.0, 19.99, 20.0, 20.01, 60.0])
    got = sqrt_softplus(z)
    ref = [math.sqrt(v if v > 20 else math.log1p(math.exp(v))) for v in z.tolist()]
    assert torch.allclose(got.double(), torch.tensor(ref, dtype=torch.float64), rtol=1e-6, atol=0)
    assert got[-1].item() == torch.sqrt(torch.tensor(60.0)).item()   # linear branch above 20
    assert torch.isfinite(sqrt_softplus(torch.tensor([1e30]))).all()


def test_topk_ties_go_to_lower_id() -> None:
    v = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0],
                      [2.0, 2.0, 2.0, 2.0, 2.0],
                      [0.0, 1.0, 5.0, 1.0, 5.0]])
    assert topk_lower_id_on_ties(v, 2).tolist() == [[1, 2], [0, 1], [2, 4]]
    assert topk_lower_id_on_ties(v, 4).tolist() == [[1, 2, 4, 0], [0, 1, 2, 3], [2, 4, 1, 3]]


def test_topk_nan_ranks_first_and_inf() -> None:
    nan, inf = float("nan"), float("inf")
    v = torch.tensor([[0.5, nan, 3.0, nan, inf],
                      [-inf, -inf, -inf, -inf, -inf]])
    assert topk_lower_id_on_ties(v, 4).tolist() == [[1, 3, 4, 2], [0, 1, 2, 3]]


def test_topk_matches_sorted_order_on_random_distinct_values() -> None:
    g = torch.Generator().manual_seed(0)
    v = torch.randn(50, 16, generator=g)
    got = topk_lower_id_on_ties(v, 5)
    assert torch.equal(got, torch.argsort(v, dim=-1, descending=True)[:, :5])


def _gate(E: int, H: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return bf16(torch.randn(E, H, generator=g) / math.sqrt(H))


def test_bias_selects_but_does_not_weight() -> None:
    g = torch.Generator().manual_seed(1)
    T, H, E, k = 6, 32, 8, 2
    x = bf16(torch.randn(T, H, generator=g))
    w = _gate(E, H, 2)
    bias = torch.zeros(E)
    bias[7] = 100.0                                           # force expert 7 into every row
    r = route(x, w, bias, k)
    assert (r.experts == 7).any(dim=-1).all()
    scores = sqrt_softplus((x.double() @ w.double().t()).float())
    assert torch.equal(r.scores, scores)
    chosen = scores.gather(-1, r.experts)
    # upstream's gate: fp32 Σ (here the exact sum rounded once), fp32 + 1e-20, fp32 division
    denom = chosen.double().sum(-1, keepdim=True).float() + torch.tensor(1e-20, dtype=torch.float32)
    assert torch.equal(r.weights, chosen / denom)
    assert torch.allclose(r.weights.sum(-1), torch.ones(T))
    # the unbiased top-1 is still chosen as the other expert when it is not 7
    unbiased_best = torch.where(scores.argmax(-1) == 7, scores.topk(2).indices[:, 1], scores.argmax(-1))
    other = torch.where(r.experts[:, 0] == 7, r.experts[:, 1], r.experts[:, 0])
    assert torch.equal(other, unbiased_best)


def test_vl_bias_only_on_image_rows() -> None:
    g = torch.Generator().manual_seed(3)
    T, H, E, k = 4, 32, 8, 2
    x = bf16(torch.randn(1, H, generator=g)).expand(T, H)   # identical rows
    w = _gate(E, H, 4)
    bias, bias_vl = torch.zeros(E), torch.zeros(E)
    plain = route(x, w, bias, k)
    weakest = sorted(plain.scores[0].argsort()[:2].tolist())  # never chosen without the vl bias
    bias_vl[weakest] = 100.0
    image = torch.tensor([False, True, False, True])
    r = route(x, w, bias, k, bias_vl=bias_vl, image_rows=image)
    assert sorted(r.experts[1].tolist()) == weakest and sorted(r.experts[3].tolist()) == weakest
    assert torch.equal(r.experts[~image], plain.experts[~image])
    assert not torch.equal(plain.experts[1], r.experts[1])


def test_swiglu_clamp_rounds_then_clamps() -> None:
    gate = torch.tensor([20.0, -30.0, 3.0, 1.0 + 2 ** -10])
    up = torch.tensor([-30.0, 30.0, 12.0, 1.0])
    out = clamped_swiglu(gate, up, 10.0)
    g = torch.tensor([10.0, -30.0, 3.0, 1.0])                # 1+2^-10 rounds to 1 in BF16
    u = torch.tensor([-10.0, 10.0, 10.0, 1.0])
    assert torch.equal(out, bf16(F.silu(g) * u))


def test_moe_sublayer_equals_dense_recomputation() -> None:
    cfg = tiny_config()
    t = cfg.text
    w = random_reference_weights(cfg, seed=5, dspark=False)
    g = torch.Generator().manual_seed(6)
    T = 9
    x = bf16(torch.randn(T, t.hidden_size, generator=g))
    image = torch.zeros(T, dtype=torch.bool)
    image[[2, 3]] = True
    p = "layers.2.ffn."
    y = moe_sublayer(t, w, "layers.2.", x, image_rows=image, act_quant=True)
    assert torch.equal(y, bf16(y))

    # dense: every expert on every token, then pick
    logits = x @ w[p + "gate.weight"].t()
    s = torch.sqrt(F.softplus(logits, threshold=20))
    biased = s + torch.where(image[:, None], w[p + "gate.bias_vl"], w[p + "gate.bias"])
    lim = t.swiglu_limit
    routed = torch.zeros(T, t.hidden_size)
    for i in range(T):
        order = sorted(range(t.n_routed_experts), key=lambda e: (-biased[i, e].item(), e))[: t.num_experts_per_tok]
        tot = sum(s[i, e].item() for e in order)
        for e in order:
            w1, w2, w3 = (w[f"{p}experts.{e}.w{j}.weight"] for j in (1, 2, 3))
            h = bf16(F.silu(bf16(x[i] @ w1.t()).clamp(max=lim)) * bf16(x[i] @ w3.t()).clamp(-lim, lim))
            routed[i] += (s[i, e].item() / tot) * bf16(h @ w2.t())
    sw = [w[f"{p}shared_experts.w{j}.weight"] for j in (1, 2, 3)]
    hs = bf16(F.silu(linear_fp8(x, sw[0]).clamp(max=lim)) * linear_fp8(x, sw[2]).clamp(-lim, lim))
    shared = linear_fp8(hs, sw[1])
    ref = bf16(shared + bf16(1.5 * routed))
    # identical math up to fp32 summation order inside the routed sum: within one BF16 ulp
    assert torch.allclose(y, ref, rtol=2 ** -7, atol=1e-6)
    assert (y == ref).float().mean().item() > 0.95

    # routed part matters, and the image rows change the routing (vl bias)
    y_text = moe_sublayer(t, w, "layers.2.", x, image_rows=None, act_quant=True)
    assert torch.equal(y_text[~image], y[~image])
    assert not torch.equal(y_text[image], y[image])


def test_moe_act_quant_only_touches_shared_expert() -> None:
    cfg = tiny_config()
    t = cfg.text
    w = random_reference_weights(cfg, seed=7, dspark=False)
    x = bf16(torch.randn(5, t.hidden_size, generator=torch.Generator().manual_seed(8)))
    y_q = moe_sublayer(t, w, "layers.0.", x, image_rows=None, act_quant=True)
    y_n = moe_sublayer(t, w, "layers.0.", x, image_rows=None, act_quant=False)
    assert not torch.equal(y_q, y_n)
    # remove the shared expert: the two settings then agree exactly (routed experts are W4A16)
    w0 = dict(w)
    for j in (1, 2, 3):
        w0[f"layers.0.ffn.shared_experts.w{j}.weight"] = torch.zeros_like(w[f"layers.0.ffn.shared_experts.w{j}.weight"])
    assert torch.equal(moe_sublayer(t, w0, "layers.0.", x, image_rows=None, act_quant=True),
                       moe_sublayer(t, w0, "layers.0.", x, image_rows=None, act_quant=False))


def test_moe_is_batch_invariant() -> None:
    cfg = tiny_config()
    t = cfg.text
    w = random_reference_weights(cfg, seed=9, dspark=False)
    x = bf16(torch.randn(23, t.hidden_size, generator=torch.Generator().manual_seed(10)))
    image = torch.zeros(23, dtype=torch.bool)
    image[4:9] = True
    y = moe_sublayer(t, w, "layers.5.", x, image_rows=image, act_quant=True)
    for i in (0, 6, 22):
        yi = moe_sublayer(t, w, "layers.5.", x[i:i + 1], image_rows=image[i:i + 1], act_quant=True)
        assert torch.equal(yi, y[i:i + 1])

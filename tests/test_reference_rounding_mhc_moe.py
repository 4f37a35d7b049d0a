"""mHC coefficients and the MoE gate/combine round where upstream SGLang 0.5.23 rounds (issue 18;
docs/reference.md "Rounding audit", rows mHC / MoE).

Expected values are restated from upstream's definitions in numpy float32, independent of
`sglang_dsv41/reference`: `hc_split_sinkhorn_kernel` and the torch fallback of `_mix_stats_impl`
(`kernels/ops/layernorm/mhc.py`, `srt/models/deepseek_v4_mhc.py`), `moe_fused_gate`'s
sqrt-softplus / renormalisation / APPLY_SCALE (`kernels/ops/moe/moe_fused_gate.py`). The
reference's device-invariance convention is restated too: a reduction or a transcendental is
evaluated in float64 and rounded once to fp32 (numpy float64 here); every elementwise step
between them is one fp32 operation. The runtime's CPU paths must give the same bits.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from sglang_dsv41.reference import mhc, moe, ops
from sglang_dsv41.runtime import moe_ops
from sglang_dsv41.runtime.backend import ExactTorchBackend
from sglang_dsv41.runtime.mhc_ops import TorchMhc

f32 = np.float32
EPS = 1e-6


def rsum(m: np.ndarray, axis: int) -> np.ndarray:
    """Σ of fp32 values in float64, rounded once to fp32."""
    return m.astype(np.float64).sum(axis=axis, keepdims=True).astype(f32)


def sigmoid_once(z: np.ndarray) -> np.ndarray:
    return (1.0 / (1.0 + np.exp(-z.astype(np.float64)))).astype(f32)


def sinkhorn_np(c: np.ndarray, iters: int, eps: float) -> np.ndarray:
    """`hc_split_sinkhorn_kernel` (mhc.py:280-299): fp32 after every step."""
    e = f32(eps)
    c = c.astype(f32)
    ex = np.exp((c - c.max(axis=-1, keepdims=True)).astype(np.float64)).astype(f32)
    m = (ex / rsum(ex, -1)).astype(f32) + e
    m = (m / (rsum(m, -2) + e)).astype(f32)
    for _ in range(iters - 1):
        m = (m / (rsum(m, -1) + e)).astype(f32)
        m = (m / (rsum(m, -2) + e)).astype(f32)
    return m


def coefficients_np(R: np.ndarray, fn: np.ndarray, base: np.ndarray, scale: np.ndarray,
                    rms_eps: float, hc_eps: float, iters: int):
    """`_mix_stats_impl`'s fallback (deepseek_v4_mhc.py:402-405): mixes = linear(x, fn)·rsqrt,
    then the kernel's pre / post / comb (mhc.py:266-277) — mix·α then + b, no FMA."""
    T, hc, H = R.shape
    x = R.astype(np.float64).reshape(T, hc * H)
    lin = (x @ fn.astype(np.float64).T).astype(f32)
    rs = (1.0 / np.sqrt((x * x).mean(-1, keepdims=True) + rms_eps)).astype(f32)
    mix = lin * rs
    a = np.concatenate([np.full(hc, scale[0]), np.full(hc, scale[1]), np.full(hc * hc, scale[2])]).astype(f32)
    z = mix * a + base.astype(f32)
    pre = sigmoid_once(z[:, :hc]) + f32(hc_eps)
    post = f32(2) * sigmoid_once(z[:, hc:2 * hc])
    comb = sinkhorn_np(z[:, 2 * hc:].reshape(T, hc, hc), iters, hc_eps)
    return pre, post, comb


def _case(seed: int, T: int = 64, H: int = 32):
    g = torch.Generator().manual_seed(seed)
    R = ops.bf16(torch.randn(T, 4, H, generator=g) * 3)
    fn = torch.randn(24, 4 * H, generator=g) / 4
    base = torch.randn(24, generator=g)
    scale = torch.tensor([0.7, 1.1, 2.3])
    return R, fn, base, scale


def test_sinkhorn_is_upstreams_fp32_steps() -> None:
    c = (torch.randn(256, 4, 4, generator=torch.Generator().manual_seed(1)) * 3).float()
    got = mhc.sinkhorn(c, 20, EPS)
    assert got.dtype == torch.float32
    assert np.array_equal(got.numpy(), sinkhorn_np(c.numpy(), 20, EPS))
    # the fp32 steps matter: the old once-rounded float64 evaluation differs somewhere
    m = torch.softmax(c.double(), -1) + EPS
    m = m / (m.sum(-2, keepdim=True) + EPS)
    for _ in range(19):
        m = m / (m.sum(-1, keepdim=True) + EPS)
        m = m / (m.sum(-2, keepdim=True) + EPS)
    assert not torch.equal(got, m.float())


def test_hc_coefficients_are_upstreams_fp32_steps_and_the_runtime_follows() -> None:
    R, fn, base, scale = _case(2)
    kw = dict(rms_eps=1e-20, hc_eps=EPS, sinkhorn_iters=20)
    co = mhc.hc_coefficients(R, fn, base, scale, **kw)
    pre, post, comb = coefficients_np(R.numpy(), fn.numpy(), base.numpy(), scale.numpy(), 1e-20, EPS, 20)
    assert np.array_equal(co.pre.numpy(), pre)
    assert np.array_equal(co.post.numpy(), post)
    assert np.array_equal(co.comb.numpy(), comb)
    rt = TorchMhc().coefficients(R, fn, base, scale, **kw)
    assert torch.equal(rt.pre, co.pre) and torch.equal(rt.post, co.post) and torch.equal(rt.comb, co.comb)
    # the fp32 steps matter: the old evaluation (everything in float64, rounded once) differs
    x = R.double().reshape(R.shape[0], -1)
    mix = (x @ fn.double().t()) * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-20)
    old_pre = (torch.sigmoid(scale[0].double() * mix[:, :4] + base[:4].double()) + EPS).float()
    assert not torch.equal(old_pre, co.pre)


def test_sqrt_softplus_is_the_fp32_sqrt_of_the_fp32_softplus() -> None:
    """moe_fused_gate.py:199-202: `sp` is an fp32 value, `sqrt(sp)` an fp32 sqrt."""
    z = torch.linspace(-30, 30, 20001, dtype=torch.float32)
    zs = z.double().numpy()
    soft = np.where(zs > 20, zs, np.log1p(np.exp(np.minimum(zs, 20)))).astype(f32)
    want = np.sqrt(soft)                                   # numpy float32 sqrt: IEEE, correctly rounded
    assert want.dtype == f32
    got = moe.sqrt_softplus(z)
    assert np.array_equal(got.numpy(), want)
    assert torch.equal(moe_ops.sqrt_softplus(z), got)     # the runtime's (float64 acc) follows
    once = np.sqrt(np.where(zs > 20, zs, np.log1p(np.exp(np.minimum(zs, 20))))).astype(f32)
    assert not np.array_equal(once, want)                  # the old once-rounded sqrt differs somewhere


def test_renormalised_weights_are_fp32_quotients() -> None:
    """moe_fused_gate.py:268-281: weights = s_k / (Σ s + 1e-20) with fp32 add and division."""
    g = torch.Generator().manual_seed(4)
    T, H, E, k = 512, 64, 16, 6
    x = ops.bf16(torch.randn(T, H, generator=g))
    w = ops.bf16(torch.randn(E, H, generator=g) / 8)
    bias = torch.zeros(E)
    r = moe.route(x, w, bias, k)
    s = r.scores.gather(-1, r.experts).numpy()
    want = s / (rsum(s, -1) + f32(1e-20))
    assert want.dtype == f32 and np.array_equal(r.weights.numpy(), want)
    be = ExactTorchBackend()
    e_rt, w_rt = be.route_select(r.scores, bias, k, moe.RENORM_EPS, None, None)
    assert torch.equal(e_rt, r.experts) and torch.equal(w_rt, r.weights)
    once = (s.astype(np.float64) / (s.astype(np.float64).sum(-1, keepdims=True) + 1e-20)).astype(f32)
    assert not np.array_equal(once, want)                  # the old once-rounded quotient differs somewhere


def test_routed_scaling_factor_is_folded_into_the_fp32_weights() -> None:
    """APPLY_SCALE (moe_fused_gate.py:282-283, fuse_routed_scaling_factor_in_topk on the MXFP4
    methods): w' = fp32(w·1.5); routed = bf16(Σ_k w'_k·E_k) with the sum as FlashInfer's finalize
    (`finalizeMoeRoutingKernel`: fp32 from +0 in slot order, acc + w'·E; products rounded, the
    project's no-FMA convention); y = bf16(S + routed) (the shared add with alpha 1,
    mxfp4_flashinfer_trtllm_moe.py:561-565)."""
    from reference_weights import random_reference_weights, tiny_config

    cfg = tiny_config()
    t = cfg.text
    w = random_reference_weights(cfg, seed=9, dspark=False)
    x = ops.bf16(torch.randn(11, t.hidden_size, generator=torch.Generator().manual_seed(10)))
    p = "layers.1.ffn."
    y = moe.moe_sublayer(t, w, "layers.1.", x, image_rows=None, act_quant=True)
    r = moe.route(x, w[p + "gate.weight"], w[p + "gate.bias"], t.num_experts_per_tok)
    wp = r.weights.numpy() * f32(t.routed_scaling_factor)                      # fp32 product
    routed = np.zeros((x.shape[0], t.hidden_size), dtype=f32)
    exact = np.zeros((x.shape[0], t.hidden_size))
    for i in range(x.shape[0]):
        for j, e in enumerate(r.experts[i].tolist()):                          # slot (selection) order
            out = moe.routed_expert(x[i:i + 1], *(w[f"{p}experts.{e}.w{n}.weight"] for n in (1, 2, 3)), t.swiglu_limit)
            routed[i] = routed[i] + wp[i, j] * out[0].numpy()                  # fp32 product, fp32 add
            exact[i] += float(wp[i, j]) * out[0].double().numpy()
    assert not np.array_equal(routed, exact.astype(f32))                      # the order is visible in fp32
    routed = ops.bf16(torch.from_numpy(routed))
    shared = moe.shared_expert(x, *(w[f"{p}shared_experts.w{n}.weight"] for n in (1, 2, 3)), t.swiglu_limit, True)
    assert torch.equal(y, ops.bf16(shared + routed))
    assert math.isclose(t.routed_scaling_factor, 1.5)


def test_engram_gate_is_upstreams_fp32_steps_and_the_runtime_follows() -> None:
    """`engram_gate` (srt/layers/engram.py:1280-1291; the fused kernel has no FMA): fp32
    w = q·k, (h·w)·key, rsqrt·rsqrt, Σ·rstd·H^-½, max(|dot|, 1e-6), sqrt; Σ, rsqrt, sigmoid
    once-rounded from float64."""
    from sglang_dsv41.reference.engram import engram_gate
    from sglang_dsv41.runtime.engram_gate import engram_gate as runtime_gate

    g = torch.Generator().manual_seed(11)
    T, hc, H = 64, 4, 48
    R = ops.bf16(torch.randn(T, hc, H, generator=g) * 2)
    keys = ops.bf16(torch.randn(T, hc, H, generator=g))
    keys[0] = 0.0                                                        # dot = +0 → sigmoid(+1e-3)
    qw, kw = (ops.bf16(1 + 0.3 * torch.randn(hc, H, generator=g)) for _ in range(2))
    eps = 1e-20
    h, k = R.numpy(), keys.numpy()
    w = qw.numpy() * kw.numpy()
    inner = rsum((h * w) * k, -1)[..., 0]
    rs_h = (1.0 / np.sqrt((h.astype(np.float64) ** 2).mean(-1) + eps)).astype(f32)
    rs_k = (1.0 / np.sqrt((k.astype(np.float64) ** 2).mean(-1) + eps)).astype(f32)
    dot = inner * (rs_h * rs_k) * f32(H ** -0.5)
    mag = np.sqrt(np.maximum(np.abs(dot), f32(1e-6)))                    # IEEE fp32 sqrt
    want = sigmoid_once(np.copysign(mag, dot))
    got = engram_gate(R, keys, qw, kw, eps)
    assert np.array_equal(got.numpy(), want)
    assert torch.equal(runtime_gate(R, keys, qw, kw, eps), got)
    assert got[0, 0].item() == float(sigmoid_once(np.array([f32(1e-3)]))[0])

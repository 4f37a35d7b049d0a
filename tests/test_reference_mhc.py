"""mHC reference (spec §3.2, §11 items 1–3, §12): finite Sinkhorn, coefficients, lagged combine,
residual update, final collapse."""
from __future__ import annotations

import math

import torch

from sglang_dsv41.reference.mhc import (
    HcCoefficients,
    hc_coefficients,
    hc_collapse,
    hc_residual_update,
    hc_sublayer_input,
    sinkhorn,
)
from sglang_dsv41.reference.ops import bf16, rms_norm

EPS = 1e-6


def _loop_sinkhorn(c: list[list[float]], iters: int, eps: float) -> list[list[float]]:
    """Independent scalar implementation (float64) of the spec's finite Sinkhorn."""
    n = len(c)
    m = []
    for j in range(n):
        mx = max(c[j])
        ex = [math.exp(v - mx) for v in c[j]]
        s = sum(ex)
        m.append([e / s + eps for e in ex])

    def cols() -> None:
        for k in range(n):
            s = sum(m[j][k] for j in range(n))
            for j in range(n):
                m[j][k] /= s + eps

    def rows() -> None:
        for j in range(n):
            s = sum(m[j])
            m[j] = [v / (s + eps) for v in m[j]]

    cols()
    for _ in range(iters - 1):
        rows()
        cols()
    return m


def _logits(seed: int, batch: int = 32, std: float = 2.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 4, 4, generator=g) * std


def test_sinkhorn_matches_independent_loop() -> None:
    c = _logits(0)
    got = sinkhorn(c, 20, EPS)
    for b in range(c.shape[0]):
        ref = torch.tensor(_loop_sinkhorn(c[b].double().tolist(), 20, EPS), dtype=torch.float64)
        assert torch.allclose(got[b].double(), ref, atol=2e-7, rtol=0), b


def test_sinkhorn_is_the_finite_column_ending_form() -> None:
    c = _logits(1)
    m = sinkhorn(c, 20, EPS)
    col_err = (m.sum(dim=-2) - 1).abs().max().item()
    row_err = (m.sum(dim=-1) - 1).abs()
    assert col_err < 1e-5
    # rows are only approximately normalised: a converged (or row-ending) Sinkhorn would put
    # every row within ~1e-6 of 1.
    assert not bool((row_err < 1e-7).all())
    assert row_err.max().item() > 1e-5
    converged = c.softmax(dim=-1)
    for _ in range(2000):
        converged = converged / converged.sum(dim=-1, keepdim=True)
        converged = converged / converged.sum(dim=-2, keepdim=True)
    assert (m - converged).abs().max().item() > 1e-4
    # the iteration count matters: 19 or 21 steps give different matrices
    assert not torch.allclose(m, sinkhorn(c, 19, EPS), atol=1e-7)
    assert not torch.allclose(m, sinkhorn(c, 21, EPS), atol=1e-7)


def test_coefficients_formula() -> None:
    g = torch.Generator().manual_seed(2)
    T, hc, H = 5, 4, 16
    R = bf16(torch.randn(T, hc, H, generator=g))
    fn = torch.randn(24, hc * H, generator=g) / 8
    base = torch.randn(24, generator=g) * 0.5
    scale = torch.tensor([0.7, 0.9, 1.3])
    co = hc_coefficients(R, fn, base, scale, rms_eps=1e-20, hc_eps=EPS, sinkhorn_iters=20)
    x = R.double().reshape(T, hc * H)
    mix = (x @ fn.double().t()) / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-20)
    b, a = base.double(), scale.double()
    pre = torch.sigmoid(a[0] * mix[:, :4] + b[:4]) + EPS
    post = 2 * torch.sigmoid(a[1] * mix[:, 4:8] + b[4:8])
    comb_logits = (a[2] * mix[:, 8:] + b[8:]).reshape(T, 4, 4)
    assert torch.allclose(co.pre.double(), pre, atol=1e-6)
    assert torch.allclose(co.post.double(), post, atol=1e-6)
    for t in range(T):
        ref = torch.tensor(_loop_sinkhorn(comb_logits[t].tolist(), 20, EPS), dtype=torch.float64)
        assert torch.allclose(co.comb[t].double(), ref, atol=1e-6)
    # stream-major flatten: permuting streams changes the mix (F sees stream 0 first)
    co_perm = hc_coefficients(R.flip(1), fn, base, scale, rms_eps=1e-20, hc_eps=EPS, sinkhorn_iters=20)
    assert not torch.allclose(co.pre, co_perm.pre)


def test_first_hyper_connection_reads_stream_zero() -> None:
    g = torch.Generator().manual_seed(3)
    R = bf16(torch.randn(3, 4, 32, generator=g))
    w = bf16(1 + 0.1 * torch.randn(32, generator=g))
    x = hc_sublayer_input(R, None, w, 1e-20)
    assert torch.equal(x, rms_norm(R[:, 0], w, 1e-20))


def test_sublayer_input_uses_given_pre() -> None:
    g = torch.Generator().manual_seed(4)
    R = bf16(torch.randn(3, 4, 32, generator=g))
    w = bf16(1 + 0.1 * torch.randn(32, generator=g))
    pre = torch.rand(3, 4, generator=g) + EPS
    x = hc_sublayer_input(R, pre, w, 1e-20)
    combined = bf16((pre[:, :, None].double() * R.double()).sum(1).float())
    assert torch.equal(x, rms_norm(combined, w, 1e-20))


def test_residual_update_comb_index_convention() -> None:
    """comb[j][k] moves input stream j into output stream k (spec §11 item 2)."""
    T, hc, H = 2, 4, 8
    R = torch.zeros(T, hc, H)
    R[:, 1] = 1.0                                # only input stream 1 is non-zero
    comb = torch.zeros(T, hc, hc)
    comb[:, 1, 3] = 0.5                          # j=1 → k=3
    post = torch.tensor([[0.0, 0.0, 0.0, 0.0]] * T)
    co = HcCoefficients(pre=torch.ones(T, hc), post=post, comb=comb)
    out = hc_residual_update(R, torch.zeros(T, H), co)
    assert torch.equal(out[:, 3], torch.full((T, H), 0.5))
    assert torch.equal(out[:, 1], torch.zeros(T, H))


def test_residual_update_formula_and_bf16() -> None:
    g = torch.Generator().manual_seed(5)
    T, hc, H = 4, 4, 16
    R = bf16(torch.randn(T, hc, H, generator=g))
    y = bf16(torch.randn(T, H, generator=g))
    co = hc_coefficients(R, torch.randn(24, hc * H, generator=g) / 8, torch.zeros(24),
                         torch.ones(3), rms_eps=1e-20, hc_eps=EPS, sinkhorn_iters=20)
    out = hc_residual_update(R, y, co)
    ref = torch.empty(T, hc, H, dtype=torch.float64)
    for k in range(hc):
        ref[:, k] = co.post[:, k, None].double() * y.double()
        for j in range(hc):
            ref[:, k] += co.comb[:, j, k, None].double() * R[:, j].double()
    assert torch.equal(out, bf16(out))                          # BF16 values
    assert torch.allclose(out.double(), ref, rtol=2 ** -8, atol=1e-6)


def test_collapse_is_pre_weighted_sum() -> None:
    g = torch.Generator().manual_seed(6)
    R = bf16(torch.randn(3, 4, 8, generator=g))
    pre = torch.rand(3, 4, generator=g)
    out = hc_collapse(R, pre)
    assert torch.equal(out, bf16((pre[:, :, None] * R).sum(1)))
    assert not torch.equal(out, bf16(R.mean(1)))


def test_coefficients_and_update_are_batch_invariant() -> None:
    """A token's mHC math does not depend on the other tokens of the call (fp64 evaluation,
    fixed-order stream sums): the basis of bit-exact chunked prefill."""
    g = torch.Generator().manual_seed(7)
    T, hc, H = 37, 4, 64
    R = bf16(torch.randn(T, hc, H, generator=g))
    y = bf16(torch.randn(T, H, generator=g))
    fn = torch.randn(24, hc * H, generator=g) / 16
    base, scale = torch.randn(24, generator=g) * 0.5, torch.tensor([0.8, 1.1, 1.7])
    kw = dict(rms_eps=1e-20, hc_eps=EPS, sinkhorn_iters=20)
    batch = hc_coefficients(R, fn, base, scale, **kw)
    out = hc_residual_update(R, y, batch)
    for t in (0, 5, 36):
        one = hc_coefficients(R[t:t + 1], fn, base, scale, **kw)
        assert torch.equal(one.pre, batch.pre[t:t + 1]) and torch.equal(one.comb, batch.comb[t:t + 1])
        assert torch.equal(hc_residual_update(R[t:t + 1], y[t:t + 1], one), out[t:t + 1])

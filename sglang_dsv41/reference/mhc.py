"""Manifold-constrained hyper-connections (mHC), V4.1 "lagged pre" variant (spec `model.md` §3.2).

The residual is carried as `hc_mult` parallel streams R ∈ [T, hc, H] holding BF16 values (in
fp32 tensors). Every sublayer (attention, MoE) is wrapped in one hyper-connection with
parameters F = `hc_*_fn` [hc·(2+hc), hc·H], b = `hc_*_base`, α = `hc_*_scale` [3].

Invariants (spec §3.2, §11 items 1–3, §12 first bullet):

* Coefficients are computed from the residual that *enters* the hyper-connection (fp32
  formula; evaluated in fp64 and rounded once to fp32, see the last bullet):
  m = (F·flat(R)) · rsqrt(mean(flat(R)²) + rms_eps) over all hc·H values (stream-major);
  pre = sigmoid(α₀·m[0:hc] + b) + hc_eps; post = 2·sigmoid(α₁·m[hc:2hc] + b);
  comb = Sinkhorn(α₂·m[2hc:] + b) with the **finite** `iters`-step form (row softmax, +ε,
  column normalise, then (iters−1)×(row, column)), ε = hc_eps in every division. It ends on a
  column normalisation, so columns sum to 1 (≈1e-6) but rows only approximately.
* Comb index convention: comb[t, j, k] multiplies input stream j into output stream k.
* The sublayer input uses the `pre` of the **previous** hyper-connection (the lag); the very
  first hyper-connection of the model has none and reads stream 0.
* Residual update: R'_k = bf16(post_k·y + Σ_j comb_jk·R_j) in fp32 math.
* Final collapse: h = bf16(Σ_j pre_j·R_j) with the pre of the last layer's ffn-hc.
* Rounding (upstream `kernels/ops/layernorm/mhc.py` `hc_split_sinkhorn_kernel` and the torch
  fallback `_mix_stats_impl`; audit in docs/reference.md): every value is fp32 after every step,
  as upstream's kernels hold it. Reductions (F·x, mean of squares, Sinkhorn row/column sums) and
  transcendentals (rsqrt, sigmoid, exp) are evaluated in fp64 and rounded once to fp32 — the
  fp32 value free of reduction-order and libm noise, so token-wise, chunk- and device-invariant;
  the elementwise steps between them (mix·rsqrt, ·α + b, + ε, the Sinkhorn divisions, c − max)
  are IEEE fp32 operations in upstream's order, without FMA contraction (the torch fallback's
  form). Stream sums run in a fixed order (post·y first, then j = 0, 1, …), IEEE fp32.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .ops import F32, bf16, fp32_scalar, rms_norm

F64 = torch.float64


@dataclass(frozen=True)
class HcCoefficients:
    """Per-token coefficients of one hyper-connection (fp32).

    pre [T, hc] (carried to the next hyper-connection), post [T, hc], comb [T, hc, hc]
    with comb[t, j, k] = weight of input stream j in output stream k.
    """

    pre: Tensor
    post: Tensor
    comb: Tensor


def _rounded_sum(m: Tensor, dim: int) -> Tensor:
    """Σ along `dim` of fp32 values, in fp64 and rounded once to fp32 (order-free)."""
    return m.to(F64).sum(dim=dim, keepdim=True).to(F32)


def sinkhorn(logits: Tensor, iters: int, eps: float) -> Tensor:
    """Finite Sinkhorn normalisation of [..., hc, hc] fp32 logits (spec §3.2, §12), rounded as
    upstream's `hc_split_sinkhorn_kernel` (`kernels/ops/layernorm/mhc.py:280-299`).

    M ← exp(C − rowmax)/rowsum + ε; M ← M / (colsum + ε); then (iters − 1) times:
    M ← M / (rowsum + ε); M ← M / (colsum + ε). rowsum_j = Σ_k M_jk, colsum_k = Σ_j M_jk.
    Exactly `iters` column normalisations; never iterated to convergence. fp32 after every
    step: exp and the sums in fp64 rounded once, the subtraction, divisions and + ε in fp32.
    """
    if iters < 1:
        raise ValueError(f"Sinkhorn needs at least one iteration, got {iters}")
    e32 = fp32_scalar(eps)
    c = logits.to(F32)
    ex = torch.exp((c - c.amax(dim=-1, keepdim=True)).to(F64)).to(F32)
    m = ex / _rounded_sum(ex, -1) + e32
    m = m / (_rounded_sum(m, -2) + e32)
    for _ in range(iters - 1):
        m = m / (_rounded_sum(m, -1) + e32)
        m = m / (_rounded_sum(m, -2) + e32)
    return m


def hc_coefficients(residual: Tensor, fn: Tensor, base: Tensor, scale: Tensor, *,
                    rms_eps: float, hc_eps: float, sinkhorn_iters: int) -> HcCoefficients:
    """pre/post/comb of one hyper-connection from the residual entering it (spec §3.2).

    residual [T, hc, H]; fn [hc·(2+hc), hc·H]; base [hc·(2+hc)]; scale [3]; all math fp32.
    """
    T, hc, H = residual.shape
    if fn.shape != (hc * (2 + hc), hc * H):
        raise ValueError(f"hc fn has shape {tuple(fn.shape)}, expected {(hc * (2 + hc), hc * H)}")
    x = residual.to(F64).reshape(T, hc * H)                       # stream-major flatten
    # upstream: fp32-equivalent products (tf32×3 / split-bf16×3 / fp32); here fp64, rounded once
    mix = (x @ fn.to(F64).t()).to(F32) * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + rms_eps).to(F32)
    a, b = scale.to(F32), base.to(F32)
    z = mix * torch.cat([a[0].expand(hc), a[1].expand(hc), a[2].expand(hc * hc)]) + b   # fp32 ·α, + b

    def sigmoid(v: Tensor) -> Tensor:
        return torch.sigmoid(v.to(F64)).to(F32)

    pre = sigmoid(z[:, :hc]) + fp32_scalar(hc_eps)
    post = 2.0 * sigmoid(z[:, hc:2 * hc])
    comb = sinkhorn(z[:, 2 * hc:].reshape(T, hc, hc), sinkhorn_iters, hc_eps)
    return HcCoefficients(pre=pre, post=post, comb=comb)


def hc_weighted_sum(residual: Tensor, pre: Tensor) -> Tensor:
    """bf16(Σ_j pre_j·R_j) in fp32 math, summed in stream order j = 0, 1, …:
    [T, hc, H], [T, hc] → [T, H] (spec §3.2, §3.7)."""
    r, p = residual.to(F32), pre.to(F32)
    acc = p[:, 0, None] * r[:, 0]
    for j in range(1, r.shape[1]):
        acc = acc + p[:, j, None] * r[:, j]
    return bf16(acc)


def hc_sublayer_input(residual: Tensor, carried_pre: Tensor | None, norm_weight: Tensor,
                      rms_eps: float) -> Tensor:
    """Sublayer input x_in = RMSNorm(bf16(Σ_j pre^{(n−1)}_j·R_j)) with the **lagged** pre.

    `carried_pre` is the pre of the previous hyper-connection; None only for the model's first
    hyper-connection (layer 0 attention), which reads stream 0 (spec §3.2).
    """
    if carried_pre is None:
        combined = residual[:, 0, :].to(F32)
    else:
        combined = hc_weighted_sum(residual, carried_pre)
    return rms_norm(combined, norm_weight, rms_eps)


def hc_residual_update(residual: Tensor, sublayer_out: Tensor, coeffs: HcCoefficients) -> Tensor:
    """R'_k = bf16(post_k·y + Σ_j comb_jk·R_j), fp32 math (spec §3.2). Returns [T, hc, H]."""
    r, comb = residual.to(F32), coeffs.comb.to(F32)
    y = sublayer_out.to(F32)
    out = []
    for k in range(r.shape[1]):                     # fixed summation order: post·y, then j = 0, 1, …
        acc = coeffs.post[:, k, None] * y
        for j in range(r.shape[1]):
            acc = acc + comb[:, j, k, None] * r[:, j]
        out.append(acc)
    return bf16(torch.stack(out, dim=1))


def hc_collapse(residual: Tensor, last_pre: Tensor) -> Tensor:
    """Final stream reduction h = bf16(Σ_j pre_j·R_j) with the last ffn-hc's pre (spec §3.2)."""
    return hc_weighted_sum(residual, last_pre)

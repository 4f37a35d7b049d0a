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
* Token-wise, chunk- and device-invariant: the coefficients (mix, rsqrt, sigmoid, softmax,
  Sinkhorn) are evaluated in fp64 and rounded once to fp32 — the fp32 formula's value without
  fp32 rounding noise, whatever the BLAS, reduction order or libm — and the stream sums run in
  a fixed order (post·y first, then j = 0, 1, …) with IEEE fp32 multiplies and adds. A token's
  coefficients and residual depend neither on how many tokens share the call nor on the device.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .ops import F32, bf16, rms_norm

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


def sinkhorn(logits: Tensor, iters: int, eps: float) -> Tensor:
    """Finite Sinkhorn normalisation of [..., hc, hc] logits (spec §3.2, §12).

    M ← softmax_k(C); M ← M + ε; M ← M / (colsum + ε); then (iters − 1) times:
    M ← M / (rowsum + ε); M ← M / (colsum + ε). rowsum_j = Σ_k M_jk, colsum_k = Σ_j M_jk.
    Exactly `iters` column normalisations; never iterated to convergence. Evaluated in fp64,
    returned as fp32.
    """
    if iters < 1:
        raise ValueError(f"Sinkhorn needs at least one iteration, got {iters}")
    m = torch.softmax(logits.to(F64), dim=-1) + eps
    m = m / (m.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        m = m / (m.sum(dim=-1, keepdim=True) + eps)
        m = m / (m.sum(dim=-2, keepdim=True) + eps)
    return m.to(F32)


def hc_coefficients(residual: Tensor, fn: Tensor, base: Tensor, scale: Tensor, *,
                    rms_eps: float, hc_eps: float, sinkhorn_iters: int) -> HcCoefficients:
    """pre/post/comb of one hyper-connection from the residual entering it (spec §3.2).

    residual [T, hc, H]; fn [hc·(2+hc), hc·H]; base [hc·(2+hc)]; scale [3]; all math fp32.
    """
    T, hc, H = residual.shape
    if fn.shape != (hc * (2 + hc), hc * H):
        raise ValueError(f"hc fn has shape {tuple(fn.shape)}, expected {(hc * (2 + hc), hc * H)}")
    x = residual.to(F64).reshape(T, hc * H)                       # stream-major flatten
    # upstream: fp32-equivalent precision (tf32×3 / split-bf16×3 / fp32); here fp64, rounded once
    mix = (x @ fn.to(F64).t()) * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + rms_eps)
    a = scale.to(F64)
    b = base.to(F64)
    pre = torch.sigmoid(a[0] * mix[:, :hc] + b[:hc]) + hc_eps
    post = 2.0 * torch.sigmoid(a[1] * mix[:, hc:2 * hc] + b[hc:2 * hc])
    comb_logits = (a[2] * mix[:, 2 * hc:] + b[2 * hc:]).reshape(T, hc, hc)
    comb = sinkhorn(comb_logits, sinkhorn_iters, hc_eps)
    return HcCoefficients(pre=pre.to(F32), post=post.to(F32), comb=comb)


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

"""Engram gate applied to the hyper-connection residual (spec `model.md` §3.3.2, §8 item 14).

At an Engram layer the residual streams are replaced **before** the layer's attention
hyper-connection: R ← Engram(R) (spec §3.2 "Engram / capture interplay"). The attention hc then
computes its coefficients from the post-Engram residual, while its combine still uses the `pre`
carried from layer i−1's ffn hc (computed on the pre-Engram residual) — that wiring belongs to
the model; this module only maps R to the new R.

Invariants:

* emb_t = concat over the hash columns (column order) of the dequantised BF16 table rows.
* kv_t = engram.wkv(emb_t) through the model's FP8 linear (BF16 output), split
  [key_0 … key_{hc−1}, value], each H wide.
* Per stream c, in fp32: dot = Σ_d (h_d·w_d)·key_{c,d} · (rsqrt(mean(h²)+ε) · rsqrt(mean(key_c²)+ε))
  · H^{−1/2}, with h = R_c, w = q_weight[c] ⊙ k_weight[c] and two **separate** RMS factors
  (upstream's fp32 steps; reductions and transcendentals float64, rounded once);
  g = sigmoid(copysign(sqrt(max(|dot|, 1e−6)), dot)); R_c ← bf16(h + g·value) (fp32 product and
  sum, upstream `srt/layers/engram.py:1291-1292`). The same value
  vector is added (gated per stream) to every stream.
* Rows of image tokens (only when the model has vision) keep R unchanged.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from .ops import F32, bf16, fp32_scalar, linear_fp8

#: |dot| is clamped below by this before the square root (spec §3.3.2).
GATE_DOT_FLOOR = 1e-6

Linear = Callable[[Tensor, Tensor], Tensor]


def engram_embedding(row_ids: Tensor, table: Tensor) -> Tensor:
    """emb [T, columns·d]: the table rows of every hash column, concatenated in column order."""
    if row_ids.ndim != 2:
        raise ValueError(f"row_ids must be [T, columns], got {tuple(row_ids.shape)}")
    if table.ndim != 2:
        raise ValueError(f"Engram table must be [rows, d], got {tuple(table.shape)}")
    if row_ids.numel() and (int(row_ids.min()) < 0 or int(row_ids.max()) >= table.shape[0]):
        raise ValueError(f"Engram row ids outside the table [0, {table.shape[0]}) "
                         f"(min {int(row_ids.min())}, max {int(row_ids.max())})")
    rows = table[row_ids.to(torch.int64)]                      # [T, columns, d]
    return rows.reshape(row_ids.shape[0], -1)


def engram_gate(residual: Tensor, keys: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float) -> Tensor:
    """g [T, hc] (fp32) from residual [T, hc, H] and keys [T, hc, H] (spec §3.3.2):
    sigmoid(copysign(sqrt(max(|dot|, 1e−6)), dot)) with dot the doubly RMS-normalised weighted
    inner product of each stream with its own key. The sign is copied as upstream does
    (`srt/layers/engram.py:1291`): dot = ±0 gives ±1e−3, not 0.

    Rounded as upstream's fp32 gate (`engram.py:1280-1291`, `kernels/ops/embeddings/engram_gate.py`,
    no FMA): w = q·k, h·w, (h·w)·key, rs_h·rs_k, Σ·rstd, ·H^−½, max and the sqrt are fp32
    operations; the sum over H, the two rsqrt(mean(·²) + ε) and the sigmoid are evaluated in
    float64 and rounded once (reductions / transcendentals: device-invariant ops convention).
    """
    f64 = torch.float64
    h = residual.to(F32)
    key = keys.to(F32)
    hidden = h.shape[-1]
    w = q_weight.to(F32) * k_weight.to(F32)                              # [hc, H] fp32
    inner = ((h * w) * key).to(f64).sum(dim=-1).to(F32)                  # fp32 products, exact sum once
    h_rms_inv = torch.rsqrt(h.to(f64).pow(2).mean(dim=-1) + eps).to(F32)
    key_rms_inv = torch.rsqrt(key.to(f64).pow(2).mean(dim=-1) + eps).to(F32)
    dot = inner * (h_rms_inv * key_rms_inv) * fp32_scalar(hidden ** -0.5)
    mag = torch.sqrt(dot.abs().clamp(min=fp32_scalar(GATE_DOT_FLOOR)).to(f64)).to(F32)   # correctly rounded fp32 sqrt
    return torch.sigmoid(torch.copysign(mag, dot).to(f64)).to(F32)


def gated_residual(R: Tensor, gate: Tensor, value: Tensor) -> Tensor:
    """bf16(R + g·value) with fp32 product and fp32 sum, in upstream's order
    (`srt/layers/engram.py:1292`: `(h + gate·value.float()).to(x.dtype)`); R [T, hc, H],
    gate [T, hc], value [T, H]. Returns fp32 BF16-valued [T, hc, H]."""
    return bf16(R.to(F32) + gate.to(F32)[:, :, None] * value.to(F32)[:, None, :])


def engram_residual_update(
    R: Tensor,
    row_ids: Tensor,
    table: Tensor,
    wkv: Tensor,
    q_weight: Tensor,
    k_weight: Tensor,
    eps: float,
    image_rows: Tensor | None = None,
    linear: Linear = linear_fp8,
) -> Tensor:
    """The residual after the Engram gate (spec §3.3.2).

    R [T, hc, H] holds BF16 values; row_ids [T, columns] from `EngramHasher`; table
    [rows, d] dequantised (BF16 values); wkv [(hc+1)·H, columns·d] dequantised; q_weight,
    k_weight [hc, H]; eps = rms_norm_eps; image_rows [T] bool marks image tokens (None: no
    vision); `linear(x, weight)` is the model's FP8 linear (default `ops.linear_fp8`).
    Returns a tensor of R's dtype holding BF16 values; image rows equal R bit for bit.
    """
    if R.ndim != 3:
        raise ValueError(f"residual must be [T, hc, H], got {tuple(R.shape)}")
    tokens, hc, hidden = R.shape
    if row_ids.shape[0] != tokens:
        raise ValueError(f"{row_ids.shape[0]} row-id rows for {tokens} tokens")
    if q_weight.shape != (hc, hidden) or k_weight.shape != (hc, hidden):
        raise ValueError(f"q_weight/k_weight must be [{hc}, {hidden}], got "
                         f"{tuple(q_weight.shape)} / {tuple(k_weight.shape)}")
    expected_wkv = ((hc + 1) * hidden, row_ids.shape[1] * table.shape[1])
    if tuple(wkv.shape) != expected_wkv:
        raise ValueError(f"engram.wkv must be {list(expected_wkv)}, got {list(wkv.shape)}")
    if image_rows is not None and tuple(image_rows.shape) != (tokens,):
        raise ValueError(f"image_rows must be [{tokens}], got {tuple(image_rows.shape)}")

    emb = engram_embedding(row_ids, table)
    kv = linear(emb, wkv).to(F32)
    if tuple(kv.shape) != (tokens, (hc + 1) * hidden):
        raise ValueError(f"linear returned {tuple(kv.shape)}, expected {(tokens, (hc + 1) * hidden)}")
    keys = kv[:, : hc * hidden].reshape(tokens, hc, hidden)
    value = kv[:, hc * hidden:]                                # [T, H], shared by all streams

    gate = engram_gate(R, keys, q_weight, k_weight, eps)       # [T, hc]
    updated = gated_residual(R, gate, value)
    if image_rows is not None:
        updated = torch.where(image_rows.to(torch.bool)[:, None, None], R.to(F32), updated)
    return updated.to(R.dtype)

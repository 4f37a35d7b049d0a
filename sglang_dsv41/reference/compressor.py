"""Compressed latents and index keys written by a kv-source layer (spec `model.md` §3.4.3).

A kv-source layer (roles table §1.3, `LayerRole.computes_latents`) turns its attention input x
into one compressed latent per `ratio` tokens and, from each latent, one indexer key:

* ratio 1: z_t = compressor.wkv·x_t (BF16 GEMM, BF16 out); latent_t = RMSNorm_norm(z_t);
  compressed position g = p, RoPE position p.
* ratio 2: a_t = compressor.wkv·x_t, s_t = compressor.wgate·x_t (BF16 GEMM, **fp32** out);
  for the pair g = (2g, 2g+1): σ = per-dimension 2-way softmax of (s_2g, s_2g+1);
  pooled_g = a_2g·σ_2g + a_2g+1·σ_2g+1 in upstream's fp32 steps (`numerics.rounding.pair_pool`);
  latent_g = RMSNorm_norm(bf16(pooled_g));
  RoPE position 2g. The latent exists only once token 2g+1 has been processed: a chunk that
  ends on an even position leaves its last token *pending* (`PendingPairToken`), and the next
  chunk completes the pair.
* stored latent (what attention reads back):
  `compressed_cache_roundtrip(FP4fake_E4M3(bf16(RoPE(latent, pos))), profile)`;
* index key: `FP4fake_UE8M0(bf16(RoPE(RMSNorm_k_norm(indexer.wk·latent), pos)))` — from the
  **pre-RoPE** latent; indexer.wk is a BF16 GEMM with BF16 out.

The rotated tail is rounded to BF16 before the FP4 round trip, as upstream does on every path
(`dsv41_sparse.py:31-44,97`, `fp4_rope_fake_quant.py:49`, `fp4_indexer_rope.cuh:109-111`):
`rope_entry_values` is that step, shared with the runtime's packed-entry writer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..config import TextConfig
from ..numerics.rounding import pair_pool
from . import ops


@dataclass
class PendingPairToken:
    """First token (even position) of a ratio-2 pair whose second token is not processed yet.

    Holds exactly what the pooling needs from it: its fp32 wkv projection `a` and wgate score
    `s` ([head_dim] each), so the pair can be completed by the next chunk (spec §3.4.3).
    """

    position: int
    a: Tensor
    s: Tensor

    def clone(self) -> "PendingPairToken":
        return PendingPairToken(self.position, self.a.clone(), self.s.clone())


@dataclass
class CompressedEntries:
    """New compressed entries of one chunk for one kv source, in compressed-position order."""

    latents: Tensor      # [n, head_dim] read-back values (cache profile applied)
    index_keys: Tensor   # [n, index_head_dim] FP4 (UE8M0) values
    rope_positions: Tensor  # [n] int64: p (ratio 1) or 2g (ratio 2)


def _weight(w, prefix: str, name: str) -> Tensor:
    key = prefix + name
    if key not in w:
        raise KeyError(f"attention weights: missing '{key}' (needed by a kv-source layer)")
    return w[key]


def linear_fp32_out(x: Tensor, weight: Tensor) -> Tensor:
    """BF16 GEMM with fp32 output (ratio-2 wkv / wgate, spec §3.4.3).

    Accumulated in float64 and rounded once to fp32: the correctly rounded value of the exact
    dot product, hence independent of the batch size. (`ops.linear_bf16(out_fp32=True)` uses an
    fp32 GEMM, whose last bits differ between a 1-row and an n-row call on CPU BLAS; these fp32
    values are kept in the state for a pending pair, so chunked == one-shot needs invariance.)
    Same product as `ops.matmul_fp32_exact`, through which it runs.
    """
    return ops.matmul_fp32_exact(x, weight)


def ratio1_latents(cfg: TextConfig, w, prefix: str, x: Tensor) -> Tensor:
    """[T, head_dim] BF16-valued pre-RoPE latents, one per token (spec §3.4.3, ratio 1)."""
    z = ops.linear_bf16(x, _weight(w, prefix, "compressor.wkv.weight"))
    return ops.rms_norm(z, _weight(w, prefix, "compressor.norm.weight"), cfg.rms_norm_eps)


def ratio2_latents(cfg: TextConfig, w, prefix: str, x: Tensor, positions: Tensor,
                   pending: PendingPairToken | None) -> tuple[Tensor, Tensor, PendingPairToken | None]:
    """Pre-RoPE latents of the pairs completed by this chunk (spec §3.4.3, ratio 2).

    Returns (latents [n, head_dim] BF16-valued, rope positions [n] = 2g, new pending token).
    The rows considered are `pending` (if any) followed by the chunk's tokens; they must start
    at an even position, pairs are consecutive rows, and an odd row count leaves the last row
    pending.
    """
    a = linear_fp32_out(x, _weight(w, prefix, "compressor.wkv.weight"))
    s = linear_fp32_out(x, _weight(w, prefix, "compressor.wgate.weight"))
    pos = positions.to(torch.int64)
    first = int(pos[0])
    if pending is not None:
        if first != pending.position + 1:
            raise ValueError(f"ratio-2 compressor: pending token at position {pending.position} "
                             f"but the chunk starts at {first}")
        a = torch.cat((pending.a[None].to(a), a))
        s = torch.cat((pending.s[None].to(s), s))
        pos = torch.cat((pos.new_tensor([pending.position]), pos))
    elif first % 2:
        raise ValueError(f"ratio-2 compressor: chunk starts at odd position {first} without a pending "
                         "first-of-pair token (state out of sync)")
    n_pairs = a.shape[0] // 2
    new_pending = None
    if a.shape[0] % 2:
        new_pending = PendingPairToken(int(pos[-1]), a[-1].clone(), s[-1].clone())
    D = a.shape[1]
    a_pairs = a[: 2 * n_pairs].reshape(n_pairs, 2, D)
    s_pairs = s[: 2 * n_pairs].reshape(n_pairs, 2, D)
    # per-dimension softmax over the pair's two tokens and the weighted sum, upstream's fp32 steps
    pooled = pair_pool(a_pairs, s_pairs)
    latents = ops.rms_norm(ops.bf16(pooled), _weight(w, prefix, "compressor.norm.weight"), cfg.rms_norm_eps)
    return latents, pos[0 : 2 * n_pairs : 2], new_pending


def rope_entry_values(cfg: TextConfig, w, prefix: str, latents: Tensor, rope_positions: Tensor,
                      inv_freq: Tensor) -> tuple[Tensor, Tensor]:
    """The values right before the FP4 round trips, both BF16-valued: (bf16(RoPE(latent)),
    bf16(RoPE(RMSNorm_k_norm(indexer.wk·latent)))) — [n, head_dim], [n, index_head_dim]."""
    roped = ops.bf16_rope_tail(latents, rope_positions, inv_freq)
    k = ops.linear_bf16(latents, _weight(w, prefix, "indexer.wk.weight"))
    k = ops.rms_norm(k, _weight(w, prefix, "indexer.k_norm.weight"), cfg.rms_norm_eps)
    return roped, ops.bf16_rope_tail(k, rope_positions, inv_freq)


def stored_latents(cfg: TextConfig, roped: Tensor, profile: ops.CacheProfile) -> Tensor:
    """What attention reads back for each latent: FP4 (per-16 E4M3) of the BF16 RoPE'd latent
    (`rope_entry_values`), then the cache profile's round trip (spec §3.4.3, §3.8)."""
    return ops.compressed_cache_roundtrip(ops.fp4_fake_quant_e4m3_scale(roped), profile, cfg.qk_rope_head_dim)


def index_keys(cfg: TextConfig, w, prefix: str, latents: Tensor, rope_positions: Tensor,
               inv_freq: Tensor) -> Tensor:
    """Indexer keys [n, index_head_dim] from the pre-RoPE latents (spec §3.4.3)."""
    _, k = rope_entry_values(cfg, w, prefix, latents, rope_positions, inv_freq)
    return ops.fp4_fake_quant_ue8m0_scale(k)


def compress_chunk(cfg: TextConfig, w, prefix: str, ratio: int, x: Tensor, positions: Tensor,
                   pending: PendingPairToken | None, inv_freq: Tensor,
                   profile: ops.CacheProfile) -> tuple[CompressedEntries, PendingPairToken | None]:
    """All compressed entries completed by this chunk of a kv-source layer, and the new pending
    token (always None at ratio 1)."""
    if ratio == 1:
        if pending is not None:
            raise ValueError("ratio-1 compressor cannot have a pending token")
        latents, rope_pos, new_pending = ratio1_latents(cfg, w, prefix, x), positions.to(torch.int64), None
    elif ratio == 2:
        latents, rope_pos, new_pending = ratio2_latents(cfg, w, prefix, x, positions, pending)
    else:
        raise ValueError(f"compressor: unsupported compress ratio {ratio} (V4.1 uses 1 and 2)")
    roped, k = rope_entry_values(cfg, w, prefix, latents, rope_pos, inv_freq)
    entries = CompressedEntries(
        latents=stored_latents(cfg, roped, profile),
        index_keys=ops.fp4_fake_quant_ue8m0_scale(k),
        rope_positions=rope_pos,
    )
    return entries, new_pending

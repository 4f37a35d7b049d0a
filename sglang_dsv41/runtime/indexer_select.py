"""Indexer selection of the runtime (spec `model.md` §3.4.4): scores → compressed positions.

Selections are [T, index_topk] int64 compressed positions, ascending, −1 padded; ties → the
lower index (docs/reference.md). Two whole-batch forms:

* `run_indexer_cpu`: one request's chunk on CPU — scores Σ_h w·ReLU(q·k) in float64 rounded
  once, a stable sort; tested against `reference.indexer.run_indexer`;
* `select_for_role`: the layer's role applied to scores from the Triton `index_scores` kernel
  (`kernels.indexer_select.select_indices`: same tie rule, order keys instead of a sort).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from ..config import LayerRole, TextConfig
from ..numerics.geometry import visible_counts
from ..numerics.rounding import bf16
from .attention_math import IndexQuery


def index_scores(query: IndexQuery, keys: Tensor, acc: torch.dtype = torch.float64) -> Tensor:
    """S[t, j] = bf16(Σ_h bf16(w[t,h]·ReLU(bf16(q[t,h]·k[j])))) ([T, N] fp32; the dots and the head
    sum in `acc`, rounded to fp32 then BF16 — upstream's rounding points; −0 → +0)."""
    dots = bf16(torch.einsum("thd,nd->thn", query.q.to(acc), keys.to(acc)).to(torch.float32))
    terms = bf16(torch.relu(dots) * query.head_weights.to(torch.float32).unsqueeze(-1))
    scores = bf16(terms.to(acc).sum(dim=1).to(torch.float32))
    return scores + 0.0


def top_k_lower_index_on_ties(scores: Tensor, allowed: Tensor, k: int) -> Tensor:
    """Per row the min(k, #allowed) allowed columns with the largest scores, ties → lower column;
    [T, k] int64 ascending, −1 padded."""
    T, N = scores.shape
    if N == 0:
        return torch.full((T, k), -1, dtype=torch.int64, device=scores.device)
    if bool((allowed & (torch.isnan(scores) | (scores == -math.inf))).any()):
        raise ValueError("indexer: NaN or −∞ score on an allowed position (cannot be ranked)")
    masked = torch.where(allowed, scores, torch.full_like(scores, -math.inf))
    take = min(k, N)
    chosen = torch.sort(masked, dim=1, descending=True, stable=True).indices[:, :take]
    keep = torch.arange(take, device=scores.device)[None, :] < allowed.sum(dim=1, keepdim=True)
    chosen = torch.where(keep, chosen, torch.full_like(chosen, -1))
    if take < k:
        chosen = torch.cat((chosen, chosen.new_full((T, k - take), -1)), dim=1)
    big = torch.iinfo(torch.int64).max
    canonical = torch.sort(torch.where(chosen < 0, big, chosen), dim=1).values
    return torch.where(canonical == big, -1, canonical)


def candidate_blocks(scores: Tensor, n_visible: Tensor, block_size: int, n_blocks: int) -> Tensor:
    """Blocks the candidate source publishes: key_b = max visible score of block b, the newest
    block +∞, top-min(n_blocks, ⌈n_t/B⌉) with ties → lower block; ascending, −1 padded."""
    T, N = scores.shape
    n_total = -(-N // block_size)
    padded = torch.full((T, n_total * block_size), -math.inf, dtype=torch.float32, device=scores.device)
    j = torch.arange(N, device=scores.device)
    padded[:, :N] = torch.where(j[None, :] < n_visible[:, None], scores.to(torch.float32), -math.inf)
    keys = padded.reshape(T, n_total, block_size).amax(dim=2)
    b = torch.arange(n_total, device=scores.device)
    keys = torch.where(b[None, :] == torch.div(n_visible - 1, block_size, rounding_mode="floor")[:, None],
                       math.inf, keys)
    allowed = b[None, :] < torch.div(n_visible + block_size - 1, block_size, rounding_mode="floor")[:, None]
    return top_k_lower_index_on_ties(keys, allowed, n_blocks)


def run_indexer_cpu(cfg: TextConfig, role: LayerRole, query: IndexQuery, positions: Tensor, keys: Tensor,
                    published_blocks: Tensor | None, acc: torch.dtype = torch.float64) -> tuple[Tensor, Tensor | None]:
    """(selection, published blocks or None) of one request's chunk against its index keys [N, d]."""
    if not role.runs_indexer:
        raise ValueError(f"layer {role.layer} does not run an indexer")
    scores = index_scores(query, keys, acc)
    n_visible = visible_counts(positions, role.ratio)
    allowed = torch.arange(keys.shape[0], device=scores.device)[None, :] < n_visible[:, None]
    if role.candidate_consumer:
        if published_blocks is None:
            raise ValueError(f"layer {role.layer} is a candidate consumer but no candidate blocks were "
                             f"published in this forward (candidate source {cfg.candidate_source_layer_id})")
        j_block = torch.arange(keys.shape[0], device=keys.device) // cfg.candidate_block_size
        allowed = allowed & (j_block[None, :, None] == published_blocks[:, None, :]).any(dim=2)
    blocks = (candidate_blocks(scores, n_visible, cfg.candidate_block_size, cfg.candidate_topk_blocks)
              if role.candidate_source else None)
    return top_k_lower_index_on_ties(scores, allowed, cfg.index_topk), blocks


def select_for_role(kernels, cfg: TextConfig, role: LayerRole, scores: Tensor, n_visible: Tensor,
                    published_blocks: Tensor | None, *, check_nan: bool = True,
                    bounded: bool = False) -> tuple[Tensor, Tensor | None]:
    """(selection, blocks or None) of an indexer layer from `kernels.indexer.index_scores` output, through
    `kernels.select_indices` (`kernels`: the selection module `kernels.indexer_select`)."""
    if not role.runs_indexer:
        raise ValueError(f"layer {role.layer} does not run an indexer")
    if role.candidate_consumer and published_blocks is None:
        raise ValueError(f"layer {role.layer} is a candidate consumer but no candidate blocks were published "
                         f"in this forward (candidate source {cfg.candidate_source_layer_id})")
    return kernels.select_indices(scores, n_visible, published_blocks if role.candidate_consumer else None,
                                  index_topk=cfg.index_topk, block_size=cfg.candidate_block_size,
                                  topk_blocks=cfg.candidate_topk_blocks, publish_blocks=role.candidate_source,
                                  check_nan=check_nan, bounded=bounded)

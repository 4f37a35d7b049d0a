"""Sparse selection of compressed positions: the FP4 indexer (spec `model.md` §3.4.4).

Selections are `[T, index_topk]` int64 tensors of compressed positions into the kv source's
cache, **sorted ascending and padded with −1** (a canonical form: attention is a set operation,
so only *which* positions are chosen matters, never their order).

Tie rule (our decision, documented in docs/reference.md): whenever scores tie — positions in
the top-k, blocks in the candidate stage — the **lower index wins**. Scores are compared as
real numbers (−0.0 == +0.0). Upstream kernels do not promise a tie order; zero scores (all
heads ReLU'd to 0) are the realistic source of exact ties.

Visibility: query at absolute position p sees compressed positions j < n = ⌊(p+1)/ratio⌋.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..config import LayerRole, TextConfig
from ..numerics.geometry import visible_counts  # noqa: F401  (re-exported)
from . import ops


@dataclass
class IndexQuery:
    """Per-token indexer query: FP4 (UE8M0) heads and the per-head score weights."""

    q: Tensor             # [T, index_n_heads, index_head_dim] FP4 values (RoPE'd before quant)
    head_weights: Tensor  # [T, index_n_heads] BF16-valued fp32


def index_query(cfg: TextConfig, w, prefix: str, x: Tensor, q_lora: Tensor, positions: Tensor,
                inv_freq: Tensor, act_quant: bool) -> IndexQuery:
    """q_idx = FP4fake_UE8M0(bf16(RoPE(view(indexer.wq_b·q_lora)))) and
    w = bf16(bf16(weights_proj·x)·fp32(index_head_dim^−1/2·index_n_heads^−1/2)) (spec §3.4.4).

    As upstream: the rotated tail is rounded to BF16 before the FP4 round trip
    (`dsv41_sparse.py:31-44,97`); the head weights are a BF16 tensor times the fp32 factor, rounded
    to BF16 again (`dsv41_sparse.py:282-283`, `fp4_indexer_rope.cuh:288-291`; for Flash the
    factor is 1/64 and the second rounding is exact).
    """
    for name in ("indexer.wq_b.weight", "indexer.weights_proj.weight"):
        if prefix + name not in w:
            raise KeyError(f"attention weights: missing '{prefix + name}' (needed by an indexer layer)")
    T = x.shape[0]
    q = ops.linear_fp8(q_lora, w[prefix + "indexer.wq_b.weight"], act_quant)
    q = q.reshape(T, cfg.index_n_heads, cfg.index_head_dim)
    q = ops.fp4_fake_quant_ue8m0_scale(ops.bf16_rope_tail(q, positions, inv_freq))
    scale = ops.fp32_scalar(cfg.index_head_dim ** -0.5 * cfg.index_n_heads ** -0.5)
    head_weights = ops.bf16(ops.linear_bf16(x, w[prefix + "indexer.weights_proj.weight"]) * scale)
    return IndexQuery(q=q, head_weights=head_weights)


def index_scores(query: IndexQuery, keys: Tensor) -> Tensor:
    """S[t, j] = Σ_h w[t,h]·ReLU(q[t,h]·k[j]) for every cached key j ([T, N] fp32, BF16 values).

    Upstream's rounding points on H200 (decode `fp4_index_logits_paged`, `fp4_indexer.py:425-430`:
    "bf16 dot -> relu -> * bf16 weight -> bf16 -> sum -> bf16"; prefill `scores`,
    `dsv41_sparse.py:289-291`, the same in BF16 torch ops): d = bf16(q·k), p_h = bf16(w_h·ReLU(d_h)),
    S = bf16(Σ_h p_h). The dots and the head sum are evaluated in float64 and rounded once to fp32
    before their BF16 rounding (order-free: batch invariant); w·ReLU(d) is exact in fp32.
    """
    f64 = torch.float64
    dots = ops.bf16(torch.einsum("thd,nd->thn", query.q.to(f64), keys.to(f64)).to(torch.float32))
    terms = ops.bf16(torch.relu(dots) * query.head_weights.to(torch.float32).unsqueeze(-1))
    scores = ops.bf16(terms.to(f64).sum(dim=1).to(torch.float32))
    return scores + 0.0  # −0.0 → +0.0, so equal scores are bit-identical


def top_k_lower_index_on_ties(scores: Tensor, allowed: Tensor, k: int) -> Tensor:
    """Per row, the min(k, #allowed) allowed columns with the largest scores, ties → lower
    column index. Returns [T, k] int64, each row sorted ascending, padded with −1."""
    T, N = scores.shape
    if N == 0:
        return torch.full((T, k), -1, dtype=torch.int64, device=scores.device)
    if bool((allowed & (torch.isnan(scores) | (scores == -math.inf))).any()):
        raise ValueError("indexer: NaN or −∞ score on an allowed position (cannot be ranked)")
    masked = torch.where(allowed, scores, torch.full_like(scores, -math.inf))
    # Columns are in ascending index order; a stable descending sort keeps lower indices first
    # among equal scores, which is exactly the tie rule.
    order = torch.sort(masked, dim=1, descending=True, stable=True).indices
    take = min(k, N)
    chosen = order[:, :take]
    n_allowed = allowed.sum(dim=1, keepdim=True)
    keep = torch.arange(take, device=scores.device)[None, :] < n_allowed
    chosen = torch.where(keep, chosen, torch.full_like(chosen, -1))
    if take < k:
        chosen = torch.cat((chosen, chosen.new_full((T, k - take), -1)), dim=1)
    # canonical form: ascending, −1 padding at the end
    big = torch.iinfo(torch.int64).max
    canonical = torch.sort(torch.where(chosen < 0, big, chosen), dim=1).values
    return torch.where(canonical == big, -1, canonical)


def candidate_blocks(scores: Tensor, n_visible: Tensor, block_size: int, n_blocks: int) -> Tensor:
    """Blocks published by the candidate source (spec §3.4.4).

    Block b covers compressed positions [b·B, (b+1)·B). key_b = max over visible positions of
    the block; the newest block (containing n_t−1) gets +∞; keep the top-min(n_blocks, ⌈n_t/B⌉)
    blocks (ties → lower block index). Returns [T, n_blocks] block ids, ascending, −1 padded.
    """
    T, N = scores.shape
    n_total_blocks = -(-N // block_size)
    padded = torch.full((T, n_total_blocks * block_size), -math.inf, dtype=torch.float32, device=scores.device)
    j = torch.arange(N, device=scores.device)
    padded[:, :N] = torch.where(j[None, :] < n_visible[:, None], scores.to(torch.float32), -math.inf)
    block_keys = padded.reshape(T, n_total_blocks, block_size).amax(dim=2)
    b = torch.arange(n_total_blocks, device=scores.device)
    newest = torch.div(n_visible - 1, block_size, rounding_mode="floor")
    block_keys = torch.where(b[None, :] == newest[:, None], math.inf, block_keys)
    allowed = b[None, :] < torch.div(n_visible + block_size - 1, block_size, rounding_mode="floor")[:, None]
    return top_k_lower_index_on_ties(block_keys, allowed, n_blocks)


def block_membership(blocks: Tensor, block_size: int, n_positions: int) -> Tensor:
    """[T, N] bool: compressed position j lies in one of the row's blocks."""
    j_block = torch.arange(n_positions, device=blocks.device) // block_size
    return (j_block[None, :, None] == blocks[:, None, :]).any(dim=2)


@dataclass
class IndexerResult:
    selection: Tensor            # [T, index_topk] compressed positions, ascending, −1 padded
    blocks: Tensor | None        # [T, candidate_topk_blocks] published blocks (candidate source only)


def run_indexer(cfg: TextConfig, role: LayerRole, w, prefix: str, x: Tensor, q_lora: Tensor,
                positions: Tensor, keys: Tensor, inv_freq: Tensor, act_quant: bool,
                published_blocks: Tensor | None) -> IndexerResult:
    """Score this chunk's queries against the kv source's index keys and select (spec §3.4.4).

    * full indexers (kv sources): top-min(index_topk, n_t) over visible positions;
    * the candidate source additionally publishes blocks (its own selection stays full);
    * candidate consumers: top-k restricted to `published_blocks` (and visibility).
    """
    if not role.runs_indexer:
        raise ValueError(f"layer {role.layer} does not run an indexer")
    query = index_query(cfg, w, prefix, x, q_lora, positions, inv_freq, act_quant)
    scores = index_scores(query, keys)
    n_visible = visible_counts(positions, role.ratio)
    allowed = torch.arange(keys.shape[0], device=scores.device)[None, :] < n_visible[:, None]
    blocks = None
    if role.candidate_consumer:
        if published_blocks is None:
            raise ValueError(f"layer {role.layer} is a candidate consumer but no candidate blocks were "
                             f"published in this forward (candidate source {cfg.candidate_source_layer_id})")
        allowed = allowed & block_membership(published_blocks, cfg.candidate_block_size, keys.shape[0])
    if role.candidate_source:
        blocks = candidate_blocks(scores, n_visible, cfg.candidate_block_size, cfg.candidate_topk_blocks)
    selection = top_k_lower_index_on_ties(scores, allowed, cfg.index_topk)
    return IndexerResult(selection=selection, blocks=blocks)

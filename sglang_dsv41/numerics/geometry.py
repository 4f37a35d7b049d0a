"""Ids, windows and visibility: the index arithmetic both sides share (spec `model.md` §3.1, §3.4)."""
from __future__ import annotations

import math

import torch
from torch import Tensor

from ..config import DeepseekV41Config
from ..engram_hash import MULTIMODAL_PAD_ID_BASE


def language_model_ids(token_ids: Tensor, cfg: DeepseekV41Config) -> Tensor:
    """Ids the language model sees (spec §3.1 item 3): with vision, multimodal pad ids
    (≥ 1,000,000) read as `image_token_id`; anything outside the vocabulary raises."""
    ids = token_ids.to(torch.int64).reshape(-1)
    if cfg.has_vision:
        ids = torch.where(ids >= MULTIMODAL_PAD_ID_BASE, torch.full_like(ids, cfg.image_token_id), ids)
    vocab = cfg.text.vocab_size
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise ValueError(f"token ids outside the vocabulary [0, {vocab}): min {int(ids.min())}, max {int(ids.max())}")
    return ids


def softmax_scale(head_dim: int) -> float:
    """Attention softmax scale head_dim^−1/2; no YaRN mscale anywhere (spec §3.4.2)."""
    return 1.0 / math.sqrt(head_dim)


def swa_key_positions(positions: Tensor, window: int) -> Tensor:
    """[T, window] absolute positions p−W+1..p (oldest first); −1 where before position 0."""
    offsets = torch.arange(-(window - 1), 1, device=positions.device)
    pos = positions.to(torch.int64)[:, None] + offsets[None, :]
    return torch.where(pos >= 0, pos, -1)


def visible_counts(positions: Tensor, ratio: int) -> Tensor:
    """n_t = ⌊(p_t + 1)/ratio⌋: compressed positions visible to each query (spec §3.4.4)."""
    if ratio < 1:
        raise ValueError(f"visible_counts: ratio must be ≥ 1, got {ratio}")
    return torch.div(positions.to(torch.int64) + 1, ratio, rounding_mode="floor")

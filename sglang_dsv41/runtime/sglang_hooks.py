"""Implementations of the runtime area's HookRegistry entries (the table is `sglang_dsv41.hooks`).

* `compute_cell_size_hook` — AROUND `DefaultPoolConfigurator._compute_cell_size`: SGLang sizes
  its KV pool from a memory budget divided by a per-token "cell size". For a V4.1 model its own
  formula counts only what its MHA pool holds — our SWA kv rows (`v_head_dim = 0`,
  `runtime/hf_config.py`). The torch path also keeps compressed latents, FP4 index keys, ratio-2
  pair state and token ids per slot (`runtime/cache.py`), allocated beside the pool. Adding their
  bytes here makes the token capacity SGLang derives (and prints as `max_total_num_tokens`) the
  honest one: pool + side buffers fit the budget. Other models are untouched.
"""
from __future__ import annotations

from .cache import RuntimeCaches
from .hf_config import MODEL_TYPE


def side_bytes_for(hf_config) -> int:
    """Per-token bytes the torch path keeps beside SGLang's pool; 0 for any other model."""
    if getattr(hf_config, "model_type", None) != MODEL_TYPE or not hasattr(hf_config, "parsed"):
        return 0
    return RuntimeCaches.planned_side_bytes_per_token(hf_config.parsed().text)


def compute_cell_size_hook(original, self, kvc, num_layers):
    """SGLang's cell size plus our side-buffer bytes per token (V4.1 only)."""
    return original(self, kvc, num_layers) + side_bytes_for(kvc.model_config.hf_config)

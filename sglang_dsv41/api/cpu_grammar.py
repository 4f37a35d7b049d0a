"""Grammar-constrained decoding on SGLang 0.5.17's CPU engine (xgrammar backend).

Why: the DSML tool grammar (``tool_choice`` required / named, ``strict`` tools) and
``response_format`` / ``regex`` / ``ebnf`` requests are decoded under an xgrammar token bitmask
(docs/api.md "Tool calls", "Structured output"). SGLang 0.5.17's `XGrammarGrammar` cannot do
that on the CPU: it allocates the bitmask in *pinned* host memory (which needs a CUDA driver:
``RuntimeError: Found no NVIDIA driver``) and applies it only to cuda/npu/xpu/musa logits
(``RuntimeError: Unsupported device: cpu``). Either error is raised in the scheduler's event
loop, so the first constrained request kills a `sglang-dsv41 serve` CPU server (found by
`tests/test_api_server.py`).

What: two AROUND hooks (table: `sglang_dsv41.hooks`, area ``api``) that act only when the
sampling device is the CPU — the bitmask is allocated in ordinary memory with xgrammar's shape
and dtype (all bits set = every token allowed, SGLang's initial value), and applied with
xgrammar's own CPU kernel (`xgrammar.apply_token_bitmask_inplace`, disallowed tokens → -inf).
Every other device runs SGLang's code unchanged.
"""
from __future__ import annotations

from typing import Any

import torch

ALLOW_ALL = -1  # a bitmask word with every bit set: all 32 tokens allowed


def _is_cpu(device: Any) -> bool:
    return torch.device(device).type == "cpu"


def allocate_vocab_mask_hook(original, self, vocab_size: int, batch_size: int, device: Any):
    """AROUND `XGrammarGrammar.allocate_vocab_mask`: an unpinned all-allowed bitmask on CPU."""
    if not _is_cpu(device):
        return original(self, vocab_size, batch_size, device)
    import xgrammar

    return torch.full(xgrammar.get_bitmask_shape(batch_size, vocab_size), ALLOW_ALL,
                      dtype=xgrammar.bitmask_dtype)


def apply_vocab_mask_hook(original, self, logits: torch.Tensor, vocab_mask: torch.Tensor) -> None:
    """AROUND `XGrammarGrammar.apply_vocab_mask`: xgrammar's CPU kernel for CPU logits."""
    if logits.device.type != "cpu":
        return original(self, logits, vocab_mask)
    import xgrammar

    xgrammar.apply_token_bitmask_inplace(logits, vocab_mask.to(logits.device))
    return None

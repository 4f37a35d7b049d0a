"""Bytes of the global-KV row and of the ratio-2 pair-state ring — the one formula the runtime
pool (`runtime/kv_pool.py`, `runtime/kv_layout.py`) and the planner (`deploy/kv.py`) share
(phase-2 contracts §1–§2; docs/runtime.md "KV pool").

* entry E = D/2 + D/16 (FP4 latent + E4M3 scales) + Dk/2 + Dk/32 (FP4 index key + UE8M0 scales);
* a kv source of compress ratio r owns ⌈E/r⌉ bytes of every token's row; the row's payload is
  the sum over kv sources (Flash 356 + 3·178 = 890 B, tiny 176 B);
* the stored row is the payload padded to a multiple of `ROW_ALIGN` = 16 B (Flash **896 B**,
  tiny 176 B): HiCache's copy kernels need 8-byte items, its JIT kernels 16-byte ones;
* the pair ring holds 2 pending pairs per request without speculation, else the next power of
  two ≥ 2 + draft tokens (8 for a 5-token DSpark block).

Pure integer arithmetic; imports nothing that needs torch or SGLang.
"""
from __future__ import annotations

from typing import Iterable

#: Alignment of a stored global-KV row (bytes).
ROW_ALIGN = 16


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def entry_bytes(head_dim: int, index_head_dim: int) -> int:
    """One packed compressed entry: D/2 + D/16 + Dk/2 + Dk/32 bytes (Flash 356)."""
    return head_dim // 2 + head_dim // 16 + index_head_dim // 2 + index_head_dim // 32


def source_shares(head_dim: int, index_head_dim: int, ratios: Iterable[int]) -> list[int]:
    """Bytes each kv source (compress ratio r, in kv-source order) owns in every row: ⌈E/r⌉."""
    e = entry_bytes(head_dim, index_head_dim)
    return [-(-e // r) for r in ratios]


def row_payload_bytes(head_dim: int, index_head_dim: int, ratios: Iterable[int]) -> int:
    """Bytes of packed entries per token (Σ shares; Flash 890, tiny 176)."""
    return sum(source_shares(head_dim, index_head_dim, ratios))


def row_stride_bytes(head_dim: int, index_head_dim: int, ratios: Iterable[int]) -> int:
    """Bytes of one stored row: the payload padded to `ROW_ALIGN` (Flash 896, tiny 176)."""
    return round_up(row_payload_bytes(head_dim, index_head_dim, ratios), ROW_ALIGN)


def pair_ring_slots(draft_tokens: int) -> int:
    """Pending-pair slots per request and ratio-2 source: 2, or the next power of two ≥ 2 + draft
    tokens under speculative decoding."""
    if draft_tokens < 0:
        raise ValueError(f"draft tokens must be ≥ 0, got {draft_tokens}")
    return 2 if draft_tokens == 0 else 1 << (1 + draft_tokens).bit_length()


def text_row_payload_bytes(t) -> int:
    """`row_payload_bytes` of a `config.TextConfig`."""
    return row_payload_bytes(t.head_dim, t.index_head_dim, (t.compress_ratios[s] for s in t.kv_source_layer_ids))


def text_row_stride_bytes(t) -> int:
    """`row_stride_bytes` of a `config.TextConfig` (the global KV bytes per token the pool holds)."""
    return row_stride_bytes(t.head_dim, t.index_head_dim, (t.compress_ratios[s] for s in t.kv_source_layer_ids))


def required_page_multiple(t) -> int:
    """The largest compress ratio of a kv source of a `config.TextConfig`: SGLang's page size must be
    a multiple of it (a ratio-r entry spans the rows of its r tokens, which must share a page)."""
    return max((t.compress_ratios[s] for s in t.kv_source_layer_ids), default=1)

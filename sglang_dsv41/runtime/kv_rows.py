"""Bytes of the global-KV rows and of the ratio-2 pair-state ring — the one formula the runtime
pool (`runtime/kv_pool.py`, `runtime/kv_layout.py`) and the planner (`deploy/kv.py`) share
(phase-2 contracts §1–§2; docs/runtime.md "KV pool").

The global KV is two row buffers, one row of each per token (full slot):

* **latent rows**: every kv source of compress ratio r owns ⌈P_lat/r⌉ bytes of the row,
  P_lat = D/2 + D/16 (FP4 latent + E4M3 scales; Flash 288 + 3·144 = 720 B, tiny 4·27 = 108);
* **index-key rows**: ⌈P_key/r⌉ bytes per source, P_key = Dk/2 + Dk/32 (FP4 index key + UE8M0
  scales; Flash 68 + 3·34 = 170 B, tiny 4·17 = 68);
* each stored row is its payload padded to a multiple of `ROW_ALIGN` = 16 B (HiCache's copy
  kernels need 8-byte items, its JIT kernels 16-byte ones): Flash 720 + 176 = **896 B/token**,
  tiny 112 + 80 = 192 B;
* the pair ring holds 2 pending pairs per request without speculation, else the next power of
  two ≥ 2 + draft tokens (8 for a 5-token DSpark block).

Pure integer arithmetic; imports nothing that needs torch or SGLang.
"""
from __future__ import annotations

from typing import Iterable

#: Alignment of a stored global-KV row (bytes).
ROW_ALIGN = 16
#: Dims per E4M3 latent scale and per UE8M0 index-key scale.
LATENT_GROUP = 16
KEY_GROUP = 32


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def latent_part_bytes(head_dim: int) -> int:
    """Latent part of one compressed entry: D/2 FP4 code bytes + D/16 E4M3 scale bytes (Flash 288)."""
    return head_dim // 2 + head_dim // LATENT_GROUP


def key_part_bytes(index_head_dim: int) -> int:
    """Index-key part of one compressed entry: Dk/2 FP4 code bytes + Dk/32 UE8M0 bytes (Flash 68)."""
    return index_head_dim // 2 + index_head_dim // KEY_GROUP


def entry_bytes(head_dim: int, index_head_dim: int) -> int:
    """One whole packed compressed entry, both parts (Flash 356)."""
    return latent_part_bytes(head_dim) + key_part_bytes(index_head_dim)


def part_shares(part_bytes: int, ratios: Iterable[int]) -> list[int]:
    """Bytes each kv source (compress ratio r, in kv-source order) owns in every row of one part's
    buffer: ⌈part_bytes/r⌉."""
    return [-(-part_bytes // r) for r in ratios]


def latent_row_stride_bytes(head_dim: int, ratios: Iterable[int]) -> int:
    """Bytes of one stored latent row: Σ latent shares padded to `ROW_ALIGN` (Flash 720, tiny 112)."""
    return round_up(sum(part_shares(latent_part_bytes(head_dim), ratios)), ROW_ALIGN)


def key_row_stride_bytes(index_head_dim: int, ratios: Iterable[int]) -> int:
    """Bytes of one stored index-key row: Σ key shares padded to `ROW_ALIGN` (Flash 176, tiny 80)."""
    return round_up(sum(part_shares(key_part_bytes(index_head_dim), ratios)), ROW_ALIGN)


def row_payload_bytes(head_dim: int, index_head_dim: int, ratios: Iterable[int]) -> int:
    """Bytes of packed entries per token over both buffers (Flash 720 + 170 = 890, tiny 176)."""
    ratios = list(ratios)
    return (sum(part_shares(latent_part_bytes(head_dim), ratios))
            + sum(part_shares(key_part_bytes(index_head_dim), ratios)))


def row_stride_bytes(head_dim: int, index_head_dim: int, ratios: Iterable[int]) -> int:
    """Global KV bytes per token the pool stores: latent row + index-key row (Flash 896, tiny 192)."""
    ratios = list(ratios)
    return latent_row_stride_bytes(head_dim, ratios) + key_row_stride_bytes(index_head_dim, ratios)


def pair_ring_slots(draft_tokens: int) -> int:
    """Pending-pair slots per request and ratio-2 source: 2, or the next power of two ≥ 2 + draft
    tokens under speculative decoding."""
    if draft_tokens < 0:
        raise ValueError(f"draft tokens must be ≥ 0, got {draft_tokens}")
    return 2 if draft_tokens == 0 else 1 << (1 + draft_tokens).bit_length()


def draft_context_row_bytes(stages: int, head_dim: int, fp32: bool = False) -> int:
    """DSpark draft context bytes per target full slot: one row of `head_dim` per stage, bf16
    (fp32 under the FP8 cache profile) — what `runtime/dspark_pool.DeepseekV41DSparkPool` stores
    (Flash 3 · 512 · 2 = 3072, tiny 576)."""
    if stages < 0 or head_dim < 1:
        raise ValueError(f"draft context rows of {stages} stage(s) × {head_dim}")
    return stages * head_dim * (4 if fp32 else 2)


def _ratios(t) -> list[int]:
    return [t.compress_ratios[s] for s in t.kv_source_layer_ids]


def text_row_payload_bytes(t) -> int:
    """`row_payload_bytes` of a `config.TextConfig`."""
    return row_payload_bytes(t.head_dim, t.index_head_dim, _ratios(t))


def text_latent_row_stride_bytes(t) -> int:
    """`latent_row_stride_bytes` of a `config.TextConfig`."""
    return latent_row_stride_bytes(t.head_dim, _ratios(t))


def text_key_row_stride_bytes(t) -> int:
    """`key_row_stride_bytes` of a `config.TextConfig`."""
    return key_row_stride_bytes(t.index_head_dim, _ratios(t))


def text_row_stride_bytes(t) -> int:
    """`row_stride_bytes` of a `config.TextConfig` (the global KV bytes per token the pool holds)."""
    return row_stride_bytes(t.head_dim, t.index_head_dim, _ratios(t))


def required_page_multiple(t) -> int:
    """The largest compress ratio of a kv source of a `config.TextConfig`: SGLang's page size must be
    a multiple of it (a ratio-r entry spans the rows of its r tokens, which must share a page)."""
    return max(_ratios(t), default=1)

"""KV-cache bytes per token and per request, derived from the config (spec `runtime.md` §A.3,
`model.md` §1.3, §3.8; phase-2 contracts §1–§3).

Two descriptions live here:

* the **plugin runtime's pool** (`runtime/kv_pool.py`, sized by `runtime/sglang_pool.py`): a
  hybrid-SWA pool whose FULL component holds two packed rows per token — a latent row, Σ over kv
  sources of ceil((D/2 + D/16) / ratio) (Flash 288 + 3·144 = 720 B), and an index-key row, Σ of
  ceil((Dk/2 + Dk/32) / ratio) (Flash 68 + 3·34 = 170 B), each padded to a multiple of 16 B
  (720 + 176 = **896 B/token** at Flash, tiny 112 + 80 = 192) on every GPU — and a SWA pool of L
  bf16 rows of D per SWA token, sized as `swa_full_tokens_ratio` × full tokens; a decoding
  request keeps `sliding_window + page_size` SWA tokens (SGLang frees the rest). The row and
  pair-ring formulas are the runtime's own (`runtime/kv_rows.py`), not a copy. Functions:
  `packed_row_bytes`, `swa_bytes_per_swa_token`, `pool_bytes_per_full_token`,
  `swa_tokens_per_request`.
* SGLang 0.5.23's own V4.1 layouts (`v4` on Hopper, `v41` on SM100), below — what upstream
  stores; the deployment configs' `features.kv_layout` names them.

What one token costs ("global KV")
----------------------------------
Only kv-source layers store compressed latents; every other compressed layer reads its
source's cache, and ratio-0 layers have none (roles table, model.md §1.3). A source of ratio r
stores one latent slot per r tokens plus one FP4 index key per r tokens. Pages hold 256 full
tokens, i.e. 256/r slots, and a latent page is padded to its layout's alignment:

| layout (main / compressed) | latent slot                                   | page alignment |
|----------------------------|-----------------------------------------------|----------------|
| `v4` / `v4`                | nope fp8 + rope bf16 + one UE8M0 per 64 nope, to a multiple of 8 (Flash 584) | 576 |
| `v41` / `v41_fp4`          | head_dim e2m1 (2 per byte) + one e4m3 per 16 values (Flash 288)              | 256 |

FP4 index key: index_head_dim/2 + index_head_dim/32 bytes (Flash 68), always FP4, no padding.
Flash: v41 → 288 + 68 + 3·(144 + 34) = 890 B/token (the card's figure); v4 → 653 + 3·326.5 =
1632.5 B/token with page padding (1630 unpadded).

What one request costs regardless of its length
-----------------------------------------------
* SWA ring: every main layer keeps the last `sliding_window` tokens in main-layout pages; a
  window can straddle a page boundary, so ⌈window/256⌉ + 1 pages per layer (paged SWA).
* DSpark draft: one SWA-only layer per stage, same pages.
* Ratio-2 pending-pair state: per ratio-2 source, a ring of fp32 [kv | score] rows (2·head_dim·4
  bytes); 2 rows without speculation, the next power of two ≥ 2 + draft tokens with it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from ..config import TextConfig
from ..runtime import kv_rows

PAGE_TOKENS = 256
LayoutName = Literal["v4", "v41"]


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def main_slot_bytes(t: TextConfig, layout: LayoutName) -> int:
    """Bytes of one token in the main (SWA) cache."""
    nope, rope = t.qk_nope_head_dim, t.qk_rope_head_dim
    if layout == "v4":
        return _round_up(nope + 2 * rope + math.ceil(nope / 64), 8)
    return t.head_dim + t.head_dim // 32  # v41: all dims e4m3, one UE8M0 per 32


def compressed_slot_bytes(t: TextConfig, layout: LayoutName) -> int:
    """Bytes of one compressed latent slot (v4 main → v4 compressed; v41 main → v41_fp4)."""
    if layout == "v4":
        return main_slot_bytes(t, "v4")
    return t.head_dim // 2 + t.head_dim // 16


def page_alignment(layout: str) -> int:
    return {"v4": 576, "v41": 512, "v41_fp4": 256}[layout]


def index_key_bytes(t: TextConfig) -> int:
    return t.index_head_dim // 2 + t.index_head_dim // 32


def _page_bytes(slots: int, slot: int, align: int) -> int:
    return _round_up(slots * slot, align)


@dataclass(frozen=True)
class SourceCost:
    layer: int
    ratio: int
    latent_per_token: float  # padded page bytes / 256
    index_per_token: float

    @property
    def per_token(self) -> float:
        return self.latent_per_token + self.index_per_token


def kv_sources(t: TextConfig, layout: LayoutName) -> list[SourceCost]:
    slot = compressed_slot_bytes(t, layout)
    align = page_alignment("v4" if layout == "v4" else "v41_fp4")
    idx = index_key_bytes(t)
    out = []
    for role in t.layer_roles():
        if not role.computes_latents:
            continue
        slots = PAGE_TOKENS // role.ratio
        out.append(SourceCost(role.layer, role.ratio, _page_bytes(slots, slot, align) / PAGE_TOKENS,
                              idx * slots / PAGE_TOKENS))
    return out


def kv_bytes_per_token(t: TextConfig, layout: LayoutName, *, padded: bool = True) -> float:
    """Global (compressed + index) KV bytes per full token on one rank (MQA: not TP-sharded)."""
    if padded:
        return sum(s.per_token for s in kv_sources(t, layout))
    slot, idx = compressed_slot_bytes(t, layout), index_key_bytes(t)
    return sum((slot + idx) / r.ratio for r in t.layer_roles() if r.computes_latents)


def swa_pages_per_layer(t: TextConfig) -> int:
    return math.ceil(t.sliding_window / PAGE_TOKENS) + 1


def swa_page_bytes(t: TextConfig, layout: LayoutName) -> int:
    return _page_bytes(PAGE_TOKENS, main_slot_bytes(t, layout), page_alignment(layout))


def pair_ring_rows(draft_tokens: int) -> int:
    """Pending-pair ring slots per request and ratio-2 source (`kv_rows.pair_ring_slots`)."""
    return kv_rows.pair_ring_slots(draft_tokens)


@dataclass(frozen=True)
class RequestCost:
    swa: int
    dspark_swa: int
    pair_state: int

    @property
    def total(self) -> int:
        return self.swa + self.dspark_swa + self.pair_state


def per_request_bytes(t: TextConfig, layout: LayoutName, *, draft_tokens: int = 0) -> RequestCost:
    """Fixed bytes one running request holds on a rank, whatever its length."""
    page = swa_page_bytes(t, layout) * swa_pages_per_layer(t)
    stages = t.num_nextn_predict_layers if draft_tokens else 0
    ratio2_sources = sum(1 for r in t.layer_roles() if r.computes_latents and r.ratio == 2)
    pair = ratio2_sources * pair_ring_rows(draft_tokens) * 2 * t.head_dim * 4
    return RequestCost(swa=t.num_hidden_layers * page, dspark_swa=stages * page, pair_state=pair)


# ---- the plugin runtime's pool (phase-2 contracts §1–§3) ----------------------------------------
def packed_entry_bytes(t: TextConfig) -> int:
    """One packed compressed entry: FP4 latent + E4M3 scales + FP4 index key + UE8M0 scales."""
    return kv_rows.entry_bytes(t.head_dim, t.index_head_dim)


def packed_latent_row_bytes(t: TextConfig) -> int:
    """The runtime pool's stored latent row per token (Flash 720, tiny 112;
    `kv_rows.text_latent_row_stride_bytes`)."""
    return kv_rows.text_latent_row_stride_bytes(t)


def packed_key_row_bytes(t: TextConfig) -> int:
    """The runtime pool's stored index-key row per token (Flash 170 → 176, tiny 68 → 80;
    `kv_rows.text_key_row_stride_bytes`)."""
    return kv_rows.text_key_row_stride_bytes(t)


def packed_row_bytes(t: TextConfig) -> int:
    """Global KV bytes per token = the runtime pool's two stored rows, latent + index key, each
    padded to 16 B (Flash 720 + 176 = 896, tiny 112 + 80 = 192; `kv_rows.text_row_stride_bytes`)."""
    return kv_rows.text_row_stride_bytes(t)


def swa_bytes_per_swa_token(t: TextConfig) -> int:
    """Bytes per SWA-pool token: the bf16 SWA kv of every layer (the Engram history is per request,
    `runtime/engram_history.py`)."""
    return t.num_hidden_layers * t.head_dim * 2


def draft_row_bytes(t: TextConfig, draft_tokens: int = 0) -> int:
    """The runtime's DSpark draft context bytes per full token under speculative decoding (0
    without): one bf16 row of head_dim per stage (`kv_rows.draft_context_row_bytes`, what
    `runtime/dspark_pool.DeepseekV41DSparkPool` allocates per full slot; Flash 3072, tiny 576)."""
    return kv_rows.draft_context_row_bytes(t.num_nextn_predict_layers, t.head_dim) if draft_tokens else 0


def pool_bytes_per_full_token(t: TextConfig, swa_full_tokens_ratio: float, draft_tokens: int = 0) -> float:
    """SGLang's hybrid-SWA cell: packed row + DSpark draft row (under speculation) + ratio × SWA
    token (what the KV budget is divided by; `runtime/sglang_pool.DeepseekV41PoolConfigurator`)."""
    return packed_row_bytes(t) + draft_row_bytes(t, draft_tokens) + swa_full_tokens_ratio * swa_bytes_per_swa_token(t)


def swa_tokens_per_request(t: TextConfig, page_size: int) -> int:
    """SWA tokens a decoding request keeps: the window plus one partially filled page."""
    return t.sliding_window + page_size

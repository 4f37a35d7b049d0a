"""Cache buffers of the torch path: packed global KV rows, window-bounded SWA, request-scoped pair
state (spec §3.4, §3.3.1, §3.8; phase-2 contracts §2–§4).

| field | shape / dtype | indexed by | holds |
|---|---|---|---|
| `latent_rows` | uint8 [S_full, latent_row_stride] | full slot (SGLang `req_to_token`, `out_cache_loc`) | latent part (FP4 + E4M3 scales) of the packed compressed entries of every kv source (`kv_layout`, contract §1–§2), padded to 16 B — the pool's FULL component, first buffer |
| `key_rows` | uint8 [S_full, key_row_stride] | full slot | index-key part (FP4 + UE8M0 scales) of the same entries, padded to 16 B — the FULL component's second buffer |
| `swa[l]` | [S_swa, D] bf16 | SWA slot = `swa_slot_of[full slot]` | read-back SWA kv of model layer l (`profile` applied, spec §3.8) — SGLang's SWA pool |
| `swa_slot_of` | int [S_full] | full slot | its SWA slot (0 = none: SGLang's padding slot; freed outside the window) |
| `engram_history` | int32 [num_req_rows, K] + int64 end | SGLang request row | the last K = max_ngram − 1 remapped ids of the request's last forward (`runtime/engram_history.py`); extends bring theirs from the host |
| `pair_kv[src]`, `pair_score[src]` | fp32 [num_req_rows, ring, D] | request row, ring slot ⌊p/2⌋ mod ring | ratio-2 sources: fp32 `wkv` / `wgate` outputs of a request's pending even-position token p |
| `pair_position[src]` | int64 [num_req_rows, ring] | request row, ring slot | position of that pending token (−1 none) — lets the CPU path refuse a stale pair state |

The pair ring (`kv_rows.pair_ring_slots`: 2, or ≥ 2 + draft tokens under speculation) keys each
pending pair by its compressed position, so draft tokens of one request never overwrite the
committed pair, and PD can ship a request's rows by request row.

Exactness: every stored value is the reference's value exactly — SWA read-back values are BF16
(profile NONE) or E4M3 × power-of-two (FP8 / FP4 profiles), all BF16-representable; compressed
latents and index keys are the FP4 codes of the reference's own fake quantisation
(`kv_layout`). The FP8 cache profile re-rounds compressed latents to "v4" FP8, which packed FP4
entries cannot hold: it is refused. The pair state stays fp32: the pooling consumes it
unrounded (spec §3.4.3).

Addressing invariants (the forward relies on them; SGLang guarantees them with an even
page_size): compressed entry e of a ratio-r source lives in rows e·r..e·r+r−1, the slots of the r
tokens of one compressed position (aligned pages); page 0 is SGLang's padding page, so entry 0 is
the write sink of "no entry" (`kv_layout.write_entries`). A prefix hit is page-aligned, hence
starts at an even position: a fresh request never needs a pending pair state.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from ..config import TextConfig
from ..numerics.profile import CacheProfile
from .engram_history import EngramHistoryRing
from .kv_layout import CompressedRowLayout, PackedSourceRows, write_source_entries
from .kv_rows import pair_ring_slots

#: dtypes that hold our BF16-valued SWA rows exactly (the CUDA attention kernel reads bf16).
EXACT_SWA_DTYPES = (torch.bfloat16, torch.float32)
#: Cache profiles whose compressed latents are exactly FP4 values (spec §3.8).
PACKED_PROFILES = (CacheProfile.NONE, CacheProfile.FP4)


def _ratio2_sources(cfg: TextConfig) -> list[int]:
    return [s for s in cfg.kv_source_layer_ids if cfg.compress_ratios[s] == 2]


def check_page_size(page_size: int, layout: CompressedRowLayout) -> None:
    """SGLang's page_size must be a multiple of every compress ratio (contract §2)."""
    if page_size < 1 or page_size % layout.max_ratio:
        raise ValueError(f"SGLang page_size {page_size} is not a multiple of the compress ratio "
                         f"{layout.max_ratio}: packed compressed entries need aligned pages "
                         f"(serve with --page-size 2 or another even page size)")


@dataclass
class RuntimeCaches:
    """All torch-path cache buffers of one SGLang pool (see the module table)."""

    layout: CompressedRowLayout
    swa: list[Tensor]
    swa_slot_of: Tensor
    latent_rows: Tensor
    key_rows: Tensor
    pair_kv: dict[int, Tensor]
    pair_score: dict[int, Tensor]
    pair_position: dict[int, Tensor]
    engram_history: EngramHistoryRing
    num_req_rows: int
    pair_ring_slots: int = 2
    profile: CacheProfile = CacheProfile.NONE
    pool_id: int = -1
    page_size: int | None = None
    #: the pool's per-layer load wait `(model layer, reads global rows)` (`kv_pool.DeepseekV41KVPool.wait_for_model_layer`)
    layer_waiter: Callable[[int, bool], None] | None = None

    # ---- construction -----------------------------------------------------------------------------
    @classmethod
    def from_buffers(cls, cfg: TextConfig, swa_rows: list[Tensor], swa_slot_of: Tensor, latent_rows: Tensor,
                     key_rows: Tensor, num_req_rows: int, profile: CacheProfile = CacheProfile.NONE, *, pool_id: int = -1,
                     page_size: int | None = None, pair_slots: int = 2, verify_width: int = 0) -> "RuntimeCaches":
        """Wrap buffers someone else owns (SGLang's SWAKVPool, `runtime/sglang_pool.py`):
        `swa_rows[l]` [S_swa, D] per model layer, `swa_slot_of` [S_full] full → SWA slot,
        `latent_rows` uint8 [S_full, ≥ latent_row_bytes] and `key_rows` uint8 [S_full,
        ≥ key_row_bytes] (two separate buffers); request-scoped state (pair ring of `pair_slots`
        slots, Engram history with a staged DSpark verify block of `verify_width` ids) for
        `num_req_rows` rows is allocated here. Shapes, dtypes and
        devices are checked."""
        profile = CacheProfile(profile)
        if profile not in PACKED_PROFILES:
            raise ValueError(f"cache profile {profile.value!r}: packed FP4 compressed rows hold the "
                             f"profiles {[p.value for p in PACKED_PROFILES]} only (the FP8 profile re-rounds "
                             "compressed latents to FP8, spec §3.8)")
        layout = CompressedRowLayout.from_config(cfg)
        if page_size is not None:
            check_page_size(page_size, layout)
        if len(swa_rows) != cfg.num_hidden_layers:
            raise ValueError(f"{len(swa_rows)} SWA buffers for {cfg.num_hidden_layers} layers")
        device = latent_rows.device
        n_swa = swa_rows[0].shape[0]
        for layer, buf in enumerate(swa_rows):
            if buf.dim() != 2 or buf.shape != (n_swa, cfg.head_dim) or buf.device != device:
                raise ValueError(f"SWA buffer of layer {layer}: {tuple(buf.shape)} on {buf.device}, expected "
                                 f"[{n_swa}, {cfg.head_dim}] on {device}")
            if buf.dtype not in EXACT_SWA_DTYPES:
                raise ValueError(f"SWA buffer dtype {buf.dtype} cannot hold the SWA kv exactly; serve with "
                                 "--kv-cache-dtype auto (bf16) on the torch path")
        n_full = latent_rows.shape[0] if latent_rows.dim() == 2 else -1
        for name, rows, width in (("latent", latent_rows, layout.latent_row_bytes), ("key", key_rows, layout.key_row_bytes)):
            if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape[1] < width or rows.shape[0] != n_full \
                    or rows.device != device:
                raise ValueError(f"packed {name} rows: expected uint8 [{n_full}, ≥ {width}] on {device}, got "
                                 f"{rows.dtype} {tuple(rows.shape)} on {rows.device}")
        if latent_rows.untyped_storage().data_ptr() == key_rows.untyped_storage().data_ptr():
            raise ValueError("packed latent rows and key rows share one storage: the global KV is two buffers "
                             "(kv_layout; PD sends them as its K and V halves)")
        if swa_slot_of.dim() != 1 or swa_slot_of.shape[0] != n_full or swa_slot_of.device != device \
                or swa_slot_of.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"swa_slot_of: expected int32/int64 [{n_full}] on {device}, got "
                             f"{swa_slot_of.dtype} {tuple(swa_slot_of.shape)} on {swa_slot_of.device}")
        if pair_slots < 2 or pair_slots & (pair_slots - 1):
            raise ValueError(f"pair ring of {pair_slots} slots: expected a power of two ≥ 2 (kv_rows.pair_ring_slots)")
        f32 = torch.float32
        ratio2 = _ratio2_sources(cfg)
        ring = (num_req_rows, pair_slots)
        return cls(
            layout=layout, swa=list(swa_rows), swa_slot_of=swa_slot_of, latent_rows=latent_rows, key_rows=key_rows,
            pair_kv={s: torch.zeros(*ring, cfg.head_dim, dtype=f32, device=device) for s in ratio2},
            pair_score={s: torch.zeros(*ring, cfg.head_dim, dtype=f32, device=device) for s in ratio2},
            pair_position={s: torch.full(ring, -1, dtype=torch.int64, device=device) for s in ratio2},
            engram_history=EngramHistoryRing.allocate(num_req_rows, cfg.engram_max_ngram_size - 1, device,
                                                     verify_width),
            num_req_rows=num_req_rows, pair_ring_slots=pair_slots,
            profile=profile, pool_id=pool_id, page_size=page_size)

    @classmethod
    def allocate(cls, cfg: TextConfig, num_slots: int, num_req_rows: int, device: torch.device | str = "cpu",
                 profile: CacheProfile = CacheProfile.NONE, *, page_size: int | None = None,
                 pair_slots: int = 2, verify_width: int = 0) -> "RuntimeCaches":
        """Stand-alone buffers for tests and tools: `num_slots` full slots = SWA slots (identity
        `swa_slot_of`), bf16 SWA rows, zeroed packed latent and key rows. Slots 0..page_size−1 are the padding
        page: slot maps handed to the forward must start at page 1 (`tests/runtime_scenarios.py`)."""
        layout = CompressedRowLayout.from_config(cfg)
        swa = [torch.zeros(num_slots, cfg.head_dim, dtype=torch.bfloat16, device=device)
               for _ in range(cfg.num_hidden_layers)]
        latent_rows = torch.zeros(num_slots, layout.latent_row_stride, dtype=torch.uint8, device=device)
        key_rows = torch.zeros(num_slots, layout.key_row_stride, dtype=torch.uint8, device=device)
        identity = torch.arange(num_slots, dtype=torch.int64, device=device)
        return cls.from_buffers(cfg, swa, identity, latent_rows, key_rows, num_req_rows, profile, page_size=page_size,
                                pair_slots=pair_slots, verify_width=verify_width)

    # ---- accounting -------------------------------------------------------------------------------
    @staticmethod
    def planned_global_bytes_per_token(cfg: TextConfig) -> int:
        """Stored global-KV bytes per full slot, latent + key row, from the config (896 at Flash:
        720 + 176)."""
        return CompressedRowLayout.from_config(cfg).row_stride

    @staticmethod
    def planned_swa_bytes_per_token(cfg: TextConfig) -> int:
        """bf16 SWA kv bytes per SWA slot over all layers: L·D·2."""
        return cfg.num_hidden_layers * cfg.head_dim * 2

    @staticmethod
    def planned_request_state_bytes(cfg: TextConfig, draft_tokens: int = 0) -> int:
        """Pair-ring bytes per request row: per ratio-2 source and ring slot, fp32 a and s [D] +
        int64 position."""
        return len(_ratio2_sources(cfg)) * pair_ring_slots(draft_tokens) * (2 * cfg.head_dim * 4 + 8)

    def global_bytes_per_token(self) -> int:
        """Bytes of global KV per full slot (latent + key row as stored; 896 at Flash, 192 tiny)."""
        return self.latent_rows[0].nbytes + self.key_rows[0].nbytes

    def swa_bytes_per_token(self) -> int:
        """SWA kv bytes per SWA slot (all layers)."""
        return sum(b.shape[1] * b.element_size() for b in self.swa)

    def request_state_bytes(self) -> int:
        """Pair-state bytes per request row (allocated beside SGLang's pools)."""
        bufs = [*self.pair_kv.values(), *self.pair_score.values(), *self.pair_position.values()]
        return sum(math.prod(b.shape[1:]) * b.element_size() for b in bufs)

    def engram_history_bytes(self) -> int:
        """Engram history bytes per request row (allocated beside SGLang's pools)."""
        return self.engram_history.bytes_per_request_row()

    @property
    def num_slots(self) -> int:
        return int(self.latent_rows.shape[0])

    @property
    def num_swa_slots(self) -> int:
        return int(self.swa[0].shape[0])

    def describe(self) -> str:
        """One log line with the per-token / per-request figures."""
        return (f"sglang-dsv41 caches: global KV {self.global_bytes_per_token()} B/token (packed FP4 rows, "
                f"{self.num_slots} full slots); SWA {self.swa_bytes_per_token()} B/token ({self.num_swa_slots} "
                f"SWA slots); pair state {self.request_state_bytes()} B + Engram history "
                f"{self.engram_history_bytes()} B per request row; page_size "
                f"{'unchecked' if self.page_size is None else self.page_size}; profile {self.profile.value}")

    def bind_swa_mapping(self, swa_slot_of: Tensor) -> None:
        """Point `swa_slot_of` at SGLang's full → SWA mapping (a view, updated in place by SGLang)."""
        if swa_slot_of.shape != (self.num_slots,) or swa_slot_of.device != self.latent_rows.device \
                or swa_slot_of.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"full → SWA mapping: expected int32/int64 [{self.num_slots}] on {self.latent_rows.device}, "
                             f"got {swa_slot_of.dtype} {tuple(swa_slot_of.shape)} on {swa_slot_of.device}")
        self.swa_slot_of = swa_slot_of

    def wait_for_layer(self, layer: int, *, global_rows: bool) -> None:
        """Before the forward touches model layer `layer`'s rows (and the global KV rows when the
        layer reads compressed entries): SGLang's per-layer load wait, so a HiCache load-back of
        those rows has landed. No-op for stand-alone caches (`allocate`)."""
        if self.layer_waiter is not None:
            self.layer_waiter(layer, global_rows)

    # ---- the ratio-2 pair ring (spec §3.4.3) --------------------------------------------------------
    def pair_slot(self, positions: Tensor) -> Tensor:
        """Ring slot of the pending pair whose first token sits at even position p: ⌊p/2⌋ mod ring."""
        return torch.div(positions.clamp(min=0), 2, rounding_mode="floor") % self.pair_ring_slots

    def pending_pair(self, source: int, req_rows: Tensor, first_positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(kv [n, D], score [n, D], stored position [n]) of the pairs whose first tokens are at
        `first_positions` [n] of requests `req_rows` [n] (stored position −1: none)."""
        slot = self.pair_slot(first_positions)
        return (self.pair_kv[source][req_rows, slot], self.pair_score[source][req_rows, slot],
                self.pair_position[source][req_rows, slot])

    def store_pending_pairs(self, source: int, req_rows: Tensor, positions: Tensor, pending: Tensor, live: Tensor,
                            kv: Tensor, score: Tensor) -> None:
        """After a forward: each live request whose last token (at `positions`) is `pending` (even
        position) stores its kv / score in that position's slot; a live request ending on an odd
        position marks its slot empty (−1); rows of non-live (padding) requests keep their values."""
        slot = self.pair_slot(positions)
        held_kv, held_score = self.pair_kv[source][req_rows, slot], self.pair_score[source][req_rows, slot]
        held_pos = self.pair_position[source][req_rows, slot]
        self.pair_kv[source][req_rows, slot] = torch.where(pending[:, None], kv, held_kv)
        self.pair_score[source][req_rows, slot] = torch.where(pending[:, None], score, held_score)
        self.pair_position[source][req_rows, slot] = torch.where(live, torch.where(pending, positions, -1), held_pos)

    def store_block_pairs(self, source: int, req_rows: Tensor, first_positions: Tensor, keep: Tensor, kv: Tensor,
                          score: Tensor) -> None:
        """DSpark verify (per token): where `keep`, the pair starting at even `first_positions` of
        request row `req_rows` holds kv / score; elsewhere the slot keeps its values. Two tokens of
        one pair write the same values (the caller's contract), so duplicates are harmless."""
        slot = self.pair_slot(first_positions)
        held_kv, held_score = self.pair_kv[source][req_rows, slot], self.pair_score[source][req_rows, slot]
        held_pos = self.pair_position[source][req_rows, slot]
        self.pair_kv[source][req_rows, slot] = torch.where(keep[:, None], kv, held_kv)
        self.pair_score[source][req_rows, slot] = torch.where(keep[:, None], score, held_score)
        self.pair_position[source][req_rows, slot] = torch.where(keep, first_positions, held_pos)

    # ---- addressing and writes (the forward's only access paths) ----------------------------------
    def swa_slots(self, full_slots: Tensor) -> Tensor:
        """SWA slots of full slots (any shape; −1 stays −1; 0 = none, SGLang's padding slot)."""
        mapped = self.swa_slot_of[full_slots.clamp(min=0)].to(torch.int64)
        return torch.where(full_slots >= 0, mapped, -1)

    def swa_rows(self, full_slots: Tensor) -> Tensor:
        """int64 SWA rows `swa_slot_of[slot]` of full slots (every slot ≥ 0)."""
        return self.swa_slot_of[full_slots].to(torch.int64)

    def write_swa(self, layer: int, full_slots: Tensor, values: Tensor, rows: Tensor | None = None) -> None:
        """SWA kv of tokens in `full_slots` [N] → `swa[layer][swa_slot_of[slot]]`; `rows`: those
        SWA rows when already made (`swa_rows(full_slots)`, e.g. once for every layer of a forward)."""
        self.swa[layer][self.swa_rows(full_slots) if rows is None else rows] = values.to(self.swa[layer].dtype)

    def write_swa_rows(self, be, layer: int, rows: Tensor, kv: Tensor, positions: Tensor, inv_freq: Tensor,
                       rope_dim: int) -> None:
        """SWA kv [N, D] of tokens at SWA rows `rows` [N] (`swa_rows(out_slots)`) → `swa[layer]`, as this cache's
        profile reads it back (`attention_math.write_swa_roundtrip` on the compute backend `be`: with the NONE
        profile the RoPE launch stores the rows itself)."""
        from .attention_math import write_swa_roundtrip

        write_swa_roundtrip(be, self.swa[layer], rows, kv, positions, inv_freq, self.profile, rope_dim)

    def packed(self, source: int) -> PackedSourceRows:
        """Read view of kv source `source`'s packed entries (latent and key rows)."""
        return PackedSourceRows(self.latent_rows, self.key_rows, self.layout.source(source), self.layout)

    def write_entries(self, source: int, entry_idx: Tensor, entry_bytes: Tensor) -> None:
        """Packed entries uint8 [n, E] of `source` at `entry_idx` [n] (−1 = none, contract §2): the
        latent part into the latent rows, the key part into the key rows."""
        write_source_entries(self.latent_rows, self.key_rows, self.layout.source(source), entry_idx, entry_bytes)

    def write_values(self, be, source: int, entry_idx: Tensor, latents: Tensor, keys: Tensor) -> None:
        """The packed entries of pre-quantisation (RoPE'd) latents [n, D] and index keys [n, Dk] of
        `source` at `entry_idx` [n] (−1 = none): encoded and written by the compute backend `be`
        (`ComputeBackend.write_packed_entries`; contract §1–§2)."""
        be.write_packed_entries(self.latent_rows, self.key_rows, self.layout.source(source), self.layout, entry_idx,
                                latents, keys)

"""The KV pool the runtime really uses, as `sglang-dsv41 plan` sizes it (`RuntimePool`; phase-2
contracts §2–§3, docs/runtime.md).

SGLang's hybrid-SWA pool: its full pool holds one packed FP4 row per token (`kv.packed_row_bytes`:
the card's 890 B of packed FP4 entries, stored as a 720-B latent row + a 176-B index-key row = 896 B)
and its SWA pool holds `--swa-full-tokens-ratio` × as many tokens of L bf16 rows
(`kv.swa_bytes_per_swa_token`). SGLang divides the budget by the cell `kv.pool_bytes_per_full_token`
(row + ratio × SWA token) and a decoding request keeps `kv.swa_tokens_per_request` SWA tokens.
SGLang 0.5.23's upstream layouts (`features.kv_layout` v4/v41, `kv.kv_bytes_per_token`) are not
used here: the plan shows them only as a comparison with upstream.

Invariant: the pool is computed from the model's text config and the server flags `launch` would
pass (the runtime's defaults unless the deployment config sets them), never from constants.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..config import TextConfig
from ..runtime import kv_rows
from ..runtime.requirements import CURRENT_RUNTIME, PAGE_SIZE, SWA_FULL_TOKENS_RATIO, flag_value
from .command import device_of
from .kv import (
    draft_row_bytes, packed_entry_bytes, packed_key_row_bytes, packed_latent_row_bytes, packed_row_bytes,
    pool_bytes_per_full_token, swa_bytes_per_swa_token, swa_tokens_per_request,
)
from .schema import DeploymentConfig


@dataclass(frozen=True)
class RuntimePool:
    """The runtime's SGLang hybrid-SWA pool on one rank (module docstring). The global KV is
    replicated on every TP rank (one KV head); the SWA pool is `swa_full_tokens_ratio` × the full
    pool, both page-aligned, as SGLang 0.5.17's HybridSWAPoolConfigurator sizes them."""

    row_bytes: int  # global KV per full token: latent row + index-key row as stored (Flash 720 + 176 = 896, tiny 192)
    latent_row_bytes: int  # the stored latent row (Flash 720, tiny 112)
    key_row_bytes: int  # the stored index-key row (Flash 176, tiny 80)
    sources: tuple[tuple[int, int, int, int], ...]  # (layer, ratio, latent bytes, index-key bytes) per kv source
    swa_token_bytes: int  # per SWA token: L bf16 rows of head_dim + the runtime's int32 token id
    cell_bytes: float  # per full token of budget: row + ratio × SWA token
    swa_full_tokens_ratio: float
    page_size: int
    swa_tokens_per_request: int  # window + page: what a decoding request keeps
    pair_state_per_request: int  # fp32 pending ratio-2 pair ring (2 slots; 8 under DSpark), request-scoped, outside the KV budget
    max_total_tokens: int | None  # --max-total-tokens: SGLang caps the full pool at it
    draft_row_bytes: int = 0  # DSpark draft context per full token (stages × head_dim bf16), 0 without speculation
    draft_tokens: int = 0  # tokens one verify forward holds per request (block + 1 under DSpark, else 0)

    @classmethod
    def for_model(cls, t: TextConfig, ratio: float, page: int, max_total_tokens: int | None,
                  draft_tokens: int = 0) -> "RuntimePool":
        lat, key = kv_rows.latent_part_bytes(t.head_dim), kv_rows.key_part_bytes(t.index_head_dim)
        assert lat + key == packed_entry_bytes(t)
        sources = tuple((s, r, -(-lat // r), -(-key // r)) for s, r in
                        ((s, t.compress_ratios[s]) for s in t.kv_source_layer_ids))
        lat_row, key_row = packed_latent_row_bytes(t), packed_key_row_bytes(t)
        assert lat_row == kv_rows.round_up(sum(s[2] for s in sources), kv_rows.ROW_ALIGN)  # contracts §2 + 16-B pad
        assert key_row == kv_rows.round_up(sum(s[3] for s in sources), kv_rows.ROW_ALIGN)
        row = packed_row_bytes(t)
        assert row == lat_row + key_row
        ratio2 = sum(1 for s in sources if s[1] == 2)
        return cls(row_bytes=row, latent_row_bytes=lat_row, key_row_bytes=key_row, sources=sources,
                   swa_token_bytes=swa_bytes_per_swa_token(t),
                   cell_bytes=pool_bytes_per_full_token(t, ratio, draft_tokens), swa_full_tokens_ratio=ratio,
                   page_size=page, swa_tokens_per_request=swa_tokens_per_request(t, page),
                   pair_state_per_request=ratio2 * kv_rows.pair_ring_slots(draft_tokens) * (2 * t.head_dim * 4 + 8),
                   max_total_tokens=max_total_tokens, draft_row_bytes=draft_row_bytes(t, draft_tokens),
                   draft_tokens=draft_tokens)

    def full_tokens(self, budget: float) -> int:
        """Full-pool tokens SGLang allocates from `budget` bytes (capped by --max-total-tokens)."""
        n = max(0, int(budget // self.cell_bytes))
        if self.max_total_tokens is not None:
            n = min(n, self.max_total_tokens)
        return n // self.page_size * self.page_size

    def swa_tokens(self, full_tokens: int) -> int:
        return int(full_tokens * self.swa_full_tokens_ratio) // self.page_size * self.page_size

    def full_tokens_of(self, context: int) -> int:
        """Full-pool slots of one request of `context` tokens (whole pages)."""
        return -(-context // self.page_size) * self.page_size

    def swa_tokens_of(self, context: int) -> int:
        """SWA slots one decoding request of `context` tokens keeps (SGLang frees the rest)."""
        return min(self.full_tokens_of(context), self.swa_tokens_per_request)

    def budget_for(self, full: int, swa: int) -> float:
        """KV bytes SGLang needs so that its split gives ≥ `full` full and ≥ `swa` SWA tokens."""
        return self.cell_bytes * max(full, swa / self.swa_full_tokens_ratio)


def runtime_pool_for(dc: DeploymentConfig, t: TextConfig) -> RuntimePool:
    """The pool `sglang-dsv41 launch` would get for `dc`: the runtime's --swa-full-tokens-ratio /
    --page-size / CPU --max-total-tokens unless the config sets them (`serving.*`, extra_args);
    under DSpark the cell holds the draft's context row and the pair ring its verify tokens."""
    extra = list(dc.serving.extra_args)
    configured = ["--max-total-tokens", str(dc.serving.max_total_tokens)] if dc.serving.max_total_tokens else []
    args = configured + CURRENT_RUNTIME.server_args(device_of(dc), configured + extra) + extra
    ratio = flag_value(args, ("--swa-full-tokens-ratio",))
    page = flag_value(args, ("--page-size",))
    cap = flag_value(args, ("--max-total-tokens",))
    verify = dc.speculative.block_size + 1 if dc.speculative.enabled and dc.speculative.block_size else 0
    return RuntimePool.for_model(t, float(ratio) if ratio else SWA_FULL_TOKENS_RATIO, int(page) if page else PAGE_SIZE,
                                 int(cap) if cap else None, verify)

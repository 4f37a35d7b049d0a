"""Per-layer cache buffers of the torch path, addressed by SGLang's token slot (spec §3.4, §3.3.1).

Every cache is a buffer with one row per KV slot of SGLang's token pool (`pool.size +
pool.page_size` rows, the same index space as `out_cache_loc` and `req_to_token`):

| buffer                       | rows hold (for the token in that slot)                     | dtype |
|------------------------------|-------------------------------------------------------------|-------|
| `swa[layer]` (every layer)   | read-back SWA kv (`profile` applied, spec §3.8) — **SGLang's own MHA pool `k_buffer[layer]`** | pool dtype (bf16) |
| `latents[src]` (kv sources)  | stored compressed latent of the pair/token **ending** at this slot (ratio 1: every slot; ratio 2: odd positions) | bf16 |
| `index_keys[src]`            | FP4 index key, same slot rule                               | bf16  |
| `pair_kv[src]`, `pair_score[src]` (ratio-2 sources) | fp32 `wkv` / `wgate` outputs of an **even**-position token, so its pair can complete in a later chunk | fp32 |
| `token_ids`                  | the (remapped) token id — Engram n-gram history is read from earlier slots | int64 |

Why slots: a request's state is then exactly the rows its `req_to_token` row points at. A radix
prefix hit shares slots computed by an earlier request, and those rows hold what a cold run of
the shared prefix computes (every row depends only on tokens at or before it) — so prefix
caching, chunked prefill at any (odd or even) boundary, decode and preemption all read correct
state without request-scoped copies. PD transfer / HiCache can later copy these buffers page-wise.

Exactness: every stored value is BF16-representable (SWA read-back values and FP4 latents/keys
are E4M3/E2M1 × power-of-two or BF16 values, spec §3.8), so BF16 rows are lossless; the pair
state stays fp32 because the pooling consumes it unrounded (spec §3.4.3). A pool with another
dtype (e.g. `--kv-cache-dtype fp8_e4m3`) is refused.

Sizing: from SGLang's pool (its token capacity), never a constant. SGLang budgets only the SWA
rows (`v_head_dim = 0`, see `hf_config.py`); the other buffers are added on top and reported by
`RuntimeCaches.bytes_per_token()` / `describe()`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..config import TextConfig
from ..reference.ops import CacheProfile

#: Pool dtypes that hold our BF16-valued SWA rows exactly (the CUDA attention kernel reads bf16).
EXACT_SWA_DTYPES = (torch.bfloat16, torch.float32)


def entry_positions(compressed: Tensor, ratio: int) -> Tensor:
    """Absolute position of the token whose slot holds compressed entry j: j·ratio + ratio − 1
    (the token that completes the entry, spec §3.4.3)."""
    return compressed * ratio + (ratio - 1)


@dataclass
class RuntimeCaches:
    """All torch-path cache buffers of one SGLang token pool (see the module table)."""

    num_slots: int
    swa: list[Tensor]
    latents: dict[int, Tensor]
    index_keys: dict[int, Tensor]
    pair_kv: dict[int, Tensor]
    pair_score: dict[int, Tensor]
    token_ids: Tensor
    pool_id: int
    profile: CacheProfile = CacheProfile.NONE

    @classmethod
    def from_pool(cls, pool, cfg: TextConfig, profile: CacheProfile = CacheProfile.NONE) -> "RuntimeCaches":
        """Wrap SGLang's MHA pool `k_buffer` (SWA rows) and allocate the other buffers beside it."""
        k_buffer = getattr(pool, "k_buffer", None)
        if k_buffer is None or len(k_buffer) != cfg.num_hidden_layers:
            raise RuntimeError(
                "sglang-dsv41 torch path needs SGLang's MHA token pool with one k_buffer per layer "
                f"({cfg.num_hidden_layers}); got {type(pool).__name__} with "
                f"{None if k_buffer is None else len(k_buffer)} buffers")
        swa = []
        for layer, buf in enumerate(k_buffer):
            if buf.dim() != 3 or buf.shape[1] != 1 or buf.shape[2] != cfg.head_dim:
                raise RuntimeError(f"KV pool layer {layer}: k_buffer shape {tuple(buf.shape)}, expected "
                                   f"[slots, 1, {cfg.head_dim}] (single KV head of head_dim)")
            if buf.dtype not in EXACT_SWA_DTYPES:
                raise RuntimeError(f"KV pool dtype {buf.dtype} cannot hold the SWA kv exactly; serve with "
                                   "--kv-cache-dtype auto (bf16) on the torch path")
            swa.append(buf[:, 0, :])
        return cls.around_swa(swa, cfg, pool_id=id(pool), profile=profile)

    @classmethod
    def allocate(cls, cfg: TextConfig, num_slots: int, device: torch.device | str = "cpu",
                 profile: CacheProfile = CacheProfile.NONE) -> "RuntimeCaches":
        """Stand-alone buffers (own BF16 SWA rows) for `num_slots` slots — tests and tools."""
        swa = [torch.zeros(num_slots, cfg.head_dim, dtype=torch.bfloat16, device=device)
               for _ in range(cfg.num_hidden_layers)]
        return cls.around_swa(swa, cfg, pool_id=-1, profile=profile)

    @classmethod
    def around_swa(cls, swa: list[Tensor], cfg: TextConfig, *, pool_id: int,
                   profile: CacheProfile) -> "RuntimeCaches":
        """The side buffers, sized and placed like the given per-layer SWA rows."""
        n = swa[0].shape[0]
        device = swa[0].device
        bf16, f32 = torch.bfloat16, torch.float32
        sources = cfg.kv_source_layer_ids
        ratio2 = [s for s in sources if cfg.compress_ratios[s] == 2]
        return cls(
            num_slots=n,
            swa=swa,
            latents={s: torch.zeros(n, cfg.head_dim, dtype=bf16, device=device) for s in sources},
            index_keys={s: torch.zeros(n, cfg.index_head_dim, dtype=bf16, device=device) for s in sources},
            pair_kv={s: torch.zeros(n, cfg.head_dim, dtype=f32, device=device) for s in ratio2},
            pair_score={s: torch.zeros(n, cfg.head_dim, dtype=f32, device=device) for s in ratio2},
            token_ids=torch.zeros(n, dtype=torch.int64, device=device),
            pool_id=pool_id,
            profile=CacheProfile(profile),
        )

    # ---- accounting ----------------------------------------------------------------------------
    @staticmethod
    def planned_side_bytes_per_token(cfg: TextConfig) -> int:
        """Bytes per token `around_swa` allocates beside the SWA rows, from the config alone."""
        sources = cfg.kv_source_layer_ids
        ratio2 = sum(1 for s in sources if cfg.compress_ratios[s] == 2)
        bf16, f32, i64 = 2, 4, 8
        return len(sources) * (cfg.head_dim + cfg.index_head_dim) * bf16 + ratio2 * 2 * cfg.head_dim * f32 + i64

    def sglang_bytes_per_token(self) -> int:
        """Bytes per token SGLang's pool budgets (our SWA rows)."""
        return sum(b.shape[1] * b.element_size() for b in self.swa)

    def side_bytes_per_token(self) -> int:
        """Bytes per token of the buffers allocated beside SGLang's pool."""
        bufs = [*self.latents.values(), *self.index_keys.values(), *self.pair_kv.values(),
                *self.pair_score.values()]
        return sum(b.shape[1] * b.element_size() for b in bufs) + self.token_ids.element_size()

    def bytes_per_token(self) -> int:
        return self.sglang_bytes_per_token() + self.side_bytes_per_token()

    def describe(self) -> str:
        return (f"sglang-dsv41 torch-path caches: {self.num_slots} token slots; "
                f"{self.bytes_per_token()} B/token = {self.sglang_bytes_per_token()} B SWA kv in "
                f"SGLang's pool + {self.side_bytes_per_token()} B beside it (compressed latents, FP4 "
                f"index keys, ratio-2 pair state, token ids); side buffers "
                f"{self.side_bytes_per_token() * self.num_slots / 2**20:.1f} MiB")

    # ---- writes ----------------------------------------------------------------------------
    def write_swa(self, layer: int, slots: Tensor, rows: Tensor) -> None:
        self.swa[layer][slots] = rows.to(self.swa[layer].dtype)

    def write_compressed(self, source: int, slots: Tensor, latents: Tensor, index_keys: Tensor) -> None:
        self.latents[source][slots] = latents.to(self.latents[source].dtype)
        self.index_keys[source][slots] = index_keys.to(self.index_keys[source].dtype)

    def write_pair_state(self, source: int, slots: Tensor, kv: Tensor, score: Tensor) -> None:
        self.pair_kv[source][slots] = kv.to(torch.float32)
        self.pair_score[source][slots] = score.to(torch.float32)

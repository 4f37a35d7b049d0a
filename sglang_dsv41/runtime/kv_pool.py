"""`DeepseekV41KVPool`: the V4.1 KV pool, a class of ours that SGLang 0.5.17 builds (phase-2
contracts §2–§4; docs/runtime.md "KV pool"; spec integration.md §1–§2).

SGLang builds it in `KVCacheConfigurator._build_token_to_kv_pool` (hook
`runtime/sglang_pool.build_token_to_kv_pool_hook`) with the sizes of our configurator
(`runtime/sglang_pool.DeepseekV41PoolConfigurator`), then wires its own hybrid-SWA machinery to
it: `SWATokenToKVPoolAllocator` (full → SWA slot mapping, SWA eviction), the unified radix tree
(FULL + SWA components) and HiCache's `_SwaStrategy` (a `SWAKVPool` with {FULL, SWA}).

Buffers, each as it is (no zero-width tensor, every row a multiple of 16 B):

| component | buffer | shape / dtype | indexed by |
|---|---|---|---|
| FULL (`full_kv_pool`) | global KV latent rows ("K") | uint8 [S_full + page, latent_row_stride] (Flash 720 = 288 + 3·144) | full slot |
| FULL (`full_kv_pool`) | global KV index-key rows ("V") | uint8 [S_full + page, key_row_stride] (Flash 176 = 68 + 3·34 + 6 pad) | full slot |
| SWA (`swa_kv_pool`) | SWA rows of model layer l | bf16 [S_swa + page, D] per layer (K = V, spec §3.4.5) | SWA slot |
| request state | ratio-2 pair ring of source s | fp32 kv, score [R, ring, D]; int64 position [R, ring] | request row, ⌊p/2⌋ mod ring |
| request state | Engram history (+ staged DSpark verify block of `verify_width` ids) | int32 [R, K (+ w)]; int64 end [R] | request row |

Global KV: Flash 720 + 176 = 896 B/token (tiny 112 + 80 = 192), `kv_rows`. It is two buffers, not
one, so SGLang's non-MLA PD path — which splits `get_contiguous_buf_infos()` into a K half and a V
half — sends both, and so attention (latents) and the indexer (keys) read separate rows.

Pool layer ids (SGLang's `layers_mapping` and the HiCache transfer-layer ids): 0 = the global KV
rows, both buffers (read by every compressed layer, so loaded first), 1 + l = the SWA rows of
model layer l.
The model's config says `num_hidden_layers = L`: these ids number the pool's buffers, not model
layers (`transfer_layer_of_swa`).

`runtime_caches` is the forward's `RuntimeCaches` over these same tensors, built here, at pool
construction; its `wait_for_layer` calls `wait_for_model_layer`, SGLang's per-layer load wait
(`SWAKVPool._wait_for_layer`), which the forward calls before it touches a layer's rows.
"""
from __future__ import annotations

import logging
from typing import Sequence

import torch
from torch import Tensor

from sglang.srt.mem_cache.memory_pool import KVCache
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

from ..config import TextConfig
from ..numerics.profile import CacheProfile
from .cache import RuntimeCaches, check_page_size
from .kv_layout import CompressedRowLayout
from .pd_state import pair_row_buf_infos

logger = logging.getLogger(__name__)
GB = 1 << 30
#: Pool layer id of the global KV rows; SWA rows of model layer l are pool layer 1 + l.
GLOBAL_ROWS_LAYER = 0
#: dtype of the SWA rows (BF16 values, read by the CUDA attention kernel as bf16).
SWA_DTYPE = torch.bfloat16


def transfer_layer_of_swa(model_layer: int) -> int:
    """Pool (HiCache transfer) layer id of model layer `model_layer`'s SWA rows."""
    return 1 + model_layer


def _page_infos(buffers: Sequence[Tensor], page_size: int) -> tuple[list[int], list[int], list[int]]:
    """(pointers, byte lengths, bytes per page) of slot-major buffers, for PD registration."""
    return ([b.data_ptr() for b in buffers], [b.nbytes for b in buffers],
            [b[0].nbytes * page_size for b in buffers])


class RowBufferCopies:
    """SGLang's row moves and CPU copies over `self.buffers`, every buffer indexed by slot in dim 0
    (the target's component pools and the DSpark draft pool)."""

    buffers: list[Tensor]

    def move_kv_cache(self, tgt_loc: Tensor, src_loc: Tensor) -> None:
        for b in self.buffers:
            b[tgt_loc] = b[src_loc]

    def get_cpu_copy(self, indices, mamba_indices=None):
        return [b[indices].to("cpu") for b in self.buffers]

    def load_cpu_copy(self, kv_cache_cpu, indices, mamba_indices=None) -> None:
        for b, rows in zip(self.buffers, kv_cache_cpu):
            b[indices] = rows.to(b.device)


class _RowsComponent(RowBufferCopies, KVCache):
    """One component of the pool: `buffers[i]` [size + page, widths[i]] slot-major rows. Reads and
    writes go through `RuntimeCaches`; this class answers what SGLang's allocator, radix cache, PD
    and offload paths ask of a component."""

    def __init__(self, size: int, page_size: int, dtype: torch.dtype, widths: Sequence[int], layers: int,
                 device: str, label: str) -> None:
        super().__init__(size, page_size, dtype, layers, device, False, allocation_label=label)
        itemsize = torch.empty(0, dtype=dtype).element_size()
        for width in widths:
            if width <= 0 or width * itemsize % 16:
                raise ValueError(f"sglang-dsv41 pool {label}: row of {width} {dtype} is not a positive multiple "
                                 "of 16 B")
        self.buffers = [torch.zeros(size + page_size, w, dtype=dtype, device=device) for w in widths]
        self._finalize_allocation_log(size)       # SGLang's "<label> KV Cache is allocated" line; sets mem_usage

    @property
    def token_bytes(self) -> int:
        """Bytes one slot holds over all of the component's buffers."""
        return sum(b[0].nbytes for b in self.buffers)

    def get_kv_size_bytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)

    def get_contiguous_buf_infos(self):
        return _page_infos(self.buffers, self.page_size)

    def get_kv_buffer(self, layer_id: int):
        return self.get_key_buffer(layer_id), self.get_value_buffer(layer_id)

    def set_kv_buffer(self, *args, **kwargs) -> None:
        raise NotImplementedError("sglang-dsv41: the model writes its rows through RuntimeCaches, never "
                                  "through an attention backend's set_kv_buffer")



class _SwaRows(_RowsComponent):
    """The SWA component: one bf16 [size + page, D] buffer per model layer (K = V, spec §3.4.5)."""

    def __init__(self, size: int, page_size: int, head_dim: int, layers: int, device: str) -> None:
        super().__init__(size, page_size, SWA_DTYPE, [head_dim] * layers, layers, device, "SWA")

    def get_key_buffer(self, layer_id: int) -> Tensor:
        return self.buffers[layer_id]

    def get_value_buffer(self, layer_id: int) -> Tensor:
        raise NotImplementedError("sglang-dsv41 pool SWA: rows hold no separate values (K = V; read them with "
                                  "get_key_buffer)")

    def get_kv_buffer(self, layer_id: int):
        raise NotImplementedError("sglang-dsv41 pool SWA: no K/V pair (K = V); use get_key_buffer")


class _GlobalRows(_RowsComponent):
    """The FULL component: one pool layer (`GLOBAL_ROWS_LAYER`) of two uint8 buffers, the latent
    rows (its "K") and the index-key rows (its "V"), `kv_layout` contract §2."""

    def __init__(self, size: int, page_size: int, layout: CompressedRowLayout, device: str) -> None:
        super().__init__(size, page_size, torch.uint8, [layout.latent_row_stride, layout.key_row_stride], 1,
                         device, "Full (global KV latent + index-key rows)")

    @property
    def latent_rows(self) -> Tensor:
        return self.buffers[0]

    @property
    def key_rows(self) -> Tensor:
        return self.buffers[1]

    def _check_layer(self, layer_id: int) -> None:
        if layer_id != 0:
            raise IndexError(f"sglang-dsv41 pool: the global KV rows are one pool layer (0), got {layer_id}")

    def get_key_buffer(self, layer_id: int) -> Tensor:
        self._check_layer(layer_id)
        return self.latent_rows

    def get_value_buffer(self, layer_id: int) -> Tensor:
        self._check_layer(layer_id)
        return self.key_rows


class DeepseekV41KVPool(SWAKVPool):
    """The V4.1 pool (module docstring): FULL = global KV rows, SWA = per-layer SWA rows, plus the
    request-scoped pair ring; `runtime_caches` is the forward's view of all of them."""

    def __init__(self, cfg: TextConfig, *, size: int, size_swa: int, page_size: int, num_req_rows: int,
                 device: str, pair_slots: int = 2, profile: CacheProfile = CacheProfile.NONE,
                 verify_width: int = 0) -> None:
        layout = CompressedRowLayout.from_config(cfg)
        check_page_size(page_size, layout)
        L = cfg.num_hidden_layers
        self.size, self.size_swa, self.page_size, self.device = size, size_swa, page_size, device
        self.dtype = SWA_DTYPE
        self.head_num, self.head_dim = 1, cfg.head_dim
        self.full_layer_nums, self.swa_layer_nums = 1, L
        self.layer_num = 1 + L
        self.start_layer = 0
        self.layer_transfer_counter = None
        self.enable_custom_mem_pool, self.custom_mem_pool = False, None
        self.full_kv_pool = _GlobalRows(size, page_size, layout, device)
        self.swa_kv_pool = _SwaRows(size_swa, page_size, cfg.head_dim, L, device)
        self.layers_mapping = {GLOBAL_ROWS_LAYER: (0, False),
                               **{transfer_layer_of_swa(l): (l, True) for l in range(L)}}
        self.full_to_swa_index_mapping: Tensor | None = None
        self.layout = layout
        self.compress_ratios = tuple(cfg.compress_ratios)
        self.runtime_caches = RuntimeCaches.from_buffers(
            cfg, self.swa_kv_pool.buffers, self._unregistered_mapping(), self.full_kv_pool.latent_rows,
            self.full_kv_pool.key_rows, num_req_rows,
            profile, pool_id=id(self), page_size=page_size, pair_slots=pair_slots,
            verify_width=verify_width)
        self.runtime_caches.layer_waiter = self.wait_for_model_layer
        self.mem_usage = (self.full_kv_pool.mem_usage + self.swa_kv_pool.mem_usage
                          + self.request_state_bytes() / GB)
        logger.info(self.describe())

    def _unregistered_mapping(self) -> Tensor:
        """All-zero (every slot → the padding SWA slot) until SGLang's allocator registers its
        mapping (`register_mapping`); `pool_caches` refuses a pool without one."""
        return torch.zeros(self.size + self.page_size, dtype=torch.int64, device=self.device)

    # ---- SGLang's hybrid-SWA interface ---------------------------------------------------------
    def register_mapping(self, full_to_swa_index_mapping: Tensor) -> None:
        """SGLang's allocator registers its full → SWA mapping (S_full + page entries and a −1
        sentinel); the forward reads a view of it, updated in place by every allocation."""
        super().register_mapping(full_to_swa_index_mapping)
        self.runtime_caches.bind_swa_mapping(full_to_swa_index_mapping[: self.size + self.page_size])

    def get_kv_size_bytes(self) -> tuple[int, int]:
        """(global KV rows + SWA rows, request-state ring) bytes."""
        return (self.full_kv_pool.get_kv_size_bytes() + self.swa_kv_pool.get_kv_size_bytes(),
                self.request_state_bytes())

    def get_contiguous_buf_infos(self):
        """PD kv_data: the two global KV buffers, an even count for SGLang's non-MLA K/V halving
        (`get_mha_kv_ptrs_with_pp`): [latent rows, index-key rows] — the first half ("K") is the
        latent rows, item = page · latent_row_stride B (Flash page 2: 1440); the second half ("V")
        the index-key rows, item = page · key_row_stride B (352). Both are "the global rows",
        pool layer `GLOBAL_ROWS_LAYER`."""
        return self.full_kv_pool.get_contiguous_buf_infos()

    def get_state_buf_infos(self):
        """PD SWA state: the SWA rows of every layer, one page item = page · D · 2 bytes."""
        return self.swa_kv_pool.get_contiguous_buf_infos()

    def get_request_state_buf_infos(self):
        """The pair ring as request-indexed buffers (kv then score of each ratio-2 source: an
        even count); item = one request row (ring · D · 4 bytes). Positions are not listed: they
        follow from the sequence length (an odd length N has its pending pair at N − 1)."""
        c = self.runtime_caches
        bufs = [t for s in sorted(c.pair_kv) for t in (c.pair_kv[s], c.pair_score[s])]
        return [b.data_ptr() for b in bufs], [b.nbytes for b in bufs], [b[0].nbytes for b in bufs]

    def request_state_bytes(self) -> int:
        return self.runtime_caches.request_state_bytes() * self.runtime_caches.num_req_rows

    # ---- PD: the pair ring as SGLang's request-scoped C128_STATE component (runtime/pd_state.py) ----
    def get_c128_state_buf_infos(self):
        """The pair ring with one ring row per item (boundary-row transfer, `pd_state`)."""
        return pair_row_buf_infos(self.runtime_caches)

    def get_ring_size(self, ratio: int) -> int:
        """Pair-ring slots per request (what SGLang's C128 index rule is handed; `pd_state` uses it)."""
        return self.runtime_caches.pair_ring_slots

    def clear_c128_req_state(self, req_pool_idx: int) -> None:
        """Decode, before a transfer into request row `req_pool_idx`: no pending pair."""
        for pos in self.runtime_caches.pair_position.values():
            pos[req_pool_idx].fill_(-1)

    # ---- the forward's per-layer load wait ------------------------------------------------------
    def wait_for_model_layer(self, model_layer: int, global_rows: bool) -> None:
        """Block until HiCache has loaded what model layer `model_layer` reads: the global KV rows
        (pool layer 0, when `global_rows`) and its SWA rows (pool layer 1 + l) — SGLang's
        layer-transfer-counter protocol (`SWAKVPool._wait_for_layer`)."""
        if global_rows:
            self._wait_for_layer(GLOBAL_ROWS_LAYER)
        self._wait_for_layer(transfer_layer_of_swa(model_layer))

    def describe(self) -> str:
        c = self.runtime_caches
        lay = self.layout
        return (f"sglang-dsv41 DeepseekV41KVPool: global KV {self.full_kv_pool.token_bytes} B/token = latent rows "
                f"{lay.latent_row_stride} B ({lay.latent_row_bytes} B packed FP4) + index-key rows "
                f"{lay.key_row_stride} B ({lay.key_row_bytes} B packed FP4), {self.size} full slots; "
                f"SWA {self.swa_kv_pool.token_bytes} B/token ({self.swa_layer_nums} layers x "
                f"{self.swa_kv_pool.buffers[0][0].nbytes} B), {self.size_swa} SWA slots; "
                f"pair ring {c.pair_ring_slots} slots = {c.request_state_bytes()} B per request row x "
                f"{c.num_req_rows} rows; page_size {self.page_size}; {self.mem_usage:.3f} GB")


def pool_caches(pool, profile: CacheProfile) -> RuntimeCaches:
    """The forward's `RuntimeCaches` of SGLang's pool: it must be our `DeepseekV41KVPool`, its mapping
    registered by SGLang's allocator, its cache profile the model's."""
    if not isinstance(pool, DeepseekV41KVPool):
        raise RuntimeError(f"sglang-dsv41: SGLang built a {type(pool).__name__}, not the V4.1 pool "
                           "(DeepseekV41KVPool): are the sglang-dsv41 runtime hooks installed?")
    if pool.full_to_swa_index_mapping is None:
        raise RuntimeError("sglang-dsv41: no full → SWA slot mapping registered on the V4.1 pool "
                           "(SGLang's SWATokenToKVPoolAllocator registers it)")
    caches = pool.runtime_caches
    if caches.profile != CacheProfile(profile):
        raise RuntimeError(f"sglang-dsv41: the pool holds cache profile {caches.profile.value}, the model "
                           f"computes {CacheProfile(profile).value}")
    return caches

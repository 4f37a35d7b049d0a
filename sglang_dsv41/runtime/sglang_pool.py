"""`RuntimeCaches` over the pool SGLang built for a V4.1 model (phase-2 contracts §2–§4).

SGLang builds a hybrid-SWA `SWAKVPool` from the attributes of `runtime/hf_config.py` (plus the
`is_hybrid_swa_compress` hook, `runtime/sglang_hooks.py`):

* full pool — ONE layer (SGLang layer 0), `k_buffer[0]` bf16 [S_full + page, 1, ceil(row_bytes/2)]:
  the packed compressed row of every token (global KV, contracts §2), viewed here as uint8
  [S_full + page, 2·ceil(row_bytes/2)];
* SWA pool — one layer per model layer (SGLang layer 1 + l), `k_buffer[l]` bf16
  [S_swa + page, 1, D]: the SWA kv of model layer l;
* the full → SWA slot mapping, owned by SGLang's `SWATokenToKVPoolAllocator` and registered on
  the pool (`full_to_swa_index_mapping`, S_full + page entries plus a trailing −1 sentinel),
  updated in place by every allocation and SWA eviction — we keep a view, never a copy.

Invariants checked here, each with a message naming the SGLang flag to change: the pool type,
the layer → sub-pool mapping, every buffer's shape and bf16 dtype, one device, and
`page_size % 2 == 0` whenever a ratio-2 kv source exists (a ratio-2 entry spans two token rows
that must share a page, contracts §2). The buffers are wrapped, not copied: what SGLang frees,
moves or evicts is what the forward sees.
"""
from __future__ import annotations

import logging

import torch
from torch import Tensor

from ..config import TextConfig
from ..numerics.profile import CacheProfile
from .cache import RuntimeCaches
from .kv_layout import CompressedRowLayout

logger = logging.getLogger(__name__)

#: SGLang dtype of both sub-pools: the packed rows are reinterpreted bytes, the SWA rows bf16 values.
POOL_DTYPE = torch.bfloat16


def _fail(what: str) -> RuntimeError:
    return RuntimeError(f"sglang-dsv41: {what}")


def required_page_multiple(cfg: TextConfig) -> int:
    """The largest compress ratio of a kv source: SGLang's page_size must be a multiple of it."""
    return max((cfg.compress_ratios[s] for s in cfg.kv_source_layer_ids), default=1)


def check_page_size(page_size: int, cfg: TextConfig) -> None:
    multiple = required_page_multiple(cfg)
    if page_size % multiple:
        raise _fail(f"SGLang page_size {page_size} is not a multiple of {multiple}: a ratio-{multiple} "
                    f"compressed entry spans {multiple} token rows that must share a page (contracts §2); "
                    f"serve with --page-size 2 (or another multiple of {multiple})")


def _buffer(buf: Tensor, what: str, slots: int | None, width: int) -> Tensor:
    """`buf` [slots, 1, width] bf16 → its [slots, width] view."""
    if buf.dtype != POOL_DTYPE:
        raise _fail(f"{what} has dtype {buf.dtype}; the torch path needs a bf16 pool: serve with "
                    "--kv-cache-dtype auto (or bf16) and a bf16 model dtype")
    if buf.dim() != 3 or buf.shape[1] != 1 or buf.shape[2] != width or (slots is not None and buf.shape[0] != slots):
        want = f"[{'S' if slots is None else slots}, 1, {width}]"
        raise _fail(f"{what} has shape {tuple(buf.shape)}, expected {want} (one KV head; are the "
                    "sglang-dsv41 hooks installed? is_hybrid_swa_compress passes the SWA head dims)")
    return buf[:, 0, :]


def _mapping(pool, allocator_or_mapping) -> Tensor:
    """The full → SWA slot mapping: a tensor, or the `full_to_swa_index_mapping` of an allocator
    (or of the pool, where SGLang's allocator registers it)."""
    if isinstance(allocator_or_mapping, Tensor):
        return allocator_or_mapping
    for owner in (allocator_or_mapping, pool):
        mapping = getattr(owner, "full_to_swa_index_mapping", None)
        if isinstance(mapping, Tensor):
            return mapping
    raise _fail("no full → SWA slot mapping: neither the allocator nor the SWAKVPool has "
                "full_to_swa_index_mapping (SGLang's SWATokenToKVPoolAllocator registers it)")


def caches_from_sglang_pool(pool, allocator_or_mapping, cfg: TextConfig, num_req_rows: int,
                            profile: CacheProfile = CacheProfile.NONE) -> RuntimeCaches:
    """Wrap SGLang's hybrid-SWA pool as the forward's `RuntimeCaches` (module doc).

    `allocator_or_mapping`: SGLang's token allocator, the mapping tensor itself, or None (the
    mapping registered on the pool); `num_req_rows`: rows of SGLang's `req_to_token` (the
    request-scoped pair state gets one row each)."""
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    if not isinstance(pool, SWAKVPool):
        raise _fail(f"expected SGLang's hybrid-SWA pool (SWAKVPool), got {type(pool).__name__}: the "
                    "V4.1 config makes SGLang build one unless --disable-hybrid-swa-memory is given")
    layers = cfg.num_hidden_layers
    expected = {0: (0, False), **{1 + l: (l, True) for l in range(layers)}}
    if dict(pool.layers_mapping) != expected:
        raise _fail(f"SWAKVPool layers {dict(pool.layers_mapping)} are not layer 0 = packed rows, "
                    f"layers 1..{layers} = SWA (hybrid_layer_pattern of runtime/hf_config.py)")
    check_page_size(int(pool.page_size), cfg)

    full_k = pool.full_kv_pool.k_buffer
    swa_k = pool.swa_kv_pool.k_buffer
    if len(full_k) != 1 or len(swa_k) != layers:
        raise _fail(f"SWAKVPool has {len(full_k)} full and {len(swa_k)} SWA layers, expected 1 and {layers}")
    head_dim = CompressedRowLayout.from_config(cfg).sglang_head_dim
    rows = _buffer(full_k[0], "the full (packed-row) pool", None, head_dim).view(torch.uint8)
    n_swa = swa_k[0].shape[0]
    swa = [_buffer(buf, f"SWA pool layer {l}", n_swa, cfg.head_dim) for l, buf in enumerate(swa_k)]

    mapping = _mapping(pool, allocator_or_mapping)
    if mapping.dim() != 1 or mapping.shape[0] < rows.shape[0]:
        raise _fail(f"full → SWA mapping of shape {tuple(mapping.shape)} does not cover the "
                    f"{rows.shape[0]} full slots")
    devices = {t.device for t in (rows, mapping, *swa)}
    if len(devices) != 1:
        raise _fail(f"pool buffers and mapping on several devices: {sorted(map(str, devices))}")
    logger.info(describe_sglang_pool(pool))
    return RuntimeCaches.from_buffers(cfg, swa, mapping[: rows.shape[0]], rows, num_req_rows, profile,
                                      pool_id=id(pool), page_size=int(pool.page_size))


def describe_sglang_pool(pool) -> str:
    """One log line with the shapes of the pool SGLang built (read from its buffers)."""
    full, swa = pool.full_kv_pool.k_buffer, pool.swa_kv_pool.k_buffer
    row = full[0].shape[2] * full[0].element_size()
    swa_bytes = sum(b.shape[2] * b.element_size() for b in swa)
    return (f"sglang-dsv41: SGLang SWAKVPool: full pool {len(full)} layer {list(full[0].shape)} {full[0].dtype} "
            f"= {row} B/token row; SWA pool {len(swa)} layers {list(swa[0].shape)} {swa[0].dtype} = {swa_bytes} "
            f"B/SWA token; page_size {pool.page_size}")

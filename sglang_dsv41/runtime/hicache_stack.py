"""HiCache for the V4.1 pool: our `StackStrategy`, registered first in SGLang 0.5.17's
hybrid-pool assembler (`register_stack_strategy`; docs/hicache.md; spec integration.md §1.1–§1.3).

`--enable-hierarchical-cache` on our `DeepseekV41KVPool` (a `SWAKVPool`, so a FULL + SWA unified
radix tree) would otherwise get SGLang's generic `_SwaStrategy`, whose MHA host pools read K/V
head dims our components do not have. Ours builds, from the pool's own components:

| pool entry | host pool | device side | transfer layers |
|---|---|---|---|
| `PoolName.KV` (anchor) | `ComponentHostPool(full_kv_pool)` | the global KV rows (every buffer of the FULL component) | 0 |
| `PoolName.SWA` | `ComponentHostPool(swa_kv_pool)` | SWA rows of model layer l, allocated through SGLang's `swa_attn_allocator` | 1 + l |

Transfer layer ids are the pool's layer ids (`kv_pool.layers_mapping`), so the controller's
per-layer load counter is what `DeepseekV41KVPool.wait_for_model_layer` waits on. The SWA entry is
what keeps prefix hits exact (SGLang's SWA component restores the window from it); the request-scoped
pair ring is not mirrored (a hit is page-aligned, so it starts at an even position with no pending pair).

Sizing: both host pools get the SAME number of slots — `--hicache-ratio` × the FULL component's
device slots, or `--hicache-size` GB / (bytes of one token's global rows + SWA rows). SGLang's
generic rule (each host pool = ratio × its own device pool) leaves the SWA host pool
`--swa-full-tokens-ratio` times smaller than the full one, while a backup copies every SWA row a
node still holds on device (a whole prompt when it was just prefilled): SWA host space then runs
out first, the SWA host LRU drops the windows of older prefixes whose global rows are still on the
host, and the SWA match validator vetoes every such hit — 0 cached tokens (SGLang#35129's shape).
A node's SWA host rows are a subset of its tokens, and a node keeps host SWA rows only while its
global rows are on the host, so with equal slot counts the SWA host pool can never be the one
that is full.
Storage (L3): SGLang's `file` backend and our Mooncake store (`STORAGE_BACKENDS`) store each page of
each host pool as one file / object of the pool's flat page (`ComponentHostPool.get_data_page`): `KV` =
the page's global latent + index-key rows, `SWA` = every layer's SWA rows of the page; SGLang's SWA
component writes and prefetches only the trailing window's SWA pages. The start-up check
(`check_hicache_flags`) refuses every other backend (they need zero-copy page buffers the V4.1 pools
do not have).
With a storage backend on a GPU the build also shortens the scheduler process's switch interval
(`hicache_gil`: SGLang's storage threads share the scheduler's GIL).
The controller is SGLang's `HybridCacheController` with storage failures turned into misses
(`hicache_faults.StorageFaultGuard`: a storage tier that is down or full costs a cold prefill) and KV
pages prefetched a batch at a time, each prefetch's timeline logged (`hicache_prefetch.V41CacheController`).
"""
from __future__ import annotations

import json
import logging

from sglang.srt.mem_cache.hicache_storage import PoolName
from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import (
    StackBuildResult,
    StackStrategy,
    _STRATEGIES,
    build_pool_entry,
    register_stack_strategy,
)
from sglang.srt.mem_cache.memory_pool_host import HostPoolGroup
from sglang.srt.mem_cache.pool_host.common import get_allocator_type
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

from . import hicache_gil
from .hicache_host import HOST_LAYOUT, IO_BACKENDS, ComponentHostPool
from .hicache_prefetch import V41CacheController

logger = logging.getLogger(__name__)
#: L3 backends served: SGLang's `file` backend reads and writes the host pools' flat pages
#: (tests/test_runtime_hicache_storage_server.py: restart reload, reload after host eviction); `mooncake`
#: is our `hicache_mooncake.MooncakeFlatStore` (the same flat pages as Mooncake store objects), served as
#: SGLang's `dynamic` backend (`resolve_storage_backend`; tests/test_runtime_hicache_mooncake_server.py).
STORAGE_BACKENDS: tuple[str, ...] = ("file", "mooncake")
#: Write policies served. write_back gave 0 host hits on CPU (docs/hicache.md; inferred cause: a node
#: is backed up only when the device evicts it, after the small SWA pool dropped its window, so the
#: match validator vetoes the hit). write_through_selective is untested.
WRITE_POLICIES = ("write_through",)


def _extra_config(server_args) -> dict:
    raw = getattr(server_args, "hicache_storage_backend_extra_config", None)
    if not raw:
        return {}
    try:
        extra = json.loads(raw) if isinstance(raw, str) else dict(raw)
    except (ValueError, TypeError) as e:
        raise RuntimeError(f"sglang-dsv41: --hicache-storage-backend-extra-config is not a JSON object: {e}") from e
    if not isinstance(extra, dict):
        raise RuntimeError("sglang-dsv41: --hicache-storage-backend-extra-config must be a JSON object")
    return extra


def resolve_storage_backend(server_args) -> None:
    """`--hicache-storage-backend mooncake` → SGLang's `dynamic` backend with our flat-page Mooncake store
    (`hicache_mooncake.dynamic_config` over the user's extra config). Runs before SGLang resolves its
    HiCache flags, so SGLang's zero-copy Mooncake set-up (transfer engine, allocator, page-first layout)
    never runs for the V4.1 pool."""
    if not getattr(server_args, "enable_hierarchical_cache", False) or \
            getattr(server_args, "hicache_storage_backend", None) != "mooncake":
        return
    from .hicache_mooncake import BACKEND_NAME, dynamic_config, mooncake_settings

    extra = dynamic_config(_extra_config(server_args))
    try:
        mooncake_settings(extra)
    except ValueError as e:
        raise RuntimeError(f"sglang-dsv41: --hicache-storage-backend mooncake: {e}") from e
    server_args.hicache_storage_backend = "dynamic"
    server_args.hicache_storage_backend_extra_config = json.dumps(extra)
    logger.info("sglang-dsv41 HiCache: --hicache-storage-backend mooncake is served by %s (flat pages as Mooncake "
                "objects) through SGLang's dynamic storage backend", BACKEND_NAME)


def check_hicache_flags(server_args) -> None:
    """Start-up refusals of HiCache settings the V4.1 host pools cannot serve (each names the flag)."""
    if not getattr(server_args, "enable_hierarchical_cache", False):
        return
    backend = getattr(server_args, "hicache_storage_backend", None)
    if backend == "dynamic":
        from .hicache_mooncake import is_ours

        if not is_ours(_extra_config(server_args)):
            raise RuntimeError("sglang-dsv41: --hicache-storage-backend dynamic: the V4.1 host pools have flat pages "
                               "only (no zero-copy page buffers); the dynamic backend is served for our Mooncake "
                               "store only: use --hicache-storage-backend mooncake or file (docs/hicache.md)")
    elif backend == "mooncake":
        raise RuntimeError("sglang-dsv41: --hicache-storage-backend mooncake was not resolved to the V4.1 Mooncake "
                           "store (hicache_stack.resolve_storage_backend did not run)")
    elif backend is not None and backend not in STORAGE_BACKENDS:
        raise RuntimeError(f"sglang-dsv41: --hicache-storage-backend {backend}: HiCache L3 (storage) for the V4.1 "
                           f"pool is served with {list(STORAGE_BACKENDS)} only (the others read zero-copy page "
                           "buffers the V4.1 host pools do not have); drop the flag to serve the host tier (L2) "
                           "alone (docs/hicache.md)")
    policy = getattr(server_args, "hicache_write_policy", "write_through")
    if policy not in WRITE_POLICIES:
        raise RuntimeError(f"sglang-dsv41: --hicache-write-policy {policy}: the V4.1 pool serves HiCache with "
                           f"{list(WRITE_POLICIES)} only (write_back backs a prefix up when the device evicts it, "
                           "after its SWA window is gone, so it never hits; docs/hicache.md)")
    io = getattr(server_args, "hicache_io_backend", "kernel")
    if io not in IO_BACKENDS:
        raise RuntimeError(f"sglang-dsv41: --hicache-io-backend {io}: the V4.1 host pools copy with "
                           f"{list(IO_BACKENDS)} only")
    if getattr(server_args, "disaggregation_decode_enable_offload_kvcache", False):
        raise RuntimeError("sglang-dsv41: --disaggregation-decode-enable-offload-kvcache is not supported with the "
                           "V4.1 pool")


def _token_bytes(component) -> int:
    """Bytes of one slot across every buffer (all layers) of a pool component."""
    return sum(b[0].nbytes for b in component.buffers)


def host_slots(server_args, full, swa) -> int:
    """Host slots of BOTH host pools (the same count, module docstring "Sizing"): `--hicache-size`
    GB divided by the bytes of one host token (global rows + every SWA layer), else
    `--hicache-ratio` × the FULL component's device slots."""
    size_gb = float(getattr(server_args, "hicache_size", 0) or 0)
    if size_gb > 0:
        slots = int(size_gb * 1e9 // (_token_bytes(full) + _token_bytes(swa)))
    else:
        slots = int(full.size * server_args.hicache_ratio)
    if slots < full.page_size:
        raise RuntimeError(f"sglang-dsv41: the HiCache host tier holds {slots} tokens (< one page): raise "
                           "--hicache-size or --hicache-ratio")
    return slots


def _gb_for(slots: int, component) -> float:
    """`host_size` (GB) that SGLang's `HostKVCache` turns into exactly `slots` slots of `component`."""
    return (slots + 0.5) * _token_bytes(component) / 1e9


class DeepseekV41StackStrategy(StackStrategy):
    """The V4.1 pool's host stack (module docstring)."""

    def matches(self, kvcache, components) -> bool:
        from .kv_pool import DeepseekV41KVPool

        return isinstance(kvcache, DeepseekV41KVPool) and components == {ComponentType.FULL, ComponentType.SWA}

    def build(self, *, cache, kvcache, params, server_args, load_cache_event, storage_backend=None,
              storage_backend_extra_config=None, prefetch_threshold=256, model_name=None,
              enable_storage_metrics=False) -> StackBuildResult:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        check_hicache_flags(server_args)
        hicache_gil.apply(storage_backend, str(getattr(server_args, "device", "cuda")))
        if server_args.hicache_mem_layout != HOST_LAYOUT:
            logger.info("sglang-dsv41 HiCache: the V4.1 host pools are %s (one host tensor per device buffer); "
                        "--hicache-mem-layout %s does not apply to them", HOST_LAYOUT, server_args.hicache_mem_layout)
        full, swa = kvcache.full_kv_pool, kvcache.swa_kv_pool
        slots = host_slots(server_args, full, swa)
        allocator_type = get_allocator_type(server_args)          # "dynamic" (our Mooncake store): plain memory
        full_host, swa_host = (ComponentHostPool(c, ratio=server_args.hicache_ratio, host_size_gb=_gb_for(slots, c),
                                                 page_size=params.page_size, allocator_type=allocator_type, label=n)
                               for c, n in ((full, "full"), (swa, "swa")))
        full_map = {g: l for g, (l, is_swa) in kvcache.layers_mapping.items() if not is_swa}
        swa_map = {g: l for g, (l, is_swa) in kvcache.layers_mapping.items() if is_swa}
        layers = len(full_map | swa_map)
        swa_allocator = params.token_to_kv_pool_allocator.swa_attn_allocator
        group = HostPoolGroup([
            build_pool_entry(name=PoolName.KV, host_pool=full_host, device_pool=full, layer_mapping=full_map,
                             transfer_layer_num=layers, is_anchor=True),
            build_pool_entry(name=PoolName.SWA, host_pool=swa_host, device_pool=swa, layer_mapping=swa_map,
                             transfer_layer_num=layers,
                             host_evict_fn=lambda n: cache.evict_host(n, ComponentType.SWA),
                             device_evict_fn=lambda n: cache.evict(EvictParams(swa_num_tokens=n)),
                             device_alloc_fn=swa_allocator.alloc, device_free_fn=swa_allocator.free),
        ])
        controller = V41CacheController(
            params.token_to_kv_pool_allocator, group, params.page_size, params.tp_cache_group,
            load_cache_event=load_cache_event, attn_cp_group=params.attn_cp_cache_group,
            attn_tp_group=params.attn_tp_cache_group, pp_group=params.pp_cache_group,
            write_policy=server_args.hicache_write_policy, io_backend=server_args.hicache_io_backend,
            storage_backend=storage_backend, prefetch_threshold=prefetch_threshold, model_name=model_name,
            storage_backend_extra_config=storage_backend_extra_config, transfer_layer_num=layers,
            enable_storage_metrics=enable_storage_metrics)
        logger.info("sglang-dsv41 HiCache: host pools full %d slots x %d B, SWA %d slots x %d B (%d layers), "
                    "io %s, write policy %s, storage %s", full_host.size, full_host.size_per_token, swa_host.size,
                    swa_host.size_per_token, layers, server_args.hicache_io_backend,
                    server_args.hicache_write_policy, storage_backend)
        return StackBuildResult(host_pool_group=group, cache_controller=controller,
                                component_host_pools={ComponentType.FULL: full_host, ComponentType.SWA: swa_host},
                                transfer_layer_num=layers, pools_desc="sglang-dsv41 global KV rows + SWA rows")


def register() -> None:
    """Put `DeepseekV41StackStrategy` first in SGLang's strategy list (idempotent)."""
    if not any(isinstance(s, DeepseekV41StackStrategy) for s in _STRATEGIES):
        register_stack_strategy(DeepseekV41StackStrategy())

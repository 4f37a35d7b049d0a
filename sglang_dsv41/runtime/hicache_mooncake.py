"""HiCache L3 on a Mooncake store for the V4.1 host pools: one Mooncake object per page per pool,
holding the pool's flat page (docs/hicache.md "L3: the Mooncake store"; issue 14; spec
integration.md §1.2–§1.3).

SGLang 0.5.17's own `MooncakeStore` moves zero-copy K/V page objects (`get_page_buffer_meta`) that
the V4.1 host pools do not have. This backend moves the flat pages the `file` backend moves
(`get_data_page` / `set_from_flat_data_page`) through `MooncakeDistributedStore` put/get, over any
Mooncake protocol (TCP where there is no RDMA). It is SGLang's `dynamic` storage backend:
`--hicache-storage-backend mooncake` is rewritten at start-up to `dynamic` with this class
(`hicache_stack.resolve_storage_backend`), so SGLang's controller takes its generic flat-page path,
never the zero-copy one, and none of SGLang's Mooncake-only set-up (transfer engine, host
allocator, page-first layout) runs for it.

Invariants:

* key = ``dsv41/<model>/tp<r>of<n>[/pp<r>of<n>]/<pool>/<layout>/<page hash>``; ``<layout>`` is the
  page's tokens and bytes plus a digest of the pool's row bytes, dtypes and widths, so two pools
  (KV, SWA), two layouts, models or TP shapes never share a key;
* an object is exactly one page of its pool, never 0 bytes: a pool whose page is empty is refused
  at registration, a page of another size is never written, and an object read back with another
  size (Mooncake answers a missing key with 0 bytes) is a failed read;
* a Mooncake call that reports an error raises `MooncakeStoreError` (queries) or fails its pages
  (reads, writes); `hicache_faults.StorageFaultGuard` turns both into a miss, a warning and a count.

The Mooncake master and the memory that holds the objects are the deployment's: a `mooncake_master`
and a `mooncake_client` (or any client that mounts a segment). The server contributes
`global_segment_size` bytes (default 0), so its restart does not take the stored pages with it.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
from typing import Any, List, Optional

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

logger = logging.getLogger(__name__)

#: the `dynamic` backend's name in SGLang's logs and in our storage-failure warnings
BACKEND_NAME = "dsv41-mooncake"
#: settings: extra-config key → (environment variable SGLang's MooncakeStore also reads, default)
SETTINGS: dict[str, tuple[str, Any]] = {
    "master_server_address": ("MOONCAKE_MASTER", None),
    "metadata_server": ("MOONCAKE_TE_META_DATA_SERVER", None),   # default: http://<master host>:8080/metadata
    "protocol": ("MOONCAKE_PROTOCOL", "tcp"),
    "device_name": ("MOONCAKE_DEVICE", ""),
    "local_hostname": ("MOONCAKE_LOCAL_HOSTNAME", "127.0.0.1"),
    "global_segment_size": ("MOONCAKE_GLOBAL_SEGMENT_SIZE", 0),
    "local_buffer_size": ("MOONCAKE_LOCAL_BUFFER_SIZE", 64 << 20),
}
#: seconds to wait for the master's TCP port at start-up (Mooncake's own setup blocks ~90 s)
CONNECT_TIMEOUT_S = 5.0


class MooncakeStoreError(RuntimeError):
    """A Mooncake store call reported an error (the master or the store is down)."""


def dynamic_config(extra: Optional[dict]) -> dict:
    """SGLang's `dynamic` backend config selecting this class, over the user's extra config."""
    return {**(extra or {}), "backend_name": BACKEND_NAME, "module_path": __name__,
            "class_name": MooncakeFlatStore.__name__}


def is_ours(extra: Optional[dict]) -> bool:
    """True when a `dynamic` backend config selects this class."""
    return bool(extra) and extra.get("module_path") == __name__ and extra.get("class_name") == MooncakeFlatStore.__name__


def mooncake_settings(extra: Optional[dict]) -> dict:
    """Connection settings: the extra config, else SGLang's Mooncake environment variables, else defaults."""
    out = {}
    for key, (env, default) in SETTINGS.items():
        value = (extra or {}).get(key, os.environ.get(env, default))
        out[key] = int(value) if isinstance(default, int) else value
    if not out["master_server_address"]:
        raise ValueError("sglang-dsv41 HiCache mooncake: no master address: set master_server_address in "
                         "--hicache-storage-backend-extra-config or MOONCAKE_MASTER (host:port)")
    if not out["metadata_server"]:
        out["metadata_server"] = f"http://{out['master_server_address'].rsplit(':', 1)[0]}:8080/metadata"
    if out["global_segment_size"] < 0 or out["local_buffer_size"] <= 0:
        raise ValueError(f"sglang-dsv41 HiCache mooncake: bad segment sizes {out}")
    return out


def key_prefix(config: HiCacheStorageConfig) -> str:
    model = "-".join((config.model_name or "").split("/"))
    prefix = f"dsv41/{model}/tp{config.tp_rank}of{config.tp_size}"
    return prefix + (f"/pp{config.pp_rank}of{config.pp_size}" if config.pp_size > 1 else "")


def layout_tag(pool) -> tuple[str, int]:
    """(`<layout>` key part, page bytes) of a host pool; a HostPoolGroup stands for its anchor (KV) pool."""
    pool = getattr(getattr(pool, "anchor_entry", None), "host_pool", pool)
    dummy = pool.get_dummy_flat_data_page()
    page_bytes = dummy.numel() * dummy.element_size()
    if page_bytes <= 0:
        raise ValueError(f"sglang-dsv41 HiCache mooncake: {type(pool).__name__} has 0-byte pages; Mooncake "
                         "objects are never empty")
    shape = (pool.page_size, getattr(pool, "row_bytes", None), [str(d) for d in getattr(pool, "dtypes", [])],
             getattr(pool, "widths", None))
    digest = hashlib.sha1(json.dumps(shape).encode()).hexdigest()[:12]
    return f"p{pool.page_size}-{page_bytes}B-{digest}", page_bytes


def _check_master(address: str) -> None:
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except (OSError, ValueError) as e:
        raise RuntimeError(f"sglang-dsv41 HiCache mooncake: the Mooncake master {address} is not reachable "
                           f"({e}); start mooncake_master (docs/hicache.md) or drop --hicache-storage-backend") from e


class MooncakeFlatStore(HiCacheStorage):
    """Flat pages of the V4.1 host pools as Mooncake store objects (module docstring)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None, store=None) -> None:
        self.settings = mooncake_settings(storage_config.extra_config)
        self.prefix = key_prefix(storage_config)
        self._layouts: dict[str, tuple[str, int]] = {}
        self.store = store if store is not None else self._connect()

    def _connect(self):
        from mooncake.store import MooncakeDistributedStore

        s = self.settings
        _check_master(s["master_server_address"])
        store = MooncakeDistributedStore()
        rc = store.setup(s["local_hostname"], s["metadata_server"], s["global_segment_size"], s["local_buffer_size"],
                         s["protocol"], s["device_name"], s["master_server_address"])
        if rc != 0:
            raise RuntimeError(f"sglang-dsv41 HiCache mooncake: MooncakeDistributedStore.setup returned {rc} "
                               f"({s})")
        logger.info("sglang-dsv41 HiCache: Mooncake store L3 at master %s (%s), keys %s/...", s["master_server_address"],
                    s["protocol"], self.prefix)
        return store

    # ---- pools and keys ------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self._layouts[str(PoolName.KV)] = layout_tag(mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool, host_pool_name) -> None:
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        self._layouts[str(host_pool_name)] = layout_tag(host_pool)

    def key(self, pool: str, page_hash: str) -> str:
        return f"{self.prefix}/{pool}/{self._layouts[str(pool)][0]}/{page_hash}"

    # ---- Mooncake calls --------------------------------------------------------------------------
    def _exist_flags(self, keys: List[str]) -> List[bool]:
        if not keys:
            return []
        flags = self.store.batch_is_exist(keys)
        if len(flags) != len(keys) or any(f < 0 for f in flags):
            raise MooncakeStoreError(f"batch_is_exist failed: {sorted({f for f in flags if f < 0})}")
        return [f == 1 for f in flags]

    def _read(self, pool: str, hashes: List[str], targets: List[torch.Tensor]) -> List[Optional[torch.Tensor]]:
        """Each page read into its target (a flat page), or None (missing, short or long)."""
        if not hashes:
            return []
        page_bytes = self._layouts[str(pool)][1]
        out = []
        for blob, target in zip(self.store.get_batch([self.key(pool, h) for h in hashes]), targets):
            if len(blob) != page_bytes or target.numel() * target.element_size() != page_bytes:
                out.append(None)
                continue
            target.view(torch.uint8).reshape(-1).numpy()[:] = np.frombuffer(blob, dtype=np.uint8)
            out.append(target)
        return out

    def _write(self, pool: str, hashes: List[str], pages: List[torch.Tensor]) -> List[bool]:
        """Writes the pages not yet stored; True per page stored (already or now)."""
        if not hashes:
            return []
        page_bytes = self._layouts[str(pool)][1]
        keys = [self.key(pool, h) for h in hashes]
        stored = self._exist_flags(keys)
        todo = [i for i, s in enumerate(stored) if not s]
        arrays = {i: pages[i].contiguous().view(torch.uint8).reshape(-1).numpy() for i in todo}
        wrong = [i for i, a in arrays.items() if a.nbytes != page_bytes]
        if wrong:
            raise ValueError(f"sglang-dsv41 HiCache mooncake: {pool} pages are {page_bytes} B, got "
                             f"{[arrays[i].nbytes for i in wrong]} B")
        if todo:
            rc = self.store.put_batch([keys[i] for i in todo], [arrays[i] for i in todo])
            if rc != 0:
                logger.debug("Mooncake put_batch of %d %s pages returned %s", len(todo), pool, rc)
                return [s for s in stored]
        return [True] * len(keys)

    # ---- SGLang's v1 API (the KV anchor pool through the controller's generic page path) ------
    def get(self, key: str, target_location: Optional[Any] = None, target_sizes: Optional[Any] = None):
        return self._read(PoolName.KV, [key], [target_location])[0]

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None, target_sizes: Optional[Any] = None):
        return self._read(PoolName.KV, keys, list(target_locations))

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        return self._write(PoolName.KV, [key], [value])[0]

    def batch_set(self, keys: List[str], values: Optional[Any] = None, target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        return all(self._write(PoolName.KV, keys, list(values)))

    def exists(self, key: str) -> bool:
        return self._exist_flags([self.key(PoolName.KV, key)])[0]

    def batch_exists(self, keys: List[str], extra_info=None) -> int:
        return _leading(self._exist_flags([self.key(PoolName.KV, k) for k in keys]))

    # ---- SGLang's v2 API (every pool by name) --------------------------------------------------
    def batch_exists_v2(self, keys: List[str], pool_transfers: Optional[List[PoolTransfer]] = None,
                        extra_info=None) -> PoolTransferResult:
        """The usable prefix: the leading KV pages, cut to where each other pool's hit policy holds
        (ALL_PAGES: every page; TRAILING_PAGES: the last `len(keys)` pages of the prefix)."""
        pools = [str(PoolName.KV)] + [str(t.name) for t in pool_transfers or []]
        flat = self._exist_flags([self.key(p, k) for p in pools for k in keys])
        have = {p: flat[i * len(keys):(i + 1) * len(keys)] for i, p in enumerate(pools)}
        kv = _leading(have[str(PoolName.KV)])
        hits, final = ({PoolName.KV: kv} if kv else {}), kv
        for t in pool_transfers or []:
            if final == 0:
                break
            pages = have[str(t.name)]
            if t.hit_policy == PoolHitPolicy.ALL_PAGES:
                usable = _leading(pages[:kv])
            else:
                window = max(1, len(t.keys or []))
                usable = next((n for n in range(kv, 0, -1) if all(pages[max(0, n - window):n])), 0)
            if usable:
                hits[t.name] = usable
            final = min(final, usable)
        return PoolTransferResult(final, hits)

    def _transfer_pages(self, t: PoolTransfer) -> Optional[List[int]]:
        pool = self.registered_pools[t.name]
        n = len(t.keys or [])
        if t.host_indices is None or t.host_indices.numel() != n * pool.page_size:
            logger.error("sglang-dsv41 HiCache mooncake: %s transfer of %d pages has %s host slots", t.name, n,
                         None if t.host_indices is None else t.host_indices.numel())
            return None
        return [int(i) for i in t.host_indices[::pool.page_size]]

    def batch_get_v2(self, transfers: List[PoolTransfer], extra_info=None) -> dict[str, List[bool]]:
        results = {}
        for t in transfers:
            starts, pool = self._transfer_pages(t), self.registered_pools[t.name]
            if starts is None:
                results[t.name] = [False] * len(t.keys or [])
                continue
            pages = self._read(t.name, t.keys, [pool.get_dummy_flat_data_page() for _ in starts])
            for start, page in zip(starts, pages):
                if page is not None:
                    pool.set_from_flat_data_page(start, page)
            results[t.name] = [p is not None for p in pages]
        return results

    def batch_set_v2(self, transfers: List[PoolTransfer], extra_info=None) -> dict[str, List[bool]]:
        results = {}
        for t in transfers:
            starts, pool = self._transfer_pages(t), self.registered_pools[t.name]
            results[t.name] = ([False] * len(t.keys or []) if starts is None else
                               self._write(t.name, t.keys, [pool.get_data_page(s, flat=True) for s in starts]))
        return results

    def clear(self) -> bool:
        """Removes this server's objects (Mooncake keeps an object that is leased, i.e. read or written in
        the last `default_kv_lease_ttl`)."""
        removed = self.store.remove_by_regex(f"^{self.prefix}/")
        logger.info("sglang-dsv41 HiCache: removed %s Mooncake objects under %s/", removed, self.prefix)
        return removed >= 0


def _leading(flags: List[bool]) -> int:
    return next((i for i, f in enumerate(flags) if not f), len(flags))

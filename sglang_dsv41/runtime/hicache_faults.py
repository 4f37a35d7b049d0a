"""A HiCache storage tier (L3) that is down or full costs a cold prefill, never a crash, a hang or a
leak (docs/hicache.md "Storage faults"; issue 14).

SGLang 0.5.17 runs the L3 I/O of `HybridCacheController` in two threads: the prefetch thread asks
the backend which pages exist (`_storage_hit_query`) and its helper reads them into host slots
(`_page_transfer`); the backup thread writes host pages out (`_page_backup`). A backend call that
RAISES kills its thread for the life of the server, with the request's host slots still allocated:

* `HiCacheFile.batch_exists_v2` lists the directory, so a removed directory (or one replaced by a
  file) raises and the prefetch thread is gone — no L3 hit again, even once storage is back;
* `HiCacheFile.get` catches only `FileNotFoundError`, so a truncated page (short read) or a path
  that is no longer a directory raises in the read helper, whose release of the prefetch's unread
  host slots then never runs (the host tier leaks them).

A backend call that RETURNS a failure is handled by SGLang (a write of a full or missing directory:
`set` returns False; a read of a vanished page: None; the all-or-nothing check discards a partial
prefetch), but only SGLang's per-page lines say so.

`StorageFaultGuard` is the controller our stack strategy builds (`hicache_stack.py`); it is
SGLang's `HybridCacheController`, with each of the three operations wrapped so that:

* an exception ends the operation as a miss: the query reports 0 hits (SGLang revokes the
  prefetch), a read stops the prefetch (SGLang's all-or-nothing check then discards it and the
  helper releases its unread slots), a write keeps the pages it completed;
* every failed operation, raised or returned, counts in `sglang_dsv41:hicache_storage_failures_total{op}`
  (`op` = query / read / write) and is logged as a warning naming the backend, the error and the
  consequence — at most one line per op every `WARN_EVERY_S`, with the count in between.

The request then prefills what storage did not provide; it never waits for storage.
"""
from __future__ import annotations

import logging
import threading
import time

from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController

from . import metrics

logger = logging.getLogger(__name__)

_CC = "sglang.srt.managers.cache_controller.HiCacheController"
_HCC = "sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller.HybridCacheController"
#: The SGLang 0.5.17 internals `StorageFaultGuard` overrides (it is a subclass, not a HookRegistry entry:
#: only the controller our stack strategy builds is changed). Each: the method's parameters as written
#: for, and the SGLang thread function that must call it as `self.<method>(operation)` for the override to
#: take effect. tests/test_runtime_hicache_guard.py fails when either moves (the hooks.py rule).
OVERRIDES: dict[str, tuple[tuple[str, ...], str | None]] = {
    "_storage_hit_query": (("self", "operation"), f"{_CC}.prefetch_thread_func"),
    "_page_transfer": (("self", "operation"), f"{_CC}.prefetch_io_aux_func"),
    "_page_backup": (("self", "operation"), f"{_HCC}.backup_thread_func"),
    "terminate_prefetch": (("self", "operation"), None),      # called by the radix cache (public)
}

OPS = ("query", "read", "write")
WARN_EVERY_S = 30.0
#: what a failure of each op costs (in the warning)
_CONSEQUENCE = {"query": "no storage hit for this prefix; it is prefilled cold",
                "read": "the prefetch is discarded; the prefix is prefilled cold",
                "write": "these pages are not in storage; a later request for them prefills cold"}


class FaultLog:
    """Counts failed storage operations per op; warns at most once per op every `every_s` seconds."""

    def __init__(self, backend: str, tp_rank: int, every_s: float = WARN_EVERY_S) -> None:
        self.backend, self.tp_rank, self.every_s = backend, tp_rank, every_s
        self.counts = dict.fromkeys(OPS, 0)
        self._last_warn = dict.fromkeys(OPS, float("-inf"))
        self._unreported = dict.fromkeys(OPS, 0)
        self._lock = threading.Lock()

    def record(self, op: str, detail: str) -> None:
        with self._lock:                               # the storage threads record concurrently
            if metrics.metrics_enabled():
                metrics.counter("hicache_storage_failures", "failed HiCache storage (L3) operations", "op").labels(
                    str(self.tp_rank), op).inc()
            self.counts[op] += 1
            self._unreported[op] += 1
            now = time.monotonic()
            if now - self._last_warn[op] < self.every_s:
                return
            n, self._unreported[op], self._last_warn[op] = self._unreported[op], 0, now
        logger.warning("sglang-dsv41 HiCache: storage %s failed on the %s backend (%d since the last warning): %s; "
                       "%s. Is the storage down or full?", op, self.backend, n, detail, _CONSEQUENCE[op])


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


class StorageFaultGuard(HybridCacheController):
    """SGLang's hybrid cache controller whose storage operations fail as misses (module docstring)."""

    def __init__(self, *args, **kwargs) -> None:
        # before SGLang's __init__, which starts the storage threads
        backend = kwargs.get("storage_backend")
        if backend == "dynamic":                       # our Mooncake store (hicache_mooncake.py) names itself
            backend = (kwargs.get("storage_backend_extra_config") or {}).get("backend_name", backend)
        self.storage_faults = FaultLog(str(backend), tp_rank=0)
        super().__init__(*args, **kwargs)
        self.storage_faults.tp_rank = int(getattr(self, "tp_rank", 0))

    def terminate_prefetch(self, operation):
        operation.dsv41_stopped = True                 # the scheduler stopped it: a short read is no fault
        return super().terminate_prefetch(operation)

    def _storage_hit_query(self, operation):
        try:
            return super()._storage_hit_query(operation)
        except Exception as e:                          # any backend error is a miss
            self.storage_faults.record("query", _error(e))
            return [], 0

    def _page_transfer(self, operation):
        try:
            super()._page_transfer(operation)
        except Exception as e:
            self.storage_faults.record("read", _error(e))     # counted before the scheduler can move on
            operation.mark_terminate()
            operation.pool_transfers_done = True
            return
        short = _short_pages(operation, self.page_size)
        if short and not getattr(operation, "dsv41_stopped", False):
            self.storage_faults.record("read", f"{short} of {len(operation.hash_value)} pages not read")

    def _page_backup(self, operation):
        try:
            super()._page_backup(operation)
        except Exception as e:
            self.storage_faults.record("write", _error(e))
            return
        short = _short_pages(operation, self.page_size)
        if short:
            self.storage_faults.record("write", f"{short} of {len(operation.hash_value)} pages not written")


def _short_pages(operation, page_size: int) -> int:
    """Pages of `operation` that its KV pool or any extra pool (SWA) did not complete."""
    pages = len(operation.hash_value)
    short = pages - operation.completed_tokens // page_size
    extra = operation.pool_storage_result.extra_pool_hit_pages
    for transfer in operation.pool_transfers or []:
        want = len(transfer.keys or [])
        if transfer.name in extra and extra[transfer.name] < want:
            short = max(short, want - extra[transfer.name])
    return max(short, 0)

"""The storage (L3) prefetch of the V4.1 host pools: KV pages read a batch at a time, and one log line
per prefetch with where its time went (docs/hicache.md "What an L3 hit costs"; issue 14).

SGLang 0.5.17's generic page read (`HiCacheController._generic_page_get`, the path of every backend
our pools serve) makes one zeroed staging tensor per page, reads each page into it through the
backend, then writes it into the host pool page by page (`set_from_flat_data_page`: a slice and a
copy per host buffer). Each of those torch calls and file calls lets go of the GIL, and the prefetch
runs in a helper thread beside the scheduler loop, which keeps the GIL while it polls the prefetch
(`wait_complete` and `timeout` policies): every hand-off can cost the reader a switch interval.
`V41CacheController._generic_page_get` reads the same pages through the same backend call
(`batch_get`, so the backend's keys, LRU touch and errors are unchanged) into ONE staging tensor per
batch, then copies the leading read pages into the host pool with one indexed copy per host buffer
(`ComponentHostPool.set_from_flat_data_pages`).

Invariants, as SGLang's: a page counts as completed only once its bytes are in the host pool; the
completed pages are the leading pages the backend returned (the first miss ends the batch, which
SGLang's `_page_transfer` then turns into a terminated prefetch); a prefetch the scheduler stopped
reads nothing more. Difference: the pages of one batch (at most SGLang's `STORAGE_BATCH_SIZE`)
become completed together, not one by one, so a `best_effort` / `timeout` prefetch cut mid-batch
keeps the batches before it.

Timeline (`PrefetchTimeline`): the operation is stamped at creation (SGLang's `start_time`, when the
scheduler queues the request), around the existence query, around the read helper's transfer, and
when the scheduler ends it (`terminate_prefetch`); the line is logged at that end, at INFO.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from .hicache_faults import StorageFaultGuard

logger = logging.getLogger(__name__)

_CC = "sglang.srt.managers.cache_controller.HiCacheController"
#: SGLang 0.5.17 internals `V41CacheController` overrides beyond `StorageFaultGuard`'s: parameters as
#: written for, and the source text of the SGLang function that must reach the override.
#: tests/test_runtime_hicache_prefetch.py fails when either moves (the hooks.py rule).
OVERRIDES: dict[str, tuple[tuple[str, ...], str, str]] = {
    "_generic_page_get": (("self", "operation", "hash_values", "host_indices", "extra_info"),
                          f"{_CC}.attach_storage_backend", "self.page_get_func = self._generic_page_get"),
    "prefetch": (("self", "request_id", "new_input_tokens", "last_hash", "prefix_keys", "extra_pools"),
                 "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.prefetch_from_storage",
                 "self.cache_controller.prefetch("),
}


@dataclass
class PrefetchTimeline:
    """Monotonic stamps (s) and sizes of one prefetch; `None` = not reached."""

    issued: float
    query: tuple[float, float] | None = None
    read: tuple[float, float] | None = None
    kv_pages: int = 0
    kv_bytes: int = 0
    kv_read_s: float = 0.0
    kv_batches: list[tuple[int, float]] = field(default_factory=list)
    other_pages: int = 0
    done: float | None = None

    def line(self, req: str) -> str:
        """The log line: each step's duration in ms, from the request's arrival in the scheduler."""
        ms = lambda a, b: f"{(b - a) * 1e3:.1f}"  # noqa: E731
        parts = [f"req={req}", f"pages kv={self.kv_pages} ({self.kv_bytes} B) other={self.other_pages}"]
        if self.query:
            parts.append(f"queue {ms(self.issued, self.query[0])} ms, query {ms(*self.query)} ms")
        if self.query and self.read:
            per_page = self.kv_read_s / self.kv_pages * 1e6 if self.kv_pages else 0.0
            parts.append(f"to read {ms(self.query[1], self.read[0])} ms, read {ms(*self.read)} ms (kv "
                         f"{self.kv_read_s * 1e3:.1f} ms in {len(self.kv_batches)} batches, {per_page:.0f} us/page)")
        if self.done is not None:
            last = self.read[1] if self.read else self.query[1] if self.query else self.issued
            parts.append(f"to done {ms(last, self.done)} ms, total {ms(self.issued, self.done)} ms")
        return "; ".join(parts)


class V41CacheController(StorageFaultGuard):
    """The controller of the V4.1 host stack: `StorageFaultGuard` (storage failures as misses) with the
    batched page read and the prefetch timeline (module docstring)."""

    def prefetch(self, request_id, new_input_tokens, last_hash=None, prefix_keys=None, extra_pools=None):
        operation = super().prefetch(request_id, new_input_tokens, last_hash, prefix_keys, extra_pools)
        operation.dsv41_timeline = PrefetchTimeline(issued=operation.start_time)
        return operation

    def _storage_hit_query(self, operation):
        t0 = time.monotonic()
        result = super()._storage_hit_query(operation)
        tl = getattr(operation, "dsv41_timeline", None)
        if tl is not None:
            tl.query = (t0, time.monotonic())
        return result

    def _page_transfer(self, operation):
        t0 = time.monotonic()
        try:
            super()._page_transfer(operation)
        finally:
            tl = getattr(operation, "dsv41_timeline", None)
            if tl is not None:
                tl.read = (t0, time.monotonic())
                extra = operation.pool_storage_result.extra_pool_hit_pages
                tl.other_pages = sum(int(v) for v in extra.values()) if extra else 0

    def terminate_prefetch(self, operation):
        result = super().terminate_prefetch(operation)
        tl = getattr(operation, "dsv41_timeline", None)
        if tl is not None and tl.done is None:
            tl.done = time.monotonic()
            logger.info("sglang-dsv41 HiCache: prefetch %s", tl.line(operation.request_id))
        return result

    def _generic_page_get(self, operation, hash_values, host_indices, extra_info=None):
        """One batch of KV pages: read into one staging tensor, then into the host pool (module docstring)."""
        if operation.is_terminated():
            return
        t0 = time.monotonic()
        host = self.mem_pool_host.anchor_entry.host_pool
        staging = host.flat_page_batch(len(hash_values))
        targets = list(staging.unbind(0))
        pages = self.storage_backend.batch_get(hash_values, targets)
        if pages is None:
            return
        done = 0
        for page, target in zip(pages, targets):
            if page is None:
                logger.warning("Prefetch operation %s failed to retrieve page %s.", operation.request_id,
                               hash_values[done])
                break
            if page is not target:                    # a backend that returns its own tensor
                target.copy_(page.reshape(-1).view(torch.uint8))
            done += 1
        if done:
            host.set_from_flat_data_pages(host_indices[: done * self.page_size], staging[:done])
            operation.increment(done * self.page_size)
        tl = getattr(operation, "dsv41_timeline", None)
        if tl is not None:
            dt = time.monotonic() - t0
            tl.kv_pages += done
            tl.kv_bytes += done * host.page_bytes
            tl.kv_read_s += dt
            tl.kv_batches.append((done, dt))

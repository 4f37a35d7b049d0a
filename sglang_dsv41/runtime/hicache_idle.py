"""While the only work is storage (L3) I/O, the scheduler loop waits instead of spinning, so the
storage threads get the GIL (docs/hicache.md "What an L3 hit costs", "L3 write throughput"; issue 14).

SGLang 0.5.17's event loop calls `Scheduler.on_idle` when it has no batch to run. `on_idle` returns
at once unless the server is fully idle, and a fully idle server sleeps only with `--sleep-on-idle`
(off by default), so the loop spins in both cases. The storage threads run in the same process:
every file and torch call they make gives the GIL up, the spinning loop takes it, and the thread
waits for the loop's next release (docs/hicache.md has the costs measured: page reads and page-file
writes tens of times slower beside the spinning loop).

`on_idle_hook` (AFTER `Scheduler.on_idle`) waits up to `WAIT_MS` on SGLang's idle poller (a new
request wakes it at once; `time.sleep` where the server has none), with the GIL released, when
  * a prefetch is in flight (`ongoing_prefetch`: requests wait for their L3 pages) and the server is
    not fully idle, or
  * a backup to storage is in flight (`ongoing_backup`: write-through / write-back pages on their way
    to L3), idle or not.
A prefetch or backup that ends is then seen at most `WAIT_MS` later. A loop that has a batch to run
never calls `on_idle`, so running requests are not slowed. `SGLANG_DSV41_HICACHE_PREFETCH_WAIT_MS`
sets the wait; 0 keeps SGLang's spinning loop (for measuring it). Every device.
"""
from __future__ import annotations

from .idle_wait import env_ms, wait_on_idle_poller

#: Longest wait of one loop iteration with nothing to run while a prefetch is in flight (milliseconds).
WAIT_MS = 1.0
ENV = "SGLANG_DSV41_HICACHE_PREFETCH_WAIT_MS"


def wait_ms() -> float:
    return env_ms(ENV, WAIT_MS)


def prefetch_in_flight(scheduler) -> bool:
    """Has the scheduler's tree cache a storage prefetch that has not ended?"""
    return bool(getattr(getattr(scheduler, "tree_cache", None), "ongoing_prefetch", None))


def backup_in_flight(scheduler) -> bool:
    """Has the scheduler's tree cache a backup to storage that has not been acknowledged?"""
    return bool(getattr(getattr(scheduler, "tree_cache", None), "ongoing_backup", None))


def on_idle_hook(result, self):
    """AFTER `Scheduler.on_idle` (module docstring)."""
    if not getattr(self, "enable_hicache_storage", False):
        return result
    backup = backup_in_flight(self)
    if not backup and not prefetch_in_flight(self):
        return result
    ms = wait_ms()
    if ms == 0 or (not backup and self.is_fully_idle()):
        return result
    wait_on_idle_poller(self, ms)
    return result

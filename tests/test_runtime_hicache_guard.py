"""Guard of the SGLang internals `StorageFaultGuard` overrides (`runtime/hicache_faults.py`,
`OVERRIDES`): each still exists in SGLang 0.5.17 with the parameters it was written for, SGLang's
thread still calls it by name, and SGLang's own version still behaves as the guard assumes (a
backend exception escapes it; the result shapes and operation fields the guard reads). The guard's
behaviour on the same fakes is checked next to it. No server: a bare controller over fake pools."""
from __future__ import annotations

import inspect

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (
    HybridCacheController,
    PrefetchOperation,
    StorageOperation,
)
from sglang.srt.mem_cache.utils import get_hash_str

from sglang_dsv41.hooks import resolve_target
from sglang_dsv41.runtime.hicache_faults import OVERRIDES, FaultLog, StorageFaultGuard

PAGE, PAGE_BYTES = 2, 8


class _Host:
    """The flat-page API of a host pool, over nothing."""

    page_size = PAGE

    def __init__(self):
        self.written = {}

    def get_dummy_flat_data_page(self):
        return torch.zeros(PAGE_BYTES, dtype=torch.uint8)

    def get_data_page(self, index, flat=True):
        return torch.full((PAGE_BYTES,), int(index), dtype=torch.uint8)

    def set_from_flat_data_page(self, index, page):
        self.written[int(index)] = page


class _Backend:
    """Answers `hits` pages; reads fail from page `short` on; `error` makes every call raise."""

    def __init__(self, hits=4, short=None, error=None, writes=True):
        self.hits, self.short, self.error, self.writes = hits, short, error, writes

    def _maybe_raise(self):
        if self.error is not None:
            raise self.error

    def batch_exists(self, keys, extra_info=None):
        self._maybe_raise()
        return min(self.hits, len(keys))

    def batch_get(self, keys, target_locations, target_sizes=None):
        self._maybe_raise()
        return [None if self.short is not None and i >= self.short else t for i, t in enumerate(target_locations)]

    def batch_set(self, keys, values, target_locations=None, target_sizes=None):
        self._maybe_raise()
        return self.writes


def _controller(cls, backend):
    ctl = object.__new__(cls)                       # no threads, no pools: only what the storage ops read
    ctl.page_size, ctl.has_draft, ctl.backup_skip = PAGE, False, False
    ctl.storage_backend, ctl.mem_pool_host, ctl.get_hash_str = backend, _Host(), get_hash_str
    ctl.page_get_func, ctl.page_set_func = ctl._generic_page_get, ctl._generic_page_set
    ctl.storage_faults = FaultLog("fake", tp_rank=0, every_s=3600)
    return ctl


def _prefetch(pool_transfers=None):
    op = PrefetchOperation("req", list(range(4 * PAGE)), pool_transfers=pool_transfers)
    op.hash_value, op.host_indices = ["a", "b", "c", "d"], torch.arange(4 * PAGE)
    return op


@pytest.mark.parametrize("name", sorted(OVERRIDES))
def test_each_override_still_exists_in_sglang_with_its_signature_and_caller(name):
    params, caller = OVERRIDES[name]
    assert name in StorageFaultGuard.__dict__
    owners = [c for c in StorageFaultGuard.__mro__[1:] if name in c.__dict__]
    assert owners, f"SGLang no longer defines {name}: StorageFaultGuard's override is dead code"
    assert tuple(inspect.signature(owners[0].__dict__[name]).parameters) == params, (
        f"{owners[0].__name__}.{name} changed its signature; re-check runtime/hicache_faults.py")
    if caller is not None:
        assert f"self.{name}(operation)" in inspect.getsource(resolve_target(caller)), (
            f"{caller} no longer calls self.{name}(operation): the guard would not run")


def test_every_override_is_in_the_table():
    ours = {n for n, v in StorageFaultGuard.__dict__.items() if inspect.isfunction(v)} - {"__init__"}
    assert ours == set(OVERRIDES)
    init = inspect.signature(HybridCacheController.__init__).parameters
    assert "storage_backend" in init and init["storage_backend"].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD


def test_storage_hit_query_raises_in_sglang_and_is_a_miss_in_the_guard():
    op = _prefetch()
    hashes, tokens = HybridCacheController._storage_hit_query(_controller(StorageFaultGuard, _Backend(hits=3)), op)
    assert hashes == get_hash_str(op.token_ids, None, page_size=PAGE)[:3] and tokens == 3 * PAGE
    assert op.pool_storage_result.kv_hit_pages == 3
    ctl = _controller(StorageFaultGuard, _Backend(error=NotADirectoryError("gone")))
    with pytest.raises(NotADirectoryError):
        HybridCacheController._storage_hit_query(ctl, _prefetch())
    assert ctl._storage_hit_query(_prefetch()) == ([], 0)
    assert ctl.storage_faults.counts["query"] == 1


def test_page_transfer_raises_in_sglang_and_ends_the_prefetch_in_the_guard():
    ok = _controller(StorageFaultGuard, _Backend())
    op = _prefetch()
    HybridCacheController._page_transfer(ok, op)
    assert op.completed_tokens == 4 * PAGE and op.pool_transfers_done and not op.is_terminated()
    assert sorted(ok.mem_pool_host.written) == [0, 2, 4, 6]

    swa = [PoolTransfer(name=PoolName.SWA, keys=["d"])]
    bad = _controller(StorageFaultGuard, _Backend(error=OSError("Short read")))
    with pytest.raises(OSError):
        HybridCacheController._page_transfer(bad, _prefetch(swa))
    op = _prefetch(swa)
    assert op.pool_transfers_done is False                  # SGLang's flag the helper thread waits on
    bad._page_transfer(op)
    assert op.is_terminated() and op.pool_transfers_done and bad.storage_faults.counts["read"] == 1


def test_a_short_read_is_counted_unless_the_scheduler_stopped_the_prefetch():
    ctl = _controller(StorageFaultGuard, _Backend(short=2))
    op = _prefetch()
    ctl._page_transfer(op)
    assert op.completed_tokens == 2 * PAGE and ctl.storage_faults.counts["read"] == 1
    op = _prefetch()
    assert ctl.terminate_prefetch(op) == (0, ["a", "b", "c", "d"]) and op.is_terminated()
    ctl._page_transfer(op)
    assert ctl.storage_faults.counts["read"] == 1


def test_page_backup_raises_in_sglang_and_counts_in_the_guard():
    def op():
        return StorageOperation(torch.arange(4 * PAGE), list(range(4 * PAGE)), hash_value=["a", "b", "c", "d"])

    ok = _controller(StorageFaultGuard, _Backend())
    done = op()
    HybridCacheController._page_backup(ok, done)
    assert done.completed_tokens == 4 * PAGE
    ok._page_backup(op())
    assert ok.storage_faults.counts["write"] == 0
    with pytest.raises(OSError):
        HybridCacheController._page_backup(_controller(StorageFaultGuard, _Backend(error=OSError(28, "full"))), op())
    for backend in (_Backend(error=OSError(28, "No space left on device")), _Backend(writes=False)):
        ctl = _controller(StorageFaultGuard, backend)
        failed = op()
        ctl._page_backup(failed)
        assert failed.completed_tokens == 0 and ctl.storage_faults.counts["write"] == 1

"""The storage prefetch of the V4.1 host pools (`runtime/hicache_prefetch.py`; docs/hicache.md "What an
L3 hit costs"): the SGLang internals `V41CacheController` overrides are still where it expects them;
its batched KV page read puts the same bytes in the same host slots as SGLang's generic page read,
through SGLang's real `HiCacheFile`, keeps SGLang's completion rules (leading pages only, nothing
after a stop), and reads a backend that returns its own tensors; the host pool's many-page write
equals its one-page write and refuses what is not whole pages; a prefetch's timeline line; the
scheduler's wait while only a prefetch is in flight (`runtime/hicache_idle.py`). No server (the real-server check is in tests/test_runtime_hicache_storage_server.py)."""
from __future__ import annotations

import inspect
import logging
import time
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController, PrefetchOperation

from sglang_dsv41.hooks import resolve_target
from sglang_dsv41.runtime.hicache_faults import OVERRIDES as GUARD_OVERRIDES
from sglang_dsv41.runtime.hicache_faults import FaultLog, StorageFaultGuard
from sglang_dsv41.runtime.hicache_host import ComponentHostPool
from sglang_dsv41.runtime.hicache_prefetch import OVERRIDES, PrefetchTimeline, V41CacheController

PAGE, PAGES = 4, 6
WIDTHS = ((40, torch.uint8), (8, torch.bfloat16))          # latents + index keys: two buffers, two dtypes


@pytest.fixture(scope="module")
def runtime_hooks():
    from sglang_dsv41 import hooks

    return hooks.install_hooks(("runtime",))


def _host(size=8 * PAGES * PAGE):
    comp = SimpleNamespace(buffers=[torch.zeros(size + PAGE, w, dtype=d) for w, d in WIDTHS], size=size,
                           page_size=PAGE, layer_num=1, device="cpu", store_dtype=torch.uint8, start_layer=0,
                           end_layer=0, allocation_label="kv", layer_shard_enabled=False)
    host = ComponentHostPool(comp, ratio=1.0, host_size_gb=0.0, page_size=PAGE, label="kv")
    g = torch.Generator().manual_seed(0)
    for h in host.kv_buffer:
        h.view(torch.uint8).copy_(torch.randint(0, 256, h.view(torch.uint8).shape, dtype=torch.uint8, generator=g))
    return host


def _file_store(tmp_path, monkeypatch):
    monkeypatch.delenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", raising=False)
    cfg = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                               is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
                               model_name="tiny")
    return HiCacheFile(cfg, file_path=str(tmp_path))


def _controller(host, backend):
    ctl = object.__new__(V41CacheController)                  # no threads: only what the read path uses
    ctl.page_size, ctl.storage_backend, ctl.storage_faults = PAGE, backend, FaultLog("test", 0, 3600)
    ctl.mem_pool_host = SimpleNamespace(anchor_entry=SimpleNamespace(host_pool=host),
                                        get_dummy_flat_data_page=host.get_dummy_flat_data_page,
                                        set_from_flat_data_page=host.set_from_flat_data_page)
    return ctl


def _stored(host, store):
    """PAGES pages of host slots [0, PAGES·PAGE) written to `store`; their keys."""
    keys = [f"page{i}" for i in range(PAGES)]
    for i, k in enumerate(keys):
        assert store.set(k, host.get_data_page(i * PAGE))
    return keys


def _bytes(host, slots):
    return [h.view(torch.uint8)[slots].clone() for h in host.kv_buffer]


@pytest.mark.parametrize("name", sorted(OVERRIDES))
def test_each_override_still_exists_in_sglang_with_its_signature_and_caller(name):
    params, caller, text = OVERRIDES[name]
    owners = [c for c in V41CacheController.__mro__[2:] if name in c.__dict__]
    assert owners, f"SGLang no longer defines {name}: V41CacheController's override is dead code"
    assert tuple(inspect.signature(owners[0].__dict__[name]).parameters) == params, (
        f"{owners[0].__name__}.{name} changed its signature; re-check runtime/hicache_prefetch.py")
    assert text in inspect.getsource(resolve_target(caller)), f"{caller} no longer has {text!r}: the override would not run"


def test_every_override_is_in_a_table():
    ours = {n for n, v in V41CacheController.__dict__.items() if inspect.isfunction(v)}
    assert ours - set(GUARD_OVERRIDES) == set(OVERRIDES)
    assert set(OVERRIDES).isdisjoint(StorageFaultGuard.__dict__)


def test_the_batched_read_puts_the_same_bytes_as_sglangs_read(tmp_path, monkeypatch):
    host = _host()
    store = _file_store(tmp_path, monkeypatch)
    keys = _stored(host, store)
    ctl = _controller(host, store)
    for way, dst0 in ((HybridCacheController._generic_page_get, 2 * PAGES * PAGE),
                      (V41CacheController._generic_page_get, 4 * PAGES * PAGE)):
        dst = torch.arange(dst0, dst0 + PAGES * PAGE)
        op = PrefetchOperation("r", list(range(PAGES * PAGE)))
        way(ctl, op, keys, dst)
        assert op.completed_tokens == PAGES * PAGE
        for got, want in zip(_bytes(host, dst), _bytes(host, torch.arange(PAGES * PAGE))):
            assert torch.equal(got, want)


def test_a_missing_page_ends_the_batch_after_the_leading_pages(tmp_path, monkeypatch, caplog):
    host = _host()
    store = _file_store(tmp_path, monkeypatch)
    keys = _stored(host, store)
    keys[3] = "absent"
    ctl = _controller(host, store)
    dst = torch.arange(2 * PAGES * PAGE, 3 * PAGES * PAGE)
    untouched = _bytes(host, dst[3 * PAGE:])
    op = PrefetchOperation("r", list(range(PAGES * PAGE)))
    with caplog.at_level(logging.WARNING):
        ctl._generic_page_get(op, keys, dst)
    assert op.completed_tokens == 3 * PAGE and "failed to retrieve page absent" in caplog.text
    for got, want in zip(_bytes(host, dst[:3 * PAGE]), _bytes(host, torch.arange(3 * PAGE))):
        assert torch.equal(got, want)
    for got, want in zip(_bytes(host, dst[3 * PAGE:]), untouched):       # nothing after the miss is written
        assert torch.equal(got, want)


def test_a_stopped_prefetch_reads_nothing_and_completes_nothing(tmp_path, monkeypatch):
    host = _host()
    store = _file_store(tmp_path, monkeypatch)
    keys = _stored(host, store)
    ctl = _controller(host, store)
    dst = torch.arange(2 * PAGES * PAGE, 3 * PAGES * PAGE)
    before = _bytes(host, dst)
    op = PrefetchOperation("r", list(range(PAGES * PAGE)))
    op.mark_terminate()
    ctl._generic_page_get(op, keys, dst)
    assert op.completed_tokens == 0
    assert all(torch.equal(a, b) for a, b in zip(_bytes(host, dst), before))


def test_a_backend_that_returns_its_own_tensors_is_copied():
    host = _host()
    pages = {f"p{i}": host.get_data_page(i * PAGE).clone() for i in range(PAGES)}
    backend = SimpleNamespace(batch_get=lambda keys, targets: [pages[k].view(torch.int8) for k in keys])
    ctl = _controller(host, backend)
    dst = torch.arange(2 * PAGES * PAGE, 3 * PAGES * PAGE)
    op = PrefetchOperation("r", list(range(PAGES * PAGE)))
    ctl._generic_page_get(op, list(pages), dst)
    assert op.completed_tokens == PAGES * PAGE
    for i in range(PAGES):
        assert torch.equal(host.get_data_page(int(dst[i * PAGE])), pages[f"p{i}"])


def test_many_page_write_equals_one_page_writes_and_refuses_partial_pages():
    a, b = _host(), _host()
    src = torch.stack([a.get_data_page(i * PAGE) for i in range(3)])
    slots = torch.tensor([[20, 21, 22, 23], [8, 9, 10, 11], [40, 41, 42, 43]]).reshape(-1)
    a.set_from_flat_data_pages(slots, src)
    for i, start in enumerate((20, 8, 40)):
        b.set_from_flat_data_page(start, src[i])
    for ha, hb in zip(a.kv_buffer, b.kv_buffer):
        assert torch.equal(ha.view(torch.uint8), hb.view(torch.uint8))
    for bad in (slots + 1, torch.tensor([20, 21, 23, 22, *slots[4:].tolist()]), slots[:-4]):
        with pytest.raises(ValueError, match="page-aligned runs"):
            a.set_from_flat_data_pages(bad, src)
    with pytest.raises(ValueError, match="flat pages are"):
        a.set_from_flat_data_pages(slots, src[:, :-1])
    with pytest.raises(ValueError, match="outside the pool"):
        a.set_from_flat_data_pages(torch.arange(a.size, a.size + PAGE), src[:1])


def test_the_timeline_line_names_each_step():
    tl = PrefetchTimeline(issued=10.0, query=(10.001, 10.003), read=(10.008, 10.058), kv_pages=512,
                          kv_bytes=512 * 12288, kv_read_s=0.048, kv_batches=[(128, 0.012)] * 4, other_pages=1,
                          done=10.0585)
    assert tl.line("r1") == ("req=r1; pages kv=512 (6291456 B) other=1; queue 1.0 ms, query 2.0 ms; to read 5.0 ms, "
                             "read 50.0 ms (kv 48.0 ms in 4 batches, 94 us/page); to done 0.5 ms, total 58.5 ms")
    assert PrefetchTimeline(issued=1.0, done=1.25).line("r2") == "req=r2; pages kv=0 (0 B) other=0; to done 250.0 ms, total 250.0 ms"


def test_the_scheduler_waits_while_only_a_prefetch_is_in_flight(runtime_hooks, monkeypatch):
    """`Scheduler.on_idle` (hooked, runtime/hicache_idle.py): with a storage prefetch in flight and nothing
    else to do, or a backup to storage in flight (even fully idle), the loop waits on SGLang's idle poller
    instead of spinning; without either, a prefetch while fully idle, without storage or with the wait set
    to 0 it is left to SGLang; a bad setting is refused."""
    from sglang_dsv41.runtime import hicache_idle

    assert any(s.impl.endswith("hicache_idle:on_idle_hook") for s in runtime_hooks)   # installed and verified

    class Poller:
        def __init__(self) -> None:
            self.waits: list[float] = []

        def poll(self, ms: float) -> None:
            self.waits.append(ms)

    def sched(prefetches=("r",), backups=(), idle=False, storage=True, poller=True):
        return SimpleNamespace(enable_hicache_storage=storage, is_fully_idle=lambda: idle,
                               tree_cache=SimpleNamespace(ongoing_prefetch=dict.fromkeys(prefetches),
                                                          ongoing_backup=dict.fromkeys(backups)),
                               idle_sleeper=SimpleNamespace(poller=Poller()) if poller else None)

    waiting = sched()
    assert hicache_idle.on_idle_hook("x", waiting) == "x"
    assert waiting.idle_sleeper.poller.waits == [hicache_idle.WAIT_MS]
    for writing in (sched(prefetches=(), backups=(7,)), sched(prefetches=(), backups=(7,), idle=True)):
        hicache_idle.on_idle_hook(None, writing)                                       # a backup: idle or not
        assert writing.idle_sleeper.poller.waits == [hicache_idle.WAIT_MS]
    for other in (sched(prefetches=()), sched(idle=True), sched(storage=False), sched(backups=(7,), storage=False)):
        hicache_idle.on_idle_hook(None, other)
        assert other.idle_sleeper.poller.waits == []
    t0 = time.perf_counter()
    hicache_idle.on_idle_hook(None, sched(poller=False))
    assert time.perf_counter() - t0 >= hicache_idle.WAIT_MS / 1000 * 0.9              # no poller: a plain sleep
    monkeypatch.setenv(hicache_idle.ENV, "0")
    off = sched()
    hicache_idle.on_idle_hook(None, off)
    assert off.idle_sleeper.poller.waits == []
    for bad in ("-1", "soon", "nan"):
        monkeypatch.setenv(hicache_idle.ENV, bad)
        with pytest.raises(ValueError, match=hicache_idle.ENV):
            hicache_idle.wait_ms()

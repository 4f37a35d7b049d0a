"""Our Mooncake store L3 backend (`runtime/hicache_mooncake.py`) over an in-memory stand-in for
`MooncakeDistributedStore` (its batch_is_exist / get_batch / put_batch contract, as measured on the
installed wheel: a missing key reads as 0 bytes, an error is a negative code): flat pages of both
V4.1 host pools round trip byte for byte under keys that never collide across pools, layouts or
ranks; objects are exactly one page, never 0 bytes; SGLang's v2 hit policies; a store that is down
raises or fails pages; the flag resolution to SGLang's `dynamic` backend. The real store, a
restart and a master that goes down: tests/test_runtime_hicache_mooncake_server.py."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, PoolHitPolicy, PoolName, PoolTransfer

from sglang_dsv41.runtime import hicache_mooncake as hm
from test_runtime_hicache import PAGE, _Component, _host


class FakeMooncake:
    """`MooncakeDistributedStore`'s batch calls over a dict; `down` answers as a client whose master is gone."""

    def __init__(self):
        self.objects, self.puts, self.down = {}, 0, False

    def batch_is_exist(self, keys):
        return [-900] * len(keys) if self.down else [int(k in self.objects) for k in keys]

    def get_batch(self, keys):
        return [b"" if self.down else self.objects.get(k, b"") for k in keys]

    def put_batch(self, keys, values):
        if self.down:
            return -900
        for k, v in zip(keys, values):
            assert v.nbytes > 0, "a 0-byte object was written"
            self.objects[k] = bytes(v)
            self.puts += 1
        return 0


def _config(tp_rank=0, model="tiny", extra=None):
    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=2, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
                                model_name=model, extra_config=extra or {"master_server_address": "127.0.0.1:1"})


def _pools():
    full = _Component([(160, torch.uint8), (48, torch.bfloat16)], layers=1, label="full")
    swa = _Component([(96, torch.bfloat16)] * 3, layers=3, label="swa")
    return {PoolName.KV: (_host(full), full), PoolName.SWA: (_host(swa), swa)}


def _store(fake, pools, **kw):
    store = hm.MooncakeFlatStore(_config(**kw), store=fake)
    for name, (host, _) in pools.items():
        store.register_mem_host_pool_v2(host, name)
    return store


def test_pages_of_both_pools_round_trip_under_distinct_keys() -> None:
    fake, pools = FakeMooncake(), _pools()
    store = _store(fake, pools)
    written, read = {}, {}
    for name, (host, comp) in pools.items():
        written[name] = host.alloc(4)
        host.backup_from_device_all_layer(comp, written[name], torch.tensor([2, 3, 14, 15]), "direct")
        read[name] = host.alloc(4)
    keys = ["page-a", "page-b"]
    ok = store.batch_set_v2([PoolTransfer(name=n, host_indices=written[n], keys=keys) for n in pools])
    assert ok == {PoolName.KV: [True, True], PoolName.SWA: [True, True]} and fake.puts == 4
    sizes = {k.split("/")[3]: len(v) for k, v in fake.objects.items()}
    assert sizes == {"kv": pools[PoolName.KV][0].page_bytes, "swa": pools[PoolName.SWA][0].page_bytes}
    assert all(k.startswith("dsv41/tiny/tp0of2/") for k in fake.objects)
    assert store.batch_set_v2([PoolTransfer(name=PoolName.KV, host_indices=written[PoolName.KV], keys=keys)]) \
        == {PoolName.KV: [True, True]} and fake.puts == 4        # stored pages are not written again
    ok = store.batch_get_v2([PoolTransfer(name=n, host_indices=read[n], keys=keys) for n in pools])
    assert ok == {PoolName.KV: [True, True], PoolName.SWA: [True, True]}
    for name, (host, _) in pools.items():
        for h in host.kv_buffer:
            assert torch.equal(h[read[name]].view(torch.uint8), h[written[name]].view(torch.uint8))
    # the same hashes from another rank, model or pool layout are other objects
    for other in (_store(fake, _pools(), tp_rank=1), _store(fake, _pools(), model="other")):
        assert other.batch_exists(keys) == 0
    wide = {PoolName.KV: (_host(_Component([(176, torch.uint8)], label="full")), None)}
    assert _store(fake, wide).batch_exists(keys) == 0
    assert store.batch_exists(keys) == 2


def test_v1_path_of_the_anchor_pool_and_object_sizes() -> None:
    fake, pools = FakeMooncake(), _pools()
    store = _store(fake, pools)
    host = pools[PoolName.KV][0]
    page = host.get_data_page(0)
    assert store.batch_set(["h1", "h2"], [page, page]) and store.exists("h1") and not store.exists("h3")
    got = store.batch_get(["h1", "h3"], [host.get_dummy_flat_data_page() for _ in range(2)])
    assert torch.equal(got[0], page) and got[1] is None
    with pytest.raises(ValueError, match="pages are"):             # a page of another size is never written
        store.set("h4", page[:-1])
    fake.objects[store.key(PoolName.KV, "h5")] = b"\0" * (host.page_bytes - 1)
    assert store.get("h5", host.get_dummy_flat_data_page()) is None   # nor read
    empty = SimpleNamespace(page_size=PAGE, get_dummy_flat_data_page=lambda: torch.zeros(0, dtype=torch.uint8))
    with pytest.raises(ValueError, match="0-byte pages"):
        store.register_mem_host_pool_v2(empty, PoolName.SWA)


@pytest.mark.parametrize("policy,swa_pages,expect", [
    (PoolHitPolicy.TRAILING_PAGES, [2], 3),          # the last page of the 3-page KV prefix: whole prefix
    (PoolHitPolicy.TRAILING_PAGES, [1], 2),          # only page 1: the prefix ending there
    (PoolHitPolicy.TRAILING_PAGES, [], 0),
    (PoolHitPolicy.ALL_PAGES, [0, 1], 2),
])
def test_hit_policies(policy, swa_pages, expect) -> None:
    fake, pools = FakeMooncake(), _pools()
    store = _store(fake, pools)
    keys = ["a", "b", "c", "d"]
    for k in keys[:3]:
        fake.objects[store.key(PoolName.KV, k)] = b"x"
    for i in swa_pages:
        fake.objects[store.key(PoolName.SWA, keys[i])] = b"x"
    result = store.batch_exists_v2(keys, [PoolTransfer(name=PoolName.SWA, keys=["d"], hit_policy=policy)])
    assert result.kv_hit_pages == expect
    assert result.extra_pool_hit_pages.get(PoolName.KV) == 3


def test_a_store_that_is_down_raises_queries_and_fails_reads_and_writes() -> None:
    fake, pools = FakeMooncake(), _pools()
    store = _store(fake, pools)
    host = pools[PoolName.KV][0]
    store.set("h1", host.get_data_page(0))
    fake.down = True
    with pytest.raises(hm.MooncakeStoreError):
        store.batch_exists_v2(["h1"], [])
    assert store.batch_get(["h1"], [host.get_dummy_flat_data_page()]) == [None]
    with pytest.raises(hm.MooncakeStoreError):
        store.batch_set(["h2"], [host.get_data_page(0)])


def test_settings_and_the_flag_resolution(monkeypatch) -> None:
    from sglang_dsv41.runtime.hicache_stack import check_hicache_flags, resolve_storage_backend

    monkeypatch.delenv("MOONCAKE_MASTER", raising=False)
    with pytest.raises(ValueError, match="MOONCAKE_MASTER"):
        hm.mooncake_settings({})
    monkeypatch.setenv("MOONCAKE_MASTER", "10.0.0.5:50051")
    s = hm.mooncake_settings({"global_segment_size": "1024"})
    assert s["metadata_server"] == "http://10.0.0.5:8080/metadata" and s["protocol"] == "tcp"
    assert s["global_segment_size"] == 1024

    args = SimpleNamespace(enable_hierarchical_cache=True, hicache_storage_backend="mooncake",
                           hicache_storage_backend_extra_config=json.dumps({"prefetch_threshold": 16}),
                           hicache_io_backend="direct", hicache_write_policy="write_through")
    resolve_storage_backend(args)
    extra = json.loads(args.hicache_storage_backend_extra_config)
    assert args.hicache_storage_backend == "dynamic" and hm.is_ours(extra) and extra["prefetch_threshold"] == 16
    check_hicache_flags(args)
    resolve_storage_backend(args)                                   # idempotent
    assert json.loads(args.hicache_storage_backend_extra_config) == extra
    args.hicache_storage_backend_extra_config = json.dumps({"backend_name": "x", "module_path": "m", "class_name": "C"})
    with pytest.raises(RuntimeError, match="--hicache-storage-backend dynamic"):
        check_hicache_flags(args)
    monkeypatch.delenv("MOONCAKE_MASTER")
    args = SimpleNamespace(**{**vars(args), "hicache_storage_backend": "mooncake",
                              "hicache_storage_backend_extra_config": None})
    with pytest.raises(RuntimeError, match="--hicache-storage-backend mooncake: .*no master address"):
        resolve_storage_backend(args)

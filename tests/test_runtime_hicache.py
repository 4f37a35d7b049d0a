"""HiCache host pools of the V4.1 pool (`runtime/hicache_host.py`) and our stack strategy
(`runtime/hicache_stack.py`): page round trips device → host → device for every buffer of a
component (one buffer or several of different widths and dtypes, as the FULL component has after
the two-buffer split), per-layer loads touch only their layer, the flat-page API the file L3
backend uses, sizing, the strategy's selection ahead of SGLang's `_SwaStrategy`, and the start-up
refusals. The end-to-end server test is tests/test_runtime_hicache_server.py."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang_dsv41.config import DeepseekV41Config
from sglang_dsv41.presets import tiny_config_dict

TINY = DeepseekV41Config.from_dict(tiny_config_dict(1000)).text
PAGE = 2


class _Component:
    """A pool component as `kv_pool._RowsComponent` presents it (buffers, sizes, layers)."""

    def __init__(self, widths_dtypes, *, size=32, layers=1, label="test"):
        g = torch.Generator().manual_seed(len(widths_dtypes) + layers)
        self.buffers = []
        for w, d in widths_dtypes:
            raw = torch.randint(0, 256, (size + PAGE, w * torch.empty(0, dtype=d).element_size()),
                                dtype=torch.uint8, generator=g)
            self.buffers.append(raw.view(d) if d != torch.uint8 else raw)
        self.size, self.page_size, self.layer_num, self.device = size, PAGE, layers, "cpu"
        self.store_dtype, self.start_layer, self.end_layer = widths_dtypes[0][1], 0, layers - 1
        self.allocation_label = label
        self.layer_shard_enabled = False


def _host(component, ratio=2.0, size_gb=0.0):
    from sglang_dsv41.runtime.hicache_host import ComponentHostPool

    return ComponentHostPool(component, ratio=ratio, host_size_gb=size_gb, page_size=PAGE, label="test")


COMPONENTS = {
    "global-rows": ([(176, torch.uint8)], 1),
    "two-buffers": ([(160, torch.uint8), (48, torch.bfloat16)], 1),      # latents + index keys
    "swa": ([(96, torch.bfloat16)] * 3, 3),
}


@pytest.mark.parametrize("io", ["kernel", "direct"])
@pytest.mark.parametrize("name", list(COMPONENTS))
def test_page_round_trip_device_host_device(name, io) -> None:
    buffers, layers = COMPONENTS[name]
    comp = _Component(buffers, layers=layers)
    host = _host(comp)
    assert host.layout == "layer_first" and host.size >= 2 * comp.size
    assert host.get_size_per_token() == sum(b[0].nbytes for b in comp.buffers)
    want = [b.clone() for b in comp.buffers]
    dev_slots = torch.tensor([6, 7, 2, 3, 20, 21])
    host_slots = host.alloc(len(dev_slots))
    assert host_slots is not None and len(host_slots) == 6
    host.backup_from_device_all_layer(comp, host_slots, dev_slots, io)
    for b in comp.buffers:
        b.zero_()
    new_slots = torch.tensor([10, 11, 30, 31, 4, 5])
    for layer in range(layers):
        host.load_to_device_per_layer(comp, host_slots, new_slots, layer, io)
    for b, w in zip(comp.buffers, want):
        assert torch.equal(b[new_slots].view(torch.uint8), w[dev_slots].view(torch.uint8))
        untouched = torch.ones(len(b), dtype=torch.bool)
        untouched[new_slots] = False
        assert not b[untouched].view(torch.uint8).any()
    assert host.free(host_slots) == 6


def test_per_layer_load_touches_only_that_layers_buffers() -> None:
    comp = _Component([(96, torch.bfloat16)] * 3, layers=3)
    host = _host(comp)
    slots = host.alloc(2)
    host.backup_from_device_all_layer(comp, slots, torch.tensor([4, 5]), "direct")
    for b in comp.buffers:
        b.zero_()
    host.load_to_device_per_layer(comp, slots, torch.tensor([8, 9]), 1, "direct")
    assert comp.buffers[1][8:10].any() and not comp.buffers[0].any() and not comp.buffers[2].any()


@pytest.mark.parametrize("name", list(COMPONENTS))
def test_flat_page_api(name) -> None:
    buffers, layers = COMPONENTS[name]
    comp = _Component(buffers, layers=layers)
    host = _host(comp)
    slots = host.alloc(4)
    host.backup_from_device_all_layer(comp, slots, torch.tensor([2, 3, 12, 13]), "direct")
    page = host.get_data_page(slots[2])
    assert page.dtype == torch.uint8 and page.numel() == host.page_bytes == PAGE * host.get_size_per_token()
    assert host.get_dummy_flat_data_page().shape == page.shape
    other = host.alloc(2)
    host.set_from_flat_data_page(other[0], page.clone())
    for h in host.kv_buffer:
        assert torch.equal(h[other].view(torch.uint8), h[slots[2:]].view(torch.uint8))
    expected = torch.cat([b[12:14].contiguous().view(torch.uint8).reshape(-1) for b in comp.buffers])
    assert torch.equal(page, expected)                       # buffer order, page rows contiguous
    with pytest.raises(ValueError, match="does not start a page"):
        host.get_data_page(int(slots[0]) + 1)
    with pytest.raises(ValueError, match="a page is"):
        host.set_from_flat_data_page(other[0], page[:-1])


@pytest.mark.parametrize("page", [2, 64])
@pytest.mark.parametrize("name", list(COMPONENTS))
def test_every_flat_page_is_its_rows_of_each_buffer_and_a_write_touches_only_its_page(name, page) -> None:
    """`get_data_page` (one byte slice per buffer) equals each buffer's rows of that page, buffer after
    buffer, for every page of the pool, at the default page and the storage page
    (`requirements.STORAGE_PAGE_SIZE`); `set_from_flat_data_page` changes exactly that page's rows."""
    from sglang_dsv41.runtime.hicache_host import ComponentHostPool

    buffers, layers = COMPONENTS[name]
    comp = _Component(buffers, layers=layers, size=4 * page)
    comp.page_size = page
    host = ComponentHostPool(comp, ratio=2.0, host_size_gb=0.0, page_size=page, label="test")
    g = torch.Generator().manual_seed(page)
    for h in host.kv_buffer:
        h.view(torch.uint8).copy_(torch.randint(0, 256, h.view(torch.uint8).shape, dtype=torch.uint8, generator=g))
    pages = range(0, host.size, page)
    assert host.size % page == 0 and len(pages) > 4
    for start in pages:
        want = torch.cat([h[start:start + page].contiguous().view(torch.uint8).reshape(-1) for h in host.kv_buffer])
        got = host.get_data_page(torch.tensor(start))
        assert torch.equal(got, want) and got.numel() == host.page_bytes
        assert torch.equal(host.get_data_page(start, flat=False), want.reshape(page, -1))
    before = [h.view(torch.uint8).clone() for h in host.kv_buffer]
    new = torch.randint(0, 256, (host.page_bytes,), dtype=torch.uint8, generator=g)
    host.set_from_flat_data_page(2 * page, new)
    assert torch.equal(host.get_data_page(2 * page), new)
    for h, old in zip(host.kv_buffer, before):
        h = h.view(torch.uint8)                        # bytes (random bf16 bytes hold NaNs)
        assert torch.equal(h[:2 * page], old[:2 * page]) and torch.equal(h[3 * page:], old[3 * page:])
    with pytest.raises(ValueError, match="outside the pool"):
        host.get_data_page(host.size)


def test_both_host_pools_get_the_same_slot_count() -> None:
    """Equal slot counts (hicache_stack "Sizing"): by ratio of the FULL device slots, or by GB over
    one token's bytes of both components; exact through SGLang's GB → slots rounding."""
    from sglang_dsv41.runtime.hicache_stack import _gb_for, host_slots

    full = _Component([(176, torch.uint8)], size=64)
    swa = _Component([(96, torch.bfloat16)] * 3, size=16, layers=3)
    assert host_slots(SimpleNamespace(hicache_size=0, hicache_ratio=3.0), full, swa) == 192
    per_token = 176 + 3 * 96 * 2
    assert host_slots(SimpleNamespace(hicache_size=per_token * 100 / 1e9, hicache_ratio=2.0), full, swa) == 100
    for slots in (100, 192, 12345):
        sizes = {_host(c, size_gb=_gb_for(slots, c)).size for c in (full, swa)}
        assert sizes == {slots // PAGE * PAGE + PAGE}                 # SGLang adds one page
    with pytest.raises(RuntimeError, match="--hicache-size or --hicache-ratio"):
        host_slots(SimpleNamespace(hicache_size=0, hicache_ratio=0.01), full, swa)


def test_bad_io_backend_and_component_shapes_are_errors() -> None:
    from sglang_dsv41.runtime.hicache_host import buffers_by_layer

    comp = _Component([(176, torch.uint8)])
    host = _host(comp)
    with pytest.raises(ValueError, match="kernel_ascend"):
        host.load_to_device_per_layer(comp, host.alloc(2), torch.tensor([2, 3]), 0, "kernel_ascend")
    with pytest.raises(ValueError, match="2 host slots for 4 device slots"):
        host.backup_from_device_all_layer(comp, host.alloc(2), torch.tensor([2, 3, 4, 5]), "direct")
    assert buffers_by_layer(_Component([(8, torch.uint8)] * 2, layers=1)) == [[0, 1]]
    with pytest.raises(ValueError, match="3 buffers for 2 layers"):
        buffers_by_layer(_Component([(8, torch.uint8)] * 3, layers=2))
    with pytest.raises(NotImplementedError, match="--hicache-storage-backend file"):
        host.get_page_buffer_meta(torch.tensor([0, 1]))


def test_the_v41_pool_components_are_mirrored_buffer_for_buffer() -> None:
    from sglang_dsv41.runtime.kv_pool import DeepseekV41KVPool

    pool = DeepseekV41KVPool(TINY, size=64, size_swa=32, page_size=PAGE, num_req_rows=3, device="cpu")
    full, swa = _host(pool.full_kv_pool), _host(pool.swa_kv_pool)
    assert [h.shape[1:] for h in full.kv_buffer] == [b.shape[1:] for b in pool.full_kv_pool.buffers]
    assert full.buffers_of_layer == [list(range(len(pool.full_kv_pool.buffers)))]
    assert swa.buffers_of_layer == [[l] for l in range(TINY.num_hidden_layers)]
    assert [h.dtype for h in swa.kv_buffer] == [torch.bfloat16] * TINY.num_hidden_layers
    comp = pool.full_kv_pool
    for b in comp.buffers:
        b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8).view(b.dtype))
    want = [b[[4, 5]].clone() for b in comp.buffers]
    slots = full.alloc(2)
    full.backup_from_device_all_layer(comp, slots, torch.tensor([4, 5]), "kernel")
    full.load_to_device_per_layer(comp, slots, torch.tensor([8, 9]), 0, "kernel")
    assert all(torch.equal(b[[8, 9]], w) for b, w in zip(comp.buffers, want))


# ---- the strategy -------------------------------------------------------------------------------

def test_our_strategy_is_selected_for_our_pool_ahead_of_sglangs() -> None:
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import _STRATEGIES, _SwaStrategy, _select_strategy
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    from sglang_dsv41.runtime import hicache_stack
    from sglang_dsv41.runtime.kv_pool import DeepseekV41KVPool

    hicache_stack.register()
    hicache_stack.register()                                  # idempotent
    ours = [s for s in _STRATEGIES if isinstance(s, hicache_stack.DeepseekV41StackStrategy)]
    assert len(ours) == 1 and _STRATEGIES.index(ours[0]) < min(
        i for i, s in enumerate(_STRATEGIES) if isinstance(s, _SwaStrategy))
    pool = DeepseekV41KVPool(TINY, size=64, size_swa=32, page_size=PAGE, num_req_rows=3, device="cpu")
    both = {ComponentType.FULL, ComponentType.SWA}
    assert isinstance(_select_strategy(pool, both), hicache_stack.DeepseekV41StackStrategy)
    assert not ours[0].matches(pool, {ComponentType.FULL})
    assert not ours[0].matches(SimpleNamespace(), both)


@pytest.mark.parametrize("over,flag", [
    (dict(hicache_storage_backend="hf3fs"), "--hicache-storage-backend hf3fs"),
    (dict(hicache_storage_backend="nixl"), "--hicache-storage-backend nixl"),
    (dict(hicache_storage_backend="dynamic"), "--hicache-storage-backend dynamic"),
    (dict(hicache_io_backend="kernel_ascend"), "--hicache-io-backend kernel_ascend"),
    (dict(hicache_write_policy="write_back"), "--hicache-write-policy write_back"),
    (dict(hicache_write_policy="write_through_selective"), "--hicache-write-policy write_through_selective"),
    (dict(disaggregation_decode_enable_offload_kvcache=True), "--disaggregation-decode-enable-offload-kvcache"),
])
def test_unsupported_hicache_settings_are_refused_naming_the_flag(over, flag) -> None:
    from sglang_dsv41.runtime.hicache_stack import check_hicache_flags

    args = SimpleNamespace(enable_hierarchical_cache=True, hicache_storage_backend=None, hicache_io_backend="kernel",
                           hicache_write_policy="write_through")
    check_hicache_flags(args)                                   # L2 alone: served
    check_hicache_flags(SimpleNamespace(**{**vars(args), "hicache_storage_backend": "file"}))   # L3 file: served
    with pytest.raises(RuntimeError, match=flag):
        check_hicache_flags(SimpleNamespace(**{**vars(args), **over}))


def test_pages_round_trip_through_sglangs_file_backend(tmp_path, monkeypatch) -> None:
    """The L3 `file` backend (SGLang's `HiCacheFile`, v2 per-pool API) writes our flat pages of
    both pools and reads them back into other host slots byte for byte."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig, PoolName, PoolTransfer

    monkeypatch.delenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", raising=False)
    full = _Component([(160, torch.uint8), (48, torch.bfloat16)], layers=1, label="full")
    swa = _Component([(96, torch.bfloat16)] * 3, layers=3, label="swa")
    hosts = {PoolName.KV: (_host(full), full), PoolName.SWA: (_host(swa), swa)}
    config = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                  is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
                                  model_name="tiny")
    store = HiCacheFile(config, file_path=str(tmp_path))
    written, read = {}, {}
    for name, (host, comp) in hosts.items():
        store.register_mem_host_pool_v2(host, name)
        written[name] = host.alloc(4)
        host.backup_from_device_all_layer(comp, written[name], torch.tensor([2, 3, 14, 15]), "direct")
        read[name] = host.alloc(4)
    keys = ["page-a", "page-b"]
    ok = store.batch_set_v2([PoolTransfer(name=n, host_indices=written[n], keys=keys) for n in hosts])
    assert ok == {PoolName.KV: [True, True], PoolName.SWA: [True, True]}
    assert len(list(tmp_path.iterdir())) == 4
    ok = store.batch_get_v2([PoolTransfer(name=n, host_indices=read[n], keys=keys) for n in hosts])
    assert ok == {PoolName.KV: [True, True], PoolName.SWA: [True, True]}
    for name, (host, _) in hosts.items():
        for h in host.kv_buffer:
            assert torch.equal(h[read[name]].view(torch.uint8), h[written[name]].view(torch.uint8))
    missing = store.batch_get_v2([PoolTransfer(name=PoolName.KV, host_indices=read[PoolName.KV][:2], keys=["none"])])
    assert missing == {PoolName.KV: [False]}


def test_a_full_file_store_fails_writes_and_each_failure_is_counted_and_warned(tmp_path, monkeypatch, caplog) -> None:
    """Storage full (runtime/hicache_faults.py): SGLang's `HiCacheFile` refuses every write when the
    filesystem would fall below its `min_free_space` (here: more than any disk), `batch_set_v2`
    returns False per page; the guard counts the operation's unwritten pages, and its warning is
    rate-limited per op (one line, then a count)."""
    import logging

    from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig, PoolName, PoolTransfer
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import StorageOperation

    from sglang_dsv41.runtime.hicache_faults import FaultLog, _short_pages

    monkeypatch.delenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", raising=False)
    full = _Component([(160, torch.uint8), (48, torch.bfloat16)], layers=1, label="full")
    swa = _Component([(96, torch.bfloat16)] * 3, layers=3, label="swa")
    config = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                  is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
                                  model_name="tiny", extra_config={"min_free_space": 10 ** 18})
    store = HiCacheFile(config, file_path=str(tmp_path))
    hosts = {PoolName.KV: _host(full), PoolName.SWA: _host(swa)}
    for name, host in hosts.items():
        store.register_mem_host_pool_v2(host, name)
    keys = ["page-a", "page-b"]
    transfers = [PoolTransfer(name=n, host_indices=h.alloc(4), keys=keys) for n, h in hosts.items()]
    results = store.batch_set_v2(transfers)
    assert results == {PoolName.KV: [False, False], PoolName.SWA: [False, False]} and not list(tmp_path.iterdir())

    op = StorageOperation(transfers[0].host_indices, list(range(4)), hash_value=keys, pool_transfers=transfers[1:])
    op.pool_storage_result.update_extra_pool_hit_pages({PoolName.SWA: results[PoolName.SWA]})
    assert _short_pages(op, PAGE) == 2                       # nothing of KV or SWA was written
    op.completed_tokens = 2 * PAGE
    op.pool_storage_result.update_extra_pool_hit_pages({PoolName.SWA: [True, False]})
    assert _short_pages(op, PAGE) == 1                       # KV written, one SWA page not
    op.pool_storage_result.update_extra_pool_hit_pages({PoolName.SWA: [True, True]})
    assert _short_pages(op, PAGE) == 0

    log = FaultLog("file", tp_rank=0, every_s=3600)
    with caplog.at_level(logging.WARNING, logger="sglang_dsv41.runtime.hicache_faults"):
        for _ in range(3):
            log.record("write", "2 of 2 pages not written")
        log.record("query", "NotADirectoryError: x")
    lines = [r.getMessage() for r in caplog.records if r.name == "sglang_dsv41.runtime.hicache_faults"]
    assert log.counts == {"query": 1, "read": 0, "write": 3}
    assert len(lines) == 2 and "storage write failed on the file backend (1 since the last warning)" in lines[0]
    assert "storage query failed" in lines[1] and "down or full" in lines[1]

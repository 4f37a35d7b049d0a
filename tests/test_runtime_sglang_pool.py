"""The V4.1 KV pool (`runtime/kv_pool.py`) and how SGLang sizes and builds it
(`runtime/sglang_pool.py`): buffers described as they are (no zero width, rows of a multiple of
16 B, ≤ 896 B/token of global KV at Flash), SGLang's own SWA allocator over it, the pair ring's
indexing, the per-layer load wait before every read, and the two SGLang hooks' dispatch."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from sglang_dsv41.config import DeepseekV41Config
from sglang_dsv41.presets import flash_config_dict, tiny_config_dict
from sglang_dsv41.reference.ops import CacheProfile
from sglang_dsv41.runtime import kv_rows

FULL, SWA = 64, 32
TINY = DeepseekV41Config.from_dict(tiny_config_dict(1000)).text
FLASH = DeepseekV41Config.from_dict(flash_config_dict()).text


@pytest.fixture(scope="module")
def runtime_hooks():
    from sglang_dsv41 import hooks

    return hooks.install_hooks(("runtime",))     # CPU paged allocation (no Triton without a GPU)


def _pool(text, *, page_size: int = 2, rows: int = 5, pair_slots: int = 2):
    from sglang_dsv41.runtime.kv_pool import DeepseekV41KVPool

    return DeepseekV41KVPool(text, size=FULL, size_swa=SWA, page_size=page_size, num_req_rows=rows, device="cpu",
                             pair_slots=pair_slots)


def _allocator(pool, page_size: int = 2):
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator

    return SWATokenToKVPoolAllocator(FULL, SWA, page_size, torch.bfloat16, "cpu", pool, False)


# ---- buffer descriptions (PD registration, HiCache item sizes) ---------------------------------------

@pytest.mark.parametrize("text,lat_row,key_row,swa_row", [(FLASH, 720, 176, 1024), (TINY, 112, 80, 192)],
                         ids=["flash", "tiny"])
def test_buffers_are_described_as_they_are(text, lat_row, key_row, swa_row) -> None:
    pool = _pool(text)
    full = pool.get_contiguous_buf_infos()
    state = pool.get_state_buf_infos()
    request = pool.get_request_state_buf_infos()
    L = text.num_hidden_layers
    assert (len(full[0]), len(state[0])) == (2, L)                          # latent rows, index-key rows
    assert full[2] == [2 * lat_row, 2 * key_row] and state[2] == [2 * swa_row] * L   # one page = page_size rows
    assert full[1] == [(FULL + 2) * lat_row, (FULL + 2) * key_row] and state[1] == [(SWA + 2) * swa_row] * L
    for ptrs, lens, items in (full, state, request):
        assert all(p for p in ptrs) and len(set(ptrs)) == len(ptrs)
        assert all(n > 0 for n in lens) and all(i > 0 and i % 16 == 0 for i in items)   # no zero width
    for infos in (full, state, request):                                    # PD's non-MLA K/V halving
        assert len(infos[0]) % 2 == 0 and len(infos[1]) == len(infos[2]) == len(infos[0])
    row = lat_row + key_row
    assert pool.full_kv_pool.token_bytes == row == kv_rows.text_row_stride_bytes(text)
    assert (kv_rows.text_latent_row_stride_bytes(text), kv_rows.text_key_row_stride_bytes(text)) == (lat_row, key_row)
    assert pool.swa_kv_pool.token_bytes == L * swa_row
    ratio2 = sum(text.compress_ratios[s] == 2 for s in text.kv_source_layer_ids)
    assert request[2] == [2 * text.head_dim * 4] * (2 * ratio2)               # a request row: ring × D fp32
    k, v = pool.get_kv_size_bytes()
    assert k == (FULL + 2) * row + L * (SWA + 2) * swa_row and v == pool.request_state_bytes() > 0


def test_global_rows_are_two_buffers_pd_halves_into_latents_and_keys() -> None:
    """Fails if the global rows are merged back into one buffer: SGLang's non-MLA PD path
    (`get_mha_kv_ptrs_with_pp`) splits the kv_data pointer list into a K half and a V half, so
    one buffer would be dropped (odd count) or sent as a zero-size V. K half = latent rows, V half
    = index-key rows, each its own allocation, both behind pool layer 0 (`_wait_for_layer(0)`)."""
    pool = _pool(TINY)
    ptrs, lens, items = pool.get_contiguous_buf_infos()
    half = len(ptrs) // 2
    assert len(ptrs) == 2 * half == 2
    lat, key = pool.full_kv_pool.latent_rows, pool.full_kv_pool.key_rows
    assert ptrs[:half] == [lat.data_ptr()] and ptrs[half:] == [key.data_ptr()]
    assert lat.untyped_storage().data_ptr() != key.untyped_storage().data_ptr()
    assert not (lat.data_ptr() <= key.data_ptr() < lat.data_ptr() + lat.nbytes)
    assert items[:half] == [2 * pool.layout.latent_row_stride] and items[half:] == [2 * pool.layout.key_row_stride]
    assert pool.get_key_buffer(0) is lat and pool.get_value_buffer(0) is key
    caches = pool.runtime_caches
    assert caches.latent_rows is lat and caches.key_rows is key
    with pytest.raises(IndexError, match="one pool layer"):
        pool.full_kv_pool.get_key_buffer(1)


def test_flash_global_kv_is_at_most_896_bytes_per_token() -> None:
    """The issue's bound: ≤ 896 B/token of global KV at Flash widths (upstream H200 ≈ 1,632)."""
    from sglang_dsv41.deploy.kv import kv_bytes_per_token, packed_row_bytes

    pool = _pool(FLASH)
    assert pool.layout.row_bytes == 890 and pool.full_kv_pool.token_bytes == 896 == packed_row_bytes(FLASH)
    assert pool.runtime_caches.global_bytes_per_token() == 896 < kv_bytes_per_token(FLASH, "v4")
    assert ("global KV 896 B/token = latent rows 720 B (720 B packed FP4) + index-key rows 176 B "
            "(170 B packed FP4)") in pool.describe()


def test_pool_layers_number_global_rows_then_swa_layers() -> None:
    from sglang_dsv41.runtime.kv_pool import transfer_layer_of_swa

    pool = _pool(TINY)
    assert pool.layers_mapping == {0: (0, False), **{1 + l: (l, True) for l in range(8)}}
    assert [transfer_layer_of_swa(l) for l in (0, 7)] == [1, 8]
    assert pool.get_key_buffer(0) is pool.full_kv_pool.latent_rows
    assert pool.get_value_buffer(0) is pool.full_kv_pool.key_rows
    assert pool.get_key_buffer(3) is pool.swa_kv_pool.buffers[2]
    with pytest.raises(NotImplementedError, match="no separate values"):
        pool.get_value_buffer(3)


def test_hicache_swa_strategy_recognises_the_pool() -> None:
    """HiCache's `_SwaStrategy` (the one a FULL + SWA unified radix tree gets) matches the pool and
    reads its layer mapping: global rows = transfer layer 0, SWA of model layer l = 1 + l."""
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import _SwaStrategy, _swa_layer_mappings
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    pool = _pool(TINY)
    assert _SwaStrategy().matches(pool, {ComponentType.FULL, ComponentType.SWA})
    full, swa = _swa_layer_mappings(pool)
    assert full == {0: 0} and swa == {1 + l: l for l in range(8)}


# ---- SGLang's allocator over the pool -------------------------------------------------------------

def test_caches_are_the_pools_buffers_and_sglangs_mapping(runtime_hooks) -> None:
    from sglang_dsv41.runtime.kv_pool import pool_caches

    pool = _pool(TINY)
    with pytest.raises(RuntimeError, match="no full → SWA slot mapping"):
        pool_caches(pool, CacheProfile.NONE)
    alloc = _allocator(pool)
    caches = pool_caches(pool, CacheProfile.NONE)
    assert caches is pool.runtime_caches and caches.latent_rows is pool.full_kv_pool.buffers[0]
    assert caches.key_rows is pool.full_kv_pool.buffers[1]
    assert caches.latent_rows.shape == (FULL + 2, 112) and caches.latent_rows.dtype == torch.uint8
    assert caches.key_rows.shape == (FULL + 2, 80) and caches.key_rows.dtype == torch.uint8
    assert all(a is b for a, b in zip(caches.swa, pool.swa_kv_pool.buffers))
    assert caches.swa_slot_of.data_ptr() == alloc.full_to_swa_index_mapping.data_ptr()
    zero = torch.tensor([0])
    full_slots = alloc.alloc_extend(zero, zero, torch.tensor([5]), torch.tensor([5]), torch.tensor([-1]), 5)
    swa_slots = caches.swa_slots(full_slots)
    assert torch.equal(swa_slots, alloc.full_to_swa_index_mapping[full_slots]) and bool((swa_slots > 0).all())
    caches.write_swa(3, full_slots, torch.ones(5, 96))
    assert bool((pool.swa_kv_pool.buffers[3][swa_slots] == 1).all())
    with pytest.raises(RuntimeError, match="profile"):
        pool_caches(pool, CacheProfile.FP4)
    with pytest.raises(RuntimeError, match="not the V4.1 pool"):
        pool_caches(pool.swa_kv_pool, CacheProfile.NONE)


def test_odd_page_size_is_refused() -> None:
    with pytest.raises(ValueError, match="page_size 3"):
        _pool(TINY, page_size=3)


# ---- the pair ring ----------------------------------------------------------------------------------

def test_pair_ring_slots_for_draft_tokens() -> None:
    assert [kv_rows.pair_ring_slots(d) for d in (0, 1, 2, 5, 6, 7)] == [2, 4, 4, 8, 8, 16]
    pool = _pool(TINY, pair_slots=kv_rows.pair_ring_slots(5))
    assert pool.runtime_caches.pair_kv[1].shape == (5, 8, 96)
    assert pool.get_request_state_buf_infos()[2][0] == 8 * 96 * 4
    with pytest.raises(ValueError, match="power of two"):
        _pool(TINY, pair_slots=3)


def test_pair_ring_is_indexed_by_request_row_and_position() -> None:
    caches = _pool(TINY, pair_slots=4).runtime_caches
    rows = torch.tensor([1, 2, 1])
    positions = torch.tensor([10, 10, 12])              # request 1 holds two pending pairs (draft tokens)
    kv = torch.arange(3, dtype=torch.float32)[:, None].expand(3, 96) + 1
    live = torch.ones(3, dtype=torch.bool)
    caches.store_pending_pairs(1, rows, positions, live, live, kv, -kv)
    assert caches.pair_slot(positions).tolist() == [1, 1, 2]            # ⌊p/2⌋ mod 4
    a, s, held = caches.pending_pair(1, torch.tensor([1, 1, 2, 3]), torch.tensor([10, 12, 10, 10]))
    assert held.tolist() == [10, 12, 10, -1]
    assert a[:, 0].tolist() == [1, 3, 2, 0] and torch.equal(s[:3], -a[:3])
    assert float(caches.pair_kv[1][1, 1, 0]) == 1 and float(caches.pair_kv[1][1, 2, 0]) == 3   # [row, slot, D]
    # a request ending on an odd position completes its pair: that slot is marked empty; a padding
    # (not live) request leaves its row untouched
    odd = torch.tensor([11])
    caches.store_pending_pairs(1, torch.tensor([1]), odd, torch.tensor([False]), torch.tensor([True]), kv[:1], kv[:1])
    caches.store_pending_pairs(1, torch.tensor([2]), odd, torch.tensor([False]), torch.tensor([False]), kv[:1], kv[:1])
    assert caches.pending_pair(1, torch.tensor([1, 2]), torch.tensor([10, 10]))[2].tolist() == [-1, 10]


# ---- the per-layer load wait -----------------------------------------------------------------------

class _Counter:
    """A stand-in for SGLang's LayerDoneCounter: records each wait in the shared event log."""

    def __init__(self, log: list) -> None:
        self.log = log

    def wait_until(self, layer: int) -> None:
        self.log.append(("wait", layer))


def test_forward_waits_for_each_layer_before_reading_its_rows(tiny_checkpoint: Path, monkeypatch) -> None:
    """A forward over the pool's caches with a fake transfer counter: for every model layer l, SGLang
    transfer layer 1 + l (its SWA rows) is waited for before those rows are touched, and transfer
    layer 0 (global rows) before any compressed entry is read or written."""
    from runtime_scenarios import Slots, run_batch, runtime_engine

    from sglang_dsv41.runtime.cache import RuntimeCaches

    engine = runtime_engine(tiny_checkpoint, torch.device("cpu"))
    cfg = engine.cfg.text
    slots = Slots(torch.device("cpu"))
    from sglang_dsv41.runtime.kv_pool import DeepseekV41KVPool

    n = slots.num_slots() - slots.page_size                     # + the padding page = the slot map's range
    pool = DeepseekV41KVPool(cfg, size=n, size_swa=n, page_size=slots.page_size, num_req_rows=slots.host.shape[0],
                             device="cpu")
    caches = pool.runtime_caches
    caches.bind_swa_mapping(torch.arange(caches.num_slots))     # identity, as stand-alone caches
    log: list = []
    pool.register_layer_transfer_counter(_Counter(log))
    write_swa, packed, write_values = RuntimeCaches.write_swa_rows, RuntimeCaches.packed, RuntimeCaches.write_values

    def spy(name, fn, layer_of):
        def wrapped(self, *args, **kwargs):
            log.append(("read", name, layer_of(*args)))
            return fn(self, *args, **kwargs)
        return wrapped

    monkeypatch.setattr(RuntimeCaches, "write_swa_rows", spy("swa", write_swa, lambda be, layer, *_: layer))
    monkeypatch.setattr(RuntimeCaches, "packed", spy("global", packed, lambda *_: None))
    monkeypatch.setattr(RuntimeCaches, "write_values", spy("global", write_values, lambda *_: None))
    run_batch(engine, caches, slots, [(1, 0, list(range(3, 20)))])
    waited: set = set()
    swa_reads = set()
    for event in log:
        if event[0] == "wait":
            waited.add(event[1])
        elif event[1] == "swa":
            assert 1 + event[2] in waited, f"layer {event[2]}'s SWA rows touched before wait_until({1 + event[2]})"
            swa_reads.add(event[2])
        else:
            assert 0 in waited, "global KV rows touched before wait_until(0)"
    assert swa_reads == set(range(cfg.num_hidden_layers))
    assert any(e[:2] == ("read", "global") for e in log)


# ---- SGLang's configurator and builder hooks --------------------------------------------------------

def _flash_model_config(tmp_path: Path):
    from sglang.srt.configs.model_config import ModelConfig

    (tmp_path / "config.json").write_text(json.dumps(flash_config_dict()))
    return ModelConfig(str(tmp_path))


def _kvc(model_config, **over):
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    kvc = dict(kv_cache_dtype_str="auto", model_config=model_config, kv_cache_dtype=torch.bfloat16,
               server_args=SimpleNamespace(swa_full_tokens_ratio=0.1, speculative_algorithm=None,
                                           speculative_num_draft_tokens=None),
               sliding_window_size=model_config.sliding_window_size, page_size=2, pool_page_size=2,
               spec_algorithm=SpeculativeAlgorithm.NONE, is_draft_worker=False, is_hybrid_swa=True,
               device="cpu")
    kvc.update(over)
    return SimpleNamespace(**kvc)


def test_sglang_sizes_the_flash_pool_with_896_byte_rows(tmp_path: Path, caplog) -> None:
    """The honest Flash config (40 SWA layers, one KV head of 512) through SGLang's ModelConfig, then
    the configurator hook: cell = 896 + 0.1 · 40 · 1024 B per full token; the log states 896."""
    from sglang.srt.model_executor import pool_configurator

    from sglang_dsv41 import hooks, plugin

    plugin.register_config()
    hooks.install_hooks(("runtime",))
    mc = _flash_model_config(tmp_path)
    assert mc.is_hybrid_swa and mc.num_hidden_layers == 40
    assert (mc.head_dim, mc.v_head_dim, mc.get_num_kv_heads(1)) == (512, 512, 1)
    assert mc.swa_attention_layer_ids == list(range(40)) and mc.full_attention_layer_ids == []
    with caplog.at_level("INFO"):
        conf = pool_configurator.create_memory_pool_configurator(_kvc(mc))
    assert "global KV 896 B/token = latent row 720 B + index-key row 176 B (890 B packed FP4" in caplog.text
    assert "request state (pair ring + Engram history) 24644 B per request row" in caplog.text
    assert conf._full_per_token == 896 and conf._cell_size == pytest.approx(896 + 0.1 * 40 * 1024)
    from sglang_dsv41.deploy import kv

    assert kv.pool_bytes_per_full_token(FLASH, 0.1) == pytest.approx(conf._cell_size)
    reserved = conf.request_state_bytes(int(10**9 // conf._cell_size))
    assert reserved == (2048 + 1) * (3 * 2 * (2 * 512 * 4 + 8) + 3 * 4 + 8)    # 2048..4096 rows: SGLang's rule
    sizes = conf.calculate_pool_sizes(10**9, page_size=2)
    assert sizes.full_max_total_num_tokens == int((10**9 - reserved) // conf._cell_size) // 2 * 2
    assert sizes.swa_max_total_num_tokens == int(sizes.full_max_total_num_tokens * 0.1) // 2 * 2
    with pytest.raises(RuntimeError, match="--kv-cache-dtype"):
        pool_configurator.create_memory_pool_configurator(_kvc(mc, kv_cache_dtype=torch.float8_e4m3fn))
    with pytest.raises(RuntimeError, match="--disable-hybrid-swa-memory"):
        pool_configurator.create_memory_pool_configurator(_kvc(mc, is_hybrid_swa=False))
    for flag, over in (("--hicache-storage-backend mooncake",
                        dict(enable_hierarchical_cache=True, hicache_storage_backend="mooncake")),
                       ("--disaggregation-transfer-backend nixl",
                        dict(disaggregation_mode="prefill", disaggregation_transfer_backend="nixl"))):
        args = SimpleNamespace(swa_full_tokens_ratio=0.1, speculative_algorithm=None, **over)
        with pytest.raises(RuntimeError, match=flag):
            pool_configurator.create_memory_pool_configurator(_kvc(mc, server_args=args))


def test_the_builder_hook_builds_our_pool_and_leaves_others_alone(tmp_path: Path) -> None:
    from sglang_dsv41.runtime.kv_pool import DeepseekV41KVPool
    from sglang_dsv41.runtime.sglang_pool import build_token_to_kv_pool_hook, memory_pool_configurator_hook

    from sglang_dsv41 import plugin

    plugin.register_config()
    (tmp_path / "config.json").write_text(json.dumps(tiny_config_dict(1000)))
    from sglang.srt.configs.model_config import ModelConfig

    kvc = _kvc(ModelConfig(str(tmp_path)), page_size=2,
               server_args=SimpleNamespace(swa_full_tokens_ratio=0.5, speculative_algorithm="DSPARK",
                                           speculative_num_draft_tokens=5))
    sizes = SimpleNamespace(full_max_total_num_tokens=FULL, swa_max_total_num_tokens=SWA)
    req_to_token = SimpleNamespace(req_to_token=torch.zeros(7, 16, dtype=torch.int32))
    never = lambda *a, **k: pytest.fail("SGLang's own builder ran for a V4.1 model")
    pool = build_token_to_kv_pool_hook(never, kvc, sizes=sizes, is_dsa_model=False, is_dsv4_model=False,
                                       req_to_token_pool=req_to_token)
    assert isinstance(pool, DeepseekV41KVPool) and (pool.size, pool.size_swa, pool.page_size) == (FULL, SWA, 2)
    assert pool.runtime_caches.num_req_rows == 7 and pool.runtime_caches.pair_ring_slots == 8
    with pytest.raises(RuntimeError, match="--page-size"):
        build_token_to_kv_pool_hook(never, _kvc(kvc.model_config, pool_page_size=3), sizes=sizes,
                                    is_dsa_model=False, is_dsv4_model=False, req_to_token_pool=req_to_token)
    other = SimpleNamespace(model_config=SimpleNamespace(hf_config=SimpleNamespace(architectures=["LlamaForCausalLM"])))
    assert build_token_to_kv_pool_hook(lambda self, **k: "stock", other, sizes=sizes) == "stock"
    assert memory_pool_configurator_hook(lambda kvc: "stock", other) == "stock"

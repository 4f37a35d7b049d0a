"""`runtime/sglang_pool.py`: the forward's caches ARE SGLang's hybrid-SWA pool (phase-2 contracts
§2–§4) — built here on CPU with SGLang's own `SWAKVPool` + `SWATokenToKVPoolAllocator` for the
tiny config, exactly as the server builds it (shapes from `runtime/hf_config.py`)."""
from __future__ import annotations

import pytest
import torch

from sglang_dsv41.config import DeepseekV41Config
from sglang_dsv41.presets import tiny_config_dict
from sglang_dsv41.runtime.hf_config import sglang_pool_attributes
from sglang_dsv41.runtime.sglang_pool import caches_from_sglang_pool, describe_sglang_pool

FULL, SWA = 64, 32


@pytest.fixture(scope="module")
def text():
    return DeepseekV41Config.from_dict(tiny_config_dict(1000)).text


@pytest.fixture(scope="module")
def runtime_hooks():
    from sglang_dsv41 import hooks

    return hooks.install_hooks(("runtime",))     # CPU paged allocation (no Triton without a GPU)


def _pool(text, *, page_size: int = 2, dtype=torch.bfloat16, compress: bool = True):
    """SGLang's SWAKVPool as `_build_hybrid_swa_kv_pool` builds it from our SGLang-visible config."""
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    a = sglang_pool_attributes(text)
    pattern = a["hybrid_layer_pattern"]
    extra = dict(swa_head_num=a["swa_num_key_value_heads"], swa_head_dim=a["swa_head_dim"],
                 swa_v_head_dim=a["swa_v_head_dim"], v_head_dim=a["v_head_dim"]) if compress else {}
    pool = SWAKVPool(size=FULL, size_swa=SWA, page_size=page_size, dtype=dtype, head_num=1, head_dim=a["head_dim"],
                     swa_attention_layer_ids=[i for i, p in enumerate(pattern) if p == 1],
                     full_attention_layer_ids=[i for i, p in enumerate(pattern) if p == 0], device="cpu", **extra)
    alloc = SWATokenToKVPoolAllocator(FULL, SWA, page_size, dtype, "cpu", pool, False)
    return pool, alloc


def test_caches_are_views_of_sglangs_buffers_and_mapping(text, runtime_hooks) -> None:
    pool, alloc = _pool(text)
    caches = caches_from_sglang_pool(pool, alloc, text, num_req_rows=5)
    # full pool: one layer of 88 bf16 = 176 B per token, read as uint8 rows of the packed layout
    assert caches.rows.dtype == torch.uint8 and tuple(caches.rows.shape) == (FULL + 2, 176)
    assert caches.rows.data_ptr() == pool.full_kv_pool.k_buffer[0].data_ptr()
    assert len(caches.swa) == text.num_hidden_layers == 8
    for l, buf in enumerate(caches.swa):
        assert tuple(buf.shape) == (SWA + 2, 96) and buf.data_ptr() == pool.swa_kv_pool.k_buffer[l].data_ptr()
    assert caches.global_bytes_per_token() == 176 and caches.swa_bytes_per_token() == 8 * 96 * 2
    assert tuple(caches.pair_kv[1].shape) == (5, 96) and tuple(caches.engram_history.ids.shape) == (5, text.engram_max_ngram_size - 1)
    # SGLang allocates 5 tokens of a fresh request: the full → SWA mapping we hold follows in place
    zero = torch.tensor([0])
    full_slots = alloc.alloc_extend(zero, zero, torch.tensor([5]), torch.tensor([5]), torch.tensor([-1]), 5)
    swa_slots = caches.swa_slots(full_slots)
    assert torch.equal(swa_slots, alloc.full_to_swa_index_mapping[full_slots]) and bool((swa_slots > 0).all())
    caches.write_swa(3, full_slots, torch.ones(5, 96))
    assert bool((pool.swa_kv_pool.k_buffer[3][swa_slots, 0] == 1).all())
    caches.rows[full_slots, :4] = 7
    assert bool((pool.full_kv_pool.k_buffer[0][full_slots].view(torch.uint8)[:, 0, :4] == 7).all())
    assert "176 B/token row" in describe_sglang_pool(pool) and "8 layers" in describe_sglang_pool(pool)


def test_mapping_from_the_pool_when_no_allocator_is_given(text) -> None:
    pool, alloc = _pool(text)
    caches = caches_from_sglang_pool(pool, None, text, num_req_rows=2)
    assert caches.swa_slot_of.data_ptr() == alloc.full_to_swa_index_mapping.data_ptr()


def test_odd_page_size_is_refused_naming_the_flag(text) -> None:
    pool, alloc = _pool(text, page_size=3)
    with pytest.raises(RuntimeError, match="--page-size"):
        caches_from_sglang_pool(pool, alloc, text, num_req_rows=2)


def test_wrong_pools_are_refused(text) -> None:
    pool, alloc = _pool(text, compress=False)       # no is_hybrid_swa_compress: SWA rows of the full width
    with pytest.raises(RuntimeError, match=r"SWA pool layer 0 has shape \(34, 1, 88\)"):
        caches_from_sglang_pool(pool, alloc, text, num_req_rows=2)
    pool, alloc = _pool(text, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="--kv-cache-dtype"):
        caches_from_sglang_pool(pool, alloc, text, num_req_rows=2)
    with pytest.raises(RuntimeError, match="SWAKVPool"):
        caches_from_sglang_pool(pool.full_kv_pool, alloc, text, num_req_rows=2)

"""The DSpark draft worker's pool (`runtime/dspark_pool.py`; docs/dspark.md "Draft pool"): its
buffers described as they are (stages × [full slots + page, D], no zero width), SGLang's allocator
mapping registered on it, the draft's rows addressed by full slot, and the target configurator
budgeting the draft's bytes per full token under DSPARK."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from sglang_dsv41.config import DeepseekV41Config
from sglang_dsv41.numerics.profile import CacheProfile
from sglang_dsv41.presets import flash_config_dict, tiny_config_dict

FULL, PAGE = 64, 2
TINY = DeepseekV41Config.from_dict(tiny_config_dict(1000)).text
FLASH = DeepseekV41Config.from_dict(flash_config_dict()).text


def _pool(text, size: int = FULL, page_size: int = PAGE):
    from sglang_dsv41.runtime.dspark_pool import DeepseekV41DSparkPool

    return DeepseekV41DSparkPool(text, size=size, page_size=page_size, device="cpu")


@pytest.mark.parametrize("text,stages,row", [(FLASH, 3, 1024), (TINY, None, None)], ids=["flash", "tiny"])
def test_draft_buffers_are_described_as_they_are(text, stages, row) -> None:
    from sglang_dsv41.runtime.dspark_pool import draft_bytes_per_token

    stages = stages or text.num_nextn_predict_layers
    row = row or text.head_dim * 2
    pool = _pool(text)
    ptrs, lens, items = pool.get_contiguous_buf_infos()
    assert len(ptrs) == stages == pool.layer_num and len(set(ptrs)) == stages and all(ptrs)
    assert lens == [(FULL + PAGE) * row] * stages and items == [PAGE * row] * stages    # no zero width
    assert all(b.shape == (FULL + PAGE, text.head_dim) and b.dtype == torch.bfloat16 for b in pool.buffers)
    assert pool.token_bytes == stages * row == draft_bytes_per_token(text)
    assert pool.get_kv_size_bytes() == (FULL + PAGE) * stages * row > 0
    assert pool.mem_usage == pytest.approx(pool.get_kv_size_bytes() / (1 << 30))
    assert pool.get_key_buffer(stages - 1) is pool.buffers[-1]
    with pytest.raises(IndexError):
        pool.get_key_buffer(stages)
    with pytest.raises(NotImplementedError, match="K = V"):
        pool.get_value_buffer(0)
    with pytest.raises(NotImplementedError, match="write_target_hidden_kv"):
        pool.set_kv_buffer(None, None, None, None)
    assert not hasattr(pool, "set_swa_key_buffer_radix_fused_norm_rope")     # SGLang takes the generic inject


def test_fp8_profile_stores_fp32_rows() -> None:
    from sglang_dsv41.runtime.dspark_pool import DeepseekV41DSparkPool, draft_bytes_per_token

    pool = DeepseekV41DSparkPool(TINY, size=FULL, page_size=PAGE, device="cpu", profile=CacheProfile.FP8)
    assert pool.buffers[0].dtype == torch.float32
    assert pool.token_bytes == draft_bytes_per_token(TINY, CacheProfile.FP8) == 2 * draft_bytes_per_token(TINY)


def test_draft_pool_refuses_a_checkpoint_without_stages_and_an_empty_pool() -> None:
    from dataclasses import replace

    with pytest.raises(ValueError, match="without DSpark stages"):
        _pool(replace(TINY, num_nextn_predict_layers=0))
    with pytest.raises(ValueError, match="0 full slots"):
        _pool(TINY, size=0)


def test_sglang_allocator_registers_its_mapping_and_rows_follow_full_slots() -> None:
    """SGLang's draft allocator path registers the shared allocator's full → SWA mapping on the draft
    pool; rows are written and read by full slot (`req_to_token`), the slot the target wrote."""
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator

    from sglang_dsv41.runtime.kv_pool import DeepseekV41KVPool

    target = DeepseekV41KVPool(TINY, size=FULL, size_swa=32, page_size=PAGE, num_req_rows=3, device="cpu",
                               pair_slots=8)
    alloc = SWATokenToKVPoolAllocator(FULL, 32, PAGE, torch.bfloat16, "cpu", target, False)
    draft = _pool(TINY)
    draft.register_mapping(alloc.full_to_swa_index_mapping)
    assert draft.full_to_swa_index_mapping is alloc.full_to_swa_index_mapping
    store = draft.dspark_context
    slots = torch.tensor([4, 5, 6, 7])
    values = torch.randn(4, TINY.head_dim).to(torch.bfloat16).float()
    store.write_rows(0, slots, values)
    req_to_token = torch.zeros(3, 16, dtype=torch.int32)
    req_to_token[1, :4] = slots.to(torch.int32)
    keys, valid = store.window(0, torch.tensor([1]), req_to_token, torch.tensor([4]), 6)
    assert valid.tolist() == [[False, False, True, True, True, True]]
    assert torch.equal(keys[0, 2:], values)


def _configurators(tmp_path: Path):
    """The target's configurator for Flash without speculation and under DSPARK (6 verify tokens)."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from sglang_dsv41 import plugin
    from sglang_dsv41.runtime.sglang_pool import memory_pool_configurator_hook

    plugin.register_config()
    (tmp_path / "config.json").write_text(json.dumps(flash_config_dict()))
    mc = ModelConfig(str(tmp_path))

    def conf(algo, tokens):
        kvc = SimpleNamespace(kv_cache_dtype_str="auto", model_config=mc, kv_cache_dtype=torch.bfloat16,
                              server_args=SimpleNamespace(swa_full_tokens_ratio=0.1, speculative_algorithm=algo,
                                                          speculative_num_draft_tokens=tokens),
                              sliding_window_size=mc.sliding_window_size, page_size=2, pool_page_size=2,
                              spec_algorithm=SpeculativeAlgorithm.NONE, is_draft_worker=False, is_hybrid_swa=True,
                              device="cpu")
        return memory_pool_configurator_hook(lambda k: pytest.fail("SGLang's configurator"), kvc)

    return conf(None, None), conf("DSPARK", 6)


def test_target_configurator_budgets_the_draft_rows(tmp_path: Path) -> None:
    """Under DSPARK the target's cell per full token grows by stages · D · 2 B (the draft pool is
    sized by the target's full-slot count); without speculation it does not."""
    from sglang_dsv41.runtime.dspark_pool import draft_bytes_per_token

    plain, spec = _configurators(tmp_path)
    assert spec._draft_per_token == draft_bytes_per_token(FLASH) == 3 * 512 * 2 and plain._draft_per_token == 0
    assert spec._cell_size == pytest.approx(plain._cell_size + 3072)
    assert spec._request_row_bytes > plain._request_row_bytes           # pair ring of 8 slots instead of 2


def test_planner_draft_row_equals_the_draft_pool_and_the_configurator(tmp_path: Path) -> None:
    """`sglang-dsv41 plan` sizes the draft context the runtime allocates: its draft row per full
    token == `DeepseekV41DSparkPool.token_bytes` (the buffers as built) == the configurator's
    `_draft_per_token`, its cell == the configurator's, its pair ring == the one the target pool
    builds for the verify width (Flash, h200-tp4-dspark.yaml; tiny: the pool's own rows)."""
    from sglang_dsv41.deploy.kv import draft_row_bytes
    from sglang_dsv41.deploy.plan import make_plan
    from sglang_dsv41.deploy.schema import load_config
    from sglang_dsv41.runtime.cache import RuntimeCaches

    plain, spec = _configurators(tmp_path)
    root = Path(__file__).resolve().parents[1]
    flash = DeepseekV41Config.from_dict(flash_config_dict())
    planned = make_plan(load_config(root / "configs" / "h200-tp4-dspark.yaml"), flash).pool
    unplanned = make_plan(load_config(root / "configs" / "h200-tp4.yaml"), flash).pool
    assert planned.draft_row_bytes == _pool(FLASH).token_bytes == spec._draft_per_token == 3072
    assert unplanned.draft_row_bytes == plain._draft_per_token == 0
    assert planned.cell_bytes == pytest.approx(spec._cell_size) and unplanned.cell_bytes == pytest.approx(plain._cell_size)
    assert planned.draft_tokens == 6 and planned.pair_state_per_request == RuntimeCaches.planned_request_state_bytes(FLASH, 6)
    assert draft_row_bytes(TINY, 6) == _pool(TINY).token_bytes and draft_row_bytes(TINY, 0) == 0

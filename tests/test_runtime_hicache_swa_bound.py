"""A HiCache load-back restores at most one window of SWA rows (`runtime/hicache_swa_bound.py`;
SGLang#31771), checked on SGLang's real unified radix tree over the V4.1 pool: host-only nodes
are built by hand, then SGLang's own LOAD_BACK transfer builder and commit run on them."""
from __future__ import annotations

import pytest
import torch

from sglang_dsv41.config import DeepseekV41Config
from sglang_dsv41.presets import tiny_config_dict

TINY = DeepseekV41Config.from_dict(tiny_config_dict(1000)).text
PAGE, WINDOW = 2, 8


def _tree(window: int = WINDOW):
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    from sglang_dsv41.runtime.kv_pool import DeepseekV41KVPool

    pool = DeepseekV41KVPool(TINY, size=128, size_swa=64, page_size=PAGE, num_req_rows=4, device="cpu")
    alloc = SWATokenToKVPoolAllocator(128, 64, PAGE, torch.bfloat16, "cpu", pool, False)
    params = CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc,
                             page_size=PAGE, sliding_window_size=window,
                             tree_components=(ComponentType.FULL, ComponentType.SWA))
    return UnifiedRadixCache(params).tree_core


def _chain(core, spec: list[tuple[int, str]]):
    """Nodes root → leaf of the given lengths, every one backed up to the host; where each node's
    rows are on the device: "host" (neither), "full" (global rows only: an SWA tombstone) or
    "both". Returns the nodes."""
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    nodes, parent, offset = [], core.root_node, 0
    for length, on_device in spec:
        rows = torch.arange(offset, offset + length)
        node = core._add_new_node(parent, RadixKey(list(range(offset + 1, offset + 1 + length))), rows)
        full, swa = node.component_data[ComponentType.FULL], node.component_data[ComponentType.SWA]
        full.host_value, swa.host_value = rows.clone(), rows.clone()
        full.value = None if on_device == "host" else rows.clone()
        swa.value = rows.clone() if on_device == "both" else None
        nodes.append(node)
        parent, offset = node, offset + length
    return nodes


def _swa_restored(core, node) -> int:
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    _, comp = core.build_load_back_spec(node.id)
    xfers = comp.get(ComponentType.SWA)
    return 0 if not xfers else xfers[0].host_indices.numel()


@pytest.mark.parametrize("spec,before", [
    ([(20, "host"), (4, "host")], 24),    # the ancestor's chunk is longer than the window still needs
    ([(40, "host")], 40),                 # one host-only node longer than the window
    # an SWA tombstone over a device chunk inside the window (counted, not reloaded) over the host-only leaf
    ([(30, "full"), (2, "both"), (2, "host")], 32),
])
def test_load_back_restores_at_most_one_window_of_swa(spec, before) -> None:
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    from sglang_dsv41.runtime.hicache_swa_bound import bound_swa_load_back, swa_restore_bound

    core = _tree()
    leaf = _chain(core, spec)[-1]
    assert _swa_restored(core, leaf) == before                  # SGLang alone restores whole chunks
    assert bound_swa_load_back(core, leaf.id) == []
    kv, comp = core.build_load_back_spec(leaf.id)
    swa = comp[ComponentType.SWA][0]
    device_on = sum(n for n, on in spec if on == "both")
    assert swa.host_indices.numel() == swa_restore_bound(WINDOW, PAGE) - device_on
    assert kv.host_indices.numel() == sum(n for n, on in spec if on == "host")   # every evicted global row loads
    if not device_on:                                              # ... the window's own rows
        total = sum(n for n, _ in spec)
        assert torch.equal(swa.host_indices, torch.arange(total - swa.host_indices.numel(), total))
    # SGLang's commit accepts the split nodes: the SWA rows land on the window's nodes only
    swa.device_indices = torch.arange(swa.host_indices.numel())
    actions = core.commit_load_back(leaf.id, torch.arange(kv.host_indices.numel()), kv, comp)
    (rebuild,) = actions
    assert sum(len(c) for c in rebuild.swa_indices) == swa.host_indices.numel()
    assert bound_swa_load_back(core, leaf.id) == []                 # loaded: nothing left to split


def test_a_chunk_within_the_window_is_not_split() -> None:
    from sglang_dsv41.runtime.hicache_swa_bound import bound_swa_load_back

    core = _tree()
    nodes = _chain(core, [(10, "host"), (8, "host")])
    count = len(core.root_node.children), len(nodes[0].children)
    assert bound_swa_load_back(core, nodes[-1].id) == [] and _swa_restored(core, nodes[-1]) == WINDOW
    assert (len(core.root_node.children), len(nodes[0].children)) == count and nodes[-1].parent is nodes[0]


@pytest.mark.parametrize("window,page,bound", [(8, 2, 8), (7, 2, 8), (128, 2, 128), (1, 4, 4)])
def test_swa_restore_bound_is_the_window_in_whole_pages(window, page, bound) -> None:
    from sglang_dsv41.runtime.hicache_swa_bound import swa_restore_bound

    assert swa_restore_bound(window, page) == bound


@pytest.mark.parametrize("ours", [True, False])
def test_the_load_back_hook_bounds_only_the_v41_trees_load_back(ours) -> None:
    """`load_back_hook` splits before SGLang's load_back when the tree's SWA host pool is ours,
    and leaves any other tree alone; it always calls SGLang's load_back."""
    from types import SimpleNamespace

    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    from sglang_dsv41.runtime.hicache_host import ComponentHostPool
    from sglang_dsv41.runtime.hicache_swa_bound import load_back_hook

    core = _tree()
    leaf = _chain(core, [(40, "host")])[-1]
    core.components_by_type[ComponentType.SWA]._swa_kv_pool_host = (
        object.__new__(ComponentHostPool) if ours else SimpleNamespace())
    calls = []
    cache = SimpleNamespace(cache_controller=object(), tree_core=core, _apply_cache_actions=calls.append)
    result = load_back_hook(lambda self, node_id, mem_quota, req=None: ("loaded", node_id, mem_quota, req),
                            cache, leaf.id, 7, req="r")
    assert result == ("loaded", leaf.id, 7, "r") and calls == []
    assert _swa_restored(core, leaf) == (WINDOW if ours else 40)

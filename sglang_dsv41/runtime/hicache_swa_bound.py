"""The SWA rows a HiCache load-back restores are bounded by the window (docs/hicache.md "SWA on
load-back"; spec integration.md §1.1 and §1.6, SGLang#31771).

SGLang 0.5.17's SWA component restores, on LOAD_BACK, the WHOLE host SWA chunk of each host-only
ancestor of the matched node until the chunks cover `sliding_window_size` tokens
(`SWAComponent.build_hicache_transfers`); its commit gives each restored node a device value of
exactly its node length. A node whose host SWA chunk is longer than what the window still needs
is therefore restored whole, which can exhaust the small SWA device pool.

`bound_swa_load_back` runs before SGLang's `UnifiedRadixCache.load_back` (hook
`load_back_hook`, hooks.py). It walks the same ancestors and, at the first host-only node whose
chunk would carry the restored rows past `swa_restore_bound(W, page)` = W rounded up to a page,
splits that node with SGLang's own `_split_node`: the upper part keeps its host SWA rows and
stays an SWA tombstone on the device (FULL rows load as before), the lower part holds exactly the
pages the window still needs. Invariant: a load-back restores at most `swa_restore_bound` SWA rows
(all of them host-only chunks below the split point), and every restored row is inside the window
of the matched prefix — the rows the forward reads.

The split happens before load_back takes its locks, the same state SGLang's own `match_prefix`
splits nodes in; a split of a node whose write-through is still pending is handed to the cache's
action queue, as `match_prefix` does. Only the V4.1 pool's tree is touched (its SWA host pool is
a `ComponentHostPool`).
"""
from __future__ import annotations

from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

from .hicache_host import ComponentHostPool


def swa_restore_bound(window: int, page: int) -> int:
    """The most SWA rows one load-back restores: the window, rounded up to whole pages."""
    return -(-window // page) * page


def _is_v41_tree(core) -> bool:
    swa = core.components_by_type.get(ComponentType.SWA)
    return swa is not None and isinstance(getattr(swa, "_swa_kv_pool_host", None), ComponentHostPool)


def bound_swa_load_back(core, node_id) -> list:
    """Split the host-only node that would carry a load-back of `node_id` past the SWA restore
    bound (module docstring). Returns the cache actions the split emitted (to be applied)."""
    swa = core.components_by_type[ComponentType.SWA]
    window, page = swa.sliding_window_size, core.page_size
    node, covered = core.node_by_id(node_id), 0
    while node is not core.root_node and covered < window:
        cd = node.component_data[ComponentType.SWA]
        if cd.value is not None:                         # on device: counts for the window, not restored
            covered += len(cd.value)
        else:
            length = len(cd.host_value)
            need = swa_restore_bound(window - covered, page)
            if length > need:
                _, action = core._split_node(node.key, node, length - need)
                return [action] if action is not None else []
            covered += length
        node = node.parent
    return []


def load_back_hook(original, self, node_id, mem_quota=None, req=None):
    """AROUND `UnifiedRadixCache.load_back`: bound the SWA rows it restores (module docstring)."""
    if self.cache_controller is not None and _is_v41_tree(self.tree_core):
        actions = bound_swa_load_back(self.tree_core, node_id)
        if actions:
            self._apply_cache_actions(actions)
    return original(self, node_id, mem_quota, req=req)

"""`DeepseekV41DSparkPool`: the KV pool of SGLang 0.5.17's DSpark draft worker for a V4.1
checkpoint (docs/dspark.md "Draft pool"; spec integration.md §3.1, §3.3).

SGLang's `DSparkWorkerV2` builds a second `TpModelWorker` for the draft; its
`KVCacheConfigurator` (`is_draft_worker`) reuses the target's `MemoryPoolConfig`, shares the
target's `req_to_token_pool` and `SWATokenToKVPoolAllocator`, and calls
`_build_token_to_kv_pool` — our hook (`runtime/sglang_pool.build_token_to_kv_pool_hook`) builds
this class there. It holds what the draft reads and nothing else:

| buffer | shape / dtype | indexed by |
|---|---|---|
| stage s context kv (`dspark_context.kv[s]`) | [S_full + page, D]; bf16 (cache profiles NONE / FP4, exact read-back), fp32 (FP8) | full slot (`req_to_token[req, pos]`) |

One row per target full slot, so a prefix hit, preemption or radix eviction frees and reuses a
draft row exactly when the target's slot (`runtime/dspark_kv.py`); S_full is the target's
`full_max_total_num_tokens`, and the target's configurator adds `draft_bytes_per_token` to its
per-token cell (`DeepseekV41PoolConfigurator`). The draft stages are SWA-only: no global KV rows,
no SWA ring of their own, no request state. SGLang's allocator registers its full → SWA mapping on
this pool too (`register_mapping`); the draft addresses rows by full slot and keeps it only for
SGLang's callers.

Not a `SWAKVPool` and without `set_swa_key_buffer_radix_fused_norm_rope`, so SGLang's injector
calls the draft model's generic `write_target_hidden_kv(target_hidden=, pool=, ...)`.
"""
from __future__ import annotations

import logging

from torch import Tensor

from sglang.srt.mem_cache.memory_pool import KVCache

from ..config import TextConfig
from ..numerics.profile import CacheProfile
from .dspark_kv import DSparkContextKV
from .kv_pool import RowBufferCopies
from .kv_rows import draft_context_row_bytes

logger = logging.getLogger(__name__)
GB = 1 << 30


def draft_stages(text: TextConfig) -> int:
    """DSpark stages of a checkpoint (one context kv row per stage and token)."""
    return int(text.num_nextn_predict_layers)


def draft_bytes_per_token(text: TextConfig, profile: CacheProfile = CacheProfile.NONE) -> int:
    """Draft context bytes per target full slot: stages · D · (2 bf16, 4 fp32 under FP8)."""
    return draft_context_row_bytes(draft_stages(text), text.head_dim, CacheProfile(profile) is CacheProfile.FP8)


class DeepseekV41DSparkPool(RowBufferCopies, KVCache):
    """The draft worker's pool (module doc): `dspark_context` is the store the draft model reads
    and `write_target_hidden_kv` fills; pool layer s = stage s's rows."""

    def __init__(self, text: TextConfig, *, size: int, page_size: int, device: str,
                 profile: CacheProfile = CacheProfile.NONE) -> None:
        stages = draft_stages(text)
        if stages < 1:
            raise ValueError("sglang-dsv41: a DSpark draft pool for a checkpoint without DSpark stages")
        if size < 1:
            raise ValueError(f"sglang-dsv41: DSpark draft pool of {size} full slots")
        self.dspark_context = DSparkContextKV(stages, size + page_size, text.head_dim, device, CacheProfile(profile))
        super().__init__(size, page_size, self.dspark_context.dtype, stages, device, False,
                         allocation_label="DSpark draft context")
        self.head_num, self.head_dim = 1, text.head_dim
        self.full_to_swa_index_mapping: Tensor | None = None
        self.mem_usage = self.dspark_context.bytes() / GB
        logger.info(self.describe())

    @property
    def buffers(self) -> list[Tensor]:
        return self.dspark_context.kv

    @property
    def token_bytes(self) -> int:
        """Bytes one full slot holds over every stage."""
        return sum(b[0].nbytes for b in self.buffers)

    def register_mapping(self, full_to_swa_index_mapping: Tensor) -> None:
        """SGLang's allocator hands its full → SWA mapping to every hybrid-SWA pool it serves."""
        self.full_to_swa_index_mapping = full_to_swa_index_mapping

    def get_kv_size_bytes(self) -> int:
        return self.dspark_context.bytes()

    def get_contiguous_buf_infos(self):
        """(pointers, byte lengths, bytes per page) of the stage buffers, slot-major."""
        return ([b.data_ptr() for b in self.buffers], [b.nbytes for b in self.buffers],
                [b[0].nbytes * self.page_size for b in self.buffers])

    def _stage(self, layer_id: int) -> Tensor:
        if not 0 <= layer_id < len(self.buffers):
            raise IndexError(f"sglang-dsv41 DSpark draft pool: stage {layer_id} of {len(self.buffers)}")
        return self.buffers[layer_id]

    def get_key_buffer(self, layer_id: int) -> Tensor:
        return self._stage(layer_id)

    def get_value_buffer(self, layer_id: int) -> Tensor:
        raise NotImplementedError("sglang-dsv41 DSpark draft pool: rows hold no separate values (K = V; "
                                  "read them with get_key_buffer)")

    def get_kv_buffer(self, layer_id: int):
        raise NotImplementedError("sglang-dsv41 DSpark draft pool: no K/V pair (K = V); use get_key_buffer")

    def set_kv_buffer(self, *args, **kwargs) -> None:
        raise NotImplementedError("sglang-dsv41: the DSpark draft writes its rows through write_target_hidden_kv, "
                                  "never through an attention backend's set_kv_buffer")

    def describe(self) -> str:
        c = self.dspark_context
        return (f"sglang-dsv41 DeepseekV41DSparkPool: {c.stages} stage(s) x {c.kv[0].shape[1]} {c.dtype} per full "
                f"slot = {self.token_bytes} B/token, {self.size} full slots + page {self.page_size}; "
                f"{self.mem_usage:.3f} GB")

"""How SGLang 0.5.17 sizes and builds the V4.1 pool (`runtime/kv_pool.DeepseekV41KVPool`; docs/runtime.md
"KV pool"; spec runtime.md §B "Memory-pool sizing" / "Memory-pool class").

The HF config is honest (`runtime/hf_config.py`: L layers, every one with sliding-window
attention, `is_hybrid_swa`), so SGLang takes its hybrid-SWA path — `SWATokenToKVPoolAllocator`,
the unified radix tree with FULL + SWA components — and two HookRegistry entries
(`sglang_dsv41.hooks`) replace what it would size and build from per-layer K/V head dims:

* `memory_pool_configurator_hook` — AROUND `create_memory_pool_configurator`: our
  `DeepseekV41PoolConfigurator` reserves the request-scoped state (pair ring + Engram history per
  request row, for as many rows as SGLang will allow), divides the rest of the KV budget by the
  cell latent + index-key row strides + ratio · L · D · 2 (Flash 720 + 176 + 0.1 · 40,960 B) and splits it into full and
  SWA tokens with SGLang's own solver;
  it logs the global KV bytes per token; under `--speculative-algorithm DSPARK` the cell also
  holds the draft's context rows (`dspark_pool.draft_bytes_per_token`, one row per stage and full
  slot). Refuses what the pool cannot be built for or serve yet
  (non-bf16 KV, no hybrid-SWA memory, unified memory, HiCache with DSpark, PD with DSpark on CPU, HiCache settings
  `runtime/hicache_stack.check_hicache_flags` refuses, a PD transfer backend other than mooncake).
* `build_token_to_kv_pool_hook` — AROUND `KVCacheConfigurator._build_token_to_kv_pool`: builds
  `DeepseekV41KVPool` from those sizes, SGLang's page size and its `req_to_token` rows (the pair
  ring has one row each), with ring slots for the speculative draft tokens. Refuses a KV dtype
  other than bf16 and a page size that is not a multiple of the largest compress ratio, at
  start-up, naming the flag. For SGLang's DSpark draft worker (`is_draft_worker`) it builds
  `dspark_pool.DeepseekV41DSparkPool` over the target's full-slot count instead.

Any other architecture goes to SGLang's own code unchanged.
"""
from __future__ import annotations

import logging

import torch

from sglang.srt.model_executor.pool_configurator import HybridSWAPoolConfigurator

from ..config import TextConfig
from .cache import RuntimeCaches
from .dspark_pool import draft_bytes_per_token
from .hf_config import ARCHITECTURE, DRAFT_ARCHITECTURE
from .kv_rows import (pair_ring_slots, text_key_row_stride_bytes, text_latent_row_stride_bytes, text_row_payload_bytes,
                      text_row_stride_bytes)

logger = logging.getLogger(__name__)
#: The only KV dtype the pool's SWA rows are (BF16 values, spec §3.8).
KV_DTYPE = torch.bfloat16


def _fail(what: str) -> RuntimeError:
    return RuntimeError(f"sglang-dsv41: {what}")


def v41_text_config(model_config) -> TextConfig | None:
    """Our parsed text config when SGLang's `ModelConfig` is a V4.1 checkpoint's (target or its DSpark
    draft, so the draft worker meets the same pool checks), else None."""
    hf = getattr(model_config, "hf_config", None)
    archs = getattr(hf, "architectures", None) or []
    if not archs or archs[0] not in (ARCHITECTURE, DRAFT_ARCHITECTURE) or not hasattr(hf, "parsed"):
        return None
    return hf.parsed().text


def check_pool_flags(kvc) -> None:
    """Start-up refusals for a configuration the pool cannot serve (each names the flag)."""
    if not kvc.is_hybrid_swa:
        raise _fail("the V4.1 pool is a hybrid-SWA pool: drop --disable-hybrid-swa-memory")
    if kvc.is_draft_worker or draft_tokens(kvc.server_args):
        if getattr(kvc.server_args, "enable_hierarchical_cache", False):
            raise _fail("--enable-hierarchical-cache with --speculative-algorithm DSPARK: the DSpark draft pool is "
                        "not wired into HiCache yet (docs/dspark.md)")
        device = str(getattr(kvc.server_args, "device", None) or getattr(kvc, "device", "cuda"))
        if getattr(kvc.server_args, "disaggregation_mode", "null") != "null" and device == "cpu":
            raise _fail("--disaggregation-mode with --speculative-algorithm DSPARK on cpu: SGLang 0.5.17's DSpark "
                        "worker runs on CUDA only; PD + DSpark (draft context rows in kv_data, docs/pd.md) is "
                        "served on GPU")
    if getattr(kvc.server_args, "enable_hierarchical_cache", False):
        from .hicache_stack import check_hicache_flags

        check_hicache_flags(kvc.server_args)          # HiCache itself is served (runtime/hicache_stack.py)
    if getattr(kvc.server_args, "disaggregation_mode", "null") != "null":
        backend = getattr(kvc.server_args, "disaggregation_transfer_backend", "mooncake")
        if backend != "mooncake":
            raise _fail(f"--disaggregation-transfer-backend {backend}: the V4.1 pool's PD transfer is built and "
                        "tested over mooncake only (docs/pd.md)")
    if getattr(kvc.server_args, "enable_unified_memory", False):
        raise _fail("--enable-unified-memory builds SGLang's own pools, not the V4.1 pool: drop the flag")
    if kvc.kv_cache_dtype != KV_DTYPE:
        raise _fail(f"--kv-cache-dtype resolves to {kvc.kv_cache_dtype}; the V4.1 pool stores BF16 SWA rows "
                    "and packed FP4 global rows: serve with --kv-cache-dtype auto (or bf16) and a bf16 model dtype")


def draft_tokens(server_args) -> int:
    """Draft tokens per decode step under speculative decoding (0 without)."""
    if getattr(server_args, "speculative_algorithm", None) is None:
        return 0
    return int(getattr(server_args, "speculative_num_draft_tokens", None) or 0)


class DeepseekV41PoolConfigurator(HybridSWAPoolConfigurator):
    """SGLang's hybrid-SWA sizing with the V4.1 pool's honest per-token bytes: a latent row and an
    index-key row of global KV per full token (`kv_rows.text_row_stride_bytes`), L bf16 SWA rows of D
    per SWA token, `--swa-full-tokens-ratio`
    SWA tokens per full token. The solver (`_solve_pool_sizes`) is SGLang's."""

    def __init__(self, kvc, text: TextConfig) -> None:
        check_pool_flags(kvc)
        self.kv_cache_dtype_str = kvc.kv_cache_dtype_str
        self._full_layers_num = 1
        self._swa_layers_num = text.num_hidden_layers
        self._full_per_token = text_row_stride_bytes(text)
        self._swa_per_token = text.head_dim * KV_DTYPE.itemsize
        self._draft_full_layers_num = self._draft_swa_full_layers_num = 0
        self._swa_full_tokens_ratio = kvc.server_args.swa_full_tokens_ratio
        self._sliding_window_size = kvc.sliding_window_size
        self._page_size = kvc.page_size
        #: DSpark draft context rows per full slot (0 without --speculative-algorithm)
        self._draft_per_token = draft_bytes_per_token(text) if draft_tokens(kvc.server_args) else 0
        self._cell_size = (self._full_per_token + self._draft_per_token
                           + self._swa_full_tokens_ratio * self._swa_per_token * self._swa_layers_num)
        self._request_row_bytes = (RuntimeCaches.planned_request_state_bytes(text, draft_tokens(kvc.server_args))
                                   + (text.engram_max_ngram_size - 1 + draft_tokens(kvc.server_args)) * 4 + 8)
        self._context_len = int(getattr(kvc.model_config, "context_len", 0) or 0)
        requested = getattr(kvc.server_args, "max_running_requests", None)
        dp = int(getattr(getattr(kvc, "ps", None), "attn_dp_size", 1) or 1)
        self._requested_requests = None if requested is None else int(requested) // dp
        logger.info("sglang-dsv41 KV pool sizing: global KV %d B/token = latent row %d B + index-key row %d B "
                    "(%d B packed FP4, each row padded to 16 B), "
                    "SWA %d B per SWA token, --swa-full-tokens-ratio %s: %.1f B per full token; request state "
                    "(pair ring + Engram history) %d B per request row, reserved first; DSpark draft context %d B "
                    "per full token",
                    self._full_per_token, text_latent_row_stride_bytes(text), text_key_row_stride_bytes(text),
                    text_row_payload_bytes(text), self._swa_per_token * self._swa_layers_num,
                    self._swa_full_tokens_ratio, self._cell_size, self._request_row_bytes, self._draft_per_token)

    def request_state_bytes(self, token_capacity: int) -> int:
        """Bytes of the request-scoped state for the request rows SGLang will allow at this token
        capacity (its `resolve_max_num_reqs` rule: the requested count, else 2048..4096 by context)."""
        reqs = self._requested_requests
        if reqs is None:
            estimated = int(token_capacity / self._context_len * 512) if self._context_len else 4096
            reqs = min(max(min(estimated, 4096), 2048), token_capacity // 2)
        return (reqs + 1) * self._request_row_bytes

    def calculate_pool_sizes(self, available_bytes: int, page_size: int):
        fixed = self.request_state_bytes(int(available_bytes // self._cell_size))
        return super().calculate_pool_sizes(max(available_bytes - fixed, 0), page_size)


def memory_pool_configurator_hook(original, kvc):
    """AROUND `create_memory_pool_configurator`: ours for a V4.1 model (module docstring)."""
    text = v41_text_config(kvc.model_config)
    if text is None:
        return original(kvc)
    return DeepseekV41PoolConfigurator(kvc, text)


def build_token_to_kv_pool_hook(original, self, *args, **kwargs):
    """AROUND `KVCacheConfigurator._build_token_to_kv_pool`: `DeepseekV41KVPool` for a V4.1 model."""
    text = v41_text_config(self.model_config)
    if text is None:
        return original(self, *args, **kwargs)
    from .kv_pool import DeepseekV41KVPool

    check_pool_flags(self)
    sizes, req_to_token_pool = kwargs["sizes"], kwargs["req_to_token_pool"]
    if self.is_draft_worker:
        from .dspark_pool import DeepseekV41DSparkPool

        return DeepseekV41DSparkPool(text, size=int(sizes.full_max_total_num_tokens),
                                     page_size=int(self.pool_page_size), device=self.device)
    try:
        return DeepseekV41KVPool(text, size=int(sizes.full_max_total_num_tokens),
                                 size_swa=int(sizes.swa_max_total_num_tokens), page_size=int(self.pool_page_size),
                                 num_req_rows=int(req_to_token_pool.req_to_token.shape[0]), device=self.device,
                                 pair_slots=pair_ring_slots(draft_tokens(self.server_args)),
                                 verify_width=draft_tokens(self.server_args))
    except ValueError as e:       # page size: name the flag
        raise _fail(f"{e} (--page-size)") from e

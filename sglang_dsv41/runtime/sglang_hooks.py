"""Implementations of the runtime area's HookRegistry entries (the table is `sglang_dsv41.hooks`).

The pool SGLang builds for a V4.1 model is its own hybrid-SWA `SWAKVPool` (phase-2 contracts
§2–§3, `runtime/hf_config.py`); these hooks make the stock code build and size it correctly:

* `derive_hybrid_model_hook` — AFTER `ModelConfig._derive_hybrid_model`: SGLang passes the SWA
  layers' own head dims (`swa_head_dim = D`, `swa_v_head_dim = 0`, `swa_num_key_value_heads`) and
  the full layer's `v_head_dim = 0` to `SWAKVPool` only when `is_hybrid_swa_compress` is set, and
  sets it from an architecture allow-list. Without the hook both pools would get the full layer's
  row width (ceil(row_bytes/2) elements) and K+V rows. Only our architecture is touched.
* `hybrid_swa_configurator_init_hook` — AFTER `HybridSWAPoolConfigurator.__init__`: SGLang
  budgets `head_dim·2` bytes per full token (the packed row, exactly our global KV) and
  `ratio × L × swa_head_dim·2` per full token for the SWA pool — the pool itself needs no
  correction. The torch path adds one int32 token id per **SWA slot** (Engram history,
  contracts §4), so the hook adds 4 B per SWA token to SGLang's per-token costs
  (`_swa_per_token`, spread over the SWA layers, and `_cell_size` at `swa_full_tokens_ratio`).
  Not counted per token, on purpose: the ratio-2 pair state (`pair_kv`/`pair_score`) is
  **request-scoped** — `num_req_rows × (#ratio-2 sources) × 2·D·4` bytes (Flash 12 KiB per
  request row), allocated like SGLang's own request-scoped `req_to_token` rows (context_len·4 B
  per row, 4 MiB at 1M context) from the memory outside the KV budget; it does not grow with
  tokens, so a per-token cell cannot express it.
* `paged_alloc_extend_hook` / `paged_alloc_decode_hook` — AROUND
  `PagedTokenToKVPoolAllocator.alloc_extend` / `alloc_decode`: the runtime needs an even
  `--page-size` (contracts §2), and SGLang's paged allocator computes the new slots with Triton
  kernels, which cannot run without a GPU (Triton finds no driver). On a CPU allocator the same
  slots are computed with torch (own implementation of the allocator's rule: fill the request's
  last partial page first, then whole new pages taken in order from the free list); CUDA
  allocators run SGLang's kernels unchanged.
"""
from __future__ import annotations

import torch

from .hf_config import ARCHITECTURE, MODEL_TYPE

#: Bytes the torch path keeps per SWA slot beside SGLang's pool: the int32 token id (contracts §4).
TOKEN_ID_BYTES_PER_SWA_SLOT = 4


def _is_v41(hf_config) -> bool:
    return getattr(hf_config, "model_type", None) == MODEL_TYPE and hasattr(hf_config, "parsed")


def derive_hybrid_model_hook(result, self) -> None:
    """Set `is_hybrid_swa_compress` for our architecture (asymmetric full/SWA pool rows)."""
    archs = getattr(self.hf_config, "architectures", None) or []
    if archs and archs[0] == ARCHITECTURE and _is_v41(self.hf_config):
        self.is_hybrid_swa_compress = True
    return result


def swa_slot_side_bytes(hf_config) -> int:
    """Bytes the torch path keeps per SWA slot beside SGLang's pool; 0 for any other model."""
    return TOKEN_ID_BYTES_PER_SWA_SLOT if _is_v41(hf_config) else 0


def hybrid_swa_configurator_init_hook(result, self, kvc) -> None:
    """Add the per-SWA-slot token id to SGLang's hybrid-SWA per-token costs (V4.1 only)."""
    extra = swa_slot_side_bytes(kvc.model_config.hf_config)
    if extra:
        self._swa_per_token += extra / self._swa_layers_num
        per_full_token = 1.0 if self._full_layers_num == 0 else self._swa_full_tokens_ratio
        self._cell_size += extra * per_full_token
    return result


def _on_cpu(allocator) -> bool:
    return torch.device(allocator.device).type == "cpu"


def _pages(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


def paged_alloc_extend_hook(original, self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu,
                            last_loc, extend_num_tokens, num_new_pages=None):
    """CPU: the slots of each request's extend tokens, computed with torch (module doc)."""
    if not _on_cpu(self):
        return original(self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc,
                        extend_num_tokens, num_new_pages)
    ps = self.page_size
    pre, seq, last = prefix_lens_cpu.tolist(), seq_lens_cpu.tolist(), last_loc.tolist()
    new_pages = [_pages(s, ps) - _pages(p, ps) for p, s in zip(pre, seq)]
    if self.need_sort and extend_num_tokens // ps + len(pre) + 1 > len(self.free_pages):
        self.merge_and_sort_free()
    total = sum(new_pages) if num_new_pages is None else num_new_pages
    if total > len(self.free_pages):
        return None
    pages = self.free_pages[:total].to(torch.int64)
    in_page = torch.arange(ps, dtype=torch.int64)
    out, cursor = [], 0
    for p, s, l, n in zip(pre, seq, last, new_pages):
        tail = min(s, _pages(p, ps) * ps) - p            # free slots left in the last prefix page
        fresh = (pages[cursor:cursor + n, None] * ps + in_page).reshape(-1)[: s - p - tail]
        out += [l + 1 + in_page[:tail], fresh]
        cursor += n
    self.free_pages = self.free_pages[total:]
    slots = torch.cat(out) if out else torch.empty(0, dtype=torch.int64)
    if slots.numel() != extend_num_tokens:
        raise RuntimeError(f"sglang-dsv41 CPU allocator: {slots.numel()} slots for {extend_num_tokens} "
                           "extend tokens (prefix/seq lengths disagree with extend_num_tokens)")
    return slots


def paged_alloc_decode_hook(original, self, seq_lens, seq_lens_cpu, last_loc):
    """CPU: one slot per decoding request — the next slot of its page, or a new page's first."""
    if not _on_cpu(self):
        return original(self, seq_lens, seq_lens_cpu, last_loc)
    ps = self.page_size
    seq, last = seq_lens_cpu.tolist(), last_loc.tolist()
    needs_page = [_pages(s, ps) != _pages(s - 1, ps) for s in seq]
    if self.need_sort and len(seq) > len(self.free_pages):
        self.merge_and_sort_free()
    total = sum(needs_page)
    if total > len(self.free_pages):
        return None
    pages = self.free_pages[:total].tolist()
    out, cursor = [], 0
    for l, new in zip(last, needs_page):
        if new:
            out.append(pages[cursor] * ps)
            cursor += 1
        else:
            out.append(l + 1)
    self.free_pages = self.free_pages[total:]
    return torch.tensor(out, dtype=torch.int64)

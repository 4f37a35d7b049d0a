"""Implementations of the runtime area's HookRegistry entries (the table is `sglang_dsv41.hooks`).

The V4.1 pool's own hooks live in `runtime/sglang_pool.py`; these make the stock scheduler paths
serve the model:

* `attach_engram_history_hook` — AFTER `ForwardBatch.init_new`: an extend (or mixed) batch of
  our model carries each request's Engram history, the K ids before its chunk, built from the
  request's own ids (`origin_input_ids + output_ids`, read as `JoinedIds`: only the K ids are
  copied, not the context; `runtime/engram_history.py`). The model
  keeps no token ids per cache slot, so SGLang's own per-token KV costs are exact and HiCache,
  PD and preemption move nothing for Engram.
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

from .engram_history import JoinedIds, host_history


def attach_engram_history_hook(result, cls, batch, model_runner, *args, **kwargs):
    """Stage the Engram history [B, K] of an extend / mixed batch of a V4.1 model with Engram
    layers (`engram_history_len` > 0) on the model, which its forward of that batch takes
    (SGLang's runners copy the ForwardBatch into their own buffers, dropping extra attributes).
    Any other batch or model is untouched."""
    K = int(getattr(getattr(model_runner, "model", None), "engram_history_len", 0) or 0)
    if not K or result is None or batch is None or result.forward_mode.name not in ("EXTEND", "MIXED"):
        return result
    starts = [int(s) - int(e) for s, e in zip(result.seq_lens_cpu.tolist(), result.extend_seq_lens_cpu)]
    tokens = [JoinedIds(req.origin_input_ids, req.output_ids) for req in batch.reqs]
    if len(tokens) != len(starts):
        raise RuntimeError(f"sglang-dsv41: {len(tokens)} requests but {len(starts)} sequence lengths in the batch")
    model_runner.model.stage_engram_history(starts, host_history(tokens, starts, K, device=result.seq_lens.device))
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

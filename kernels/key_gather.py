"""Each decode query's keys gathered into one BF16 key tensor, plus FlashMLA-style indices into it
(issue 21: the input of `flash_mla_sparse_fwd` at decode, `runtime/attention_flashmla.py`; with no
window, `gather_latent_rows`, the BF16 rows the Triton attention kernel reads instead of decoding the
packed entries in its loop, `SGLANG_DSV41_ATTN_DECODE=gather`).

`gather_key_rows(swa_cache, swa_slots, comp_cache, comp_entries, out_dim)`: for N queries with
window slots `swa_slots` [N, W] into the BF16 SWA rows [S, D] and compressed entries
`comp_entries` [N, K] of a `PackedSource` of latent rows (−1 = no key in either), returns

    kv      BF16 [N·T, 1, out_dim], T = W + K rounded up to `width_multiple`:
            row t·T + c = SWA row swa_slots[t, c] (c < W) or the decoded latent of entry
            comp_entries[t, c − W] (W ≤ c < W + K), dims ≥ D zero; zero rows where there is no key
            and in the padding columns;
    indices int32 [N, 1, T]: t·T + c where query t has a key in column c, else −1.

Decoding is exact (`packed_rows.load_latent_pair_tiles`: every decoded latent is a BF16 value),
so kv holds the same values the Triton kernel multiplies. One launch over (query, column tile);
each program moves BLOCK_N rows as int32 words (word i = dims 2i | 2i+1). Traffic per query:
W SWA rows and K packed entries read, T·out_dim·2 bytes written. Tensor-only; no host sync.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.interpreter import InterpretedFunction

from sglang_dsv41.kernels.packed_rows import PackedSource, load_latent_pair_tiles

#: rows per program
BLOCK_N = 16


@triton.jit
def _gather_keys_kernel(swa_ptr, swa_row_stride, swa_slots_ptr, swa_slots_stride, W,
                        comp_ptr, comp_row_stride, comp_slots_ptr, comp_slots_stride, K, comp_offset, comp_ratio,
                        kv_ptr, idx_ptr, T, D,
                        HAS_COMP: tl.constexpr, COMP_SHARE: tl.constexpr, OUT_P: tl.constexpr,
                        BLOCK_N: tl.constexpr, COMPILED: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    p = tl.arange(0, OUT_P)
    p_live = p < D // 2
    is_swa = c < W
    slot = tl.load(swa_slots_ptr + t * swa_slots_stride + c, mask=is_swa, other=-1).to(tl.int64)
    valid_swa = slot >= 0
    words = tl.load(swa_ptr + slot[:, None] * swa_row_stride + p[None, :],
                    mask=valid_swa[:, None] & p_live[None, :], other=0)
    valid = valid_swa
    if HAS_COMP:
        is_comp = (c >= W) & (c < W + K)
        entry = tl.load(comp_slots_ptr + t * comp_slots_stride + (c - W), mask=is_comp, other=-1).to(tl.int64)
        valid_comp = entry >= 0
        even, odd = load_latent_pair_tiles(comp_ptr, entry * comp_ratio * comp_row_stride, valid_comp, D,
                                           comp_row_stride, comp_offset, COMP_SHARE, OUT_P, COMPILED)
        lo = even.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        hi = odd.to(tl.int16, bitcast=True).to(tl.int32) << 16
        words = tl.where(valid_comp[:, None], lo | hi, words)
        valid = valid | valid_comp
    row = t * T + c
    tl.store(kv_ptr + row[:, None] * OUT_P + p[None, :], words, mask=(c < T)[:, None])
    tl.store(idx_ptr + row, tl.where(valid, row, -1).to(tl.int32), mask=c < T)


INTERPRETED = isinstance(_gather_keys_kernel, InterpretedFunction)


def gather_key_rows(swa_cache: Tensor, swa_slots: Tensor, comp_cache: PackedSource | None,
                    comp_entries: Tensor | None, out_dim: int, width_multiple: int = 1) -> tuple[Tensor, Tensor]:
    """(kv BF16 [N·T, 1, out_dim], indices int32 [N, 1, T]) of the module docstring."""
    if swa_cache.dtype != torch.bfloat16 or swa_cache.dim() != 2 or swa_cache.stride(-1) != 1:
        raise ValueError(f"gather_key_rows: swa_cache must be BF16 [S, D] rows, got {swa_cache.dtype} "
                         f"{tuple(swa_cache.shape)}")
    N, W = swa_slots.shape
    D = swa_cache.shape[1]
    if D % 2 or out_dim < D or (out_dim // 2) & (out_dim // 2 - 1) or out_dim < 2 or \
            (swa_cache.shape[0] > 1 and swa_cache.stride(0) % 2):
        raise ValueError(f"gather_key_rows: needs an even head_dim {D} ≤ out_dim {out_dim} = 2·(a power of two) "
                         "and an even row stride")
    has_comp = comp_cache is not None and comp_entries is not None
    K = comp_entries.shape[1] if has_comp else 0
    if has_comp:
        comp_cache.require_part("latent", "gather_key_rows")
        if comp_cache.head_dim != D or comp_entries.shape[0] != N:
            raise ValueError(f"gather_key_rows: entries [{comp_entries.shape[0]}, K] of head_dim "
                             f"{comp_cache.head_dim} for {N} queries of head_dim {D}")
    T = -(-(W + K) // width_multiple) * width_multiple
    dev = swa_cache.device
    kv = torch.empty(N * T, 1, out_dim, dtype=torch.bfloat16, device=dev)
    indices = torch.empty(N, 1, T, dtype=torch.int32, device=dev)
    if N == 0 or T == 0:
        return kv, indices
    comp_rows = comp_cache.rows if has_comp else swa_cache
    comp_slots = comp_entries if has_comp else swa_slots
    _gather_keys_kernel[(N, triton.cdiv(T, BLOCK_N))](
        swa_cache.view(torch.int32), swa_cache.stride(0) // 2, swa_slots, swa_slots.stride(0), W,
        comp_rows, comp_rows.stride(0), comp_slots, comp_slots.stride(0), K,
        comp_cache.offset if has_comp else 0, comp_cache.ratio if has_comp else 1,
        kv.view(torch.int32), indices, T, D,
        HAS_COMP=has_comp, COMP_SHARE=comp_cache.share if has_comp else 1, OUT_P=out_dim // 2,
        BLOCK_N=BLOCK_N, COMPILED=not INTERPRETED)
    return kv, indices


def gather_latent_rows(comp_cache: PackedSource, comp_entries: Tensor) -> tuple[Tensor, Tensor]:
    """(BF16 rows [N·K, D] — a view with an even row stride —, int32 rows [N, K], −1 = none): the
    decoded latents of `comp_entries` [N, K], for the Triton kernel's BF16-row path (the same values
    as its packed path decodes)."""
    N, K = comp_entries.shape
    D = comp_cache.head_dim
    out_dim = 2 * (1 << max(0, (D // 2 - 1).bit_length()))          # 2·(a power of two) ≥ D
    # no window: a zero-column view of the entry list and a one-row placeholder cache, never read (both
    # keep a real device address: the launcher is not handed the null pointer of an empty allocation)
    no_window = comp_entries[:, :0]
    placeholder = torch.empty(1, D, dtype=torch.bfloat16, device=comp_entries.device)
    kv, indices = gather_key_rows(placeholder, no_window, comp_cache, comp_entries, out_dim)
    return kv.view(N * K, out_dim)[:, :D], indices.view(N, K)


__all__ = ["BLOCK_N", "gather_key_rows", "gather_latent_rows"]

"""Packed compressed entries decoded into BF16 rows — Triton (issue 21; contracts §1, §2, §5; spec
`model.md` §3.4.3).

`decode_entry_rows(rows, entries, offset=, share=, ratio=, dims=, part=)` → BF16 [n, dims]: row i holds the
decoded `part` ("latent": E2M1 × E4M3 per 16 dims; "key": E2M1 × UE8M0 per 32 dims) of packed entry
entries.flat[i] of the source whose part lives at columns [offset, offset + share) of `rows` (entry e's byte j
at row e·ratio + j // share, column offset + j % share), and zeros where the entry is −1. Decoded values are
exact (`packed_rows`), so a row equals `runtime.kv_layout.decode_latents` / `decode_keys` of the same bytes
rounded to BF16, bit for bit; an entry whose scale byte is a NaN code decodes to NaNs (bits unspecified).

One launch over blocks of BLOCK_E entries; a program writes its rows as int32 words (word i = dims 2i | 2i+1).
Tensor-only, no host sync. The prefill workspaces of `runtime/attention_prefill.py` use it for every kv
source and forward (it replaces about twenty torch ops per workspace; measured in docs/performance.md
"Session 42").
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.interpreter import InterpretedFunction

from sglang_dsv41.kernels.packed_rows import (PARTS, key_entry_bytes, latent_entry_bytes, load_key_pair_tiles,
                                              load_latent_pair_tiles)

#: entries per program
BLOCK_E = 16


@triton.jit
def _decode_rows_kernel(rows_ptr, row_stride, offset, entries_ptr, n, out_ptr, dims,
                        SHARE: tl.constexpr, RATIO: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr,
                        KEY: tl.constexpr, COMPILED: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK_E + tl.arange(0, BLOCK_E)
    live = i < n
    entry = tl.load(entries_ptr + i, mask=live, other=-1).to(tl.int64)
    valid = entry >= 0
    base = tl.where(valid, entry, 0) * RATIO * row_stride
    if KEY:
        even, odd = load_key_pair_tiles(rows_ptr, base, valid, dims, row_stride, offset, SHARE, BLOCK_P, COMPILED)
    else:
        even, odd = load_latent_pair_tiles(rows_ptr, base, valid, dims, row_stride, offset, SHARE, BLOCK_P, COMPILED)
    words = (even.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF) | (odd.to(tl.int16, bitcast=True).to(tl.int32) << 16)
    p = tl.arange(0, BLOCK_P)
    half = dims // 2
    tl.store(out_ptr + i[:, None] * half + p[None, :], words, mask=live[:, None] & (p < half)[None, :])


INTERPRETED = isinstance(_decode_rows_kernel, InterpretedFunction)


def decode_entry_rows(rows: Tensor, entries: Tensor, *, offset: int, share: int, ratio: int, dims: int,
                      part: str) -> Tensor:
    """BF16 [entries.numel(), dims] of the module docstring. `rows` uint8 [S, row_bytes] (unit last
    stride), `entries` integer (any shape; −1 = none, else an entry e with e·ratio + ratio − 1 < S)."""
    if part not in PARTS:
        raise ValueError(f"decode_entry_rows: part {part!r} is not one of {PARTS}")
    group = 16 if part == "latent" else 32
    if dims < group or dims % group:
        raise ValueError(f"decode_entry_rows: {part} dims {dims} must be a positive multiple of {group}")
    entry_bytes = latent_entry_bytes(dims) if part == "latent" else key_entry_bytes(dims)
    if rows.dim() != 2 or rows.dtype != torch.uint8 or (rows.shape[1] > 1 and rows.stride(1) != 1):
        raise ValueError(f"decode_entry_rows: rows must be uint8 [S, row_bytes] with unit last stride, got "
                         f"{rows.dtype} {tuple(rows.shape)}")
    if ratio < 1 or share != -(-entry_bytes // ratio) or offset < 0 or offset + share > rows.shape[1]:
        raise ValueError(f"decode_entry_rows: columns [{offset}, {offset} + {share}) at ratio {ratio} do not hold "
                         f"{entry_bytes}-byte {part} entries in rows of {rows.shape[1]} bytes (contracts §2)")
    if entries.dtype not in (torch.int32, torch.int64) or entries.device != rows.device:
        raise ValueError(f"decode_entry_rows: entries must be int32 / int64 on {rows.device}, got {entries.dtype} "
                         f"on {entries.device}")
    flat = entries.reshape(-1).contiguous()
    n = flat.numel()
    out = torch.empty(n, dims, dtype=torch.bfloat16, device=rows.device)
    if n == 0:
        return out
    if rows.device.type != "cuda" and not INTERPRETED:
        raise ValueError(f"decode_entry_rows: tensors on {rows.device} need a CUDA device, or TRITON_INTERPRET=1 "
                         "set before this module is imported (Triton's CPU interpreter)")
    _decode_rows_kernel[(triton.cdiv(n, BLOCK_E),)](
        rows, rows.stride(0), offset, flat, n, out.view(torch.int32), dims,
        SHARE=share, RATIO=ratio, BLOCK_E=BLOCK_E, BLOCK_P=triton.next_power_of_2(dims // 2), KEY=part == "key",
        COMPILED=not INTERPRETED)
    return out


__all__ = ["BLOCK_E", "INTERPRETED", "decode_entry_rows"]

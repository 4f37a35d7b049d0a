"""Host-side checks and views for `sparse_attention.sparse_sink_attention` (spec §3.4.5).

`check_inputs`: shapes, dtypes, strides and devices of the call (no host synchronisation);
`validate_values`: the host-synchronising value checks of `validate=True` (slot / entry ranges,
sink, empty key sets with a −∞ sink); `bf16_pairs`: a BF16 cache viewed as int32 pairs of
dims, the layout the kernel's parity-split tiles read. All raise ValueError with the argument's
name; none silently repairs an input.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from .packed_rows import PackedSource

_SLOT_DTYPES = (torch.int32, torch.int64)
_OUT_DTYPES = (torch.bfloat16, torch.float32)


def check_inputs(q: Tensor, swa_cache: Tensor, swa_slots: Tensor, comp_cache: Tensor | PackedSource | None,
                  comp_slots: Tensor | None, sink: Tensor, scale: float, out: Tensor | None,
                  row_dtype: torch.dtype = torch.bfloat16) -> None:
    """Shapes, dtypes, strides and devices (no host sync); q and the row caches in `row_dtype`."""
    if q.dim() != 3 or q.dtype != row_dtype or q.stride(2) != 1:
        raise ValueError(f"sparse_sink_attention: q must be [N, H, D] {row_dtype} with unit last stride, got "
                         f"{tuple(q.shape)} {q.dtype} strides {q.stride()}")
    N, H, D = q.shape
    if D % 2:
        raise ValueError(f"sparse_sink_attention: head_dim {D} must be even (the kernel splits dims by parity)")
    caches = [("swa", swa_cache, swa_slots)] + ([("comp", comp_cache, comp_slots)] if comp_cache is not None else [])
    if (comp_cache is None) != (comp_slots is None):
        raise ValueError("sparse_sink_attention: comp_cache and comp_slots must both be given or both be None")
    for name, cache, slots in caches:
        if isinstance(cache, PackedSource):
            cache.require_part("latent", "sparse_sink_attention")
            if cache.head_dim != D:
                raise ValueError(f"sparse_sink_attention: packed comp_cache has head_dim {cache.head_dim}, q has {D}")
        elif cache.dim() != 2 or cache.shape[1] != D or cache.dtype != row_dtype or cache.stride(1) != 1:
            raise ValueError(f"sparse_sink_attention: {name}_cache must be [S, {D}] {row_dtype} with unit last stride, "
                             f"got {tuple(cache.shape)} {cache.dtype} strides {cache.stride()}")
        if slots.dim() != 2 or slots.shape[0] != N or slots.dtype not in _SLOT_DTYPES or slots.stride(1) != 1:
            raise ValueError(f"sparse_sink_attention: {name}_slots must be [{N}, n] int32/int64 with unit last "
                             f"stride, got {tuple(slots.shape)} {slots.dtype} strides {slots.stride()}")
    if swa_slots.shape[1] < 1:
        raise ValueError("sparse_sink_attention: swa_slots needs at least one column (the window)")
    if sink.shape != (H,) or sink.dtype != torch.float32:
        raise ValueError(f"sparse_sink_attention: sink must be [{H}] float32, got {tuple(sink.shape)} {sink.dtype}")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"sparse_sink_attention: scale must be a positive finite float, got {scale}")
    if out is not None and (out.shape != q.shape or out.dtype not in _OUT_DTYPES or out.stride(2) != 1):
        raise ValueError(f"sparse_sink_attention: out must be [{N}, {H}, {D}] bf16/fp32 with unit last stride, "
                         f"got {tuple(out.shape)} {out.dtype}")
    comp_tensor = comp_cache.rows if isinstance(comp_cache, PackedSource) else comp_cache
    devices = {x.device for x in (q, swa_cache, swa_slots, sink, comp_tensor, comp_slots, out) if x is not None}
    if len(devices) != 1:
        raise ValueError(f"sparse_sink_attention: all tensors must be on one device, got {sorted(map(str, devices))}")


def validate_values(swa_cache: Tensor, swa_slots: Tensor, comp_cache: Tensor | PackedSource | None,
                     comp_slots: Tensor | None, sink: Tensor) -> None:
    """Host-synchronising checks of the slot (entry) ranges, the sink and empty key sets."""
    has_key = torch.zeros(swa_slots.shape[0], dtype=torch.bool, device=swa_slots.device)
    for name, cache, slots in (("swa", swa_cache, swa_slots), ("comp", comp_cache, comp_slots)):
        if cache is None:
            continue
        limit = cache.num_entries if isinstance(cache, PackedSource) else cache.shape[0]
        bad = (slots < -1) | (slots >= limit)
        if bool(bad.any()):
            raise ValueError(f"sparse_sink_attention: {name}_slots holds values outside −1..{limit - 1} "
                             f"(e.g. {slots[bad][:4].tolist()})")
        has_key |= (slots >= 0).any(dim=1)
    if bool((torch.isnan(sink) | (sink == math.inf)).any()):
        raise ValueError("sparse_sink_attention: sink holds NaN or +∞")
    if bool((sink == -math.inf).any()) and not bool(has_key.all()):
        raise ValueError("sparse_sink_attention: a query has no valid key and a head has sink −∞ (empty softmax)")


def bf16_pairs(cache: Tensor, name: str) -> Tensor:
    """The BF16 cache [S, D] viewed as int32 [S, D/2] (word i = dims 2i, 2i+1: the kernel's
    even/odd tiles); needs an even D, row stride and storage offset (raises otherwise)."""
    if cache.shape[1] % 2 or (cache.shape[0] > 1 and cache.stride(0) % 2) or cache.storage_offset() % 2:
        raise ValueError(f"sparse_sink_attention: {name}_cache needs an even head_dim, row stride and storage "
                         f"offset (rows are read as pairs of BF16), got {tuple(cache.shape)} strides "
                         f"{cache.stride()} offset {cache.storage_offset()}")
    return cache.view(torch.int32)

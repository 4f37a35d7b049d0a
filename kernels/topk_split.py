"""Top-k of few wide rows in two stages (issue 21: long-context decode) — `kernels.indexer_select.select_topk`'s
result bit for bit, with the row spread over many programs.

`topk_select.select_topk_fused` ranks a row in one program, so a decode step with few rows of 32K–64K
columns uses a handful of the GPU's multiprocessors.
Here each row is cut into segments of SEGMENT columns:

1. every segment's top-k by the fused kernel (N · S programs, one launch of `topk_select.segment_candidates`),
   written as the segments' candidates side by side, segment after segment — so in column order —
   each a column of the row with its score, −1 / −∞ where a segment had fewer;
2. their top-k by the fused kernel; the chosen positions mapped back to columns.

Why the result is the same: the contract ranks by (score descending, column ascending), a total
order (−0 == +0 by the key; NaN excluded). An entry in the row's top-k is in its segment's top-k under
the same order, so stage 2 sees every entry it must choose, and its own tie break (lower position)
is the lower column because the candidates lie in column order. Positions ascending are columns
ascending, so the output row is sorted as the contract asks.

Sizes: S = ⌈E / SEGMENT⌉ segments (stage 1 is one launch of `topk_select.segment_candidates`, a program a
segment; the last segment reads only the columns below E), stage 2 has S · k columns; when that is
still wider than the fused kernel takes, stage 2 is split again. Only worth it for few rows: a
prefill chunk already fills the GPU with one program per row. Which calls take this path is the
dispatcher's choice (`kernels.indexer_select.select_topk`, SGLANG_DSV41_TOPK_SPLIT). No host sync; static
shapes, so it can be captured in a CUDA graph.
"""
from __future__ import annotations

import os

import torch
from torch import Tensor

from . import topk_select as TS

#: Columns per segment: a resident block of the fused kernel, wider than k = 512 or 1,024 by 4–8×.
SEGMENT = 4096
#: Where `kernels.indexer_select.select_topk` ranks here (`split_applies`): "auto" (default) few rows wider than
#: the fused kernel takes whose candidates fit one stage-2 launch; "on" also few rows wider than a resident
#: block, and any row past the fused kernel's width; "off" never. docs/performance.md "Session 20" has the
#: H200 numbers behind "auto".
SPLIT_ENV, SPLIT_CHOICES, DEFAULT_SPLIT = "SGLANG_DSV41_TOPK_SPLIT", ("auto", "off", "on"), "auto"
#: "auto"'s widest stage 2 (S · k candidates): the widest one measured ahead of the torch path (256K × top-512).
AUTO_MAX_CANDIDATES = 32768


def split_applies(rows: int, width: int, k: int, bounded: bool = False) -> bool:
    """Whether SGLANG_DSV41_TOPK_SPLIT (default DEFAULT_SPLIT) sends a fused ranking of rows × width
    here; always k < SEGMENT. "auto": few rows (≤ `topk_select.FEW_ROWS`) wider than the fused kernel
    takes (otherwise the torch path) with ⌈width / SEGMENT⌉ · k ≤ AUTO_MAX_CANDIDATES candidates — any
    number of candidates when `bounded` (row lengths given: the segments past a row's length end at
    once, and stage 2 reads only the live segments' candidates). "on": few rows wider than a resident
    block, or any row past the fused kernel's width. An unknown value raises."""
    chosen = os.environ.get(SPLIT_ENV, "").strip().lower() or DEFAULT_SPLIT
    if chosen not in SPLIT_CHOICES:
        raise ValueError(f"{SPLIT_ENV}={chosen!r}: expected one of {SPLIT_CHOICES}")
    if chosen == "off" or k >= SEGMENT:
        return False
    few = rows <= TS.FEW_ROWS
    if chosen == "auto":
        return few and width > TS.FUSED_MAX_ENTRIES and (bounded or -(-width // SEGMENT) * k <= AUTO_MAX_CANDIDATES)
    return (few and width > TS.RESIDENT_MAX_ENTRIES) or width > TS.FUSED_MAX_ENTRIES


def select_topk_split(scores: Tensor, k: int, *, segment: int = SEGMENT, lengths: Tensor | None = None) -> Tensor:
    """[N, k] int64, `select_topk_fused(scores, k, lengths=lengths)` bit for bit (module doc); scores fp32
    [N, E] (CUDA, or CPU under TRITON_INTERPRET=1). `segment` must exceed k. `lengths` [N]: row r ranks
    columns < lengths[r] only; segments past it end at once and stage 2 ranks only the candidates of
    the ⌈lengths[r] / segment⌉ segments before it."""
    if scores.dim() != 2 or scores.dtype != torch.float32:
        raise TypeError(f"select_topk_split: want a 2-D fp32 score tensor, got {scores.dtype} {tuple(scores.shape)}")
    if not 1 <= k < segment:
        raise ValueError(f"select_topk_split: need 1 ≤ k < segment, got k={k}, segment={segment}")
    N, E = scores.shape
    if N == 0 or E <= segment:
        return TS.select_topk_fused(scores, k, lengths=lengths)
    S = -(-E // segment)
    cols, picked = TS.segment_candidates(scores, k, segment, lengths=lengths)   # stage 1 and its candidates
    live = None
    if lengths is not None:                           # candidates of the segments before each row's length
        live = (lengths.clamp(0, E) + segment - 1).div(segment, rounding_mode="floor") * k
    if S * k > TS.FUSED_MAX_ENTRIES:
        pos = select_topk_split(picked, k, segment=segment, lengths=live)
    else:
        pos = TS.select_topk_fused(picked, k, lengths=live)
    return torch.where(pos >= 0, cols.gather(1, pos.clamp(min=0)), -1)

"""Launch planning of the sparse sink attention kernels (`kernels/sparse_attention.py`, which re-exports
every name here; `kernels/sparse_attention_prefill.py` shares MAX_SPLITS and `merge_tile`).

`SparseAttentionConfig` (block sizes, key-tile splits, warps, stages) and its planners: `plan_config`
(any batch), `plan_decode_config` (split-KV for small decode batches), `plan_prefill_config` (one split,
compressed keys as BF16 rows), `merge_tile` (the split-merge kernel's tile), with their constants.

Invariants: a plan is a function of the shapes (N, H, D, W, K) and the multiprocessor count only — never
of tensor values, never of Flash constants. `SparseAttentionConfig` checks that block_h / block_d / block_n
are powers of two ≥ 16, block_d ≥ 32 and 1 ≤ num_splits ≤ MAX_SPLITS; the planners leave no split
empty. The oracle bound of `kernels.sparse_attention` holds for any config; the bits depend on it
(`plan_config`'s blocks do not depend on N, its split count does: that module's doc, "Batch
invariance"), except `merge_tile`'s, which changes no output bit. Nothing here launches a kernel or
touches a device.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import triton

#: fp32 accumulator elements one program keeps in registers ([block_h, block_d]); 16384 = 64 KiB
#: = 64 registers per thread at 8 warps, leaving room for q and the logits tile.
ACC_ELEMS_PER_PROGRAM = 16384
#: Bytes of one gathered key tile ([block_n, block_d] BF16) in shared memory per pipeline stage.
KEY_TILE_BYTES = 32768
#: Upper bound on key-tile splits of one query (flash-decoding).
MAX_SPLITS = 32
#: Largest query count `plan_decode_config` splits (above it: one split).
DECODE_SPLIT_MAX_QUERIES = 16
#: Heads per program of `plan_decode_config` up to DECODE_SMALL_BLOCK_H_MAX_QUERIES queries (when it
#: is below `plan_config`'s): more head blocks, so the splits fill the multiprocessors with smaller
#: programs (docs/performance.md, session 12's variants and session 21)
DECODE_SMALL_BLOCK_H = 16
DECODE_SMALL_BLOCK_H_MAX_QUERIES = 1
#: [heads, columns] fp32 elements one program of the split-merge kernel combines at most (16 per
#: thread), and at least when the grid would otherwise not fill the multiprocessors twice over.
MERGE_ELEMS_PER_PROGRAM = 2048
MERGE_MIN_ELEMS_PER_PROGRAM = 128
#: Widest column block of one merge program.
MERGE_MAX_BLOCK_D = 128


@dataclass(frozen=True)
class SparseAttentionConfig:
    """Launch parameters. block_h/block_d/block_n are powers of two ≥ 16 (tensor-core tile
    minimum), block_d ≥ 32 (the kernel splits it into two halves of dims by parity); `num_splits` ≥ 1 key-tile splits per query; `num_warps`/`num_stages` as Triton."""

    block_h: int
    block_d: int
    block_n: int
    num_splits: int
    num_warps: int
    num_stages: int

    def __post_init__(self) -> None:
        for name in ("block_h", "block_d", "block_n"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"SparseAttentionConfig.{name}={v}: must be a power of two ≥ 16")
        if self.block_d < 32:
            raise ValueError(f"SparseAttentionConfig.block_d={self.block_d}: must be ≥ 32 (two halves ≥ 16)")
        if not 1 <= self.num_splits <= MAX_SPLITS:
            raise ValueError(f"SparseAttentionConfig.num_splits={self.num_splits}: must be in 1..{MAX_SPLITS}")
        if self.num_warps not in (1, 2, 4, 8, 16) or self.num_stages < 1:
            raise ValueError(f"SparseAttentionConfig: bad num_warps={self.num_warps} / num_stages={self.num_stages}")


def _pow2_at_least(x: int, floor: int = 16) -> int:
    return max(floor, triton.next_power_of_2(max(1, x)))


def plan_config(num_queries: int, num_heads: int, head_dim: int, window: int, topk: int,
                sm_count: int) -> SparseAttentionConfig:
    """Block sizes from the shapes (`kernels.sparse_attention` module docstring): block_d = next_pow2(D);
    block_h = as many
    heads as fit ACC_ELEMS_PER_PROGRAM; block_n = keys per KEY_TILE_BYTES tile (≤ the longer key
    list); splits = ⌊sm_count / (N·⌈H/block_h⌉)⌋ (≥ 2 only when at least half the multiprocessors
    would idle), capped so that a split keeps ≥ ⌈2H/block_n⌉ tiles and by MAX_SPLITS."""
    if head_dim < 1 or num_heads < 1 or window < 1 or topk < 0 or sm_count < 1:
        raise ValueError(f"plan_config: bad shape (D={head_dim}, H={num_heads}, W={window}, K={topk}, "
                         f"sm_count={sm_count})")
    block_d = _pow2_at_least(head_dim, 32)
    if ACC_ELEMS_PER_PROGRAM // block_d < 16:
        raise ValueError(f"sparse_sink_attention: head_dim {head_dim} > {ACC_ELEMS_PER_PROGRAM // 16} "
                         "does not fit one program's fp32 accumulator")
    block_h = min(_pow2_at_least(num_heads), ACC_ELEMS_PER_PROGRAM // block_d)
    block_n = min(max(16, KEY_TILE_BYTES // (2 * block_d)), 64, _pow2_at_least(max(window, topk)))
    num_warps = 8 if block_h * block_d >= 16384 else 4
    tiles = triton.cdiv(window, block_n) + triton.cdiv(topk, block_n)
    programs = num_queries * triton.cdiv(num_heads, block_h)
    splits = 1
    if 0 < 2 * programs <= sm_count:   # whole extra waves only: a partial wave would not finish sooner
        min_tiles = max(1, triton.cdiv(2 * num_heads, block_n))
        splits = max(1, min(sm_count // programs, tiles // min_tiles, MAX_SPLITS))
        splits = triton.cdiv(tiles, triton.cdiv(tiles, splits))   # no empty split
    return SparseAttentionConfig(block_h=block_h, block_d=block_d, block_n=block_n, num_splits=splits,
                                 num_warps=num_warps, num_stages=2)


def plan_decode_config(num_queries: int, num_heads: int, head_dim: int, window: int, topk: int,
                       sm_count: int, block_h: int | None = None) -> SparseAttentionConfig:
    """Split-KV for small decode batches: `plan_config`'s blocks (or `block_h`), and for
    N ≤ DECODE_SPLIT_MAX_QUERIES as many key-tile splits as fill the multiprocessors (with at most
    DECODE_SMALL_BLOCK_H heads per program at N ≤ DECODE_SMALL_BLOCK_H_MAX_QUERIES unless `block_h`),
    ⌈sm_count / (N·⌈H/block_h⌉)⌉, down to one tile per split (≤ tiles, ≤ MAX_SPLITS; no empty
    split). Unlike `plan_config` a split may hold fewer than ⌈2H/block_n⌉ tiles: its scratch
    (H·(D + 2)·4 B written and read back, L2-resident) then exceeds the keys it reads, which pays at
    these N because the launch would otherwise run on N·⌈H/block_h⌉ multiprocessors (2 at Flash,
    N = 1). Above DECODE_SPLIT_MAX_QUERIES: one split. The split count depends on N, so a query's
    bits depend on its batch's size class (N = 1, ≤ 16, above): not batch invariant."""
    base = plan_config(num_queries, num_heads, head_dim, window, topk, sm_count)
    if block_h is None and 1 <= num_queries <= DECODE_SMALL_BLOCK_H_MAX_QUERIES:
        block_h = min(base.block_h, DECODE_SMALL_BLOCK_H)
    if block_h is not None:
        base = dataclasses.replace(base, block_h=block_h)
    if num_queries > DECODE_SPLIT_MAX_QUERIES or num_queries < 1:
        return dataclasses.replace(base, num_splits=1)
    tiles = triton.cdiv(window, base.block_n) + triton.cdiv(topk, base.block_n)
    programs = num_queries * triton.cdiv(num_heads, base.block_h)
    splits = max(1, min(tiles, MAX_SPLITS, triton.cdiv(sm_count, programs)))
    splits = triton.cdiv(tiles, triton.cdiv(tiles, splits))   # no empty split
    return dataclasses.replace(base, num_splits=splits)


#: Prefill launches whose compressed keys are BF16 rows (the workspace of `runtime.attention_prefill`):
#: (block_d, `plan_config`'s block_h) → (block_h, num_warps) where measured faster on the H200
#: (docs/performance.md "Session 13": 64 heads × head_dim 512, 8,192 queries, block_n 32, 2 stages).
#: Other classes keep `plan_config`'s blocks.
PREFILL_BF16_BLOCKS = {(512, 32): (16, 4)}


def plan_prefill_config(num_queries: int, num_heads: int, head_dim: int, window: int,
                        topk: int) -> SparseAttentionConfig:
    """One key split (an extend batch fills the multiprocessors with queries) and `plan_config`'s
    blocks, except the classes of PREFILL_BF16_BLOCKS — for compressed keys given as BF16 rows, not
    a `PackedSource`. Only block_h and num_warps change (the same key tiles in the same order; the
    oracle bound of the `kernels.sparse_attention` module doc holds for any config)."""
    base = dataclasses.replace(plan_config(num_queries, num_heads, head_dim, window, topk, sm_count=1),
                               num_splits=1)
    blocks = PREFILL_BF16_BLOCKS.get((base.block_d, base.block_h))
    if blocks is None:
        return base
    return dataclasses.replace(base, block_h=blocks[0], num_warps=blocks[1])


def merge_tile(n: int, h: int, block_d: int, sms: int) -> tuple[int, int]:
    """(heads, columns) per program of the split-merge kernel, both powers of two: the largest tile of
    at most MERGE_ELEMS_PER_PROGRAM elements whose grid over [n, h, block_d] has ≥ 2·sms programs,
    down to MERGE_MIN_ELEMS_PER_PROGRAM. Each output element's arithmetic does not depend on the
    tile, so neither do its bits."""
    elems = MERGE_ELEMS_PER_PROGRAM
    while elems > MERGE_MIN_ELEMS_PER_PROGRAM and n * h * block_d < 2 * sms * elems:
        elems //= 2
    cols = min(block_d, MERGE_MAX_BLOCK_D, elems)
    return max(1, elems // cols), cols


__all__ = ["ACC_ELEMS_PER_PROGRAM", "DECODE_SMALL_BLOCK_H", "DECODE_SMALL_BLOCK_H_MAX_QUERIES",
           "DECODE_SPLIT_MAX_QUERIES", "KEY_TILE_BYTES", "MAX_SPLITS", "MERGE_ELEMS_PER_PROGRAM", "MERGE_MAX_BLOCK_D",
           "MERGE_MIN_ELEMS_PER_PROGRAM", "PREFILL_BF16_BLOCKS", "SparseAttentionConfig", "merge_tile", "plan_config",
           "plan_decode_config", "plan_prefill_config"]

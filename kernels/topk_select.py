"""Top-k selection of index scores in one launch (issue 21: the indexer's decode step without the
~10 torch launches of `indexer_select.select_topk` per call) — same result, bit for bit.

Contract = `kernels.indexer_select.select_topk`: per row of fp32 scores [N, E], the min(k, #allowed)
columns with the largest scores (allowed = score > −∞; +∞ allowed), ties → lower column, −0 == +0,
sorted ascending, −1 padded to k; NaN must not occur (the caller's guarantee, as with
`check_nan=False`).

Method, one program per row (no sort): each score maps to the order-preserving unsigned key
u = monotone(int32 bits of the canonical score) + 2³¹ (−0 made +0 first). The take-th largest key
T among the allowed columns is found by bisection on its 32 bits, most significant first: T | 2^b
is kept when at least `take` allowed keys are ≥ it (32 counting passes over the row, each a
masked sum over chunks of BLOCK_E columns). Then g = #(u > T) columns are in, and the `take − g`
lowest columns with u = T. One last pass in column order writes every chosen column j at its
rank among the chosen (a running count + an inclusive cumsum within the chunk), so the output
row is ascending by construction; the positions from `take` to k − 1 get −1.

Cost: rows of ≤ RESIDENT_MAX_ENTRIES columns are read twice (held in registers for the 34
counting passes, re-read for the write pass), wider rows 35 times (chunks of BLOCK_E, from L2
after the first); one write of k int64 — at decode (N = 1, E = 4096) against the torch path's
~10 launches with int64 temporaries of 28 B per entry. Rows are independent programs, so a prefill chunk of N rows is N programs;
for very wide rows (E ≫ 64 K) at small N the 33 passes of one program are slow, hence
`FUSED_MAX_ENTRIES`: the dispatcher (`kernels.indexer_select.select_topk`) uses this kernel only up to it.

Radix (`_topk_rows_radix_kernel`, the default; `SGLANG_DSV41_TOPK_SEARCH=bisect` for the above): the same
T found one 8-bit digit at a time, most significant first, on uint32 keys (`_ukey32`, the same
order): a 256-bin histogram of the digit over the allowed keys whose higher digits equal T's so far;
the digit is the largest d with #(digit ≥ d) ≥ need, and need drops by #(digit > d). Four histogram
passes replace the 34 counting passes; the first also gives take, and a row with at most k allowed
columns stops there (T = 0: all of them). The last leaves need = the number of keys equal to T to
take. The write pass chooses the same columns in the same order (one 32-bit scan per chunk), so the
result is the same bit for bit.
Spans (`segment_topk`): a program ranks one span of a row, columns [s·segment, (s+1)·segment) of
row r for program r·S + s (S = ⌈E / segment⌉; one span per row for `select_topk_fused`), and with
`lengths` only the columns below lengths[r]: the rest are taken as not allowed and never read. A
CUDA-graph layout sizes its score rows by the served context (the static width), so lengths (the
visible counts) keep a decode step's ranking at the requests' real lengths (`kernels.indexer_select`).
No host sync. Triton's interpreter runs it on CPU tensors (tests).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

#: Columns per chunk of a pass; rows of at most RESIDENT_MAX_ENTRIES columns are held in registers
#: (one chunk, loaded once) — the decode widths of moderate contexts.
BLOCK_E = 1024
RESIDENT_MAX_ENTRIES = 8192
#: Register widths of a resident row: the smallest that holds it — the powers of two from
#: RESIDENT_MIN_BLOCK to RESIDENT_MAX_ENTRIES, so the kernel has seven builds in all (six resident,
#: one chunked) and not one per power of two down to 16: each first use of a build compiles it in
#: the request. Wider blocks for narrow rows were measured (docs/performance.md, session 16, "Kernel builds in a request").
RESIDENT_MIN_BLOCK = 256
RESIDENT_BLOCKS = tuple(1 << b for b in range(RESIDENT_MIN_BLOCK.bit_length() - 1,
                                              RESIDENT_MAX_ENTRIES.bit_length()))
#: Columns per chunk of the write pass (resident rows too: `_write_selected`).
WRITE_BLOCK = 1024
#: Row counts up to which the radix kernel runs a wide row with 16 warps (`radix_warps`).
FEW_ROWS = 128
#: Widest row the dispatcher sends here (wider rows: the torch path).
FUSED_MAX_ENTRIES = 1 << 16
#: How the kernel finds the take-th largest key: "bisect" (34 counting passes) or "radix" (four
#: digit histograms); the default is the one measured faster (docs/performance.md).
SEARCH_ENV, SEARCHES, DEFAULT_SEARCH = "SGLANG_DSV41_TOPK_SEARCH", ("bisect", "radix"), "radix"


def radix_search() -> bool:
    """True when SGLANG_DSV41_TOPK_SEARCH (default DEFAULT_SEARCH) names "radix"; an unknown value raises."""
    chosen = os.environ.get(SEARCH_ENV, "").strip().lower() or DEFAULT_SEARCH
    if chosen not in SEARCHES:
        raise ValueError(f"{SEARCH_ENV}={chosen!r}: expected one of {SEARCHES}")
    return chosen == "radix"


@triton.jit
def _ukey(s):
    """Order-preserving unsigned key (int64 in [0, 2³²)) of fp32 scores; −0 → +0."""
    s = tl.where(s == 0.0, 0.0, s)
    bits = s.to(tl.int32, bitcast=True).to(tl.int64)
    mono = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return mono + 2147483648


@triton.jit
def _count_at_least(base, E, cand, s_res, offs, BLOCK: tl.constexpr, RESIDENT: tl.constexpr):
    """#(allowed columns with key ≥ cand) of the row (RESIDENT: its scores are `s_res`)."""
    if RESIDENT:
        n = tl.sum(((s_res > float("-inf")) & (_ukey(s_res) >= cand)).to(tl.int64), axis=0)
    else:
        acc = tl.zeros([BLOCK], tl.int64)
        for c in range(0, E, BLOCK):
            s = tl.load(base + c + offs, mask=c + offs < E, other=float("-inf"))
            acc += ((s > float("-inf")) & (_ukey(s) >= cand)).to(tl.int64)
        n = tl.sum(acc, axis=0)
    return n


@triton.jit
def _row_span(s_ptr, len_ptr, W, SEG_W, SEGS, stride_s, HAS_LEN: tl.constexpr):
    """(program, base pointer, n, col0) of this program's span (module doc "Spans"): program p ranks row
    p // SEGS, columns [col0, …) of it, col0 = (p % SEGS)·SEG_W, n = how many it reads (≥ 0, int32)."""
    pid = tl.program_id(0).to(tl.int64)
    row = pid // SEGS
    col0 = (pid % SEGS) * SEG_W
    n = tl.minimum(W - col0, SEG_W)
    if HAS_LEN:
        n = tl.minimum(n, tl.load(len_ptr + row).to(tl.int64) - col0)
    return pid, s_ptr + row * stride_s + col0, tl.maximum(n, 0).to(tl.int32), col0  # int32: masks on int32 offsets


@triton.jit
def _topk_rows_kernel(s_ptr, out_ptr, val_ptr, len_ptr, W, SEG_W, SEGS, K, stride_s, stride_o,
                      HAS_LEN: tl.constexpr, BLOCK: tl.constexpr, RESIDENT: tl.constexpr, WBLOCK: tl.constexpr,
                      CAND: tl.constexpr):
    """One span per program (module doc). RESIDENT (SEG_W ≤ BLOCK): the span is loaded once and every
    counting pass runs on registers. CAND: `_write_selected`'s candidates; with HAS_LEN a span past its
    row's length (E = 0) does nothing (stage 2 of `topk_split` reads the spans before the length only)."""
    _program_span(s_ptr, out_ptr, val_ptr, len_ptr, W, SEG_W, SEGS, K, stride_s, stride_o, HAS_LEN, BLOCK, RESIDENT,
                  WBLOCK, CAND, False)


@triton.jit
def _program_span(s_ptr, out_ptr, val_ptr, len_ptr, W, SEG_W, SEGS, K, stride_s, stride_o, HAS_LEN: tl.constexpr,
                  BLOCK: tl.constexpr, RESIDENT: tl.constexpr, WBLOCK: tl.constexpr, CAND: tl.constexpr,
                  RADIX: tl.constexpr):
    """This program's span ranked by the digit search (RADIX) or the bisection, or nothing for a
    candidates span past its row's length."""
    pid, base, E, col0 = _row_span(s_ptr, len_ptr, W, SEG_W, SEGS, stride_s, HAS_LEN)
    obase, vbase = out_ptr + pid * stride_o, val_ptr + pid * stride_o
    if CAND and HAS_LEN:
        if E > 0:
            _rank_span(base, obase, vbase, col0, E, K, BLOCK, RESIDENT, WBLOCK, CAND, RADIX)
    else:
        _rank_span(base, obase, vbase, col0, E, K, BLOCK, RESIDENT, WBLOCK, CAND, RADIX)


@triton.jit
def _rank_span(base, obase, vbase, col0, E, K, BLOCK: tl.constexpr, RESIDENT: tl.constexpr, WBLOCK: tl.constexpr,
               CAND: tl.constexpr, RADIX: tl.constexpr):
    if RADIX:
        _rank_span_radix(base, obase, vbase, col0, E, K, BLOCK, RESIDENT, WBLOCK, CAND)
    else:
        _rank_span_bisect(base, obase, vbase, col0, E, K, BLOCK, RESIDENT, WBLOCK, CAND)


@triton.jit
def _rank_span_bisect(base, obase, vbase, col0, E, K, BLOCK: tl.constexpr, RESIDENT: tl.constexpr,
                      WBLOCK: tl.constexpr, CAND: tl.constexpr):
    """The bisection search and the write pass of one span (`_topk_rows_kernel`)."""
    offs = tl.arange(0, BLOCK)
    s_res = tl.load(base + offs, mask=offs < E, other=float("-inf")) if RESIDENT else tl.zeros([BLOCK], tl.float32)
    zero = tl.full([], 0, tl.int64)
    take = tl.minimum(_count_at_least(base, E, zero, s_res, offs, BLOCK, RESIDENT), K)
    thr = zero                                           # the take-th largest key, built bit by bit
    for i in range(32):
        cand = thr | (tl.full([], 1, tl.int64) << (31 - i))
        thr = tl.where(_count_at_least(base, E, cand, s_res, offs, BLOCK, RESIDENT) >= take, cand, thr)
    need_eq = take - _count_at_least(base, E, thr + 1, s_res, offs, BLOCK, RESIDENT)   # equal keys to take
    _write_selected(base, obase, vbase, col0, E, K, thr.to(tl.uint32), take.to(tl.int32), need_eq.to(tl.int32),
                    WBLOCK, CAND)                        # the same key as `_ukey32` on allowed scores


@triton.jit
def _ukey32(s):
    """`_ukey` as uint32, 0 for a disallowed (−∞) score: the same order on the allowed ones, half the
    width (negative → all bits flipped, else the sign bit set; −0 → +0), and every allowed key ≥
    key(−∞) + 1 > 0 (0 itself would be a NaN's key, which the contract excludes)."""
    s = tl.where(s == 0.0, 0.0, s)
    b = s.to(tl.uint32, bitcast=True)
    return tl.where(s > float("-inf"), tl.where((b >> 31) != 0, b ^ 0xFFFFFFFF, b | 0x80000000), 0)


@triton.jit
def _digit_histogram(base, E, prefix, shift, u_res, offs, BLOCK: tl.constexpr, RESIDENT: tl.constexpr,
                     TOP: tl.constexpr):
    """[256] int32: histogram of key digit (u >> shift) & 255 over the allowed columns whose key
    bits above the digit equal `prefix`'s (TOP, the top digit: all allowed columns)."""
    if RESIDENT:
        match = u_res != 0
        if not TOP:
            match = match & ((u_res >> (shift + 8)) == (prefix >> (shift + 8)))
        hist = tl.histogram(((u_res >> shift) & 255).to(tl.int32), 256, mask=match)
    else:
        hist = tl.zeros([256], tl.int32)
        for c in range(0, E, BLOCK):
            u = _ukey32(tl.load(base + c + offs, mask=c + offs < E, other=float("-inf")))
            match = u != 0
            if not TOP:
                match = match & ((u >> (shift + 8)) == (prefix >> (shift + 8)))
            hist += tl.histogram(((u >> shift) & 255).to(tl.int32), 256, mask=match)
    return hist


@triton.jit
def _next_digit(hist, need, thr, shift):
    """(thr with the digit at `shift` set, need less the keys above it): the digit is the largest d
    with #(digit ≥ d) ≥ need among the keys the histogram counts."""
    bins = tl.arange(0, 256)
    at_least = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist          # keys with digit ≥ b
    digit = tl.maximum(tl.sum((at_least >= need).to(tl.int32), axis=0) - 1, 0)
    above = tl.sum(tl.where(bins == digit, at_least - hist, 0), axis=0)       # keys with digit > it
    return thr | (digit.to(tl.uint32) << shift), need - above


@triton.jit
def _write_selected(base, obase, vbase, col0, E, K, thr, take, need_eq, WBLOCK: tl.constexpr, CAND: tl.constexpr):
    """The write pass (module doc), on uint32 keys: in column order, every allowed column with key > thr and the
    first `need_eq` with key == thr, at its rank among the chosen; then −1 from `take` to K − 1. CAND
    (`segment_candidates`): the column written is col0 + local, and its score goes to `vbase` at the same rank
    (−∞ from `take` on). In chunks of WBLOCK columns read again (a resident row too: a scan over the whole row
    would cost it its registers), one scan per chunk: the greater keys counted in the low 16 bits and the equal
    ones in the high 16 (WBLOCK < 65,536), so a chosen column's rank is #greater so far + min(#equal so far,
    need_eq). thr > 0 or need_eq = 0, so the disallowed columns (key 0) are never chosen."""
    offs = tl.arange(0, WBLOCK)
    gt_seen = tl.full([], 0, tl.int32)
    eq_seen = tl.full([], 0, tl.int32)
    for c in range(0, E, WBLOCK):
        cols = c + offs
        sc = tl.load(base + cols, mask=cols < E, other=float("-inf"))
        u = _ukey32(sc)
        gt = u > thr
        eq = u == thr
        packed = gt.to(tl.int32) + (eq.to(tl.int32) << 16)
        both = tl.cumsum(packed, axis=0)
        n_eq = eq_seen + (both >> 16)                     # 1-based rank among the equal keys so far
        chosen = gt | (eq & (n_eq <= need_eq))
        pos = gt_seen + (both & 0xFFFF) + tl.minimum(n_eq, need_eq) - 1
        if CAND:
            tl.store(obase + pos, col0 + cols.to(tl.int64), mask=chosen)
            tl.store(vbase + pos, sc, mask=chosen)
        else:
            tl.store(obase + pos, cols.to(tl.int64), mask=chosen)
        chunk = tl.sum(packed, axis=0)                    # both counts of the chunk in one reduction
        gt_seen += chunk & 0xFFFF
        eq_seen += chunk >> 16
    for c in range(0, K, WBLOCK):
        p = c + offs
        tl.store(obase + p, tl.full([WBLOCK], -1, tl.int64), mask=(p >= take) & (p < K))
        if CAND:
            tl.store(vbase + p, tl.full([WBLOCK], float("-inf"), tl.float32), mask=(p >= take) & (p < K))


@triton.jit
def _topk_rows_radix_kernel(s_ptr, out_ptr, val_ptr, len_ptr, W, SEG_W, SEGS, K, stride_s, stride_o,
                            HAS_LEN: tl.constexpr, BLOCK: tl.constexpr, RESIDENT: tl.constexpr,
                            WBLOCK: tl.constexpr, CAND: tl.constexpr):
    """`_topk_rows_kernel`'s result from four 8-bit digit histograms of uint32 keys instead of 34
    counting passes (module doc "Radix"); a resident span is held as its keys only. A span with at
    most K allowed columns takes them all after the first histogram (threshold 0). CAND and HAS_LEN:
    as `_topk_rows_kernel`."""
    _program_span(s_ptr, out_ptr, val_ptr, len_ptr, W, SEG_W, SEGS, K, stride_s, stride_o, HAS_LEN, BLOCK, RESIDENT,
                  WBLOCK, CAND, True)


@triton.jit
def _rank_span_radix(base, obase, vbase, col0, E, K, BLOCK: tl.constexpr, RESIDENT: tl.constexpr,
                     WBLOCK: tl.constexpr, CAND: tl.constexpr):
    """The digit search and the write pass of one span (`_topk_rows_radix_kernel`)."""
    offs = tl.arange(0, BLOCK)
    if RESIDENT:
        u_res = _ukey32(tl.load(base + offs, mask=offs < E, other=float("-inf")))
    else:
        u_res = tl.zeros([BLOCK], tl.uint32)
    thr = tl.full([], 0, tl.uint32)                      # the take-th largest key, a digit at a time
    hist = _digit_histogram(base, E, thr, 24, u_res, offs, BLOCK, RESIDENT, True)
    allowed = tl.sum(hist, axis=0)
    take = tl.minimum(allowed, K)
    need = tl.full([], 0, tl.int32)                      # its rank among the keys matching thr so far
    if allowed > K:
        thr, need = _next_digit(hist, take, thr, 24)
        for shift in range(16, -1, -8):                  # a loop, not unrolled: fewer live registers
            hist = _digit_histogram(base, E, thr, shift, u_res, offs, BLOCK, RESIDENT, False)
            thr, need = _next_digit(hist, need, thr, shift)
    _write_selected(base, obase, vbase, col0, E, K, thr, take, need, WBLOCK, CAND)


def select_topk_fused(scores: Tensor, k: int, *, lengths: Tensor | None = None, radix: bool | None = None,
                      num_warps: int | None = None) -> Tensor:
    """[N, k] int64, `kernels.indexer_select.select_topk(scores, k, check_nan=False, lengths=lengths)` bit
    for bit (module doc); scores fp32 [N, E] (CUDA, or CPU under TRITON_INTERPRET=1). `lengths` [N]
    (integer, on the scores' device): row r ranks columns < lengths[r] only and reads no other.
    `num_warps` overrides `launch_blocks`' choice (benchmarks)."""
    return segment_topk(scores, k, scores.shape[1] if scores.dim() == 2 else 0, lengths=lengths, radix=radix,
                        num_warps=num_warps)


def segment_topk(scores: Tensor, k: int, segment: int, *, lengths: Tensor | None = None, radix: bool | None = None,
                 num_warps: int | None = None) -> Tensor:
    """[N·S, k] int64, S = ⌈E / segment⌉: row r·S + s is the top-k of columns [s·segment, (s+1)·segment) of
    scores row r (below E, and below lengths[r] when given), as columns local to that span, ascending,
    −1 padded (module doc "Spans"). One launch; `segment` = E is `select_topk_fused`."""
    return _spans(scores, k, segment, lengths, radix, num_warps, candidates=False)[0]


def segment_candidates(scores: Tensor, k: int, segment: int, *, lengths: Tensor | None = None,
                       radix: bool | None = None) -> tuple[Tensor, Tensor]:
    """(columns [N, S·k] int64, scores [N, S·k] fp32): `segment_topk`'s spans side by side per row, each
    span's top-k as columns of the row (col0 + local) with their scores, −1 / −∞ padded — stage 1 of
    `topk_split` and its candidates in one launch. With `lengths`, spans past a row's length write
    nothing (those positions hold any value): read only the first ⌈lengths[r] / segment⌉·k of row r."""
    out, vals = _spans(scores, k, segment, lengths, radix, None, candidates=True)
    return out.view(scores.shape[0], -1), vals.view(scores.shape[0], -1)


def _spans(scores: Tensor, k: int, segment: int, lengths: Tensor | None, radix: bool | None, num_warps: int | None,
           candidates: bool) -> tuple[Tensor, Tensor | None]:
    """One launch of the spans kernel (`segment_topk`, or with `candidates` `segment_candidates`)."""
    if scores.dim() != 2 or scores.dtype != torch.float32:
        raise TypeError(f"select_topk_fused: want a 2-D fp32 score tensor, got {scores.dtype} {tuple(scores.shape)}")
    if k < 1:
        raise ValueError(f"select_topk_fused: k must be ≥ 1, got {k}")
    N, E = scores.shape
    if lengths is not None and (lengths.shape != (N,) or lengths.dtype not in (torch.int32, torch.int64)
                                or lengths.device != scores.device):
        raise ValueError(f"select_topk_fused: lengths must be int32 / int64 [{N}] on {scores.device}, got "
                         f"{lengths.dtype} {tuple(lengths.shape)} on {lengths.device}")
    segs = -(-E // segment) if E else 1
    out = torch.empty((N * segs, k), dtype=torch.int64, device=scores.device)
    vals = torch.empty((N * segs, k), dtype=torch.float32, device=scores.device) if candidates else None
    if N == 0:
        return out, vals
    if E == 0:
        return out.fill_(-1), (vals.fill_(float("-inf")) if candidates else None)
    s = scores if scores.stride(1) == 1 else scores.contiguous()
    lens = s if lengths is None else lengths.contiguous()     # any pointer when HAS_LEN is off (never read)
    block, resident, warps = launch_blocks(segment)
    args = (s, out, out if vals is None else vals, lens, E, segment, segs, k, s.stride(0), out.stride(0))
    flags = dict(HAS_LEN=lengths is not None, BLOCK=block, RESIDENT=resident, WBLOCK=min(block, WRITE_BLOCK),
                 CAND=candidates)
    if radix_search() if radix is None else radix:
        _topk_rows_radix_kernel[(N * segs,)](*args, **flags,
                                             num_warps=num_warps or radix_warps(block, resident, N * segs))
    else:
        _topk_rows_kernel[(N * segs,)](*args, **flags, num_warps=num_warps or warps)
    return out, vals


def radix_warps(block: int, resident: bool, rows: int) -> int:
    """Warps per row of the radix kernel, as measured on the H200 (docs/performance.md, session 19):
    at most FEW_ROWS rows (decode, hit extends) a wide row is one program's latency, so 16 warps
    (resident rows of ≥ 4,096 columns and chunked rows); more rows (prefill chunks) fill the GPU, so
    fewer warps and more rows per multiprocessor — 8 for an 8,192-column resident row, else 4."""
    if rows <= FEW_ROWS:
        return 16 if (not resident or block >= 4096) else 4
    return 8 if resident and block >= 8192 else 4


def launch_blocks(E: int) -> tuple[int, bool, int]:
    """(BLOCK, RESIDENT, num_warps) of a row of E columns: the smallest of RESIDENT_BLOCKS that holds
    it (RESIDENT_MAX_ENTRIES is the last), else chunks of BLOCK_E; num_warps is the bisection
    kernel's (the radix kernel's: `radix_warps`)."""
    for block in RESIDENT_BLOCKS:
        if E <= block and E <= RESIDENT_MAX_ENTRIES:
            return block, True, 8 if block >= 4096 else 4
    return BLOCK_E, False, 4

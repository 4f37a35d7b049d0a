"""W8A8 FP8 GEMV on the CUDA cores for 1–4 rows: the `gemv` row tier of `kernels/fp8_w8a8.py`
(spec `model.md` §2.3, §3.8; issue 21). Opt-in (`SGLANG_DSV41_FP8_GEMM=w8a8_gemv`) until the H200
measures it (docs/performance.md "Session 25").

Why a tier of its own: at one decode row the tensor-core tier multiplies 16-row MMA tiles (15 rows
of padding) and quantises the activation again in every program; the H200 sweep found it at
26–35 % of copy bandwidth at every launch configuration. Here the products run on the CUDA cores,
which have time to spare at ≤ GEMV_MAX_ROWS rows.

Operands and rounding points are the tensor-core tiers' (`fp8_w8a8` module doc):
1. `act_quant`: x̂ = q·s_x per (row, 32 columns) — quantised by the kernel per block it reads
   (`fused_quant`, `fp8_quant._quantize_groups`), or by one `fake_quantize_activations_bf16` launch
   before it (exact in BF16): the same values, hence the same bits; otherwise (W8A16, `wo_a`) the
   kernel rounds x to BF16 itself;
2. one program per BLOCK_N weight rows and K chunk (`fp8_w8a8.k_chunks`, shape only); per 32-wide
   K block kb and row m, p = Σ_k x̂[m, k]·w[n, k] in fp32 — every product exact (E4M3 times an
   E4M3·2^e or BF16 value), the 32 summed by Triton's reduction tree, which equals
   s_x·Σ_k q·w exactly (power-of-two scaling) — then acc_m += p·s_w[n/32, kb], kb ascending;
3. the chunk partials summed in ascending order from 0 (inside the launch with `counters`, else
   `fp8_w8a8.sum_chunks`), one BF16 rounding.

Error: the tensor-core tiers' bound (exact products, fp32 sums). Bits: only the order inside a
32-block differs from the MMA tiers, so the tier boundary changes bits (as between the other
tiers). Each row has its own accumulator and the same [BLOCK_N, 32] reduction at every M, so a
row's bits do not depend on the batch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from sglang_dsv41.kernels.fp8_quant import _quantize_groups, _rne_bf16, fake_quantize_activations_bf16
from sglang_dsv41.kernels.fp8_w8a8 import (INTERPRETED, TILE, W8A8Config, _bf16_bits, divisor_block_n, k_chunks,
                                            sum_chunks)

#: the most rows the kernel takes (one accumulator each)
GEMV_MAX_ROWS = 4
#: what the kernel does with x (`X_MODE`): take it as quantised before the launch, round it to BF16
#: (W8A16), or quantise each 32-block itself (no extra launch; the same values q·s_x)
X_PREQUANTISED: tl.constexpr = tl.constexpr(0)
X_ROUND_BF16: tl.constexpr = tl.constexpr(1)
X_QUANTISE: tl.constexpr = tl.constexpr(2)


@triton.jit
def _block_sum(acc, x_row, kk, x_live, wv, sw, X_MODE: tl.constexpr, INTERPRET: tl.constexpr):
    """acc + (Σ over the 32-block of x̂·w)·s_w for one row: wv [BLOCK_N, 32] fp32, sw [BLOCK_N]; x̂ as
    loaded (X_PREQUANTISED), rounded to BF16 (X_ROUND_BF16) or q·s_x of this block (X_QUANTISE)."""
    xv = tl.load(x_row + kk[None, :], mask=x_live, other=0.0).to(tl.float32)     # [1, 32]
    if X_MODE == X_ROUND_BF16:
        xv = _rne_bf16(xv) if INTERPRET else xv.to(tl.bfloat16).to(tl.float32)
    elif X_MODE == X_QUANTISE:
        q, s = _quantize_groups(xv, INTERPRET)
        xv = q.to(tl.float32) * s[:, None]                       # exact: E4M3 times a power of two
    return acc + tl.sum(wv * xv, axis=1) * sw


@triton.jit
def _load_block(w_rows, ws_rows, kb, kb_end, offs_k, n_ok):
    """(E4M3 block [BLOCK_N, 32], its tile scales [BLOCK_N]) of 32-wide K block kb (zeros past kb_end)."""
    live = n_ok & (kb < kb_end)
    return (tl.load(w_rows + (kb * 32 + offs_k)[None, :], mask=live[:, None], other=0.0),
            tl.load(ws_rows + kb, mask=live, other=0.0))


@triton.jit
def _rows_step(acc0, acc1, acc2, acc3, x_row, stride_xm, M, kb, kb_end, offs_k, wb, sw, ROWS: tl.constexpr,
               X_MODE: tl.constexpr, INTERPRET: tl.constexpr):
    """Block kb of every row (one accumulator each; rows ≥ M read zeros)."""
    wv = wb.to(tl.float32)
    kk = kb * 32 + offs_k
    live = kb < kb_end
    acc0 = _block_sum(acc0, x_row, kk, live, wv, sw, X_MODE, INTERPRET)
    if ROWS > 1:
        acc1 = _block_sum(acc1, x_row + stride_xm, kk, live & (M > 1), wv, sw, X_MODE, INTERPRET)
    if ROWS > 2:
        acc2 = _block_sum(acc2, x_row + 2 * stride_xm, kk, live & (M > 2), wv, sw, X_MODE, INTERPRET)
        acc3 = _block_sum(acc3, x_row + 3 * stride_xm, kk, live & (M > 3), wv, sw, X_MODE, INTERPRET)
    return acc0, acc1, acc2, acc3


@triton.jit
def _store_row(ptr, acc, ok, OUT_F32: tl.constexpr, ROUNDED: tl.constexpr, INTERPRET: tl.constexpr):
    if ROUNDED:
        tl.store(ptr, _bf16_bits(acc, OUT_F32, False, INTERPRET), mask=ok)
    else:
        tl.store(ptr, acc, mask=ok)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, ws_ptr, out_ptr, y_ptr, counters_ptr, M, N, K, n_per_group, chunk_blocks, n_chunks,
                 stride_xm, stride_wn, stride_wsn, stride_oc,
                 ROWS: tl.constexpr, BLOCK_N: tl.constexpr, SUB: tl.constexpr, SPLIT_K: tl.constexpr,
                 FIXUP: tl.constexpr, X_MODE: tl.constexpr, OUT_F32: tl.constexpr, INTERPRET: tl.constexpr):
    """y [M, N] (row stride N) of x [M, groups·K] and the E4M3 tiles; with SPLIT_K program (n, c)
    stores chunk c's fp32 partials to out [n_chunks, M, N] (module doc, steps 2–3). Each loop step
    first loads the next step's SUB (2 or 4) weight blocks, so their loads are in flight while this
    step's are summed (ptxas sinks loads to their first use inside a step)."""
    tl.static_assert(SUB == 2 or SUB == 4)
    pid_n = tl.program_id(0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, 32)
    n_ok = offs_n < N
    x_row = x_ptr + ((pid_n * BLOCK_N) // n_per_group) * K       # this group's columns; BLOCK_N divides n_per_group
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    ws_rows = ws_ptr + (offs_n // 32).to(tl.int64) * stride_wsn
    k_blocks = K // 32
    kb_begin = 0
    kb_end = k_blocks
    if SPLIT_K:
        kb_begin = tl.program_id(1) * chunk_blocks
        kb_end = tl.minimum(kb_begin + chunk_blocks, k_blocks)
    acc0 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc1 = tl.zeros_like(acc0)
    acc2 = tl.zeros_like(acc0)
    acc3 = tl.zeros_like(acc0)
    w0, s0 = _load_block(w_rows, ws_rows, kb_begin, kb_end, offs_k, n_ok)
    w1, s1 = _load_block(w_rows, ws_rows, kb_begin + 1, kb_end, offs_k, n_ok)
    if SUB == 4:
        w2, s2 = _load_block(w_rows, ws_rows, kb_begin + 2, kb_end, offs_k, n_ok)
        w3, s3 = _load_block(w_rows, ws_rows, kb_begin + 3, kb_end, offs_k, n_ok)
    for kb0 in range(kb_begin, kb_end, SUB):
        nxt = kb0 + SUB                           # the next step's blocks, loaded before this step's sums
        n0, t0 = _load_block(w_rows, ws_rows, nxt, kb_end, offs_k, n_ok)
        n1, t1 = _load_block(w_rows, ws_rows, nxt + 1, kb_end, offs_k, n_ok)
        if SUB == 4:
            n2, t2 = _load_block(w_rows, ws_rows, nxt + 2, kb_end, offs_k, n_ok)
            n3, t3 = _load_block(w_rows, ws_rows, nxt + 3, kb_end, offs_k, n_ok)
        acc0, acc1, acc2, acc3 = _rows_step(acc0, acc1, acc2, acc3, x_row, stride_xm, M, kb0, kb_end, offs_k, w0, s0,
                                            ROWS, X_MODE, INTERPRET)
        acc0, acc1, acc2, acc3 = _rows_step(acc0, acc1, acc2, acc3, x_row, stride_xm, M, kb0 + 1, kb_end, offs_k, w1,
                                            s1, ROWS, X_MODE, INTERPRET)
        w0, s0, w1, s1 = n0, t0, n1, t1
        if SUB == 4:
            acc0, acc1, acc2, acc3 = _rows_step(acc0, acc1, acc2, acc3, x_row, stride_xm, M, kb0 + 2, kb_end, offs_k,
                                                w2, s2, ROWS, X_MODE, INTERPRET)
            acc0, acc1, acc2, acc3 = _rows_step(acc0, acc1, acc2, acc3, x_row, stride_xm, M, kb0 + 3, kb_end, offs_k,
                                                w3, s3, ROWS, X_MODE, INTERPRET)
            w2, s2, w3, s3 = n2, t2, n3, t3
    if SPLIT_K:
        dst = out_ptr + tl.program_id(1).to(tl.int64) * stride_oc + offs_n
    else:
        dst = y_ptr + offs_n
    _store_row(dst, acc0, n_ok, OUT_F32, not SPLIT_K, INTERPRET)
    if ROWS > 1:
        _store_row(dst + N, acc1, n_ok & (M > 1), OUT_F32, not SPLIT_K, INTERPRET)
    if ROWS > 2:
        _store_row(dst + 2 * N, acc2, n_ok & (M > 2), OUT_F32, not SPLIT_K, INTERPRET)
        _store_row(dst + 3 * N, acc3, n_ok & (M > 3), OUT_F32, not SPLIT_K, INTERPRET)
    if FIXUP:                                       # the last-arriving chunk sums all (fixed order)
        tl.debug_barrier()                          # every thread's partial stored before the release
        slot = counters_ptr + pid_n
        arrived = tl.atomic_add(slot, 1, sem="acq_rel", scope="gpu")
        if arrived == n_chunks - 1:
            for m in tl.static_range(ROWS):
                if m < M:
                    y = tl.zeros((BLOCK_N,), dtype=tl.float32)
                    for c in range(n_chunks):
                        y += tl.load(out_ptr + c * stride_oc + m * N + offs_n, mask=n_ok, other=0.0,
                                     cache_modifier=".cg")
                    tl.store(y_ptr + m * N + offs_n, _bf16_bits(y, OUT_F32, False, INTERPRET), mask=n_ok)
            tl.atomic_xchg(slot, 0, sem="relaxed", scope="gpu")           # ready for the next launch


def gemv_rows(m: int) -> int:
    """The kernel's ROWS for m rows: 1, 2 or 4 (one compiled variant each)."""
    if not 1 <= m <= GEMV_MAX_ROWS:
        raise ValueError(f"fp8 gemv: {m} rows; the gemv tier takes 1…{GEMV_MAX_ROWS}")
    return 1 if m == 1 else (2 if m == 2 else 4)


def gemv_launch(x: Tensor, values: Tensor, scales: Tensor, cfg: W8A8Config, *, groups: int, act_quant: bool,
                counters: Tensor | None, out_dtype: torch.dtype) -> Tensor:
    """y [M, N] of checked operands (`fp8_w8a8_linear`'s) on `_gemv_kernel` with cfg.block_n rows per
    program (halved until it divides a group) and cfg.sub_blocks K blocks per loop step; M ≤ GEMV_MAX_ROWS.
    `act_quant` with cfg.fused_quant: the kernel quantises x itself, else one launch does first (the
    same values, so the same bits)."""
    M, N, K = x.shape[0], values.shape[0], values.shape[1]
    y = torch.empty(M, N, dtype=out_dtype, device=x.device)
    if M == 0:
        return y
    rows = gemv_rows(M)
    n_per_group = N // groups
    block_n = divisor_block_n(n_per_group, cfg.block_n, "fp8 gemv")
    if act_quant and not cfg.fused_quant:
        xq, x_mode = fake_quantize_activations_bf16(x), X_PREQUANTISED
    else:
        xq, x_mode = (x if x.stride(1) == 1 else x.contiguous()), (X_QUANTISE if act_quant else X_ROUND_BF16)
    chunks = k_chunks(N, K, cfg.target_programs)
    chunk_blocks = -(-(K // TILE) // chunks)
    split = cfg.split_k and chunks > 1
    grid = (triton.cdiv(N, block_n), chunks if split else 1)
    fixup = split and counters is not None and counters.numel() >= grid[0]
    out = torch.empty(chunks, M, N, dtype=torch.float32, device=x.device) if split else y
    launch = {} if INTERPRETED else {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    _gemv_kernel[grid](xq, values, scales, out, y, counters if fixup else y, M, N, K, n_per_group, chunk_blocks,
                       chunks, xq.stride(0), values.stride(0), scales.stride(0), M * N if split else 0,
                       ROWS=rows, BLOCK_N=block_n, SUB=cfg.sub_blocks, SPLIT_K=split, FIXUP=fixup,
                       X_MODE=x_mode, OUT_F32=out_dtype == torch.float32, INTERPRET=INTERPRETED, **launch)
    if split and not fixup:
        sum_chunks(out, y)
    return y


__all__ = ["GEMV_MAX_ROWS", "gemv_launch", "gemv_rows"]

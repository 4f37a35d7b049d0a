"""W8A8 FP8 GEMM for decode rows on scale-folded BF16 operands: the `fold` row tier of
`kernels/fp8_w8a8.py` (spec `model.md` §2.3, §3.8; issue 21), the serving default's decode rows
(`runtime/triton_backend.py` `w8a8_fold`; measured in docs/performance.md "Session 29").

Why a tier of its own: the MMA tiers multiply one 32-wide K block per MMA and scale each block's
fp32 result by s_x·s_w. Here the scales go into the operands instead — both are powers of two, so the
operands stay exact in BF16 — each loop step multiplies 32·SUB columns in one BF16 MMA, and about two
programs per SM stream longer K ranges (`benchmarks/fp8_decode_floor.py`).

Operands and rounding points:
1. x̂ = q·s_x per (row, 32 columns) as BF16 — quantised by the kernel (`fp8_quant._quantize_groups`,
   the values of `fake_quantize_activations_bf16`; exact: E4M3 times 2^≥−42) — or, without
   `act_quant` (W8A16, `wo_a`), x rounded to BF16;
2. ŵ = w·s_w per 32×32 tile as BF16: exact for the scales 2^-124…2^119 the loader admits
   (`fp8_linear.scales_are_bf16_exact`);
3. one program per BLOCK_N weight rows, BLOCK_M rows of x and K chunk (`fp8_w8a8.k_chunks`, shape
   only); acc += x̂·ŵᵀ per step on the tensor cores (exact products, fp32 sums), K ascending;
4. the chunk partials summed in ascending order from 0 by the last-arriving chunk (inside the launch
   with `counters`, else `fp8_w8a8.sum_chunks`), one BF16 rounding.

Quantised hand-off (`x_quantised`, `quantise_out`): the activation quantisation is idempotent — the
values q·s_x of a group quantise to themselves — so a producer may write its BF16 output already
quantised per 32 columns (`quantise_out`: this kernel's store, or one `fake_quantize_activations_bf16`
launch where the store cannot) and its consumer may take x as it is (`x_quantised`: loaded straight
into the MMA, no quantisation in registers; docs/performance.md "Session 29"). Either way the
consumer's result keeps its bits; `x_quantised` on x that is not quantised is a caller error this
kernel cannot see.

Error: the MMA tiers' bound (exact products, fp32 sums; `tests/test_kernels_fp8_w8a8.py`). Bits: the
sums are grouped differently from the MMA tiers', so the tier boundary changes bits; a row's bits do
not depend on the other rows (each row has its own MMA accumulator) nor on split-K's summing launch.
Under Triton's interpreter the BF16 MMA is an fp32 matmul of the same (BF16-exact) values.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from sglang_dsv41.kernels.fp8_quant import _quantize_groups, _rne_bf16, fake_quantize_activations_bf16
from sglang_dsv41.kernels.fp8_w8a8 import (INTERPRETED, TILE, W8A8Config, _bf16_bits, _last_chunk_sum,
                                            divisor_block_n, k_chunks, sum_chunks)


@triton.jit
def _folded_x(xv, ACT_QUANT: tl.constexpr, BLOCK_M: tl.constexpr, SUB: tl.constexpr, INTERPRET: tl.constexpr):
    """x [BLOCK_M, 32·SUB] fp32 → x̂ (fp32 holding BF16 values): q·s_x per 32 columns, or x rounded to BF16."""
    if ACT_QUANT:
        q, s = _quantize_groups(tl.reshape(xv, (BLOCK_M * SUB, 32)), INTERPRET)
        return tl.reshape(q.to(tl.float32) * s[:, None], (BLOCK_M, SUB * 32))
    if INTERPRET:
        return _rne_bf16(xv)
    return xv.to(tl.bfloat16).to(tl.float32)


@triton.jit
def _store_y(y_ptr, tile, ok, y, OUT_F32: tl.constexpr, OUT_QUANT: tl.constexpr, BLOCK_M: tl.constexpr,
             BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr):
    """The BF16 rounding of y [BLOCK_M, BLOCK_N] (fp32 holding it with OUT_F32), stored; OUT_QUANT: then
    quantised per 32 columns (q·s as BF16, `fake_quantize_activations_bf16`'s values)."""
    if OUT_QUANT:
        v = _bf16_bits(y, True, False, INTERPRET)
        q, s = _quantize_groups(tl.reshape(v, (BLOCK_M * BLOCK_N // 32, 32)), INTERPRET)
        y = tl.reshape(q.to(tl.float32) * s[:, None], (BLOCK_M, BLOCK_N))
    tl.store(y_ptr + tile, _bf16_bits(y, OUT_F32, False, INTERPRET), mask=ok)


@triton.jit
def _fold_kernel(x_ptr, w_ptr, ws_ptr, out_ptr, y_ptr, counters_ptr, M, N, K, n_per_group, chunk_blocks, n_chunks,
                 stride_xm, stride_wn, stride_wsn, stride_om, stride_oc,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SUB: tl.constexpr, SPLIT_K: tl.constexpr,
                 FIXUP: tl.constexpr, ACT_QUANT: tl.constexpr, X_QUANTISED: tl.constexpr, OUT_F32: tl.constexpr,
                 OUT_QUANT: tl.constexpr, INTERPRET: tl.constexpr):
    """y [M, N] of x [M, groups·K] and the E4M3 tiles (module doc); with SPLIT_K program (n, m, c) stores
    chunk c's fp32 partials to out [n_chunks, M, N]. X_QUANTISED (with ACT_QUANT): x holds quantised
    values, multiplied as loaded; OUT_QUANT: y stored quantised (`_store_y`)."""
    BLOCK_K: tl.constexpr = SUB * 32
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_g = tl.arange(0, SUB)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + ((pid_n * BLOCK_N) // n_per_group) * K
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    s_rows = ws_ptr + (offs_n // 32).to(tl.int64)[:, None] * stride_wsn
    c = 0
    kb_begin = 0
    kb_end = K // 32
    if SPLIT_K:
        c = tl.program_id(2)
        kb_begin = c * chunk_blocks
        kb_end = tl.minimum(kb_begin + chunk_blocks, kb_end)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb0 in range(kb_begin, kb_end, SUB):
        kk = kb0 * 32 + offs_k
        live = kk < kb_end * 32
        xv = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & live[None, :], other=0.0)
        if ACT_QUANT and X_QUANTISED:
            xf = xv.to(tl.float32) if INTERPRET else xv
        else:
            xf = _folded_x(xv.to(tl.float32), ACT_QUANT, BLOCK_M, SUB, INTERPRET)
        wv = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & live[None, :], other=0.0)
        sv = tl.load(s_rows + (kb0 + offs_g)[None, :], mask=n_ok[:, None] & (kb0 + offs_g < kb_end)[None, :],
                     other=0.0)
        wf = tl.reshape(tl.reshape(wv.to(tl.float32), (BLOCK_N, SUB, 32)) * sv[:, :, None], (BLOCK_N, BLOCK_K))
        if INTERPRET:                               # the interpreter's BF16 dot is unusable (Triton 3.6)
            acc += tl.dot(xf, tl.trans(wf), input_precision="ieee")
        else:
            acc += tl.dot(xf.to(tl.bfloat16), tl.trans(wf.to(tl.bfloat16)))
    tile = offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    ok = m_ok[:, None] & n_ok[None, :]
    if SPLIT_K:
        tl.store(out_ptr + c.to(tl.int64) * stride_oc + tile, acc, mask=ok)
        if FIXUP:                                   # the tile's last-arriving chunk sums all (fixed order)
            last, y = _last_chunk_sum(out_ptr, counters_ptr, tile, ok, n_chunks, stride_oc, BLOCK_M, BLOCK_N)
            if last:
                _store_y(y_ptr, tile, ok, y, OUT_F32, OUT_QUANT, BLOCK_M, BLOCK_N, INTERPRET)
    else:
        _store_y(y_ptr, tile, ok, acc, OUT_F32, OUT_QUANT, BLOCK_M, BLOCK_N, INTERPRET)


def fold_launch(x: Tensor, values: Tensor, scales: Tensor, cfg: W8A8Config, *, groups: int, act_quant: bool,
                counters: Tensor | None, out_dtype: torch.dtype, x_quantised: bool = False,
                quantise_out: bool = False) -> Tensor:
    """y [M, N] of checked operands (`fp8_w8a8_linear`'s) on `_fold_kernel`: cfg.block_m × cfg.block_n tiles
    (block_n halved until it divides a group), 32·cfg.sub_blocks columns per step, K cut by
    `k_chunks(N, K, cfg.target_programs)`. `x_quantised` / `quantise_out`: the quantised hand-off (module
    doc); the output is quantised by the kernel's store where a program stores whole 32-column groups of
    the final sum, else by one launch after it."""
    M, N, K = x.shape[0], values.shape[0], values.shape[1]
    y = torch.empty(M, N, dtype=out_dtype, device=x.device)
    if M == 0:
        return y
    n_per_group = N // groups
    block_n = divisor_block_n(n_per_group, cfg.block_n, "fp8 fold")
    xc = x if x.stride(1) == 1 else x.contiguous()
    chunks = k_chunks(N, K, cfg.target_programs)
    chunk_blocks = -(-(K // TILE) // chunks)
    split = cfg.split_k and chunks > 1
    grid = (triton.cdiv(N, block_n), triton.cdiv(M, cfg.block_m), chunks if split else 1)
    fixup = split and counters is not None and counters.numel() >= grid[0] * grid[1]
    out = torch.empty(chunks, M, N, dtype=torch.float32, device=x.device) if split else y
    launch = {} if INTERPRETED else {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    quant_store = quantise_out and block_n % TILE == 0 and (fixup or not split)
    _fold_kernel[grid](xc, values, scales, out, y, counters if fixup else y, M, N, K, n_per_group, chunk_blocks,
                       chunks, xc.stride(0), values.stride(0), scales.stride(0), N, M * N if split else 0,
                       BLOCK_M=cfg.block_m, BLOCK_N=block_n, SUB=cfg.sub_blocks, SPLIT_K=split, FIXUP=fixup,
                       ACT_QUANT=act_quant, X_QUANTISED=x_quantised, OUT_F32=out_dtype == torch.float32,
                       OUT_QUANT=quant_store, INTERPRET=INTERPRETED, **launch)
    if split and not fixup:
        sum_chunks(out, y)
    if quantise_out and not quant_store:
        y = fake_quantize_activations_bf16(y).to(out_dtype)
    return y


__all__ = ["fold_launch"]

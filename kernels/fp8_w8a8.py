"""W8A8 FP8 GEMM for 32×32-tile weights on Hopper tensor cores (spec `model.md` §2.3, §3.8; issue 21).

`fp8_w8a8_linear(x, values, scales, groups=1)`: x [M, G·K] (bf16, or fp32 holding any values),
values [N, K] `float8_e4m3fn` with unit stride along K, scales [⌈N/32⌉, K/32] fp32 powers of two
(one per 32×32 weight tile, the UE8M0 byte decoded at load) → y [M, N] BF16. With `groups` G > 1
it is the grouped product of `wo_a`: output columns of group g (rows g·N/G … of values) read x's
columns g·K … (g+1)·K − 1 — one launch over all groups. `act_quant=False` leaves the activations
unquantised (x rounded to BF16, BF16 MMA on the exact BF16 weight values: W8A16): that is `wo_a`'s
arithmetic in upstream and in the reference (BF16 on the dequantised weight, spec §2.4.1), with
fp8_linear's bound |ỹ − y*| ≤ K·2⁻²³·S before the BF16 rounding.

Arithmetic — upstream's Hopper numerics (DeepGEMM SM90 block32, spec §3.8):
1. activations per (row, 32 columns): s = 2^⌈log2(max(amax, 1e−10)/448)⌉ (UE8M0), q = e4m3(x/s)
   with round-to-nearest-even — `fp8_quant._quantize_groups`, the same values as `reference.ops.
   fp8_act_fake_quant` (s comes from amax's bits: amax = m·2^e, m ∈ [1, 2), gives e − 8, plus 1
   when m > 1.75 = 448/2^8; the fp32 quotient amax/448 the reference rounds keeps that decision);
2. per 32-wide K block kb: p = q[:, kb]·w[:, kb]ᵀ on the tensor cores (fp32 result), then
   acc += p·s_x[m, kb]·s_w[n/32, kb] in fp32 (power-of-two scales: the products are exact). By
   default the E4M3 operands are widened to f16 first (exact) and multiplied on f16 MMAs
   (`mma.sync` for BLOCK_M 16, `wgmma` for BLOCK_M 64): exact products, fp32 sums — the
   reference's arithmetic on the same quantised operands. `fp8_mma` (opt-in, MID_FP8_CONFIG) feeds
   E4M3 to `wgmma` directly: Hopper's FP8 MMA sums the 32 products with ~14 bits (DeepGEMM
   block32's accumulation class), which measured below the end-to-end contract (docs/runtime.md);
3. K is cut into `k_chunks(n, k, target)` chunks — a function of the weight's shape and the
   configuration's `target_programs` only. Each chunk's
   blocks accumulate into a fresh fp32 sum, in ascending kb; the chunk sums are added in
   ascending order starting from 0, then rounded once to BF16 (RNE). At small M every chunk is
   its own program (split-K: fp32 partials [chunks, M, N]); with `counters` the last program of an
   output tile to finish (an acq_rel arrival count per tile, reset by that program) adds the
   partials in that order inside the same launch, else `_sum_chunks_kernel` does; at large M
   one program walks all chunks. The order of additions is the same either way, so within one
   configuration a row's bits depend neither on the batch nor on split-K. The row tiers use
   different MMA instructions and chunkings and the prefill form is a cuBLAS GEMM, so the bits
   change at the tier boundaries (each stays within the bound below; docs/performance.md).
   `SHAPE_CONFIGS` may give one weight shape its own configuration in a tier — chosen by the
   shape and the tier only, so a row's bits still do not depend on M within the tier. A
   `swap_ab` configuration computes the transposed tile W·xqᵀ (weight rows on the MMA's M side):
   the same products, scales and chunk order, other MMA instructions (other bits).

`out_dtype=torch.float32` stores the BF16-rounded values widened to fp32 (exact) from the same
stores — the bits of the BF16 result upcast, without a copy launch.

Error against the exact product of the quantised operands, y* = Σ_k q_k·s_x·w_k (what the
reference's `linear_fp8` rounds to BF16): every E4M3·E4M3 product is exact; the tensor core sums
32 of them in fp32 (f16 MMA) or, with `fp8_mma`, with its own alignment (Hopper's FP8 MMA keeps
fewer than fp32's bits: at most 2⁻¹³·Σ|products| assumed, the DeepSeek-V3 report's ~14 bits), the fp32 sums add ≤ K/32 roundings
of 2⁻²⁴: |ỹ − y*| ≤ ε = 2⁻¹²·S with S = Σ_k |q_k·s_x·w_k|, and after the BF16 roundings
|ŷ − bf16(y*)| ≤ 2⁻⁷·|y*| + 2ε (the bound of tests/test_kernels_fp8_w8a8.py, derived there). Under
the Triton interpreter the MMA is numpy's fp32 matmul.

Decode (M ≤ 16) reads every weight byte once: 1 B per weight + 4 B per tile scale; the x tile is
quantised inside the GEMM (`fused_quant`, no extra launch). Triton cannot keep the FP8 MMAs in
flight while it scales each 32-K step, so at prefill sizes the kernel stays far below the tensor
cores' rate (docs/performance.md); from BF16_GEMM_MIN_ROWS rows `fp8_w8a8_linear` therefore runs
the *prefill form*: the quantised activations q·s and the dequantised weight as transient BF16
copies (both exact), one cuBLAS BF16 GEMM with fp32 accumulation (reduced-precision split-K
reductions disallowed), one BF16 rounding — the same quantised operands, exact products and
fp32 sums: inside the same bound, with other bits (upstream's own SM90 fallback for M ≥ 64 is
this form, spec `hopper-kernels.md` §1a). Its weight scales must lie in 2^-124…2^119
(`fp8_linear.scales_are_bf16_exact`, checked when weights are loaded).

Triton's interpreter (TRITON_INTERPRET=1 before triton is imported): its FP8 `tl.dot` and its
fp32 → E4M3 / BF16 roundings are unusable (Triton 3.6), so under it (`INTERPRETED`) the kernel
rounds with integer arithmetic (`fp8_quant`) and multiplies the E4M3 values as fp32. Compiled
kernels use the hardware conversions and MMAs. CPU tensors without the interpreter raise.

Launch configurations (`W8A8Config`, the row tiers, SHAPE_CONFIGS, `config_for_rows`, `k_chunks`) live in
`kernels/fp8_w8a8_configs.py` and are re-exported here.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.interpreter import InterpretedFunction

from sglang_dsv41.kernels.fp8_quant import (FP8, TILE, _quantize_groups, _rne_bf16, check_device,
                                            dequantize_weight_bf16, fake_quantize_activations_bf16,
                                            quantize_activations)
from sglang_dsv41.kernels.fp8_w8a8_configs import (CHUNK_BLOCK_N, DECODE_CONFIG, DECODE_S7_CONFIG,
                                                   DECODE_TARGET_PROGRAMS, FOLD_CONFIG, FP8_MMA_ROW_TIERS,
                                                   GEMV_CONFIG, MID_CONFIG, MID_FP8_CONFIG, MIN_CHUNK_BLOCKS,
                                                   PREFILL_CONFIG, ROW_TIERS, SHAPE_CONFIGS, TARGET_PROGRAMS,
                                                   W8A8Config, config_for_rows, divisor_block_n, k_chunks)

#: from this many rows `fp8_w8a8_linear` runs the prefill form (dequantise + cuBLAS BF16, module doc)
BF16_GEMM_MIN_ROWS = 129


# ---- kernels -----------------------------------------------------------------------------------------

@triton.jit
def _product(xq, w, ACT_QUANT: tl.constexpr, FP8_MMA: tl.constexpr, SWAP_AB: tl.constexpr,
             INTERPRET: tl.constexpr):
    """One 32-wide K block on the tensor cores, exact products and fp32 sums: xq [BM, 32] times the
    weight block — Wᵀ [32, BN] → [BM, BN], or with SWAP_AB W [BN, 32] → [BN, BM] (w·xqᵀ)."""
    if INTERPRET:
        a = xq.to(tl.float32)
        b = w.to(tl.float32)
    elif ACT_QUANT and FP8_MMA:
        a = xq                                                # Hopper FP8 MMA sums (~14 bits)
        b = w
    elif ACT_QUANT:
        a = xq.to(tl.float16)                                 # E4M3 → f16 exact, products exact
        b = w.to(tl.float16)
    else:
        a = xq                                                # W8A16: E4M3 → BF16 exact
        b = w.to(tl.bfloat16)
    if SWAP_AB:
        if INTERPRET:
            p = tl.dot(b, tl.trans(a), input_precision="ieee")
        else:
            p = tl.dot(b, tl.trans(a))
    else:
        if INTERPRET:
            p = tl.dot(a, b, input_precision="ieee")
        else:
            p = tl.dot(a, b)
    return p


@triton.jit
def _bf16_bits(v, OUT_F32: tl.constexpr, RAW_OUT: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 → BF16 (RNE), or with OUT_F32 the same BF16 value held in fp32 (exact upcast); with
    RAW_OUT the fp32 value itself (no rounding)."""
    if RAW_OUT:
        return v
    if INTERPRET:
        v = _rne_bf16(v)
    b = v.to(tl.bfloat16)
    if OUT_F32:
        b = b.to(tl.float32)
    return b


@triton.jit
def _last_chunk_sum(out_ptr, counters_ptr, tile, ok, n_chunks, stride_oc, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr):
    """Split-K's in-launch sum, called by every program of grid (N tiles, M tiles, chunks) once its
    chunk's partials are stored at `tile`: (whether it arrived last at its output tile, and then the
    chunks' partials summed in ascending order from 0). The tile's arrival count (acq_rel) is reset by
    that last program, ready for the next launch."""
    tl.debug_barrier()                            # every thread's partial stored before the release
    slot = counters_ptr + tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
    arrived = tl.atomic_add(slot, 1, sem="acq_rel", scope="gpu")
    last = arrived == n_chunks - 1
    y = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if last:
        for c in range(n_chunks):
            y += tl.load(out_ptr + c * stride_oc + tile, mask=ok, other=0.0, cache_modifier=".cg")
        tl.atomic_xchg(slot, 0, sem="relaxed", scope="gpu")
    return last, y


@triton.jit
def _w8a8_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, y_ptr, counters_ptr, M, N, K, n_per_group, chunk_blocks,
                 n_chunks, stride_xm, stride_xsm, stride_wn, stride_wsn, stride_om, stride_oc,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SUB: tl.constexpr, FUSED_QUANT: tl.constexpr,
                 SPLIT_K: tl.constexpr, ACT_QUANT: tl.constexpr, FP8_MMA: tl.constexpr, FIXUP: tl.constexpr,
                 SWAP_AB: tl.constexpr, OUT_F32: tl.constexpr, W_SCALED: tl.constexpr, RAW_OUT: tl.constexpr,
                 INTERPRET: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, 32)
    m_ok = offs_m < M
    n_ok = offs_n < N
    group = (pid_n * BLOCK_N) // n_per_group                      # BLOCK_N divides n_per_group
    k_blocks = K // 32
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + group * K
    xs_rows = xs_ptr + offs_m.to(tl.int64) * stride_xsm + group * k_blocks
    if SWAP_AB:
        w_blk = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn         # W block [BN, 32]
        w_mask = n_ok[:, None]
        k_step = offs_k[None, :]
    else:
        w_blk = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn         # Wᵀ block [32, BN]
        w_mask = n_ok[None, :]
        k_step = offs_k[:, None]
    ws_cols = ws_ptr + (offs_n // 32).to(tl.int64) * stride_wsn
    if SPLIT_K:
        c_begin = tl.program_id(2)
        c_end = c_begin + 1
    else:
        c_begin = 0
        c_end = n_chunks
    if SWAP_AB:
        total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for c in range(c_begin, c_end):
        kb_begin = c * chunk_blocks
        kb_end = tl.minimum(kb_begin + chunk_blocks, k_blocks)
        acc = tl.zeros_like(total)
        for kb0 in range(kb_begin, kb_end, SUB):
            for j in tl.static_range(SUB):
                kb = kb0 + j
                live = kb < kb_end
                kk = kb * 32 + offs_k
                if not ACT_QUANT:                                 # W8A16: x rounded to BF16, scale 1
                    xv = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & live, other=0.0).to(tl.float32)
                    xq = _rne_bf16(xv) if INTERPRET else xv.to(tl.bfloat16)
                    sx = tl.full((BLOCK_M,), 1.0, tl.float32)
                elif FUSED_QUANT:
                    xv = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & live, other=0.0).to(tl.float32)
                    xq, sx = _quantize_groups(xv, INTERPRET)
                else:
                    xq = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & live, other=0.0)
                    sx = tl.load(xs_rows + kb, mask=m_ok & live, other=0.0)
                wb = tl.load(w_blk + kb * 32 + k_step, mask=w_mask & live, other=0.0)
                if W_SCALED:
                    sw = tl.load(ws_cols + kb, mask=n_ok & live, other=0.0)
                p = _product(xq, wb, ACT_QUANT, FP8_MMA, SWAP_AB, INTERPRET)
                if not W_SCALED:                                  # BF16 weight values: no scales (x's is 1)
                    acc += p
                elif SWAP_AB:
                    acc += p * sx[None, :] * sw[:, None]          # the same (p·s_x)·s_w order
                else:
                    acc += p * sx[:, None] * sw[None, :]
        if SPLIT_K:
            total = acc
        else:
            total += acc
    if SWAP_AB:
        total = tl.trans(total)                                   # once per program, to [BM, BN]
    tile = offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    ok = m_ok[:, None] & n_ok[None, :]
    if SPLIT_K:
        tl.store(out_ptr + tl.program_id(2).to(tl.int64) * stride_oc + tile, total, mask=ok)
        if FIXUP:                                     # the tile's last-arriving chunk sums all (fixed order)
            last, y = _last_chunk_sum(out_ptr, counters_ptr, tile, ok, n_chunks, stride_oc, BLOCK_M, BLOCK_N)
            if last:
                tl.store(y_ptr + tile, _bf16_bits(y, OUT_F32, RAW_OUT, INTERPRET), mask=ok)
    else:
        tl.store(out_ptr + tile, _bf16_bits(total, OUT_F32, RAW_OUT, INTERPRET), mask=ok)


@triton.jit
def _sum_chunks_kernel(p_ptr, y_ptr, n_chunks, size, BLOCK: tl.constexpr, OUT_F32: tl.constexpr,
                       RAW_OUT: tl.constexpr, INTERPRET: tl.constexpr):
    """y = bf16(((0 + p[0]) + p[1]) + …) over the chunk partials p [n_chunks, size] fp32 (RAW_OUT: unrounded)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < size
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for c in range(n_chunks):
        total += tl.load(p_ptr + c * size + offs, mask=ok, other=0.0)
    tl.store(y_ptr + offs, _bf16_bits(total, OUT_F32, RAW_OUT, INTERPRET), mask=ok)


INTERPRETED = isinstance(_w8a8_kernel, InterpretedFunction)
SUM_BLOCK = 1024


# ---- host API ------------------------------------------------------------------------------------------

def _bf16_gemm(x: Tensor, values: Tensor, scales: Tensor, groups: int, act_quant: bool) -> Tensor:
    """The prefill form (module doc): BF16 copies of the quantised activations and of the weight
    (transient), one cuBLAS GEMM (`wo_a`: one batched GEMM) with fp32 accumulation and fp32
    split-K reductions (reduced-precision reduction disallowed for the call), one BF16 rounding."""
    M = x.shape[0]
    N, K = values.shape
    xb = fake_quantize_activations_bf16(x) if act_quant else x.to(torch.bfloat16)
    wb = dequantize_weight_bf16(values, scales)
    allowed = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    try:
        if groups == 1:
            return xb @ wb.t()
        r = N // groups                        # group g's rows written straight into columns g·r … (g + 1)·r − 1
        y = torch.empty(M, N, dtype=torch.bfloat16, device=x.device)
        torch.bmm(xb.view(M, groups, K).transpose(0, 1), wb.view(groups, r, K).transpose(1, 2),
                  out=y.view(M, groups, r).transpose(0, 1))
        return y
    finally:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = allowed


def _checked(x: Tensor, values: Tensor, scales: Tensor, groups: int) -> tuple[int, int, int, int]:
    who = "fp8_w8a8_linear"
    if values.dtype != FP8 or values.dim() != 2 or values.stride(1) != 1:
        raise ValueError(f"{who}: values must be 2-D float8_e4m3fn with unit stride along K, got {values.dtype} "
                         f"{tuple(values.shape)} strides {values.stride()}")
    N, K = values.shape
    if K % TILE:
        raise ValueError(f"{who}: K = {K} must be a multiple of {TILE}")
    want = (-(-N // TILE), K // TILE)
    if scales.dtype != torch.float32 or tuple(scales.shape) != want or scales.stride(1) != 1:
        raise ValueError(f"{who}: scales must be fp32 {want} with unit stride, got {scales.dtype} "
                         f"{tuple(scales.shape)} strides {scales.stride()}")
    if groups < 1 or N % groups or (N // groups) % TILE:
        raise ValueError(f"{who}: {N} output rows do not split into {groups} groups of whole 32-row tiles")
    if x.dim() != 2 or x.shape[1] != groups * K or x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"{who}: x must be [M, {groups * K}] fp32 or bf16, got {x.dtype} {tuple(x.shape)}")
    check_device(who, x, values, scales)
    return x.shape[0], N, K, N // groups


def fp8_w8a8_linear(x: Tensor, values: Tensor, scales: Tensor, *, groups: int = 1, act_quant: bool = True,
                    config: W8A8Config | None = None, bf16_gemm: bool | None = None, fp8_mma: bool = False,
                    counters: Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
                    gemv: bool = False, fold: bool = False, x_quantised: bool = False,
                    quantise_out: bool = False) -> Tensor:
    """y [M, N] BF16 = x·Wᵀ with upstream's W8A8 numerics (module doc); `groups` > 1: the grouped
    product (x [M, groups·K], group g's output rows read x's g-th K columns), one GEMM launch.
    From BF16_GEMM_MIN_ROWS rows (or with `bf16_gemm=True`) the prefill form runs (`_bf16_gemm`);
    below, the Triton kernel with `config` or `config_for_rows(M, fp8_mma)`. `act_quant=False`: no
    activation quantisation — x rounded to BF16, exact products, fp32 sums, BF16 out: the reference's
    `linear_bf16` on the dequantised weight, i.e. what `wo_a` is (spec §2.4.1, §3.8). `counters`
    (`split_k_counters`, zero): split-K sums its chunks inside the GEMM launch (module doc, step 3)
    when they cover the launch's output tiles; else a second launch does (the same bits). No host
    sync. `out_dtype=torch.float32`: the same BF16 values held in fp32 (written by the GEMM's own
    stores, no extra launch below BF16_GEMM_MIN_ROWS). `gemv`: up to GEMV_CONFIG.block_m rows on the
    CUDA-core tier (`kernels.fp8_gemv`; one more launch quantises x); `fold`: up to FOLD_CONFIG.block_m rows on
    the scale-folded BF16 MMA tier (`kernels.fp8_fold`). The quantised hand-off (`kernels.fp8_fold` module doc):
    `x_quantised` — x holds activations quantised per 1×32 already, which the fold tier then multiplies as
    loaded (the other tiers quantise them again: the same values); `quantise_out` — y [M, N] BF16 comes
    out quantised per 1×32 (`fake_quantize_activations_bf16`'s values; by the fold tier's store, elsewhere
    one more launch), for a consumer that passes `x_quantised`."""
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"fp8_w8a8_linear: out_dtype must be torch.bfloat16 or torch.float32, got {out_dtype}")
    if counters is not None and (counters.dtype != torch.int32 or counters.dim() != 1
                                 or counters.device != values.device):
        raise ValueError(f"fp8_w8a8_linear: counters must be 1-D int32 on {values.device} (split_k_counters), got "
                         f"{counters.dtype} {tuple(counters.shape)} on {counters.device}")
    M, N, K, n_per_group = _checked(x, values, scales, groups)
    use_bf16_gemm = bf16_gemm if bf16_gemm is not None else (config is None and M >= BF16_GEMM_MIN_ROWS)
    if quantise_out and (N // groups) % TILE:
        raise ValueError(f"fp8_w8a8_linear: quantise_out needs whole 32-column groups, got {N} columns")
    cfg = config or config_for_rows(M, fp8_mma, (N, K, groups), gemv, fold)
    if cfg.fold and not use_bf16_gemm:
        from sglang_dsv41.kernels.fp8_fold import fold_launch

        return fold_launch(x, values, scales, cfg, groups=groups, act_quant=act_quant, counters=counters,
                           out_dtype=out_dtype, x_quantised=x_quantised, quantise_out=quantise_out)
    if use_bf16_gemm:
        y = _bf16_gemm(x, values, scales, groups, act_quant)
    else:
        y = _launch(x, values, scales, cfg, groups=groups, act_quant=act_quant, counters=counters,
                    out_dtype=out_dtype)
    return (fake_quantize_activations_bf16(y) if quantise_out else y).to(out_dtype)


def _launch(x: Tensor, values: Tensor, scales: Tensor | None, cfg: W8A8Config, *, groups: int, act_quant: bool,
            counters: Tensor | None, out_dtype: torch.dtype) -> Tensor:
    """One `_w8a8_kernel` launch (+ `_sum_chunks_kernel` when split-K runs without `counters`) of
    checked operands. `scales` None: BF16 weight values, no scales, fp32 output unrounded
    (`kernels.bf16_linear`); else E4M3 tiles, BF16 output (`out_dtype` fp32: BF16 values in fp32)."""
    if cfg.gemv:
        if scales is None:
            raise ValueError("fp8_w8a8_linear: the gemv tier multiplies E4M3 weights only")
        from sglang_dsv41.kernels.fp8_gemv import gemv_launch

        return gemv_launch(x, values, scales, cfg, groups=groups, act_quant=act_quant, counters=counters,
                           out_dtype=out_dtype)
    if cfg.fold:
        raise ValueError("fp8_w8a8_linear: the fold tier runs through fold_launch (E4M3 weights only)")
    M, N, K = x.shape[0], values.shape[0], values.shape[1]
    n_per_group = N // groups
    raw = scales is None
    y = torch.empty(M, N, dtype=out_dtype, device=x.device)
    if M == 0:
        return y
    if cfg.swap_ab and cfg.fp8_mma:
        raise ValueError("fp8_w8a8_linear: swap_ab runs the f16 / BF16 MMAs only (fp8_mma False)")
    block_n = cfg.block_n if groups == 1 else divisor_block_n(n_per_group, cfg.block_n, "fp8_w8a8_linear")
    if cfg.fused_quant or not act_quant:
        xq, xs = (x if x.stride(1) == 1 else x.contiguous()), x        # xs unused (constexpr path)
        stride_xs = 0
    else:
        xq, xs = quantize_activations(x)
        stride_xs = xs.stride(0)
    chunks = k_chunks(N, K, cfg.target_programs)
    blocks = K // TILE
    chunk_blocks = -(-blocks // chunks)
    split = cfg.split_k and chunks > 1
    grid = (triton.cdiv(N, block_n), triton.cdiv(M, cfg.block_m), chunks if split else 1)
    fixup = split and counters is not None and counters.numel() >= grid[0] * grid[1]
    out = torch.empty(chunks, M, N, dtype=torch.float32, device=x.device) if split else y
    launch = {} if INTERPRETED else {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    ws, stride_ws = (values, 0) if raw else (scales, scales.stride(0))          # raw: ws never read
    _w8a8_kernel[grid](xq, xs, values, ws, out, y, counters if fixup else y, M, N, K, n_per_group, chunk_blocks,
                       chunks, xq.stride(0), stride_xs, values.stride(0), stride_ws, out.stride(-2),
                       out.stride(0) if split else 0, BLOCK_M=cfg.block_m, BLOCK_N=block_n, SUB=cfg.sub_blocks,
                       FUSED_QUANT=cfg.fused_quant, SPLIT_K=split, ACT_QUANT=act_quant, FP8_MMA=cfg.fp8_mma,
                       FIXUP=fixup, SWAP_AB=cfg.swap_ab, OUT_F32=out_dtype == torch.float32, W_SCALED=not raw,
                       RAW_OUT=raw, INTERPRET=INTERPRETED, **launch)
    if split and not fixup:
        sum_chunks(out, y, raw=raw)
    return y


def sum_chunks(partials: Tensor, y: Tensor, *, raw: bool = False) -> None:
    """y = bf16(((0 + p[0]) + p[1]) + …) over the split-K partials [chunks, M, N] (`raw`: unrounded), in
    one `_sum_chunks_kernel` launch: the fixed order of the in-launch sum (module doc, step 3)."""
    size = y.numel()
    _sum_chunks_kernel[(triton.cdiv(size, SUM_BLOCK),)](partials, y, partials.shape[0], size, BLOCK=SUM_BLOCK,
                                                        OUT_F32=y.dtype == torch.float32, RAW_OUT=raw,
                                                        INTERPRET=INTERPRETED)


def split_k_counters(n: int, device: torch.device | str) -> Tensor:
    """The zeroed int32 arrival counters `fp8_w8a8_linear(counters=)` needs for a weight with `n`
    output rows at every row tier below BF16_GEMM_MIN_ROWS (one per output tile); allocate once,
    outside CUDA-graph capture: each launch leaves them zero again."""
    tiles = max(triton.cdiv(BF16_GEMM_MIN_ROWS - 1, c.block_m) * triton.cdiv(n, 16) for _, c in ROW_TIERS)
    return torch.zeros(tiles, dtype=torch.int32, device=device)


def weight_bytes(n: int, k: int) -> int:
    """Device bytes of one FP8 weight [n, k]: E4M3 values + fp32 tile scales."""
    return n * k + 4 * (-(-n // TILE)) * (-(-k // TILE))


__all__ = ["BF16_GEMM_MIN_ROWS", "CHUNK_BLOCK_N", "DECODE_CONFIG", "FOLD_CONFIG", "GEMV_CONFIG", "DECODE_S7_CONFIG",
           "DECODE_TARGET_PROGRAMS", "FP8", "FP8_MMA_ROW_TIERS", "INTERPRETED", "MID_CONFIG", "MID_FP8_CONFIG",
           "MIN_CHUNK_BLOCKS", "PREFILL_CONFIG", "ROW_TIERS", "SHAPE_CONFIGS", "TARGET_PROGRAMS", "TILE", "W8A8Config",
           "config_for_rows", "dequantize_weight_bf16", "divisor_block_n", "fake_quantize_activations_bf16",
           "fp8_w8a8_linear", "k_chunks", "quantize_activations", "split_k_counters", "weight_bytes"]

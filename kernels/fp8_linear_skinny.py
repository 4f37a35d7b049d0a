"""y = x·Wᵀ for FP8 block-scaled weights, "swap AB" form for skinny x (decode) — a candidate next to
`fp8_linear` (spec `model.md` §2.3, §3.8). Not the runtime default: nothing calls it but the tests
and `benchmarks/fp8_linear.py` (label `swap_ab`).

`fp8_linear_swap_ab(x, values, scales)`: same inputs and rules as `fp8_linear.fp8_linear` (x [M, K]
fp32 holding BF16 values or bf16, values [N, K] `float8_e4m3fn` with unit K stride — a weight or a
row slice of one starting on a 32-row tile — scales [⌈N/32⌉, ⌈K/32⌉] fp32 powers of two) → y [M, N]
fp32.

Form. The kernel computes yᵀ[N, M] = W[N, K]·xᵀ[K, M]: the weight's rows are the MMA's M
dimension (BLOCK_W rows per program, a multiple of 32 so a program holds whole scale-tile rows)
and x's rows its N dimension (BLOCK_X = 16, the smallest `tl.dot` N; rows ≥ M are masked zeros).
For M ≤ 16 one program streams BLOCK_W complete weight rows and never re-reads a byte; the weight
tile is loaded row-major with K contiguous, i.e. whole 32-byte sectors of each row. The result is
stored transposed into y [M, N] (contiguous along N).

Arithmetic. The K loop steps BLOCK_K; inside a step, BLOCK_K/32 sub-steps of 32 columns each
load the E4M3 block [BLOCK_W, 32], its scales — one per 32-row group, a [BLOCK_W] vector
(s[row // 32, k // 32]) broadcast along the 32 columns — convert to fp32 (exact), multiply by the
scale (power of two: exact), cast to BF16 (exact when `scales_are_bf16_exact`, see fp8_linear's
module doc), and `tl.dot(w [BLOCK_W, 32] bf16, xᵀ [32, 16] bf16, acc)` with fp32 accumulation.
Splitting the K step into 32-column sub-steps is what makes the scale a per-row vector: the
[BLOCK_W/32, BLOCK_K/32] scale block never has to be expanded to [BLOCK_W, BLOCK_K] (that needs
tl.reshape/broadcast tricks the team avoids on the H200, or BLOCK_W·BLOCK_K scalar scale loads).
Products are exact (8 + 8 significand bits), accumulation fp32, so fp8_linear's bound holds
unchanged:

    |ŷ − x·Wᵀ| ≤ K·2⁻²³·S,   S = Σ_k |x_k|·|W_k|                        (GEMM_BOUND)

The bits differ from `fp8_linear`'s (different MMA shapes and accumulation grouping).

Batch invariance. The configuration (`SWAP_AB_CONFIG`) is one constant: independent of M and of
the weight's shape. M is walked in blocks of 16 x rows (grid axis 0); each output element y[m, n]
is W[n]·x[m] accumulated over the same 32-column sub-steps in the same order, with no split-K and
no cross-row reduction; a masked x row only meets its own output column. So a row's result is the
same bits alone or in any batch, and a tile-row slice of a weight gives the same bits as those
columns of the whole product (its programs see the same rows in the same 32-row groups).

Configuration (reasoning; nothing here was timed — the H200 was not available when it was
written). Decode is weight-bandwidth bound: the kernel must keep enough weight bytes in flight
per SM and enough SMs busy. Programs = ⌈N/BLOCK_W⌉ for M ≤ 16: with BLOCK_W = 64 the Flash layer
gives wq_b 512, wo_a 128, wo_b / shared w2 80, indexer wq_b 64, shared w1/w3 36, wq_a 20, wkv 8
(132 SMs); BLOCK_W = 128 halves every count (wo_a 64, wo_b 40: half the SMs idle for 60 % of the
bytes) and BLOCK_W = 32 leaves wgmma for mma.sync, so 64 (one warpgroup of 4 warps: wgmma
M = 64, N = 16). BLOCK_K = 256 (eight 32-column sub-steps) and num_stages = 4: Triton 3.6
pipelines every load of the loop through shared memory with cp.async (the weight tile as 16-byte
`cp.async.cg`, x and the scales as 4/8-byte copies; no `ld.global` left — pinned by the tests),
waiting with two K steps still outstanding, i.e. 2–3 × 64 × 256 B = 32–48 KiB of weight in flight
per program. Compiled for sm_90 (Triton's ptxas, runtime argument alignment): 55 registers, no
spills, 105,472 B of shared memory (x's fp32 [256, 16] tile per stage costs as much as the
weight's), so 2 programs fit per SM — enough for wq_b's 512 programs, while the under-filled
weights (≤ 1 program per SM) get the deepest pipeline. Rejected on paper: 3 stages (70 KiB,
16–32 KiB in flight), 5 stages (137 KiB: one program per SM), 128 × 128 × 4 (72 registers, half
the programs). The benchmark times 32 × 256 × 4, 128 × 128 × 4 and 64 × 256 × 3 next to it.
Grid: (⌈M/16⌉, ⌈N/BLOCK_W⌉) — the x blocks sharing a weight block are launched together, so for
M > 16 they read it from L2. `Fp8SkinnyConfig` values other than `SWAP_AB_CONFIG` are for the
benchmark only (each fixed choice is equally invariant, with different bits).

Interpreter: as in fp8_linear, under TRITON_INTERPRET=1 the BF16-valued operands are multiplied as
fp32 (Triton 3.6's interpreted BF16 `tl.dot` is wrong; same exact products, same bound).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from .fp8_linear import INTERPRETED, TILE, checked_inputs

#: x rows per program: the smallest N of `tl.dot`
BLOCK_X = 16


@dataclass(frozen=True)
class Fp8SkinnyConfig:
    block_w: int      # weight rows per program (a multiple of 32)
    block_k: int      # K step (a multiple of 32; walked in 32-column sub-steps)
    num_warps: int
    num_stages: int


#: the one configuration of `fp8_linear_swap_ab` (module doc)
SWAP_AB_CONFIG = Fp8SkinnyConfig(block_w=64, block_k=256, num_warps=4, num_stages=4)


@triton.jit
def _fp8_linear_swap_ab_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_ym,
                               BLOCK_W: tl.constexpr, BLOCK_X: tl.constexpr, BLOCK_K: tl.constexpr,
                               DOT_FP32: tl.constexpr):
    pid_x = tl.program_id(0)                  # x blocks of one weight block are adjacent: they share it in L2
    pid_w = tl.program_id(1)
    offs_w = pid_w * BLOCK_W + tl.arange(0, BLOCK_W)
    offs_x = pid_x * BLOCK_X + tl.arange(0, BLOCK_X)
    offs_c = tl.arange(0, 32)                                      # one scale tile's columns
    w_ok = offs_w < N
    x_ok = offs_x < M
    w_rows = w_ptr + offs_w.to(tl.int64)[:, None] * stride_wn      # [BW, 1]
    x_cols = x_ptr + offs_x.to(tl.int64)[None, :] * stride_xm      # xᵀ: [1, BX]
    s_rows = s_ptr + (offs_w // 32).to(tl.int64) * stride_sn        # [BW]: each row's scale-tile row
    acc = tl.zeros((BLOCK_W, BLOCK_X), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        for j in tl.static_range(BLOCK_K // 32):
            kk = k0 + j * 32 + offs_c
            k_ok = kk < K
            w8 = tl.load(w_rows + kk[None, :], mask=w_ok[:, None] & k_ok[None, :], other=0.0)      # [BW, 32]
            s = tl.load(s_rows + (k0 // 32 + j), mask=w_ok & (k0 + j * 32 < K), other=0.0)          # [BW]
            xt = tl.load(x_cols + kk[:, None], mask=k_ok[:, None] & x_ok[None, :], other=0.0)       # [32, BX]
            w = (w8.to(tl.float32) * s[:, None]).to(tl.bfloat16)
            if DOT_FP32:
                acc += tl.dot(w.to(tl.float32), xt.to(tl.bfloat16).to(tl.float32), input_precision="ieee")
            else:
                acc = tl.dot(w, xt.to(tl.bfloat16), acc)
    y = y_ptr + offs_x.to(tl.int64)[None, :] * stride_ym + offs_w[:, None]                       # yᵀ tile
    tl.store(y, acc, mask=w_ok[:, None] & x_ok[None, :])


def fp8_linear_swap_ab(x: Tensor, values: Tensor, scales: Tensor, *, config: Fp8SkinnyConfig | None = None) -> Tensor:
    """x·Wᵀ in fp32 within GEMM_BOUND (module doc), inputs as `fp8_linear` (same checks). No host
    sync. `config` overrides `SWAP_AB_CONFIG` (benchmark sweeps; a different fixed choice gives
    different, equally bounded and invariant bits)."""
    cfg = config or SWAP_AB_CONFIG
    if cfg.block_w % TILE or cfg.block_k % TILE or cfg.block_w < TILE or cfg.block_k < TILE:
        raise ValueError(f"fp8_linear_swap_ab: BLOCK_W {cfg.block_w} and BLOCK_K {cfg.block_k} must be positive "
                         f"multiples of the {TILE}-row scale tile")
    x = checked_inputs(x, values, scales, "fp8_linear_swap_ab")
    M, (N, K) = x.shape[0], values.shape
    y = torch.empty(M, N, dtype=torch.float32, device=x.device)
    if M == 0:
        return y
    grid = (triton.cdiv(M, BLOCK_X), triton.cdiv(N, cfg.block_w))
    launch = {} if INTERPRETED else {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    _fp8_linear_swap_ab_kernel[grid](x, values, scales, y, M, N, K, x.stride(0), values.stride(0), scales.stride(0),
                                     y.stride(0), BLOCK_W=cfg.block_w, BLOCK_X=BLOCK_X, BLOCK_K=cfg.block_k,
                                     DOT_FP32=INTERPRETED, **launch)
    return y


__all__ = ["BLOCK_X", "SWAP_AB_CONFIG", "Fp8SkinnyConfig", "fp8_linear_swap_ab"]

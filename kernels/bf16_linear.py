"""BF16-weight products of few rows on the W8A8 GEMM's kernel (issue 21; spec `model.md` §3.8).

`bf16_linear(x, weight, counters=None)`: x [M, K] (BF16, or fp32 holding BF16 values) times a
BF16 weight [N, K] (unit stride along K) → y [M, N] fp32, for M < `MAX_ROWS` (= the W8A8 GEMM's
BF16_GEMM_MIN_ROWS). It is `kernels.fp8_w8a8`'s `_w8a8_kernel` with the weight's values taken as
they are (no tile scales) and the fp32 sum stored unrounded: the same row tiers
(`config_for_rows`: `mma.sync` BLOCK_M 16 up to 16 rows, `wgmma` BLOCK_M 64 above), the same
shape-only split-K (`k_chunks`) whose chunk partials the last program of an output tile adds
in ascending order when `counters` (`fp8_w8a8.split_k_counters(N)`) are given, else a second
launch does.

Why it exists, and why it is an opt-in: at decode the CUDA backend multiplies BF16 weights with
cuBLAS on rows padded to a 128-row block (`dense_ops.BlockedBf16Gemm`), 5–9 µs per linear for the
router, compressor and indexer weights of a Flash layer (0.3–5 MB). This one launch measured no
faster on the H200 (the layer's BF16 products 34 / 43 / 127 against 40 / 40 / 42 µs at N = 1 / 8 / 64;
docs/performance.md "Session 24"), so cuBLAS stays the default.

Arithmetic: every product of two BF16 values is exact in fp32 and the sums are fp32 (tensor-core
accumulation, then the chunk sums), so the result is within `dense_ops`' GEMM_BOUND
(|ŷ − x·wᵀ| ≤ K·2⁻²³·S) like cuBLAS's; the order of the sums differs from cuBLAS's, so the bits
differ. Within one row tier a row's bits do not depend on M (fixed tiles, fixed chunk order), so
this serves the opt-in `triton` BF16 products of serving mode (`runtime.backend.bf16_gemm_for`), never the row-invariant
(`blocked`) ones of the deterministic mode. Under Triton's interpreter the MMA is numpy's fp32
matmul (exact products of BF16 values too).
"""
from __future__ import annotations

import torch
from torch import Tensor

from sglang_dsv41.kernels import fp8_w8a8 as W
from sglang_dsv41.kernels.fused_elementwise import check_device

#: rows from which the product goes back to cuBLAS (`dense_ops.BlockedBf16Gemm`)
MAX_ROWS = W.BF16_GEMM_MIN_ROWS


def bf16_linear(x: Tensor, weight: Tensor, counters: Tensor | None = None) -> Tensor:
    """y [M, N] fp32 = x·weightᵀ, exact products and fp32 sums (module doc); no host sync."""
    who = "bf16_linear"
    if weight.dtype != torch.bfloat16 or weight.dim() != 2 or weight.stride(1) != 1:
        raise ValueError(f"{who}: weight must be 2-D bfloat16 with unit stride along K, got {weight.dtype} "
                         f"{tuple(weight.shape)} strides {weight.stride()}")
    N, K = weight.shape
    if K % W.TILE:
        raise ValueError(f"{who}: K = {K} must be a multiple of {W.TILE}")
    if x.dim() != 2 or x.shape[1] != K or x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"{who}: x must be [M, {K}] fp32 or bf16, got {x.dtype} {tuple(x.shape)}")
    if x.shape[0] >= MAX_ROWS:
        raise ValueError(f"{who}: {x.shape[0]} rows: from {MAX_ROWS} rows BF16 products go to cuBLAS")
    if counters is not None and (counters.dtype != torch.int32 or counters.dim() != 1
                                 or counters.device != weight.device):
        raise ValueError(f"{who}: counters must be 1-D int32 on {weight.device} (split_k_counters)")
    check_device(who, x, weight)
    cfg = W.config_for_rows(max(1, x.shape[0]))
    return W._launch(x, weight, None, cfg, groups=1, act_quant=False, counters=counters, out_dtype=torch.float32)


__all__ = ["MAX_ROWS", "bf16_linear"]

"""y = x·Wᵀ for FP8 block-scaled weights, W8A16 on tensor cores (spec `model.md` §2.3, §3.8).

`fp8_linear(x, values, scales)`: x [M, K] (fp32 holding BF16 values, or bf16), values [N, K]
`float8_e4m3fn`, scales [⌈N/32⌉, ⌈K/32⌉] fp32 powers of two (one per 32×32 tile, the UE8M0 byte
decoded once at load, `codecs.ue8m0_to_float`) → y [M, N] fp32.

Arithmetic. Each program holds BLOCK_M rows of x and BLOCK_N output columns and walks K in
BLOCK_K steps, always in the same order: it loads the E4M3 tile [BLOCK_K, BLOCK_N] of Wᵀ,
converts it to fp32 (exact), multiplies by its tile scales (a power of two: exact in fp32) and
casts to BF16 — exact too when every tile scale 2^s has −124 ≤ s ≤ 119 (`scales_are_bf16_exact`):
E4M3 values are multiples of 2⁻⁹ with ≤ 4 significant bits and |v| ≤ 448, so v·2^s is a multiple
of 2^(s−9) ≥ 2⁻¹³³ (BF16's subnormal spacing) and below BF16's largest finite value. x is cast
to BF16 (exact for BF16-valued x). `tl.dot(bf16, bf16)` multiplies exactly (8 + 8 ≤ 24
significand bits) and accumulates in fp32, so the bound of `runtime/dense_ops.py` holds unchanged:

    |ŷ − x·Wᵀ| ≤ K·2⁻²³·S,   S = Σ_k |x_k|·|W_k|                        (GEMM_BOUND)

Batch invariance. The configuration (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) depends only on
the weight's shape (`config_for(N, K)`), never on M; there is no split-K; each output element is
its row's dot product accumulated over the same BLOCK_K steps in the same order. Rows of x beyond
M are masked loads (zeros) and only ever meet their own output row, so a row's result is the same
bits alone or in any batch.

Tile scales. A call's first row is a multiple of 32 (views of a weight must start on a tile row,
checked by `fp8_linear`). With BLOCK_N dividing 32 (the runtime's configuration) a program's
columns lie in one 32-row tile row: its scales are one vector along K, broadcast over BLOCK_N.
With BLOCK_N a multiple of 32 (wide tiles for large M, `benchmarks/fp8_linear.py` alternatives)
each column loads its own tile row's scales — the same exact products, so the same bound; the
branch is a compile-time constant, so the narrow configuration compiles as before.

Decode (M ≤ 16: one row block) is weight-bandwidth bound: 1 + 4/1024 bytes per weight element
(E4M3 + fp32 tile scale). One configuration for every shape: BLOCK_M = 16, BLOCK_N = 16 (N/16
programs: 32 for N = 512, 80 for wq_a's 1280, ≥ 144 from N = 2304 on; the H200 has 132 SMs),
BLOCK_K = 128 (128-byte contiguous weight row segments), 4 warps, 3 stages — 144 registers and
no spills when compiled for sm_90 (checked by the tests without a GPU). It is a tunable: any
other fixed choice keeps the invariance argument (not the same bits as this one).

Measured (H200, 2026-11-30, docs/validation.md runs 8–9; `benchmarks/fp8_linear.py`, the 9 FP8
weights of Flash layer 2 = 155 MiB in one eager pass): this configuration is ≈ 412 µs of device
time per decode step at M = 1 (≈ 395 GB/s, 9 % of the copy bandwidth) — still the largest item
of the graphed step. Tried and rejected the same day: BLOCK_M 64 / BLOCK_N 32 / 8 warps with a
shape-only split-K (≥ 4 programs per SM, fixed-order partial sum): 556 µs at M = 1 (better at
M = 64: whole step 2,161 vs 2,568 µs), and a weight slice then gets a different split than the
whole weight (different bits for wo_a's group views). cuBLAS on BF16 copies (2 bytes per element)
ran the same pass in 280 µs eager: the W8A16 kernel has ≥ 3× headroom (next: pipelined weight
loads through shared memory, a GEMV-shaped kernel for M ≤ 16).

Triton's interpreter (TRITON_INTERPRET=1 before triton is imported) runs the kernel on CPU
tensors; its BF16 `tl.dot` is wrong in Triton 3.6, so there the BF16-valued operands are
multiplied as fp32 (same exact products, fp32 accumulation: same bound). Without the interpreter,
CPU tensors raise.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.interpreter import InterpretedFunction

TILE = 32
FP8 = torch.float8_e4m3fn
#: tile-scale exponents for which E4M3 · 2^s is exact in BF16 (module doc)
MIN_EXACT_SCALE_EXPONENT = -124
MAX_EXACT_SCALE_EXPONENT = 119


@dataclass(frozen=True)
class Fp8LinearConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


#: the launch configuration of every call (module doc); BLOCK_N divides TILE or is a multiple of it
DEFAULT_CONFIG = Fp8LinearConfig(block_m=16, block_n=16, block_k=128, num_warps=4, num_stages=3)


def config_for(n: int, k: int) -> Fp8LinearConfig:
    """The launch configuration for a weight [n, k] — a function of the weight shape only."""
    if n < 1 or k < 1:
        raise ValueError(f"fp8_linear: weight shape [{n}, {k}] must be positive")
    return DEFAULT_CONFIG


@triton.jit
def _fp8_linear_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_ym,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       DOT_FP32: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    s_row = s_ptr + ((pid_n * BLOCK_N) // 32) * stride_sn       # BLOCK_N ≤ 32 (divides 32): one tile row
    s_cols = s_ptr + (offs_n // 32)[None, :] * stride_sn        # BLOCK_N a multiple of 32: a row per column
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    w_cols = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        k_ok = kk < K
        x = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0).to(tl.bfloat16)
        w8 = tl.load(w_cols + kk[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)   # Wᵀ tile [BK, BN]
        if BLOCK_N <= 32:
            s = tl.load(s_row + kk // 32, mask=k_ok, other=0.0)
            w = (w8.to(tl.float32) * s[:, None]).to(tl.bfloat16)
        else:
            s2 = tl.load(s_cols + (kk // 32)[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            w = (w8.to(tl.float32) * s2).to(tl.bfloat16)
        if DOT_FP32:
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
    y = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y, acc, mask=m_ok[:, None] & n_ok[None, :])


INTERPRETED = isinstance(_fp8_linear_kernel, InterpretedFunction)


def scales_are_bf16_exact(scales: Tensor) -> bool:
    """True when every tile scale is a power of two 2^s with −124 ≤ s ≤ 119, i.e. every E4M3 value
    times its scale is exactly representable in BF16 (module doc). One host sync (load time)."""
    if scales.dtype != torch.float32:
        raise TypeError(f"fp8_linear: tile scales must be fp32 powers of two, got {scales.dtype}")
    if scales.numel() == 0:
        return True
    mantissa, exponent = torch.frexp(scales)          # scale = 0.5·2^exponent for a power of two
    ok = (mantissa == 0.5) & (exponent - 1 >= MIN_EXACT_SCALE_EXPONENT) & (exponent - 1 <= MAX_EXACT_SCALE_EXPONENT)
    return bool(ok.all())


def checked_inputs(x: Tensor, values: Tensor, scales: Tensor, who: str) -> Tensor:
    """The input rules of `fp8_linear` (shared with `fp8_linear_skinny`; errors name `who`): values
    2-D E4M3 with unit stride along K, scales fp32 [⌈N/32⌉, ⌈K/32⌉] with unit stride, x [M, K] fp32
    or bf16, all on one device (CUDA, or CPU under the interpreter). Returns x with unit K stride."""
    if values.dtype != FP8 or values.dim() != 2 or values.stride(1) != 1:
        raise ValueError(f"{who}: values must be 2-D float8_e4m3fn with unit stride along K, got "
                         f"{values.dtype} {tuple(values.shape)} strides {values.stride()}")
    N, K = values.shape
    want = (-(-N // TILE), -(-K // TILE))
    if scales.dtype != torch.float32 or tuple(scales.shape) != want or scales.stride(1) != 1:
        raise ValueError(f"{who}: scales must be fp32 {want} with unit stride, got {scales.dtype} "
                         f"{tuple(scales.shape)} strides {scales.stride()}")
    if x.dim() != 2 or x.shape[1] != K or x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"{who}: x must be [M, {K}] fp32 or bf16, got {x.dtype} {tuple(x.shape)}")
    if not (x.device == values.device == scales.device):
        raise ValueError(f"{who}: x on {x.device}, values on {values.device}, scales on {scales.device}")
    if x.device.type != "cuda" and not INTERPRETED:
        raise RuntimeError(f"{who}: tensors on {x.device} need a CUDA device, or TRITON_INTERPRET=1 set "
                           "before triton is imported (tests)")
    return x if x.stride(1) == 1 else x.contiguous()


def fp8_linear(x: Tensor, values: Tensor, scales: Tensor, *, tiles: Fp8LinearConfig | None = None) -> Tensor:
    """x·Wᵀ in fp32 within GEMM_BOUND (module doc); x [M, K] fp32 (BF16-valued) or bf16, values
    [N, K] E4M3 with unit stride along K (a contiguous weight or a row slice of one starting on a
    tile row), scales [⌈N/32⌉, ⌈K/32⌉] fp32 powers of two for exactly those rows. No host sync.
    `tiles` overrides the launch configuration (benchmarks/fp8_linear.py compares them; the runtime
    always uses `config_for`: another fixed configuration gives different, equally bounded bits)."""
    x = checked_inputs(x, values, scales, "fp8_linear")
    M, (N, K) = x.shape[0], values.shape
    y = torch.empty(M, N, dtype=torch.float32, device=x.device)
    if M == 0:
        return y
    cfg = tiles or config_for(N, K)
    if TILE % cfg.block_n and cfg.block_n % TILE:
        raise ValueError(f"fp8_linear: BLOCK_N {cfg.block_n} must divide the {TILE}-row scale tile or be a "
                         "multiple of it")
    grid = (triton.cdiv(N, cfg.block_n), triton.cdiv(M, cfg.block_m))
    launch = {} if INTERPRETED else {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    _fp8_linear_kernel[grid](x, values, scales, y, M, N, K, x.stride(0), values.stride(0), scales.stride(0),
                             y.stride(0), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                             DOT_FP32=INTERPRETED, **launch)
    return y


def weight_bytes(n: int, k: int) -> int:
    """Device bytes of one FP8 weight [n, k] in this format: E4M3 values + fp32 tile scales."""
    return n * k + 4 * (-(-n // TILE)) * (-(-k // TILE))


__all__ = ["DEFAULT_CONFIG", "FP8", "Fp8LinearConfig", "INTERPRETED", "MAX_EXACT_SCALE_EXPONENT", "MIN_EXACT_SCALE_EXPONENT",
           "TILE", "checked_inputs", "config_for", "fp8_linear", "scales_are_bf16_exact", "weight_bytes"]

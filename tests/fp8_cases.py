"""Inputs and the accuracy check shared by the FP8 W8A16 kernel tests (`kernels/fp8_linear.py`,
`kernels/fp8_linear_skinny.py`): random E4M3 weights with power-of-two tile scales, BF16-valued
rows, and GEMM_BOUND (|ŷ − x·Wᵀ| ≤ K·2⁻²³·Σ|x||W|, runtime/dense_ops.py) against the float64 product.

Bit-identity checks (a row alone == the row in a batch, a weight slice == those columns of the
whole product) use `exact_sum_case` under the Triton interpreter: there `tl.dot` is numpy's matmul,
whose summation order depends on the host's BLAS kernel and on the shape, so only inputs whose
every partial sum is exact in fp32 give host-independent bits. On CUDA the kernel's own arithmetic
decides, and general random inputs are used."""
from __future__ import annotations

import pytest
import torch

from sglang_dsv41.checkpoint.codecs import ue8m0_from_exponent, ue8m0_to_float
from sglang_dsv41.kernels.fp8_linear import INTERPRETED

F32, F64, BF16, FP8 = torch.float32, torch.float64, torch.bfloat16, torch.float8_e4m3fn
KERNEL_HERE = INTERPRETED or torch.cuda.is_available()
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu"
kernel = pytest.mark.skipif(not KERNEL_HERE, reason="runs in the TRITON_INTERPRET child (or on CUDA)")


def fp8_weight(n: int, k: int, g: torch.Generator, exp_range: tuple[int, int] = (-12, -4),
               device: str = DEVICE) -> tuple[torch.Tensor, torch.Tensor]:
    """Random E4M3 values [n, k] (no NaN codes) and fp32 power-of-two tile scales with exponents
    in exp_range."""
    codes = torch.randint(0, 256, (n, k), generator=g, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x3C
    exps = torch.randint(exp_range[0], exp_range[1] + 1, (-(-n // 32), -(-k // 32)), generator=g)
    return codes.view(FP8).to(device), ue8m0_to_float(ue8m0_from_exponent(exps)).to(device)


#: E4M3 values of exact-sum weights: every product with an integer |x| ≤ 8 and a scale 2^-2..2^1 is
#: a multiple of 2^-3 below 2^6, so sums over K ≤ 2^12 stay below 2^24 units: exact in any order.
EXACT_SUM_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0)
EXACT_SUM_MAX_K = 4096


def exact_sum_case(m: int, n: int, k: int, g: torch.Generator,
                   device: str = DEVICE) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(values [n, k] E4M3, scales, x [m, k] fp32) whose products and partial sums are all exact in
    fp32: any summation order gives the same bits. The tile scales 2^((3i + j) mod 4 − 2) differ
    between neighbouring tile rows i, so a kernel reading the wrong scale row changes the result."""
    assert k <= EXACT_SUM_MAX_K, k
    table = torch.tensor(EXACT_SUM_VALUES)
    magnitudes = table[torch.randint(0, len(EXACT_SUM_VALUES), (n, k), generator=g)]
    signs = torch.randint(0, 2, (n, k), generator=g) * 2.0 - 1.0
    values = (magnitudes * signs).to(FP8)
    i = torch.arange(-(-n // 32))[:, None]
    j = torch.arange(-(-k // 32))[None, :]
    scales = torch.exp2(((3 * i + j) % 4 - 2).float())
    x = torch.randint(-8, 9, (m, k), generator=g).to(F32)
    return values.to(device), scales.to(device), x.to(device)


def dequantised(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    n, k = values.shape
    return values.to(F32) * scales.repeat_interleave(32, 0)[:n].repeat_interleave(32, 1)[:, :k]


def bf16_rows(m: int, k: int, g: torch.Generator, device: str = DEVICE) -> torch.Tensor:
    return torch.randn(m, k, generator=g).to(BF16).to(F32).to(device)


def within_gemm_bound(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> tuple[bool, float]:
    """(every element within GEMM_BOUND, worst error / bound)."""
    exact = x.to(F64) @ w.to(F64).t()
    s = x.to(F64).abs() @ w.to(F64).abs().t()
    bound = x.shape[-1] * 2.0**-23 * s
    err = (y.to(F64) - exact).abs()
    return bool((err <= bound).all()), float((err / bound.clamp(min=1e-300)).max())


def check_within_gemm_bound(multiply, m: int, n: int, k: int, x_dtype: torch.dtype) -> None:
    """`multiply(x, values, scales)` on a random case (scale exponents −40…20) is within GEMM_BOUND."""
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    values, scales = fp8_weight(n, k, g, exp_range=(-40, 20))
    x = bf16_rows(m, k, g).to(x_dtype)
    y = multiply(x, values, scales)
    assert y.dtype == F32 and y.shape == (m, n)
    ok, worst = within_gemm_bound(x, dequantised(values, scales), y)
    assert ok, worst


def bit_identity_case(m: int, n: int, k: int, g: torch.Generator,
                      exp_range: tuple[int, int] = (-12, -4)) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(values, scales, x) for a bit-identity check: `exact_sum_case` under the interpreter (module
    doc), general random inputs with scale exponents in exp_range on CUDA."""
    if INTERPRETED:
        return exact_sum_case(m, n, k, g)
    values, scales = fp8_weight(n, k, g, exp_range=exp_range)
    return values, scales, bf16_rows(m, k, g)


def check_rows_alone_equal_rows_in_a_batch(multiply, spans=((0, 1), (7, 8), (39, 40), (3, 20), (16, 33))) -> None:
    """Batch invariance: every row span of a 40-row batch alone gives the batch's bits; a
    row-strided x too; an empty x gives an empty result (inputs: `bit_identity_case`)."""
    g = torch.Generator().manual_seed(1)
    values, scales, x = bit_identity_case(40, 96, 320, g)
    full = multiply(x, values, scales)
    for lo, hi in spans:
        assert torch.equal(multiply(x[lo:hi], values, scales), full[lo:hi]), (lo, hi)
    assert torch.equal(multiply(torch.cat([x, x], 1)[:, :320], values, scales), full)   # row-strided x
    assert multiply(x[:0], values, scales).shape == (0, 96)


def check_row_prefixes(multiply, x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor,
                       prefixes: tuple[int, ...]) -> tuple[torch.Tensor, float]:
    """Each row prefix x[:m] gives the full call's rows bit for bit and stays within GEMM_BOUND;
    single rows too. Returns (the full product, the worst error / bound)."""
    w = dequantised(values, scales)
    full = multiply(x, values, scales)
    worst = 0.0
    for m in prefixes:
        y = multiply(x[:m], values, scales)
        assert torch.equal(y, full[:m]), m
        ok, r = within_gemm_bound(x[:m], w, y)
        assert ok, (m, r)
        worst = max(worst, r)
    for i in (0, 17, x.shape[0] - 1):
        assert torch.equal(multiply(x[i:i + 1], values, scales), full[i:i + 1]), i
    return full, worst


def assert_graph_replays_eager(call, counters: torch.Tensor, replays: int = 3) -> None:
    """CUDA: `call()` captured in a CUDA graph (after a warm-up on a side stream) and replayed `replays`
    times gives the eager result's bits each time, with the split-K `counters` left at zero."""
    want = call()
    out = torch.empty_like(want)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out.copy_(call())
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(call())
    for _ in range(replays):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want) and not counters.any()


class CountingLaunch:
    """Stands in for a @triton.jit kernel: records each launch's grid, then launches."""

    def __init__(self, kern) -> None:
        self.kern, self.grids = kern, []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.kern[grid]

"""Inputs and the accuracy check shared by the FP8 W8A16 kernel tests (`kernels/fp8_linear.py`,
`kernels/fp8_linear_skinny.py`): random E4M3 weights with power-of-two tile scales, BF16-valued
rows, and GEMM_BOUND (|ŷ − x·Wᵀ| ≤ K·2⁻²³·Σ|x||W|, runtime/dense_ops.py) against the float64 product."""
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


def check_rows_alone_equal_rows_in_a_batch(multiply, spans=((0, 1), (7, 8), (39, 40), (3, 20), (16, 33))) -> None:
    """Batch invariance: every row span of a 40-row batch alone gives the batch's bits; a
    row-strided x too; an empty x gives an empty result."""
    g = torch.Generator().manual_seed(1)
    values, scales = fp8_weight(96, 320, g)
    x = bf16_rows(40, 320, g)
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

"""The fp32 Engram gate kernel (`kernels/engram_gate.py`) against the reference's float64 gate (spec §3.3.2).

Bound, per (t, j), derived in the kernel's module doc and evaluated here in float64 from the
inputs: with S = Σ|h·w·k|·a·b·H^−½ (a, b the reference's inverse RMS of h and k) the fp32 dot is
within e = c·2⁻²⁴·(S + |dot|), c = H/BLOCK_H + log2(BLOCK_H) + 16 (per-lane sums, the tree of
`tl.sum`, the three factors' roundings); g = sigmoid(±√max(|dot|, 1e−6)) moves by at most
e / (8·√max(|dot| − e, 1e−6)), plus 2⁻²⁰ for exp and the final fp32 roundings. The bound can
fail: swapping two streams' weights, or scaling q_weight by 1.01, is outside it
(`test_kernel_case_bound_catches_*`).

Pinned: within the bound for fp32 and BF16 inputs, H below, at and above one BLOCK_H step, keys
as a strided view of the kv projection (as `runtime.engram_gate.engram_update` passes them); a row
alone == the row in a batch, bitwise (batch invariance); zero rows give sigmoid(1e−3); bad shapes
raise. Kernel cases run in a TRITON_INTERPRET child on CPU machines, compiled on CUDA; GPU (`gpu`):
Flash widths (hc 4, H 4096).
"""
from __future__ import annotations

import math

import pytest
import torch

from sglang_dsv41.kernels import engram_gate as EG
from sglang_dsv41.reference import engram as RE
from triton_checks import run_kernel_cases_in_interpreter

F32, F64, BF16 = torch.float32, torch.float64, torch.bfloat16
KERNEL_HERE = EG.INTERPRETED or torch.cuda.is_available()
DEVICE = "cuda" if torch.cuda.is_available() and not EG.INTERPRETED else "cpu"
kernel = pytest.mark.skipif(not KERNEL_HERE, reason="runs in the TRITON_INTERPRET child (or on CUDA)")
EPS = 1e-6


def bound(residual, keys, qw, kw, eps: float = EPS) -> torch.Tensor:
    h, k = residual.to(F64), keys.to(F64)
    H = h.shape[-1]
    w = qw.to(F64) * kw.to(F64)
    a = torch.rsqrt(h.pow(2).mean(-1) + eps)
    b = torch.rsqrt(k.pow(2).mean(-1) + eps)
    dot = (h * w * k).sum(-1) * a * b * H ** -0.5
    s = (h * w * k).abs().sum(-1) * a * b * H ** -0.5
    block = min(EG.MAX_BLOCK_H, 1 << (H - 1).bit_length())
    c = H / block + math.log2(block) + 16
    e = c * 2.0 ** -24 * (s + dot.abs())
    return e / (8 * torch.sqrt((dot.abs() - e).clamp(min=EG.GATE_DOT_FLOOR))) + 2.0 ** -20


def case(T: int, hc: int, H: int, seed: int, dtype=F32, device: str = DEVICE):
    g = torch.Generator().manual_seed(seed)
    R = torch.randn(T, hc, H, generator=g).to(BF16).to(dtype)
    kv = torch.randn(T, (hc + 1) * H, generator=g) * 3
    keys = kv[:, :hc * H].reshape(T, hc, H)                     # a strided view, as engram_update
    qw, kw = torch.rand(hc, H, generator=g) + 0.5, torch.rand(hc, H, generator=g) + 0.5
    return R.to(device), keys.to(device), qw.to(device), kw.to(device)


def within(got, R, keys, qw, kw) -> tuple[bool, float]:
    want = RE.engram_gate(R, keys, qw, kw, EPS).to(F64)
    b = bound(R, keys, qw, kw)
    err = (got.to(F64) - want).abs()
    return bool((err <= b).all()), float((err / b).max())


@kernel
@pytest.mark.parametrize("H,dtype", [(96, F32), (1024, BF16), (1536, F32)])
def test_kernel_case_within_bound_of_the_reference(H: int, dtype) -> None:
    R, keys, qw, kw = case(6, 4, H, seed=H, dtype=dtype)
    got = EG.engram_gate(R, keys, qw, kw, EPS)
    assert got.dtype == F32 and got.shape == (6, 4)
    ok, worst = within(got, R, keys, qw, kw)
    assert ok, worst


@kernel
def test_kernel_case_rows_are_batch_invariant_and_zero_rows_floor() -> None:
    R, keys, qw, kw = case(9, 2, 160, seed=1)
    R[4] = 0.0
    full = EG.engram_gate(R, keys, qw, kw, EPS)
    for lo, hi in ((0, 1), (4, 5), (3, 8)):
        assert torch.equal(EG.engram_gate(R[lo:hi], keys[lo:hi], qw, kw, EPS), full[lo:hi]), (lo, hi)
    assert torch.allclose(full[4], torch.sigmoid(torch.tensor(1e-3)).expand(2).to(full.device), rtol=0, atol=2.0 ** -22)
    assert EG.engram_gate(R[:0], keys[:0], qw, kw, EPS).shape == (0, 2)


@kernel
def test_kernel_case_bound_catches_swapped_or_scaled_weights() -> None:
    R, keys, qw, kw = case(8, 3, 256, seed=2)
    assert within(EG.engram_gate(R, keys, qw, kw, EPS), R, keys, qw, kw)[0]
    assert not within(EG.engram_gate(R, keys, qw[[1, 0, 2]].contiguous(), kw, EPS), R, keys, qw, kw)[0]
    assert not within(EG.engram_gate(R, keys, qw * 1.01, kw, EPS), R, keys, qw, kw)[0]


def test_bad_inputs_raise() -> None:
    R, keys, qw, kw = case(2, 2, 64, seed=3, device="cpu")
    with pytest.raises(ValueError, match="one shape"):
        EG.engram_gate(R, keys[:, :1], qw, kw, EPS)
    with pytest.raises(ValueError, match=r"\[2, 64\]"):
        EG.engram_gate(R, keys, qw[:1], kw, EPS)
    with pytest.raises(ValueError, match="fp32 or bf16"):
        EG.engram_gate(R.double(), keys, qw, kw, EPS)
    if not EG.INTERPRETED:
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
            EG.engram_gate(R, keys, qw, kw, EPS)


if not EG.INTERPRETED:

    def test_kernel_cases_in_triton_interpreter() -> None:
        """Run this file's kernel cases in a child pytest with TRITON_INTERPRET=1 (CPU)."""
        run_kernel_cases_in_interpreter(__file__, min_passed=5, exact=True)


@pytest.mark.gpu
def test_gpu_flash_widths_within_bound_and_batch_invariant() -> None:
    R, keys, qw, kw = case(64, 4, 4096, seed=4, dtype=BF16, device="cuda")
    got = EG.engram_gate(R, keys, qw, kw, EPS)
    ok, worst = within(got, R, keys, qw, kw)
    assert ok, worst
    assert torch.equal(EG.engram_gate(R[5:6], keys[5:6], qw, kw, EPS), got[5:6])
    print(f"\n[engram_gate Flash widths] worst |err| / bound = {worst:.3g}")

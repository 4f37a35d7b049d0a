"""The fp32 Engram gate kernel (`kernels/engram_gate.py`) against the reference's float64 gate (spec §3.3.2).

Bound, per (t, j), derived in the kernel's module doc and evaluated here in float64 from the
inputs: with S = Σ|h·w·k|·a·b·H^−½ (a, b the reference's inverse RMS of h and k) the fp32 dot is
within e = c·2⁻²⁴·(S + |dot|), c = H/BLOCK_H + log2(BLOCK_H) + 16 (per-lane sums, the tree of
`tl.sum`, the three factors' roundings); g = sigmoid(±√max(|dot|, 1e−6)) moves by at most
e / (8·√max(|dot| − e, 1e−6)), plus 2⁻²⁰ for exp and the final fp32 roundings. The bound can
fail: swapping two streams' weights, or scaling q_weight by 1.01, is outside it
(`test_kernel_case_bound_catches_*`).

Pinned: within the bound for fp32 and BF16 inputs (a BF16 R: g and the update the fp32 R's bits), H below, at and above one BLOCK_H step, keys
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


def torch_update(R, g, value, image_rows):
    """`runtime.engram_gate.engram_update`'s torch update for the gate g: bf16(R + g·value), R on image rows."""
    from sglang_dsv41.numerics.rounding import bf16
    updated = bf16(R.to(F32) + g[:, :, None] * value[:, None, :].to(F32))
    if image_rows is not None:
        updated = torch.where(image_rows[:, None, None], R.to(F32), updated)
    return updated.to(R.dtype)


@kernel
@pytest.mark.parametrize("dtype,image", [(F32, False), (BF16, True)], ids=["fp32", "bf16_image_rows"])
def test_kernel_case_residual_update_is_the_torch_update_of_its_gate(dtype, image: bool) -> None:
    """`engram_residual`: its g is `engram_gate`'s bit for bit, and R' is the torch update of that g bit for bit
    (value a strided column slice of the kv projection, as `engram_update` passes it; image rows keep R)."""
    T, hc, H = 5, 4, 1536
    R, keys, qw, kw = case(T, hc, H, seed=9, dtype=dtype)
    g0 = torch.Generator().manual_seed(10)
    kv = (torch.randn(T, (hc + 1) * H, generator=g0) * 3).to(R.device)
    value = kv[:, hc * H:]
    rows = torch.tensor([False, True, False, False, True], device=R.device) if image else None
    got, g = EG.engram_residual(R, keys, value, qw, kw, EPS, rows)
    assert torch.equal(g, EG.engram_gate(R, keys, qw, kw, EPS))
    want = torch_update(R, g, value, rows)
    assert got.dtype == R.dtype and got.shape == R.shape
    assert torch.equal(got.view(torch.int16 if dtype == BF16 else torch.int32),
                       want.view(torch.int16 if dtype == BF16 else torch.int32))
    if image:
        assert torch.equal(got[1], R[1]) and not torch.equal(got[0], R[0])


@kernel
def test_kernel_case_bf16_residual_gives_the_fp32_bits() -> None:
    """R held as BF16 (the CUDA path's mHC residual dtype, `mhc_ops.TritonMhc`): g bit for bit R-as-fp32's,
    and R' written as BF16 = the fp32 R' cast (exact: R' holds BF16 values), image rows kept."""
    T, hc, H = 5, 4, 1536
    R, keys, qw, kw = case(T, hc, H, seed=13)
    value = (torch.randn(T, (hc + 1) * H, generator=torch.Generator().manual_seed(14)) * 3).to(R.device)[:, hc * H:]
    rows = torch.tensor([True, False, False, True, False], device=R.device)
    want, g_want = EG.engram_residual(R, keys, value, qw, kw, EPS, rows)
    got, g = EG.engram_residual(R.to(BF16), keys, value, qw, kw, EPS, rows)
    assert torch.equal(g, g_want) and torch.equal(EG.engram_gate(R.to(BF16), keys, qw, kw, EPS), g_want)
    assert got.dtype == BF16 and want.dtype == F32
    assert torch.equal(got, want.to(BF16)) and torch.equal(got.float(), want)


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
        run_kernel_cases_in_interpreter(__file__, min_passed=8, exact=True)


if not EG.INTERPRETED:

    @pytest.mark.parametrize("out_bf16", [False, True], ids=["fp32_out", "bf16_out"])
    def test_residual_update_compiles_for_hopper_without_fma(out_bf16: bool) -> None:
        """sm_90 build of the gate + update launch (Flash: BLOCK_H 1024, image rows): no spills, no fp32 FMA (the
        update's bits are torch's separate multiply and add), no float64."""
        import re

        from triton_checks import compile_for_sm90, no_spills
        k = EG._engram_gate_kernel
        sig = {n: "*fp32" for n in ("h_ptr", "k_ptr", "qw_ptr", "kw_ptr", "out_ptr", "v_ptr", "r_out_ptr")}
        sig |= {n: "i32" for n in ("HC", "H", "stride_ht", "stride_hj", "stride_kt", "stride_kj", "stride_vt",
                                   "stride_ot", "stride_oj")}
        sig["image_ptr"] = "*u8"
        if out_bf16:
            sig["r_out_ptr"] = "*bf16"
        consts = {"EPS": EPS, "FLOOR": EG.GATE_DOT_FLOOR, "BLOCK_H": EG.MAX_BLOCK_H, "UPDATE": True,
                  "HAS_IMAGE": True, "OUT_BF16": out_bf16}
        compiled, usage = compile_for_sm90(k, {n: ("constexpr" if n in consts else sig[n]) for n in k.arg_names},
                                           consts, {"num_warps": EG.NUM_WARPS, "enable_fp_fusion": False})
        ptx = compiled.asm["ptx"]
        assert no_spills(usage), usage
        assert not re.findall(r"\bfma\.\w+\.f32", ptx) and not re.findall(r"\.f64\b", ptx)


@pytest.mark.gpu
def test_gpu_flash_widths_within_bound_and_batch_invariant() -> None:
    R, keys, qw, kw = case(64, 4, 4096, seed=4, dtype=BF16, device="cuda")
    got = EG.engram_gate(R, keys, qw, kw, EPS)
    ok, worst = within(got, R, keys, qw, kw)
    assert ok, worst
    assert torch.equal(EG.engram_gate(R[5:6], keys[5:6], qw, kw, EPS), got[5:6])
    print(f"\n[engram_gate Flash widths] worst |err| / bound = {worst:.3g}")


@pytest.mark.gpu
def test_gpu_residual_update_at_flash_widths_is_the_torch_update() -> None:
    """CUDA, Flash widths (hc 4, H 4096, 64 tokens): R' from the one launch equals the torch update of the launch's
    own g bit for bit (no FMA contraction), and g stays within the bound."""
    R, keys, qw, kw = case(64, 4, 4096, seed=11, dtype=F32, device="cuda")
    value = (torch.randn(64, 5 * 4096, generator=torch.Generator().manual_seed(12)) * 3).cuda()[:, 4 * 4096:]
    rows = (torch.arange(64) % 7 == 0).cuda()
    got, g = EG.engram_residual(R, keys, value, qw, kw, EPS, rows)
    assert within(g, R, keys, qw, kw)[0]
    assert torch.equal(got.view(torch.int32), torch_update(R, g, value, rows).view(torch.int32))

"""`kernels/stacked_halves.py`: the two halves of a stacked product's rows read in one launch.

What is pinned:
* kernel cases (interpreter child on CPU; compiled on CUDA): `rms_norm_pair`'s outputs equal
  `fused_elementwise.rms_norm` on each half alone, bit for bit — fp32 and BF16 inputs, a row stride
  wider than the row (a column slice of a wider product), the first half rounded to BF16 and the
  second not, halves that are not powers of two, one row and many, a row of zeros; a batch's row
  equals that row alone; the first half's rounding flag really rounds (the unrounded result differs);
  `clamped_swiglu_halves` equals `swiglu.clamped_swiglu` of the two halves bit for bit
  (fp32 / BF16 inputs, a wider row stride, gates past the limit and far down the exp range); with
  `quantise_out` its BF16 output is those values quantised per 1×32, bit for bit what
  `fake_quantize_activations_bf16` makes of them (the fold tier's hand-off to `w2`);
* main process: bad shapes raise; the kernels build for sm_90 without spills, with no float64 instruction;
* GPU (`gpu`): Flash's halves (q_lora 1280 | kv 512, the shared expert's 2048 | 2048) against the
  one-tensor kernels at 1 … 256 rows.
"""
from __future__ import annotations

import pytest
import torch

from sglang_dsv41.kernels import fused_elementwise as FE
from sglang_dsv41.kernels import swiglu as SW
from sglang_dsv41.kernels.stacked_halves import (_rms_norm_pair_kernel, _swiglu_halves_kernel, clamped_swiglu_halves,
                                                 rms_norm_pair)
from triton_checks import compile_for_sm90, no_spills, run_kernel_cases_in_interpreter

KERNEL_HERE = FE.INTERPRETED or torch.cuda.is_available()
DEVICE = "cuda" if torch.cuda.is_available() and not FE.INTERPRETED else "cpu"


def _bf16_values(g: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16).float()


def _check_halves(x: torch.Tensor, split: int, w1: torch.Tensor, w2: torch.Tensor, eps: float) -> None:
    first, second = rms_norm_pair(x, split, w1, w2, eps)
    assert first.dtype == second.dtype == torch.float32
    want1 = FE.rms_norm(x[:, :split].float().contiguous(), w1, eps)
    want2 = FE.rms_norm(x[:, split:].float().contiguous(), w2, eps, round_bf16=False)
    assert torch.equal(first, want1) and torch.equal(second, want2)


if KERNEL_HERE:

    def test_kernel_case_halves_equal_the_single_row_kernel() -> None:
        g = torch.Generator().manual_seed(0)
        for rows, d1, d2 in ((1, 64, 32), (5, 96, 40), (3, 160, 128)):
            x = _bf16_values(g, rows, d1 + d2, scale=3.0)
            x[0, :d1] = 0.0                                       # a zero half: rsqrt(ε)·0
            w1, w2 = _bf16_values(g, d1).abs() + 0.5, _bf16_values(g, d2).abs() + 0.5
            d = lambda t: t.to(DEVICE)  # noqa: E731
            _check_halves(d(x), d1, d(w1), d(w2), 1e-6)
            _check_halves(d(x).to(torch.bfloat16), d1, d(w1), d(w2), 1e-6)
            wide = torch.zeros(rows, d1 + d2 + 64)
            wide[:, :d1 + d2] = x                                 # row stride d1 + d2 + 64
            _check_halves(d(wide)[:, :d1 + d2], d1, d(w1), d(w2), 1e-6)

    def test_kernel_case_rows_are_independent_and_the_first_half_rounds() -> None:
        g = torch.Generator().manual_seed(1)
        x = _bf16_values(g, 7, 96 + 32).to(DEVICE)
        w1, w2 = (_bf16_values(g, n).abs().to(DEVICE) + 0.5 for n in (96, 32))
        first, second = rms_norm_pair(x, 96, w1, w2, 1e-6)
        for i in (0, 3, 6):
            a, b = rms_norm_pair(x[i:i + 1], 96, w1, w2, 1e-6)
            assert torch.equal(a, first[i:i + 1]) and torch.equal(b, second[i:i + 1])
        assert torch.equal(first, first.to(torch.bfloat16).float())        # the first half is BF16-valued
        unrounded, _ = rms_norm_pair(x, 96, w1, w2, 1e-6, round_first=False)
        assert not torch.equal(unrounded, first)
        assert not torch.equal(second, second.to(torch.bfloat16).float())  # the second half is not rounded


    def test_kernel_case_swiglu_halves_equal_the_two_tensor_kernel() -> None:
        g = torch.Generator().manual_seed(3)
        for rows, n in ((1, 32), (4, 200), (3, 1024)):
            y = _bf16_values(g, rows, 2 * n, scale=6.0)
            y[0, :4] = torch.tensor([-90.0, -300.0, 15.0, -0.0])    # exp range, past the limit, −0
            wide = torch.zeros(rows, 2 * n + 32)
            wide[:, :2 * n] = y
            for got_in in (y.to(DEVICE), y.to(DEVICE).to(torch.bfloat16), wide.to(DEVICE)[:, :2 * n]):
                got = clamped_swiglu_halves(got_in, 10.0)
                want = SW.clamped_swiglu(y[:, :n].contiguous().to(DEVICE), y[:, n:].contiguous().to(DEVICE), 10.0)
                assert got.dtype == torch.float32 and torch.equal(got, want)

    def test_kernel_case_swiglu_halves_quantised_for_w2() -> None:
        from sglang_dsv41.kernels.fp8_quant import fake_quantize_activations_bf16

        g = torch.Generator().manual_seed(4)
        for rows, n in ((1, 32), (3, 224), (2, 1024)):
            y = _bf16_values(g, rows, 2 * n, scale=6.0).to(DEVICE)
            y[0, :32] *= 1e-9                                     # a group near the quantisation's floor
            plain = clamped_swiglu_halves(y, 10.0)
            got = clamped_swiglu_halves(y.to(torch.bfloat16), 10.0, quantise_out=True)
            assert got.dtype == torch.bfloat16 and torch.equal(got, fake_quantize_activations_bf16(plain))
            assert not torch.equal(got.float(), plain)


# ---- the interpreter child and the main-process checks -------------------------------------------

if not FE.INTERPRETED:

    def test_kernel_cases_in_triton_interpreter() -> None:
        """Run this file's kernel cases in a child pytest with TRITON_INTERPRET=1 (CPU)."""
        run_kernel_cases_in_interpreter(__file__, min_passed=4, exact=True)

    def test_bad_shapes_raise() -> None:
        x, w = torch.zeros(2, 96), torch.ones(64)
        with pytest.raises(ValueError, match="split"):
            rms_norm_pair(x, 96, w, w, 1e-6)
        with pytest.raises(ValueError, match="weights"):
            rms_norm_pair(x, 64, w, w, 1e-6)
        with pytest.raises(ValueError, match="4096"):
            rms_norm_pair(torch.zeros(1, 8192 + 64), 8192, torch.ones(8192), torch.ones(64), 1e-6)
        with pytest.raises(ValueError, match="2n"):
            clamped_swiglu_halves(torch.zeros(2, 7), 10.0)
        with pytest.raises(ValueError, match="32-column"):
            clamped_swiglu_halves(torch.zeros(2, 80), 10.0, quantise_out=True)

    def test_builds_for_sm90_without_spills_or_float64() -> None:
        sig = {"x_ptr": "*bf16", "stride": "i32", "w1_ptr": "*fp32", "w2_ptr": "*fp32", "out1_ptr": "*fp32",
               "out2_ptr": "*fp32", "D1": "i32", "D2": "i32"}
        consts = {"EPS_HI": 1e-6, "EPS_LO": 0.0, "BLOCK1": 2048, "BLOCK2": 512, "LOG2_1": 11, "LOG2_2": 9,
                  "ROUND1": True, "ROUND2": False}
        compiled, usage = compile_for_sm90(_rms_norm_pair_kernel, sig | {k: "constexpr" for k in consts}, consts,
                                           {"num_warps": 4, "enable_fp_fusion": False})
        assert no_spills(usage), usage
        assert ".f64" not in compiled.asm["ptx"]
        for quant in (False, True):
            sig = {"y_ptr": "*bf16", "out_ptr": "*bf16" if quant else "*fp32", "n": "i32", "stride": "i32",
                   "limit": "fp32"}
            consts = {"BLOCK": 1024, "QUANT": quant, "INTERPRET": False}
            compiled, usage = compile_for_sm90(_swiglu_halves_kernel, sig | {k: "constexpr" for k in consts}, consts,
                                               {"num_warps": 4, "enable_fp_fusion": False})
            assert no_spills(usage), usage
            assert ".f64" not in compiled.asm["ptx"]
            assert ("cvt.rn.satfinite.e4m3x2.f32" in compiled.asm["ptx"]) == quant


@pytest.mark.gpu
def test_gpu_flash_halves_equal_the_single_row_kernel() -> None:
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(2)
    w1 = torch.rand(1280, generator=g, device=dev) + 0.5
    w2 = torch.rand(512, generator=g, device=dev) + 0.5
    for rows in (1, 8, 64, 256):
        x = (torch.randn(rows, 1280 + 512, generator=g, device=dev) * 2).to(torch.bfloat16)
        _check_halves(x, 1280, w1, w2, 1e-6)
        n = 2048
        y = (torch.randn(rows, 2 * n, generator=g, device=dev) * 6).to(torch.bfloat16)
        assert torch.equal(clamped_swiglu_halves(y, 10.0), SW.clamped_swiglu(y[:, :n].float().contiguous(),
                                                                             y[:, n:].float().contiguous(), 10.0))


@pytest.mark.gpu
def test_gpu_flash_swiglu_quantised_for_w2() -> None:
    """The shared expert's 2304 columns at 1 … 16 rows: `quantise_out` gives, bit for bit, what the
    quantisation launch makes of the plain SwiGLU (hardware E4M3 rounding in both)."""
    from sglang_dsv41.kernels.fp8_quant import fake_quantize_activations_bf16

    g = torch.Generator().manual_seed(21)
    for rows in (1, 3, 16):
        y = _bf16_values(g, rows, 2 * 2304, scale=4.0).to("cuda").to(torch.bfloat16)
        got = clamped_swiglu_halves(y, 10.0, quantise_out=True)
        assert torch.equal(got, fake_quantize_activations_bf16(clamped_swiglu_halves(y, 10.0))), rows

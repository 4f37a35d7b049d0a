"""Engram gather kernel (`sglang_dsv41.kernels.engram_gather`) vs `codecs.dequantize_engram_rows`
(spec §2.3: E4M3 · 2^(s−127) in fp32, rounded once to BF16).

What is pinned:
* every (E4M3 code, UE8M0 byte) pair — 256 × 256, so the smallest (byte 0 = 2^−127: BF16
  subnormal rounding) and largest (byte 254: overflow to ±∞) scales, zeros, −0.0, negative
  values, max E4M3 (±448) and both NaN sources — gives the reference's bits (NaN positions equal,
  every other bit equal);
* random tables: repeated ids, int32 ids, 2-D id shapes, the sorted-read flag (same bits in the
  original order), no ids;
* input checks; CPU tensors without the interpreter raise; the kernel compiles for sm_90 with no
  float arithmetic left to contract or flush and no spills (Triton's bundled ptxas, no GPU).

Kernel cases run in a child pytest under TRITON_INTERPRET=1 (`test_kernel_cases_in_triton_interpreter`;
the interpreter must be set before triton is imported); with CUDA they also run here, compiled.
The UVA (registered host memory) cases are GPU tests in tests/test_runtime_engram_host.py.
"""
from __future__ import annotations

import re

import pytest
import torch

from sglang_dsv41.checkpoint.codecs import dequantize_engram_rows, ue8m0_from_exponent
from sglang_dsv41.kernels import engram_gather as K
from triton_checks import compile_for_sm90, no_spills, run_kernel_cases_in_interpreter

KERNEL_HERE = K.INTERPRETED or torch.cuda.is_available()
DEVICE = "cuda" if torch.cuda.is_available() and not K.INTERPRETED else "cpu"


def same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    """NaN at the same places and every other value bit for bit (−0.0 ≠ +0.0)."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    nan = torch.isnan(want)
    if not torch.equal(torch.isnan(got), nan):
        return False
    return torch.equal(got.view(torch.int32)[~nan], want.view(torch.int32)[~nan])


def reference_rows(values: torch.Tensor, scales: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    flat = ids.reshape(-1).long().cpu()
    return dequantize_engram_rows(values.cpu()[flat], scales.cpu()[flat]).float()


def every_code_and_scale() -> tuple[torch.Tensor, torch.Tensor]:
    """Row r holds all 256 E4M3 codes, every group of it scaled by UE8M0 byte r (256 rows)."""
    codes = torch.arange(256, dtype=torch.uint8).repeat(256, 1)
    scale_bytes = torch.arange(256, dtype=torch.uint8)[:, None].repeat(1, 256 // 32)
    return codes.view(torch.float8_e4m3fn), scale_bytes.view(torch.float8_e8m0fnu)


def random_table(rows: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (rows, d), generator=g, dtype=torch.uint8)
    exps = torch.randint(-127, 128, (rows, d // 32), generator=g)
    return codes.view(torch.float8_e4m3fn), ue8m0_from_exponent(exps)


# ---- kernel cases (interpreter child, or CUDA) ----------------------------------------------

if KERNEL_HERE:

    @pytest.mark.parametrize("sorted_reads", [False, True], ids=["id_order", "sorted"])
    def test_kernel_case_every_code_and_scale_byte(sorted_reads: bool) -> None:
        values, scales = every_code_and_scale()
        ids = torch.randperm(256, generator=torch.Generator().manual_seed(0))
        want = reference_rows(values, scales, ids)
        assert torch.isinf(want).any() and torch.isnan(want).any() and (want == 0).any()
        assert (want.view(torch.int32) == torch.tensor(-2**31, dtype=torch.int32)).any()      # −0.0 present
        tiny = want.abs()[(want != 0) & torch.isfinite(want)].min()
        assert tiny < 2.0 ** -126                                                              # BF16 subnormals
        got = K.engram_gather(values.to(DEVICE), scales.to(DEVICE), ids.to(DEVICE), sorted_reads=sorted_reads)
        assert got.device.type == DEVICE and got.shape == (256, 256) and got.dtype == torch.float32
        assert same_bits(got.cpu(), want)

    @pytest.mark.parametrize("sorted_reads", [False, True], ids=["id_order", "sorted"])
    @pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32], ids=["int64", "int32"])
    def test_kernel_case_random_tables_repeated_ids_and_shapes(sorted_reads: bool, id_dtype: torch.dtype) -> None:
        values, scales = random_table(97, 64, seed=1)
        ids = torch.tensor([[5, 96, 5, 0], [40, 40, 7, 96], [0, 1, 2, 3]], dtype=id_dtype)   # repeats, 2-D
        got = K.engram_gather(values.to(DEVICE), scales.to(DEVICE), ids.to(DEVICE), sorted_reads=sorted_reads)
        assert got.shape == (12, 64)
        assert same_bits(got.cpu(), reference_rows(values, scales, ids))
        # a row's bits do not depend on the other ids of the call (batch invariance)
        alone = K.engram_gather(values.to(DEVICE), scales.to(DEVICE), ids[1:2, 2:3].to(DEVICE))
        assert same_bits(alone.cpu(), got[6:7].cpu())

    def test_kernel_case_uint8_views_and_no_ids() -> None:
        values, scales = random_table(10, 96, seed=2)
        ids = torch.tensor([9, 0, 3])
        got = K.engram_gather(values.view(torch.uint8).to(DEVICE), scales.view(torch.uint8).to(DEVICE), ids.to(DEVICE))
        assert same_bits(got.cpu(), reference_rows(values, scales, ids))
        empty = K.engram_gather(values.to(DEVICE), scales.to(DEVICE), torch.zeros(0, 3, dtype=torch.int64).to(DEVICE))
        assert empty.shape == (0, 96)


    def test_kernel_case_stored_table_lookups_take_the_kernel(monkeypatch) -> None:
        """`StoredEngramTable[ids]` on CUDA ids (`gathers_in_kernel`, forced here for the interpreter) is one launch of
        this kernel with the torch path's bits and the ids' shape."""
        from sglang_dsv41.runtime import engram_table as ET

        values, scales = random_table(50, 64, seed=3)
        table = ET.StoredEngramTable(values.to(DEVICE), scales.to(DEVICE))
        ids = torch.tensor([[4, 49, 4], [0, 17, 33]]).to(DEVICE)
        want = table[ids.cpu()] if DEVICE == "cpu" else reference_rows(values, scales, ids).reshape(2, 3, 64)
        launches = []
        kernel = K._engram_gather_kernel
        monkeypatch.setattr(K, "_engram_gather_kernel", type("Counted", (), {
            "__getitem__": lambda self, grid: launches.append(grid) or kernel[grid]})())
        monkeypatch.setattr(ET, "gathers_in_kernel", lambda i: True)
        got = table[ids]
        assert launches == [(6,)] and got.shape == (2, 3, 64) and same_bits(got.cpu(), want.cpu())


# ---- the interpreter child and compile checks --------------------------------------------------

if not K.INTERPRETED:

    def test_kernel_cases_in_triton_interpreter() -> None:
        """Run this file's kernel cases in a child pytest with TRITON_INTERPRET=1 (CPU)."""
        run_kernel_cases_in_interpreter(__file__, min_passed=8, exact=True)

    @pytest.mark.parametrize("sorted_reads", [False, True], ids=["id_order", "sorted"])
    def test_kernel_compiles_for_hopper_without_float_math(sorted_reads: bool) -> None:
        """Flash rows (d = 256) build for sm_90 with no spills, and the PTX holds no fp32
        arithmetic (no mul/add/fma to contract, no .ftz to flush): the dequantisation is integer
        only, so the GPU's bits are the interpreter's."""
        kern = K._engram_gather_kernel
        consts = dict(D=256, BLOCK_D=256, SORTED=sorted_reads)
        sig = {"values_ptr": "*u8", "scales_ptr": "*u8", "ids_ptr": "*i64", "dest_ptr": "*i64", "out_ptr": "*fp32",
               **{n: "constexpr" for n in consts}}
        compiled, usage = compile_for_sm90(kern, sig, consts, {"num_warps": K.NUM_WARPS, "enable_fp_fusion": False})
        assert no_spills(usage), usage
        ptx = compiled.asm["ptx"]
        assert not re.search(r"\b(fma|mul|add|sub|div)(\.[a-z]+)*\.f32\b", ptx)
        assert ".ftz" not in ptx

    def test_cpu_without_interpreter_raises() -> None:
        values, scales = random_table(4, 32, seed=3)
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
            K.engram_gather(values, scales, torch.tensor([1]))


# ---- input checks (any process) ---------------------------------------------------------------

class _HostRows:
    """A stand-in `RowMajorBytes` (only its checks run here: no CUDA ids on this machine)."""

    dtype = torch.uint8

    def __init__(self, t: torch.Tensor) -> None:
        self.t, self.shape = t, tuple(t.shape)

    def data_ptr(self) -> int:
        return self.t.data_ptr()


def test_inputs_are_checked() -> None:
    values, scales = random_table(8, 64, seed=4)
    ids = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="do not match"):
        K.engram_gather(values, scales[:4], ids)
    with pytest.raises(ValueError, match="values must be a 2-D contiguous"):
        K.engram_gather(values.t(), scales, ids)
    with pytest.raises(ValueError, match="scales must be a 2-D contiguous"):
        K.engram_gather(values, scales.view(torch.uint8).float(), ids)
    with pytest.raises(TypeError, match="ids must be an int64 or int32"):
        K.engram_gather(values, scales, ids.float())
    with pytest.raises(TypeError, match="RowMajorBytes"):
        K.engram_gather(object(), scales, ids)
    host = _HostRows(values.view(torch.uint8))
    assert isinstance(host, K.RowMajorBytes)
    with pytest.raises(ValueError, match="needs ids on a CUDA device"):
        K.engram_gather(host, scales, ids)


@pytest.mark.gpu
def test_device_tables_at_flash_width_equal_the_reference() -> None:
    """Flash rows (d = 256) from device tensors, int32 and int64 ids, both read orders."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    values, scales = random_table(5000, 256, seed=5)
    ids = torch.randint(0, 5000, (64, 24), generator=torch.Generator().manual_seed(6))
    want = reference_rows(values, scales, ids)
    for dtype in (torch.int64, torch.int32):
        for sorted_reads in (False, True):
            got = K.engram_gather(values.cuda(), scales.cuda(), ids.to(dtype).cuda(), sorted_reads=sorted_reads)
            assert same_bits(got.cpu(), want), (dtype, sorted_reads)
    from sglang_dsv41.runtime.engram_table import StoredEngramTable
    rows = StoredEngramTable(values.cuda(), scales.cuda())[ids.cuda()]          # the device table's lookup: this kernel
    assert rows.shape == (64, 24, 256) and same_bits(rows.reshape(-1, 256).cpu(), want)

"""The CUDA-core W8A8 GEMV tier for 1–4 rows: `kernels/fp8_gemv.py` (spec §2.3, §3.8; issue 21).

The oracle and the bound are `test_kernels_fp8_w8a8.py`'s (`reference.ops.linear_fp8`, or
`linear_bf16` for `wo_a`'s W8A16 arithmetic): the tier multiplies the same quantised operands
exactly and sums in fp32, so the tensor-core tiers' bound holds unchanged.

What is pinned:
* kernel cases (interpreter child on CPU; compiled on CUDA): within the bound at 1–4 rows for
  fp32 and bf16 x, partial column tiles, split-K or one program, grouped `wo_a` with and without
  activation quantisation; x quantised inside the kernel gives the bits of x quantised by a launch
  before it, in one launch; the oracle's bits on exact-sum inputs at every row count; the in-launch
  split-K sum equal to the second-launch sum with the counters left at zero; a row's bits the same
  alone and in any batch of the tier; mutation checks (a doubled tile scale, a wrong group); the
  row limit;
* main process: the tier choice (`config_for_rows(gemv=True)`) and the sm_90 builds (no spills,
  ≤ 128 registers at 1–2 rows (4 rows: ≤ 168), E4M3 widened on the CUDA cores, 16-byte weight loads);
* GPU (`gpu`): Flash shapes at 1–4 rows within the bound, split-K == one program, row invariance
  and CUDA-graph replay with the counters.
"""
from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from sglang_dsv41.kernels import fp8_gemv as G
from sglang_dsv41.kernels import fp8_w8a8 as W

from fp8_cases import (BF16, F32, CountingLaunch, exact_sum_case, fp8_weight,
                        kernel)
from test_kernels_fp8_w8a8 import FLASH_SHAPES, oracle, random_x, within
import fp8_tier_cases as T
from triton_checks import compile_for_sm90, no_spills, run_kernel_cases_in_interpreter

GEMV = W.GEMV_CONFIG
ONE_PROGRAM = dataclasses.replace(GEMV, split_k=False)
SUB2_BN32 = dataclasses.replace(GEMV, block_n=32, sub_blocks=2)
PREQUANT = dataclasses.replace(GEMV, fused_quant=False)


# ---- kernel cases (interpreter child / CUDA) ---------------------------------------------------

@kernel
@pytest.mark.parametrize("cfg", [GEMV, ONE_PROGRAM, SUB2_BN32, PREQUANT],
                         ids=["split_k", "one_program", "bn32_sub2", "prequant"])
@pytest.mark.parametrize("n,k,dtype", [(64, 256, BF16), (96, 640, F32), (160, 384, BF16)])
def test_kernel_case_within_bound_at_every_row_count(cfg, n: int, k: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(n + k)
    values, scales = fp8_weight(n, k, g, exp_range=(-30, 10))
    x = random_x(4, k, g, dtype)
    for m in (1, 2, 3, 4):
        y = W.fp8_w8a8_linear(x[:m], values, scales, config=cfg)
        assert y.dtype == BF16 and y.shape == (m, n)
        ok, worst = within(y, *oracle(x[:m], values, scales))
        assert ok, (m, worst)


@kernel
def test_kernel_case_exact_sums_give_the_oracle_bits_at_every_row_count() -> None:
    """Exact-sum inputs: any order of the fp32 sums gives the same bits, so the tier, its one-program
    form and the tensor-core decode tier all give the oracle's."""
    g = torch.Generator().manual_seed(3)
    values, scales, x = exact_sum_case(4, 128, 640, g)
    ref, _ = oracle(x, values, scales)
    for m in (1, 2, 3, 4):
        for cfg in (GEMV, ONE_PROGRAM, SUB2_BN32, PREQUANT):
            assert torch.equal(W.fp8_w8a8_linear(x[:m], values, scales, config=cfg).float(), ref[:m]), (m, cfg)
        assert torch.equal(W.fp8_w8a8_linear(x[:m], values, scales, gemv=True).float(), ref[:m]), m


@kernel
def test_kernel_case_split_k_sums_inside_the_launch_with_counters(monkeypatch) -> None:
    T.check_split_k_sums_inside_the_launch({"gemv": True}, (G, "_gemv_kernel"), GEMV.target_programs, monkeypatch)


@kernel
def test_kernel_case_quantising_inside_the_kernel_gives_the_prequantised_bits(monkeypatch) -> None:
    """`fused_quant` (the kernel quantises each block it reads) and a quantisation launch before the
    GEMV give x the same values q·s_x, hence the same bits — with one launch instead of two."""
    from sglang_dsv41.kernels import fp8_quant

    g = torch.Generator().manual_seed(8)
    values, scales = fp8_weight(96, 640, g, exp_range=(-20, 0))
    quant = CountingLaunch(fp8_quant._quantize_kernel)
    monkeypatch.setattr(fp8_quant, "_quantize_kernel", quant)
    for dtype in (BF16, F32):
        x = random_x(4, 640, g, dtype)
        for m in (1, 2, 4):
            fused = W.fp8_w8a8_linear(x[:m], values, scales, config=GEMV)
            assert len(quant.grids) == 0
            assert torch.equal(fused, W.fp8_w8a8_linear(x[:m], values, scales, config=PREQUANT)), (dtype, m)
            assert len(quant.grids) == 1
            quant.grids.clear()


@kernel
def test_kernel_case_a_row_has_the_same_bits_alone_and_in_a_batch() -> None:
    T.check_rows_alone_and_in_a_batch({"gemv": True}, 4, ((0, 1), (3, 4), (1, 3), (0, 3)))


@kernel
@pytest.mark.parametrize("act_quant", [True, False])
def test_kernel_case_grouped_wo_a_is_one_launch_within_the_bound(act_quant: bool, monkeypatch) -> None:
    T.check_grouped_wo_a({"gemv": True}, (G, "_gemv_kernel"), act_quant, monkeypatch)


@kernel
def test_kernel_case_bound_catches_a_wrong_tile_scale_and_a_wrong_group() -> None:
    T.check_bound_catches_a_wrong_tile_scale_and_a_wrong_group({"gemv": True})


@kernel
def test_kernel_case_row_limit_and_empty_input() -> None:
    g = torch.Generator().manual_seed(1)
    values, scales = fp8_weight(64, 256, g)
    x = random_x(5, 256, g)
    with pytest.raises(ValueError, match="gemv tier takes 1…4"):
        W.fp8_w8a8_linear(x, values, scales, config=GEMV)
    assert W.fp8_w8a8_linear(x[:0], values, scales, config=GEMV).shape == (0, 64)
    assert torch.equal(W.fp8_w8a8_linear(x, values, scales, gemv=True), W.fp8_w8a8_linear(x, values, scales))


# ---- main process ---------------------------------------------------------------------------------

def test_gemv_tier_choice() -> None:
    assert GEMV.gemv and GEMV.block_m == G.GEMV_MAX_ROWS and GEMV.fused_quant
    for m in (1, 2, 3, 4):
        assert W.config_for_rows(m, gemv=True, shape=(1280, 5120, 1)) is GEMV
    assert W.config_for_rows(5, gemv=True) is W.DECODE_CONFIG and W.config_for_rows(17, gemv=True) is W.MID_CONFIG
    assert W.config_for_rows(1) is W.DECODE_CONFIG                     # off unless asked
    assert [G.gemv_rows(m) for m in (1, 2, 3, 4)] == [1, 2, 4, 4]


def _compile(rows: int, x_mode: int, x_type: str, block_n: int = 64, sub: int = 4, warps: int = 4):
    consts = dict(ROWS=rows, BLOCK_N=block_n, SUB=sub, SPLIT_K=True, FIXUP=True, X_MODE=x_mode, OUT_F32=True,
                  INTERPRET=False)
    pointers = {"x_ptr": x_type, "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32",
                "out_ptr": "*fp32", "y_ptr": "*fp32", "counters_ptr": "*i32"}
    names = list(G._gemv_kernel.arg_names)
    sig = {n: "constexpr" if n in consts else pointers.get(n, "i32") for n in names}
    aligned = [i for i, n in enumerate(names) if n.endswith("_ptr") or n in ("K", "N") or n.startswith("stride")]
    return compile_for_sm90(G._gemv_kernel, sig, consts, {"num_warps": warps, "num_stages": 1},
                            attrs={(i,): [["tt.divisibility", 16]] for i in aligned})


#: (rows, X_MODE, x's type) → the most registers a build may use: ≤ 128 keeps 4 programs of 4 warps per SM
#: (1–2 rows, the decode case); 4 rows hold four rows of x blocks: ≤ 168 (3 programs)
BUILDS = {(1, "quantise", "*bf16"): 128, (2, "quantise", "*bf16"): 128, (4, "quantise", "*bf16"): 168,
          (1, "quantise", "*fp32"): 128, (4, "quantise", "*fp32"): 168, (1, "prequantised", "*bf16"): 128,
          (4, "prequantised", "*bf16"): 168, (1, "round_bf16", "*fp32"): 128, (4, "round_bf16", "*fp32"): 168}
X_MODES = {"prequantised": G.X_PREQUANTISED.value, "round_bf16": G.X_ROUND_BF16.value, "quantise": G.X_QUANTISE.value}


@pytest.mark.parametrize("rows,x_mode,x_type", sorted(BUILDS))
def test_kernel_compiles_for_hopper_without_spills(rows: int, x_mode: str, x_type: str) -> None:
    if W.INTERPRETED:
        pytest.skip("no sm_90 compile under the interpreter: the parent (compiled) process runs this")
    compiled, usage = _compile(rows, X_MODES[x_mode], x_type)
    assert no_spills(usage), usage
    assert int(re.search(r"REG:(\d+)", usage).group(1)) <= BUILDS[rows, x_mode, x_type], usage
    ptx = compiled.asm["ptx"]
    assert "cvt.rn.f16x2.e4m3x2" in ptx and "mma" not in ptx             # E4M3 widened, CUDA-core sums
    assert ("cvt.rn.satfinite.e4m3x2.f32" in ptx) == (x_mode == "quantise")   # hardware RNE quantisation
    # the prologue's four weight blocks, then each step's next four: 16-byte loads (`tl.load` of [BLOCK_N, 32] E4M3)
    assert len(re.findall(r"@%p\d+ ld\.global\.v4\.b32", ptx)) >= 8


if not W.INTERPRETED:

    def test_kernel_cases_in_triton_interpreter() -> None:
        """Run this file's kernel cases in a child pytest with TRITON_INTERPRET=1 (CPU)."""
        run_kernel_cases_in_interpreter(__file__, min_passed=20, exact=True)


# ---- GPU ------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(FLASH_SHAPES))
def test_gpu_flash_shapes_within_bound_split_k_and_row_invariance(name: str) -> None:
    T.check_gpu_flash_shape({"gemv": True}, ONE_PROGRAM, *FLASH_SHAPES[name], (1, 2, 3, 4), seed=len(name))


@pytest.mark.gpu
@pytest.mark.parametrize("act_quant", [True, False])
def test_gpu_grouped_wo_a_at_flash_shape(act_quant: bool) -> None:
    T.check_gpu_grouped_wo_a({"gemv": True}, act_quant, (1, 4))


@pytest.mark.gpu
def test_gpu_replays_in_a_cuda_graph_with_the_counters() -> None:
    T.check_gpu_graph_replay({"gemv": True})

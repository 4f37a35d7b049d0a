"""The scale-folded W8A8 tier for 1–16 rows: `kernels/fp8_fold.py` (spec §2.3, §3.8; issue 21).

The oracle and the bound are `test_kernels_fp8_w8a8.py`'s (`reference.ops.linear_fp8`, or
`linear_bf16` for `wo_a`'s W8A16 arithmetic): the tier multiplies the same quantised operands —
the scales folded into BF16 operands exactly — and sums in fp32, so the tensor-core tiers' bound holds.

What is pinned:
* kernel cases (interpreter child on CPU; compiled on CUDA): within the bound at 1, 3 and 16 rows
  for fp32 and bf16 x, partial column tiles, K not a multiple of the step, split-K or one program;
  the oracle's bits on exact-sum inputs; the in-launch split-K sum equal to the second-launch sum
  with the counters left at zero; a row's bits the same alone and in any batch; grouped `wo_a`
  with and without activation quantisation in one launch; mutation checks (a doubled tile scale, a
  wrong group); the quantised hand-off: the quantisation is idempotent (bits), `x_quantised` on
  quantised x gives the bits of quantising inside, `quantise_out` gives the bits of the output
  quantised by its own launch (kernel store, post-launch fallback, and the other tiers);
* main process: the tier choice (`config_for_rows(fold=True)`) and the sm_90 build (no spills, BF16
  MMAs, hardware E4M3 quantisation, pipelined loads, the in-launch sum's release/acquire);
* GPU (`gpu`): Flash shapes at 1–16 rows within the bound, row invariance, grouped `wo_a`, and
  CUDA-graph replay with the counters.
"""
from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from sglang_dsv41.kernels import fp8_fold as FK
from sglang_dsv41.kernels import fp8_w8a8 as W

from fp8_cases import (BF16, DEVICE, F32, CountingLaunch, exact_sum_case, fp8_weight,
                        kernel)
from test_kernels_fp8_w8a8 import FLASH_SHAPES, oracle, random_x, within
import fp8_tier_cases as T
from triton_checks import compile_for_sm90, no_spills, run_kernel_cases_in_interpreter

FOLD = W.FOLD_CONFIG
ONE_PROGRAM = dataclasses.replace(FOLD, split_k=False)
BN32_SUB2 = dataclasses.replace(FOLD, block_n=32, sub_blocks=2, target_programs=W.DECODE_TARGET_PROGRAMS)


# ---- kernel cases (interpreter child / CUDA) ---------------------------------------------------

@kernel
@pytest.mark.parametrize("cfg", [FOLD, ONE_PROGRAM, BN32_SUB2], ids=["split_k", "one_program", "bn32_sub2"])
@pytest.mark.parametrize("n,k,dtype", [(64, 256, BF16), (96, 672, F32), (160, 384, BF16)])
def test_kernel_case_within_bound_at_every_row_count(cfg, n: int, k: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(n + k)
    values, scales = fp8_weight(n, k, g, exp_range=(-30, 10))
    x = random_x(16, k, g, dtype)
    for m in (1, 3, 16):
        y = W.fp8_w8a8_linear(x[:m], values, scales, config=cfg)
        assert y.dtype == BF16 and y.shape == (m, n)
        ok, worst = within(y, *oracle(x[:m], values, scales))
        assert ok, (m, worst)


@kernel
def test_kernel_case_exact_sums_give_the_oracle_bits() -> None:
    """Exact-sum inputs: any order of the fp32 sums gives the same bits, so the tier and its forms
    give the oracle's."""
    g = torch.Generator().manual_seed(3)
    values, scales, x = exact_sum_case(16, 128, 640, g)
    ref, _ = oracle(x, values, scales)
    for m in (1, 5, 16):
        for cfg in (FOLD, ONE_PROGRAM, BN32_SUB2):
            assert torch.equal(W.fp8_w8a8_linear(x[:m], values, scales, config=cfg).float(), ref[:m]), (m, cfg)
        assert torch.equal(W.fp8_w8a8_linear(x[:m], values, scales, fold=True).float(), ref[:m]), m


@kernel
def test_kernel_case_split_k_sums_inside_the_launch_with_counters(monkeypatch) -> None:
    T.check_split_k_sums_inside_the_launch({"fold": True}, (FK, "_fold_kernel"), FOLD.target_programs, monkeypatch)


@kernel
def test_kernel_case_a_row_has_the_same_bits_alone_and_in_a_batch() -> None:
    T.check_rows_alone_and_in_a_batch({"fold": True}, 16, ((0, 1), (15, 16), (1, 3), (4, 13)))


@kernel
@pytest.mark.parametrize("act_quant", [True, False])
def test_kernel_case_grouped_wo_a_is_one_launch_within_the_bound(act_quant: bool, monkeypatch) -> None:
    T.check_grouped_wo_a({"fold": True}, (FK, "_fold_kernel"), act_quant, monkeypatch)


@kernel
def test_kernel_case_bound_catches_a_wrong_tile_scale_and_a_wrong_group() -> None:
    T.check_bound_catches_a_wrong_tile_scale_and_a_wrong_group({"fold": True})


@kernel
def test_kernel_case_row_limit_and_empty_input(monkeypatch) -> None:
    g = torch.Generator().manual_seed(1)
    values, scales = fp8_weight(64, 256, g)
    x = random_x(17, 256, g)
    folds = CountingLaunch(FK._fold_kernel)
    monkeypatch.setattr(FK, "_fold_kernel", folds)
    assert W.fp8_w8a8_linear(x[:0], values, scales, fold=True).shape == (0, 64)
    assert torch.equal(W.fp8_w8a8_linear(x, values, scales, fold=True), W.fp8_w8a8_linear(x, values, scales))
    assert not folds.grids                                             # 17 rows: the mid tier
    W.fp8_w8a8_linear(x[:16], values, scales, fold=True)
    assert len(folds.grids) == 1


@kernel
def test_kernel_case_activation_quantisation_is_idempotent() -> None:
    """What the hand-off rests on: quantised values quantise to themselves, bit for bit — random rows,
    groups of zeros, tiny groups near the 1e-10 floor, E4M3 subnormals, the 448 edge."""
    from sglang_dsv41.kernels.fp8_quant import fake_quantize_activations_bf16 as fq

    g = torch.Generator().manual_seed(12)
    x = random_x(8, 256, g, F32) * torch.logspace(-14, 6, 8)[:, None].to(DEVICE)
    x[1, :32] = 0.0
    x[2, 32:64] = 3e-11
    x[3, :64] = torch.linspace(-1e-10, 1.2e-10, 64).to(DEVICE)
    x[4, :32] = 448.0 * 2.0 ** -20
    x[5, 64:96] = torch.arange(32, dtype=F32).to(DEVICE) * 2.0 ** -9
    once = fq(x)
    assert torch.equal(fq(once), once) and torch.equal(fq(once.float()), once)


@kernel
@pytest.mark.parametrize("cfg", [FOLD, ONE_PROGRAM], ids=["split_k", "one_program"])
def test_kernel_case_x_quantised_gives_the_bits_of_quantising_inside(cfg) -> None:
    from sglang_dsv41.kernels.fp8_quant import fake_quantize_activations_bf16 as fq

    g = torch.Generator().manual_seed(13)
    values, scales = fp8_weight(96, 640, g, exp_range=(-20, 0))
    x = random_x(5, 640, g, BF16)
    counters = W.split_k_counters(96, DEVICE)
    for m in (1, 5):
        want = W.fp8_w8a8_linear(x[:m], values, scales, config=cfg, counters=counters)
        got = W.fp8_w8a8_linear(fq(x[:m]), values, scales, config=cfg, counters=counters, x_quantised=True)
        assert torch.equal(got, want), m
    unquantised = W.fp8_w8a8_linear(x, values, scales, config=cfg, x_quantised=True)     # a caller error
    assert not torch.equal(unquantised, W.fp8_w8a8_linear(x, values, scales, config=cfg))


@kernel
@pytest.mark.parametrize("act_quant", [True, False])
def test_kernel_case_quantise_out_gives_the_bits_of_a_quantising_launch(act_quant: bool, monkeypatch) -> None:
    """The fold tier's store (split-K fixup and one program) quantises y as `fake_quantize_activations_bf16`
    would, without its launch; without counters (the summing launch) and on the other tiers that launch
    runs; grouped `wo_a` included; BF16 or fp32 out."""
    from sglang_dsv41.kernels import fp8_quant

    fq = fp8_quant.fake_quantize_activations_bf16
    g = torch.Generator().manual_seed(14)
    groups, rows, k = 4, 64, 640
    values, scales = fp8_weight(groups * rows, k, g, exp_range=(-20, 0))
    x = random_x(20, groups * k, g, F32)
    counters = W.split_k_counters(groups * rows, DEVICE)
    assert W.k_chunks(groups * rows, k, FOLD.target_programs) > 1
    quant = CountingLaunch(fp8_quant._quantize_kernel)
    monkeypatch.setattr(fp8_quant, "_quantize_kernel", quant)
    cases = [(FOLD, counters, 0), (ONE_PROGRAM, None, 0), (FOLD, None, 1), (W.DECODE_CONFIG, counters, 1)]
    for cfg, ctr, launches in cases:
        for m, out_dtype in ((1, BF16), (3, F32)):
            kw = dict(groups=groups, act_quant=act_quant, config=cfg, counters=ctr, out_dtype=out_dtype)
            plain = W.fp8_w8a8_linear(x[:m], values, scales, **kw)
            quant.grids.clear()
            got = W.fp8_w8a8_linear(x[:m], values, scales, quantise_out=True, **kw)
            assert len(quant.grids) == launches, (cfg, m)
            assert got.dtype == out_dtype and torch.equal(got, fq(plain).to(out_dtype)), (cfg, m)
    assert not torch.equal(fq(plain), plain.to(BF16))                  # the quantisation changes these values
    y = W.fp8_w8a8_linear(x[:17], values, scales, groups=groups, act_quant=act_quant, fold=True, quantise_out=True)
    assert torch.equal(y, fq(W.fp8_w8a8_linear(x[:17], values, scales, groups=groups, act_quant=act_quant)))


# ---- main process ---------------------------------------------------------------------------------

def test_fold_tier_choice() -> None:
    assert FOLD.fold and FOLD.block_m == 16 and FOLD.split_k and not FOLD.gemv
    for m in (1, 4, 16):
        assert W.config_for_rows(m, fold=True, shape=(1280, 5120, 1)) is FOLD
    assert W.config_for_rows(17, fold=True) is W.MID_CONFIG
    assert W.config_for_rows(1) is W.DECODE_CONFIG                     # off unless asked
    with pytest.raises(ValueError, match="gemv or fold"):
        W.config_for_rows(1, gemv=True, fold=True)


def _compile(act_quant: bool, x_type: str, x_quantised: bool = False, out_quant: bool = False,
             cfg: W.W8A8Config = FOLD):
    consts = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, SUB=cfg.sub_blocks, SPLIT_K=True, FIXUP=True,
                  ACT_QUANT=act_quant, X_QUANTISED=x_quantised, OUT_F32=False, OUT_QUANT=out_quant, INTERPRET=False)
    pointers = {"x_ptr": x_type, "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32",
                "out_ptr": "*fp32", "y_ptr": "*bf16", "counters_ptr": "*i32"}
    names = list(FK._fold_kernel.arg_names)
    sig = {n: "constexpr" if n in consts else pointers.get(n, "i32") for n in names}
    aligned = [i for i, n in enumerate(names) if n.endswith("_ptr") or n in ("K", "N") or n.startswith("stride")]
    return compile_for_sm90(FK._fold_kernel, sig, consts, {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages},
                            attrs={(i,): [["tt.divisibility", 16]] for i in aligned})


@pytest.mark.parametrize("act_quant,x_type", [(True, "*bf16"), (True, "*fp32"), (False, "*bf16"), (False, "*fp32")])
def test_kernel_compiles_for_hopper_without_spills(act_quant: bool, x_type: str) -> None:
    if W.INTERPRETED:
        pytest.skip("no sm_90 compile under the interpreter: the parent (compiled) process runs this")
    compiled, usage = _compile(act_quant, x_type)
    assert no_spills(usage), usage
    ptx = compiled.asm["ptx"]
    assert re.search(r"mma\S*\.f32\.bf16\.bf16", ptx)                    # BF16 MMAs, fp32 sums
    assert ("cvt.rn.satfinite.e4m3x2.f32" in ptx) == act_quant            # hardware RNE quantisation
    assert "cp.async" in ptx                                              # pipelined global loads
    stores, atom = ptx.find("st.global"), ptx.find("atom.global.gpu.acq_rel.add")
    assert 0 <= stores < ptx.find("bar.sync", stores) < atom and "ld.global.cg" in ptx[atom:]


@pytest.mark.parametrize("act_quant,x_quantised,out_quant", [(True, True, False), (False, False, True),
                                                             (True, True, True)])
def test_hand_off_builds_for_hopper_without_spills(act_quant: bool, x_quantised: bool, out_quant: bool) -> None:
    """`x_quantised`: no E4M3 rounding of x in the loop (x streams into the MMA); `quantise_out`: the
    E4M3 rounding only in the store, after the in-launch sum."""
    if W.INTERPRETED:
        pytest.skip("no sm_90 compile under the interpreter: the parent (compiled) process runs this")
    compiled, usage = _compile(act_quant, "*bf16", x_quantised, out_quant)
    assert no_spills(usage), usage
    ptx = compiled.asm["ptx"]
    assert re.search(r"mma\S*\.f32\.bf16\.bf16", ptx) and "cp.async" in ptx
    rounding = ptx.find("cvt.rn.satfinite.e4m3x2.f32")
    assert (rounding >= 0) == out_quant
    if out_quant:                                                         # only after the arrival count
        assert rounding > ptx.find("atom.global.gpu.acq_rel.add")


if not W.INTERPRETED:

    def test_kernel_cases_in_triton_interpreter() -> None:
        """Run this file's kernel cases in a child pytest with TRITON_INTERPRET=1 (CPU)."""
        run_kernel_cases_in_interpreter(__file__, min_passed=21, exact=True)


# ---- GPU ------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(FLASH_SHAPES))
def test_gpu_flash_shapes_within_bound_and_row_invariance(name: str) -> None:
    T.check_gpu_flash_shape({"fold": True}, ONE_PROGRAM, *FLASH_SHAPES[name], (1, 2, 7, 16), seed=len(name))


@pytest.mark.gpu
@pytest.mark.parametrize("act_quant", [True, False])
def test_gpu_grouped_wo_a_at_flash_shape(act_quant: bool) -> None:
    T.check_gpu_grouped_wo_a({"fold": True}, act_quant, (1, 16))


@pytest.mark.gpu
def test_gpu_replays_in_a_cuda_graph_with_the_counters() -> None:
    T.check_gpu_graph_replay({"fold": True})


@pytest.mark.gpu
def test_gpu_quantised_handoff_keeps_the_bits_at_flash_shapes() -> None:
    """Flash's `wo_a` → `wo_b` at 1 and 16 rows: `wo_a` with `quantise_out` equals its plain output quantised
    by the launch (hardware E4M3 rounding in the store), and `wo_b` on it with `x_quantised` equals `wo_b`
    quantising it inside."""
    from sglang_dsv41.kernels.fp8_quant import fake_quantize_activations_bf16 as fq

    g = torch.Generator().manual_seed(22)
    a_values, a_scales = fp8_weight(8192, 4096, g)
    b_values, b_scales = fp8_weight(5120, 8192, g)
    o = random_x(16, 8 * 4096, g)
    a_ctr, b_ctr = W.split_k_counters(8192, o.device), W.split_k_counters(5120, o.device)
    for m in (1, 16):
        kw = dict(groups=8, act_quant=False, fold=True, counters=a_ctr)
        u = W.fp8_w8a8_linear(o[:m], a_values, a_scales, quantise_out=True, **kw)
        assert torch.equal(u, fq(W.fp8_w8a8_linear(o[:m], a_values, a_scales, **kw))), m
        handed = W.fp8_w8a8_linear(u, b_values, b_scales, fold=True, counters=b_ctr, x_quantised=True)
        assert torch.equal(handed, W.fp8_w8a8_linear(u, b_values, b_scales, fold=True, counters=b_ctr)), m
    assert not a_ctr.any() and not b_ctr.any()

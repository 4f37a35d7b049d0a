"""`kernels/fp8_w8a8.py`: the fp32 output option, the swap-AB form and per-shape configurations.

What is pinned:
* kernel cases (interpreter child on CPU; compiled on CUDA): `out_dtype=torch.float32` gives the
  BF16 result's values bit for bit (fp32 holding BF16 values) at every row tier — split-K summed
  in the launch (counters) and by the second launch, one program, the Triton prefill tier, the
  cuBLAS prefill form, groups > 1, W8A16 (`act_quant=False`) and swap-AB — in one GEMM launch
  (no copy kernel); swap-AB configurations are within the bound of tests/test_kernels_fp8_w8a8.py,
  give the oracle's bits on exact-sum inputs, and their grouped product equals the groups alone;
* main process: SHAPE_CONFIGS replaces a tier's configuration for one weight shape at every M of
  that tier and no other; bad `out_dtype` / swap-AB with the FP8 MMA raise; swap-AB compiles for
  sm_90 without spills (cp.async, f16 MMA, fp32 stores with OUT_F32).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from sglang_dsv41.kernels import fp8_w8a8 as W

from fp8_cases import BF16, DEVICE, F32, CountingLaunch, exact_sum_case, fp8_weight, kernel
from test_kernels_fp8_w8a8 import CONFIGS, _compile, oracle, random_x, within
from triton_checks import no_spills, run_kernel_cases_in_interpreter

SWAP_DECODE = W.W8A8Config(16, 64, 4, 4, 3, fused_quant=True, split_k=True,
                           target_programs=W.DECODE_TARGET_PROGRAMS, swap_ab=True)
SWAP_CONFIGS = {"swap_decode": SWAP_DECODE,
                "swap_bn128": dataclasses.replace(SWAP_DECODE, block_n=128, sub_blocks=2),
                "swap_one_program": dataclasses.replace(SWAP_DECODE, split_k=False),
                "swap_mid": W.W8A8Config(64, 64, 1, 4, 3, fused_quant=True, split_k=True, swap_ab=True),
                "swap_prequant": dataclasses.replace(SWAP_DECODE, fused_quant=False)}
OUT_CASES = {"decode_counters": (W.DECODE_CONFIG, True), "decode_second_launch": (W.DECODE_CONFIG, False),
             "decode_one_program": (CONFIGS["decode_one_program"], False), "mid": (W.MID_CONFIG, True),
             "prefill_triton": (W.PREFILL_CONFIG, False), "prefill_form": (None, False),
             "swap_decode": (SWAP_DECODE, True), "swap_second_launch": (SWAP_DECODE, False)}


# ---- kernel cases (interpreter child / CUDA) ---------------------------------------------------

@kernel
@pytest.mark.parametrize("groups,act_quant", [(1, True), (3, True), (3, False)])
@pytest.mark.parametrize("label", sorted(OUT_CASES))
def test_kernel_case_fp32_output_is_the_bf16_output_upcast(label: str, groups: int, act_quant: bool,
                                                           monkeypatch) -> None:
    cfg, with_counters = OUT_CASES[label]
    g = torch.Generator().manual_seed(groups * 31 + len(label))
    n, k, m = groups * 64, 640, 5
    values, scales = fp8_weight(n, k, g, exp_range=(-20, 0))
    x = random_x(m, groups * k, g, F32)
    kw = dict(groups=groups, act_quant=act_quant) | (dict(bf16_gemm=True) if cfg is None else dict(config=cfg))
    counters = W.split_k_counters(n, DEVICE) if with_counters else None
    want = W.fp8_w8a8_linear(x, values, scales, counters=counters, **kw)
    assert want.dtype == BF16
    gemms, sums = CountingLaunch(W._w8a8_kernel), CountingLaunch(W._sum_chunks_kernel)
    monkeypatch.setattr(W, "_w8a8_kernel", gemms)
    monkeypatch.setattr(W, "_sum_chunks_kernel", sums)
    got = W.fp8_w8a8_linear(x, values, scales, counters=counters, out_dtype=F32, **kw)
    assert got.dtype == F32 and got.shape == (m, n)
    assert torch.equal(got.view(torch.int32), want.float().view(torch.int32)), label
    split = cfg is not None and cfg.split_k and W.k_chunks(n, k, cfg.target_programs) > 1
    assert len(gemms.grids) == (0 if cfg is None else 1)
    assert len(sums.grids) == (1 if split and not with_counters else 0)
    if counters is not None:
        assert not counters.any()


@kernel
@pytest.mark.parametrize("cfg", [W.DECODE_CONFIG, SWAP_DECODE], ids=["decode", "swap"])
def test_kernel_case_in_launch_sum_of_negative_zero_partials_is_positive_zero(cfg: W.W8A8Config) -> None:
    """A zero x row against negative weights: every chunk's partial is −0; the in-launch sum and
    the second launch both give +0 (sums start from +0)."""
    g = torch.Generator().manual_seed(14)
    values, scales = fp8_weight(64, 32 * 36, g, exp_range=(-4, 0))
    values = (-(values.float().abs().clamp(max=400) + 1)).to(W.FP8)
    x = random_x(2, 32 * 36, g, F32)
    x[0] = 0.0
    assert W.k_chunks(64, 32 * 36, cfg.target_programs) % 4 != 0
    one = W.fp8_w8a8_linear(x, values, scales, config=cfg, counters=W.split_k_counters(64, DEVICE), out_dtype=F32)
    two = W.fp8_w8a8_linear(x, values, scales, config=cfg, out_dtype=F32)
    assert torch.equal(one.view(torch.int32), two.view(torch.int32))
    assert not one[0].view(torch.int32).any()


@kernel
def test_kernel_case_fp32_output_with_no_rows() -> None:
    g = torch.Generator().manual_seed(1)
    values, scales = fp8_weight(32, 64, g)
    y = W.fp8_w8a8_linear(random_x(2, 64, g)[:0], values, scales, out_dtype=F32)
    assert y.dtype == F32 and y.shape == (0, 32)


@kernel
@pytest.mark.parametrize("label", sorted(SWAP_CONFIGS))
@pytest.mark.parametrize("m,n,k,dtype", [(1, 64, 256, BF16), (19, 192, 160, F32)])
def test_kernel_case_swap_ab_within_bound_of_the_reference(label: str, m: int, n: int, k: int,
                                                           dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(m * 5 + n + k)
    values, scales = fp8_weight(n, k, g, exp_range=(-30, 10))
    x = random_x(m, k, g, dtype)
    y = W.fp8_w8a8_linear(x, values, scales, config=SWAP_CONFIGS[label], counters=W.split_k_counters(n, DEVICE))
    ok, worst = within(y, *oracle(x, values, scales))
    assert ok, worst


#: the distinct configurations of kernels.fp8_w8a8.SHAPE_CONFIGS (the H200 sweep's picks), by key
SHAPE_CONFIG_CASES = {f"{lim}_{n}x{k}_g{g}": cfg for (lim, n, k, g), cfg in W.SHAPE_CONFIGS.items()}


@kernel
@pytest.mark.parametrize("label", sorted(SHAPE_CONFIG_CASES))
def test_kernel_case_shape_configs_within_bound_and_exact_on_exact_sums(label: str) -> None:
    """Every per-shape configuration on a small weight (its tiles, split-K with counters, partial blocks):
    within the bound of tests/test_kernels_fp8_w8a8.py, the oracle's bits on exact-sum inputs."""
    cfg = SHAPE_CONFIG_CASES[label]
    g = torch.Generator().manual_seed(len(label))
    m = 5 if cfg.block_m == 16 else 37
    values, scales = fp8_weight(160, 640, g, exp_range=(-30, 10))
    x = random_x(m, 640, g, F32)
    y = W.fp8_w8a8_linear(x, values, scales, config=cfg, counters=W.split_k_counters(160, DEVICE))
    ok, worst = within(y, *oracle(x, values, scales))
    assert ok, worst
    values, scales, x = exact_sum_case(m, 128, 640, g)
    assert torch.equal(W.fp8_w8a8_linear(x, values, scales, config=cfg).float(), oracle(x, values, scales)[0])


@kernel
def test_kernel_case_swap_ab_gives_the_oracles_bits_on_exact_sums() -> None:
    g = torch.Generator().manual_seed(3)
    values, scales, x = exact_sum_case(21, 128, 640, g)
    ref, _ = oracle(x, values, scales)
    for label, cfg in SWAP_CONFIGS.items():
        assert torch.equal(W.fp8_w8a8_linear(x, values, scales, config=cfg).float(), ref), label


@kernel
@pytest.mark.parametrize("act_quant", [True, False])
def test_kernel_case_swap_ab_grouped_equals_the_groups_alone(act_quant: bool) -> None:
    g = torch.Generator().manual_seed(12)
    groups, rows, k, m = 4, 64, 192, 6
    values, scales = fp8_weight(groups * rows, k, g, exp_range=(-20, 0))
    x = random_x(m, groups * k, g)
    y = W.fp8_w8a8_linear(x, values, scales, groups=groups, act_quant=act_quant, config=SWAP_DECODE)
    ok, worst = within(y, *oracle(x, values, scales, groups, act_quant=act_quant))
    assert ok, worst
    for gi in range(groups):
        rows_g = slice(gi * rows, (gi + 1) * rows)
        alone = W.fp8_w8a8_linear(x[:, gi * k:(gi + 1) * k].contiguous(), values[rows_g], scales[gi * 2:(gi + 1) * 2],
                                  act_quant=act_quant, config=SWAP_DECODE)
        assert torch.equal(alone, y[:, rows_g]), gi


# ---- main process -------------------------------------------------------------------------------

def test_shape_configs_replace_a_tier_for_one_shape_at_every_m_of_the_tier(monkeypatch) -> None:
    monkeypatch.setitem(W.SHAPE_CONFIGS, (16, 1280, 5120, 1), SWAP_DECODE)
    for m in (1, 7, 16):
        assert W.config_for_rows(m, shape=(1280, 5120, 1)) is SWAP_DECODE
        assert W.config_for_rows(m, shape=(4096, 1280, 1)) is W.DECODE_CONFIG
        assert W.config_for_rows(m, fp8_mma=True, shape=(1280, 5120, 1)) is W.DECODE_CONFIG
        assert W.config_for_rows(m) is W.DECODE_CONFIG
    assert W.config_for_rows(17, shape=(1280, 5120, 1)) is W.MID_CONFIG
    assert W.config_for_rows(300, shape=(1280, 5120, 1)) is W.PREFILL_CONFIG
    assert all(lim in {limit for limit, _ in W.ROW_TIERS} for lim, *_ in W.SHAPE_CONFIGS)


def test_bad_output_dtype_and_swap_ab_on_the_fp8_mma_raise() -> None:
    g = torch.Generator().manual_seed(2)
    values, scales = fp8_weight(32, 64, g, device="cpu")
    with pytest.raises(ValueError, match="out_dtype"):
        W.fp8_w8a8_linear(torch.zeros(2, 64), values, scales, out_dtype=torch.float16)
    if W.INTERPRETED:
        with pytest.raises(ValueError, match="swap_ab"):
            W.fp8_w8a8_linear(torch.zeros(2, 64), values, scales,
                              config=dataclasses.replace(SWAP_DECODE, fp8_mma=True))


@pytest.mark.parametrize("key", sorted(W.SHAPE_CONFIGS))
def test_shape_configs_compile_for_hopper_without_spills(key: tuple) -> None:
    if W.INTERPRETED:
        pytest.skip("no sm_90 compile under the interpreter: the parent (compiled) process runs this")
    cfg, act_quant = W.SHAPE_CONFIGS[key], key[3] == 1                 # grouped = wo_a: W8A16
    compiled, usage = _compile(cfg, act_quant, fixup=True, out_f32=True)
    assert no_spills(usage), (key, usage)
    assert "cp.async" in compiled.asm["ptx"]


@pytest.mark.parametrize("label,act_quant,out_f32", [("swap_decode", True, True), ("swap_bn128", True, False),
                                                     ("swap_decode", False, True), ("swap_mid", True, True)])
def test_swap_ab_compiles_for_hopper_without_spills(label: str, act_quant: bool, out_f32: bool) -> None:
    if W.INTERPRETED:
        pytest.skip("no sm_90 compile under the interpreter: the parent (compiled) process runs this")
    compiled, usage = _compile(SWAP_CONFIGS[label], act_quant, fixup=True, out_f32=out_f32)
    ptx = compiled.asm["ptx"]
    assert no_spills(usage), usage
    assert "cp.async" in ptx
    assert ("mma" in ptx) and (".f16.f16" in ptx if act_quant else ".bf16.bf16" in ptx)
    assert ("st.global.b32" in ptx or "st.global.v" in ptx) and "atom.global.gpu.acq_rel.add" in ptx


if not W.INTERPRETED:

    def test_kernel_cases_in_triton_interpreter() -> None:
        """Run this file's kernel cases in a child pytest with TRITON_INTERPRET=1 (CPU)."""
        run_kernel_cases_in_interpreter(__file__, min_passed=40 + len(SHAPE_CONFIG_CASES), exact=True)

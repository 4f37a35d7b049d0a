"""Kernel cases shared by the small-row W8A8 tiers — the CUDA-core GEMV (`kernels/fp8_gemv.py`) and the
scale-folded MMA tier (`kernels/fp8_fold.py`). Each tier's test file runs them (interpreter child / CUDA)
with `tier`, its `fp8_w8a8_linear` switch ({"gemv": True} / {"fold": True}), and its kernel as
(module, attribute name) for counting launches. The oracle and the bound: `test_kernels_fp8_w8a8.py`."""
from __future__ import annotations

import torch

from sglang_dsv41.kernels import fp8_w8a8 as W

from fp8_cases import BF16, DEVICE, F32, CountingLaunch, fp8_weight
from test_kernels_fp8_w8a8 import oracle, random_x, within


def check_split_k_sums_inside_the_launch(tier: dict, kernel: tuple, target: int, monkeypatch) -> None:
    """Without counters a second launch sums the chunks; with them the GEMM's own launch does — the same
    bits, the counters left at zero, within the bound."""
    g = torch.Generator().manual_seed(10)
    values, scales = fp8_weight(96, 640, g, exp_range=(-20, 0))
    x = random_x(3, 640, g, F32)
    assert W.k_chunks(96, 640, target) > 1
    sums, gemms = CountingLaunch(W._sum_chunks_kernel), CountingLaunch(getattr(*kernel))
    monkeypatch.setattr(W, "_sum_chunks_kernel", sums)
    monkeypatch.setattr(*kernel, gemms)
    two_launch = W.fp8_w8a8_linear(x, values, scales, **tier)
    assert len(sums.grids) == 1 and len(gemms.grids) == 1
    counters = W.split_k_counters(96, DEVICE)
    one_launch = W.fp8_w8a8_linear(x, values, scales, counters=counters, **tier)
    assert len(sums.grids) == 1 and len(gemms.grids) == 2 and torch.equal(one_launch, two_launch)
    assert not counters.any()
    ok, worst = within(one_launch, *oracle(x, values, scales))
    assert ok, worst


def check_rows_alone_and_in_a_batch(tier: dict, rows: int, spans: tuple) -> None:
    g = torch.Generator().manual_seed(7)
    values, scales = fp8_weight(96, 640, g, exp_range=(-20, 0))
    x = random_x(rows, 640, g, BF16)
    batch = W.fp8_w8a8_linear(x, values, scales, **tier)
    for lo, hi in spans:
        assert torch.equal(W.fp8_w8a8_linear(x[lo:hi], values, scales, **tier), batch[lo:hi]), (lo, hi)


def check_grouped_wo_a(tier: dict, kernel: tuple, act_quant: bool, monkeypatch) -> None:
    """`wo_a`'s grouped product (act_quant False: x rounded to BF16 inside the kernel) is one launch, equals
    the groups alone and is within the bound; W8A8 differs from W8A16."""
    g = torch.Generator().manual_seed(9)
    groups, rows, k = 4, 64, 160
    values, scales = fp8_weight(groups * rows, k, g, exp_range=(-20, 0))
    x = random_x(2, groups * k, g, F32)
    gemms = CountingLaunch(getattr(*kernel))
    monkeypatch.setattr(*kernel, gemms)
    y = W.fp8_w8a8_linear(x, values, scales, groups=groups, act_quant=act_quant, **tier)
    assert len(gemms.grids) == 1
    ok, worst = within(y, *oracle(x, values, scales, groups, act_quant=act_quant))
    assert ok, worst
    for gi in range(groups):
        rows_g = slice(gi * rows, (gi + 1) * rows)
        alone = W.fp8_w8a8_linear(x[:, gi * k:(gi + 1) * k].contiguous(), values[rows_g],
                                  scales[gi * 2:(gi + 1) * 2], act_quant=act_quant, **tier)
        assert torch.equal(alone, y[:, rows_g]), gi
    other = W.fp8_w8a8_linear(x, values, scales, groups=groups, act_quant=not act_quant, **tier)
    assert not torch.equal(y, other)


def check_bound_catches_a_wrong_tile_scale_and_a_wrong_group(tier: dict) -> None:
    g = torch.Generator().manual_seed(5)
    values, scales = fp8_weight(64, 256, g, exp_range=(-4, 0))
    x = random_x(2, 256, g, F32)
    ref, bound = oracle(x, values, scales)
    assert within(W.fp8_w8a8_linear(x, values, scales, **tier), ref, bound)[0]
    doubled = scales.clone()
    doubled[1, 3] *= 2
    assert not within(W.fp8_w8a8_linear(x, values, doubled, **tier), ref, bound)[0]
    wide, wide_scales = fp8_weight(2 * 64, 256, g, exp_range=(-4, 0))
    x2 = random_x(1, 2 * 256, g, F32)
    swapped = torch.cat([x2[:, 256:], x2[:, :256]], dim=1)
    ok, _ = within(W.fp8_w8a8_linear(swapped, wide, wide_scales, groups=2, **tier), *oracle(x2, wide, wide_scales, 2))
    assert not ok


# ---- GPU (Flash shapes) -----------------------------------------------------------------------------

def check_gpu_flash_shape(tier: dict, one_program: W.W8A8Config, n: int, k: int, rows: tuple[int, ...],
                          seed: int) -> None:
    """A Flash weight at the tier's row counts: within the bound, the counters left at zero, the in-launch
    sum equal to the second-launch sum, a row prefix the batch's bits; the one-program form within the
    bound (its sums run in another order than the chunks': no bit claim)."""
    from test_kernels_fp8_w8a8 import _flash_case

    values, scales, x = _flash_case(n, k, max(rows), seed=seed)
    counters = W.split_k_counters(n, x.device)
    batch = W.fp8_w8a8_linear(x, values, scales, counters=counters, **tier)
    assert not counters.any()
    assert torch.equal(W.fp8_w8a8_linear(x, values, scales, **tier), batch)
    ok, worst = within(W.fp8_w8a8_linear(x, values, scales, config=one_program), *oracle(x, values, scales))
    assert ok, ("one program", worst)
    for m in rows:
        y = W.fp8_w8a8_linear(x[:m], values, scales, counters=counters, **tier)
        assert torch.equal(y, batch[:m]), m
        ok, worst = within(y, *oracle(x[:m], values, scales))
        assert ok, (m, worst)


def check_gpu_grouped_wo_a(tier: dict, act_quant: bool, rows: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(11)
    values, scales = fp8_weight(8192, 4096, g)
    x = random_x(max(rows), 8 * 4096, g)
    counters = W.split_k_counters(8192, x.device)
    for m in rows:
        y = W.fp8_w8a8_linear(x[:m], values, scales, groups=8, act_quant=act_quant, counters=counters, **tier)
        ok, worst = within(y, *oracle(x[:m], values, scales, groups=8, act_quant=act_quant))
        assert ok, (m, worst)


def check_gpu_graph_replay(tier: dict) -> None:
    from fp8_cases import assert_graph_replays_eager
    from test_kernels_fp8_w8a8 import _flash_case

    values, scales, x = _flash_case(5120, 8192, 1, seed=3)
    counters = W.split_k_counters(5120, x.device)
    assert_graph_replays_eager(lambda: W.fp8_w8a8_linear(x, values, scales, counters=counters, **tier), counters)

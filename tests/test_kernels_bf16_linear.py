"""BF16-weight products of few rows: `kernels/bf16_linear.py` (issue 21; spec §3.8).

The oracle is the float64 product of the same BF16 operands; the kernel must be within
`dense_ops`' GEMM_BOUND, |ŷ − x·wᵀ| ≤ K·2⁻²³·Σ|x||w| (`fp8_cases.within_gemm_bound`): every
product of BF16 values is exact in fp32 and only the fp32 sums err.

What is pinned:
* kernel cases (interpreter child on CPU; compiled on CUDA): within the bound at both row tiers,
  for BF16 and fp32 (BF16-valued) x, partial row / column blocks; the output is the fp32 sum
  itself, not rounded to BF16 (a sum that needs more than 8 significant bits comes back exact);
  exact-sum inputs give the exact product (a wrong weight row or K offset breaks it); split-K
  summed inside the launch with counters == the second launch's bits, one launch, counters zero
  again; M = 0; `dense_ops.BlockedBf16Gemm(triton_rows=True)` runs it below its row limit only;
* main process: input validation; the sm_90 builds (no spills, BF16 MMAs, cp.async, in-launch
  split-K sum);
* GPU (`gpu`): Flash's BF16 weight shapes at M = 1…128 within the bound; a row alone == the row in
  a batch within one row tier; the in-launch sum == the second launch's bits.
"""
from __future__ import annotations

import re

import pytest
import torch

from sglang_dsv41.kernels import bf16_linear as L
from sglang_dsv41.kernels import fp8_w8a8 as W

from fp8_cases import BF16, DEVICE, F32, CountingLaunch, kernel, within_gemm_bound
from test_kernels_fp8_w8a8 import _compile
from triton_checks import no_spills, run_kernel_cases_in_interpreter


def bf16_weight(n: int, k: int, g: torch.Generator, device: str = DEVICE) -> torch.Tensor:
    """Random BF16 weight values [n, k] spanning 2^-12…2^4."""
    mag = torch.exp2(torch.randint(-12, 5, (n, k), generator=g).float())
    return (torch.randn(n, k, generator=g) * mag).to(BF16).to(device)


def bf16_valued_x(m: int, k: int, g: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(m, k, generator=g).to(BF16).to(dtype).to(DEVICE)


# ---- kernel cases (interpreter child / CUDA) ---------------------------------------------------

@kernel
@pytest.mark.parametrize("m,n,k", [(1, 32, 640), (5, 96, 1024), (16, 48, 320), (17, 64, 640), (70, 160, 384)])
@pytest.mark.parametrize("dtype", [BF16, F32])
def test_kernel_case_within_the_gemm_bound(m: int, n: int, k: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(m * 31 + n + k)
    w, x = bf16_weight(n, k, g), bf16_valued_x(m, k, g, dtype)
    y = L.bf16_linear(x, w, W.split_k_counters(n, DEVICE))
    assert y.dtype == F32 and y.shape == (m, n)
    ok, worst = within_gemm_bound(x.float(), w.float(), y)
    assert ok, worst


@kernel
def test_kernel_case_output_is_the_unrounded_fp32_sum() -> None:
    """1 + 2⁻¹⁰ needs 11 significant bits: BF16 would round it to 1; fp32 holds it exactly."""
    k = 64
    x = torch.zeros(2, k)
    x[:, 0], x[:, 1] = 1.0, 2.0**-10
    w = torch.zeros(32, k)
    w[:, :2] = 1.0
    y = L.bf16_linear(x.to(BF16).to(DEVICE), w.to(BF16).to(DEVICE))
    assert torch.equal(y.cpu(), torch.full((2, 32), 1.0 + 2.0**-10))


@kernel
@pytest.mark.parametrize("m", [3, 40])
def test_kernel_case_exact_sums_give_the_exact_product(m: int) -> None:
    """Small integers: every partial sum is exact in fp32, so any order gives x·wᵀ itself — a wrong
    weight row, column block or K chunk offset would not."""
    g = torch.Generator().manual_seed(m)
    n, k = 80, 32 * 37
    w = torch.randint(-4, 5, (n, k), generator=g).float()
    x = torch.randint(-8, 9, (m, k), generator=g).float()
    y = L.bf16_linear(x.to(DEVICE), w.to(BF16).to(DEVICE), W.split_k_counters(n, DEVICE))
    assert torch.equal(y.cpu(), x @ w.t())


@kernel
def test_kernel_case_in_launch_split_k_sum_matches_the_second_launch(monkeypatch) -> None:
    g = torch.Generator().manual_seed(7)
    n, k = 96, 1280
    w, x = bf16_weight(n, k, g), bf16_valued_x(4, k, g, BF16)
    assert W.k_chunks(n, k, W.DECODE_TARGET_PROGRAMS) > 1
    counters = W.split_k_counters(n, DEVICE)
    gemms, sums = CountingLaunch(W._w8a8_kernel), CountingLaunch(W._sum_chunks_kernel)
    monkeypatch.setattr(W, "_w8a8_kernel", gemms)
    monkeypatch.setattr(W, "_sum_chunks_kernel", sums)
    two = L.bf16_linear(x, w)
    assert (len(gemms.grids), len(sums.grids)) == (1, 1)
    one = L.bf16_linear(x, w, counters)
    assert (len(gemms.grids), len(sums.grids)) == (2, 1)
    assert torch.equal(one.view(torch.int32), two.view(torch.int32))
    assert not counters.any()


@kernel
def test_kernel_case_no_rows() -> None:
    w = bf16_weight(32, 64, torch.Generator().manual_seed(0))
    assert L.bf16_linear(torch.zeros(0, 64, device=DEVICE), w).shape == (0, 32)


@kernel
def test_kernel_case_dense_backend_takes_the_kernel_below_its_row_limit(monkeypatch) -> None:
    """`dense_ops.BlockedBf16Gemm(triton_rows=True)` (SGLANG_DSV41_BF16_GEMM=triton): a BF16 weight's
    product of fewer than MAX_ROWS rows is one launch of this kernel within the bound; more rows, a
    weight above BF16_KERNEL_MAX_ELEMENTS or K not a multiple of 32 go to cuBLAS (no launch)."""
    from sglang_dsv41.runtime import dense_ops as D
    from sglang_dsv41.runtime.dense_weights import DenseWeightCache

    g = torch.Generator().manual_seed(5)
    n, k = 64, 320
    w = bf16_weight(n, k, g).float()
    x = bf16_valued_x(L.MAX_ROWS + 3, k, g, F32)
    with pytest.raises(ValueError, match="whole_rows"):
        D.BlockedBf16Gemm(DenseWeightCache(), triton_rows=True)
    dense = D.BlockedBf16Gemm(DenseWeightCache.from_weights({"a.weight": w}), whole_rows=True, triton_rows=True)
    gemms = CountingLaunch(W._w8a8_kernel)
    monkeypatch.setattr(W, "_w8a8_kernel", gemms)
    for m, launches in ((1, 1), (L.MAX_ROWS - 1, 2), (L.MAX_ROWS, 2), (L.MAX_ROWS + 3, 2)):
        y = dense.matmul(x[:m], w)
        assert len(gemms.grids) == launches, m
        assert within_gemm_bound(x[:m], w, y)[0], m
    monkeypatch.setattr(D, "BF16_KERNEL_MAX_ELEMENTS", n * k - 1)
    dense.matmul(x[:1], w)
    assert len(gemms.grids) == 2
    odd = bf16_weight(16, 48, g).float()
    D.BlockedBf16Gemm(DenseWeightCache.from_weights({"b.weight": odd}), whole_rows=True,
                      triton_rows=True).matmul(x[:1, :48], odd)
    assert len(gemms.grids) == 2


# ---- main process ------------------------------------------------------------------------------

def test_inputs_are_checked() -> None:
    w = torch.zeros(32, 64, dtype=BF16)
    with pytest.raises(ValueError, match="2-D bfloat16"):
        L.bf16_linear(torch.zeros(1, 64), w.float())
    with pytest.raises(ValueError, match="multiple of 32"):
        L.bf16_linear(torch.zeros(1, 48), torch.zeros(32, 48, dtype=BF16))
    with pytest.raises(ValueError, match=r"x must be \[M, 64\]"):
        L.bf16_linear(torch.zeros(1, 32), w)
    with pytest.raises(ValueError, match="go to cuBLAS"):
        L.bf16_linear(torch.zeros(L.MAX_ROWS, 64), w)
    with pytest.raises(ValueError, match="counters"):
        L.bf16_linear(torch.zeros(1, 64), w, torch.zeros(4, dtype=torch.int64))


@pytest.mark.parametrize("label", ["decode", "mid"])
def test_kernel_compiles_for_hopper_with_bf16_mmas_and_no_spills(label: str) -> None:
    if W.INTERPRETED:
        pytest.skip("no sm_90 compile under the interpreter: the parent (compiled) process runs this")
    cfg = {"decode": W.DECODE_CONFIG, "mid": W.MID_CONFIG}[label]
    compiled, usage = _compile(cfg, act_quant=False, fixup=True, bf16_weight=True)
    ptx = compiled.asm["ptx"]
    assert no_spills(usage), usage
    assert "cp.async" in ptx
    assert re.search(r"(wgmma\.mma_async|mma\.sync)\S*bf16", ptx)
    assert "atom.global.gpu.acq_rel.add" in ptx
    assert "cvt.rn.bf16.f32" not in ptx and "cvt.rn.bf16x2.f32" not in ptx      # fp32 stored unrounded


if not W.INTERPRETED:

    def test_kernel_cases_in_triton_interpreter() -> None:
        """Run this file's kernel cases in a child pytest with TRITON_INTERPRET=1 (CPU)."""
        run_kernel_cases_in_interpreter(__file__, min_passed=16, exact=True)


# ---- GPU ---------------------------------------------------------------------------------------

FLASH_BF16 = {"compressor_wkv": (512, 5120), "indexer_weights_proj": (32, 5120), "indexer_wk": (128, 512),
              "gate": (384, 5120)}


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(FLASH_BF16))
def test_flash_shapes_on_cuda(name: str) -> None:
    n, k = FLASH_BF16[name]
    g = torch.Generator().manual_seed(n + k)
    w = bf16_weight(n, k, g, "cuda")
    counters = W.split_k_counters(n, "cuda")
    x = torch.randn(128, k, generator=g).to(BF16).cuda()
    for m in (1, 2, 8, 16, 17, 64, 127):
        y = L.bf16_linear(x[:m], w, counters)
        ok, worst = within_gemm_bound(x[:m].float(), w.float(), y)
        assert ok, (m, worst)
        print(f"{name} M={m}: worst error / bound {worst:.3g}")
    for lo, hi in ((1, 16), (17, 127)):                # a row's bits within one row tier
        batch = L.bf16_linear(x[:hi], w, counters)
        alone = L.bf16_linear(x[lo - 1:lo], w, counters) if lo == 1 else L.bf16_linear(x[:lo], w, counters)[-1:]
        assert torch.equal(alone.view(torch.int32), batch[lo - 1:lo].view(torch.int32)), (name, lo, hi)
    assert torch.equal(L.bf16_linear(x[:5], w, counters), L.bf16_linear(x[:5], w))
    assert not counters.any()

"""`kernels/fp8_linear_skinny.py` (`fp8_linear_swap_ab`, the swap-AB W8A16 candidate for decode).

What is pinned:
* kernel cases (Triton interpreter in a child pytest on CPU; compiled on CUDA): within GEMM_BOUND
  (K·2⁻²³·S) of the exact float64 product of the dequantised weight, for fp32 and bf16 x, tile
  scales 2^-40..2^20 (distinct per 32-row group: a wrong group's scale breaks the bound), partial
  tiles (N not a multiple of BLOCK_W, K not a multiple of BLOCK_K or 32) and M = 1, 5, 17, 40, with
  the default and other fixed configurations; each row alone == the row in a batch, bit for bit
  (also a row-strided x); a tile-row slice of a weight (values[r0:r1], scales[r0/32:r1/32]) gives
  the same bits as those columns of the whole product;
* main process: the input checks (shared with `fp8_linear`) and the configuration rules raise;
  without CUDA or the interpreter the call raises;
* the kernel compiles for sm_90 (Triton's bundled ptxas, no GPU) with the runtime's argument
  alignment (16-divisible pointers, N, K, row strides): no register spills, wgmma, and the weight
  tile goes to shared memory by 16-byte cp.async (pipelined) with no plain global load left;
* GPU (`gpu` marker): the Flash layer's FP8 shapes within the bound and row invariant.
"""
from __future__ import annotations

import functools
import re

import pytest
import torch

from sglang_dsv41.kernels import fp8_linear_skinny as S
from sglang_dsv41.kernels.fp8_linear import INTERPRETED
from fp8_cases import (BF16, F32, KERNEL_HERE, bf16_rows, bit_identity_case, check_row_prefixes,
                       check_rows_alone_equal_rows_in_a_batch,
                       check_within_gemm_bound, fp8_weight, kernel)
from triton_checks import compile_for_sm90, run_kernel_cases_in_interpreter

SMALL_CONFIGS = {"default": None, "bw32_bk64": S.Fp8SkinnyConfig(32, 64, 4, 3),
                 "bw128_bk32": S.Fp8SkinnyConfig(128, 32, 4, 3)}


# ---- kernel cases (interpreter child / CUDA) -----------------------------------------------------

@kernel
@pytest.mark.parametrize("config", sorted(SMALL_CONFIGS))
@pytest.mark.parametrize("m,n,k,x_dtype", [(1, 64, 96, F32), (5, 96, 512, F32), (17, 40, 300, F32),
                                           (40, 160, 160, BF16)])
def test_kernel_case_within_gemm_bound(m: int, n: int, k: int, x_dtype: torch.dtype, config: str) -> None:
    check_within_gemm_bound(functools.partial(S.fp8_linear_swap_ab, config=SMALL_CONFIGS[config]), m, n, k, x_dtype)


@kernel
def test_kernel_case_rows_alone_equal_rows_in_a_batch() -> None:
    check_rows_alone_equal_rows_in_a_batch(S.fp8_linear_swap_ab,
                                           ((0, 1), (7, 8), (39, 40), (3, 20), (16, 33), (0, 5), (0, 17)))


@kernel
def test_kernel_case_tile_row_slices_equal_the_whole_product() -> None:
    """wo_a-style group views: the rows of a slice and their scale rows give the same bits."""
    g = torch.Generator().manual_seed(2)
    values, scales, x = bit_identity_case(6, 224, 192, g, exp_range=(-20, 0))
    whole = S.fp8_linear_swap_ab(x, values, scales)
    for r0, r1 in [(0, 32), (32, 96), (64, 224), (96, 160), (192, 224)]:
        part = S.fp8_linear_swap_ab(x, values[r0:r1], scales[r0 // 32:r1 // 32])
        assert torch.equal(part, whole[:, r0:r1]), (r0, r1)
    shifted = S.fp8_linear_swap_ab(x, values[32:96], scales[0:2])                    # wrong scale rows
    assert not torch.equal(shifted, whole[:, 32:96])


# ---- main process ---------------------------------------------------------------------------------

def test_input_and_configuration_checks() -> None:
    g = torch.Generator().manual_seed(4)
    values, scales = fp8_weight(64, 96, g, device="cpu")
    x = torch.zeros(2, 96)
    with pytest.raises(ValueError, match="fp8_linear_swap_ab: values"):
        S.fp8_linear_swap_ab(x, values.t(), scales)
    with pytest.raises(ValueError, match="fp8_linear_swap_ab: scales"):
        S.fp8_linear_swap_ab(x, values, scales[:1])
    with pytest.raises(ValueError, match="fp8_linear_swap_ab: x"):
        S.fp8_linear_swap_ab(torch.zeros(2, 95), values, scales)
    for bad in (S.Fp8SkinnyConfig(48, 128, 4, 3), S.Fp8SkinnyConfig(64, 48, 4, 3), S.Fp8SkinnyConfig(0, 128, 4, 3)):
        with pytest.raises(ValueError, match="multiples"):
            S.fp8_linear_swap_ab(x, values, scales, config=bad)
    if not KERNEL_HERE:
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
            S.fp8_linear_swap_ab(x, values, scales)


def compiled_for_sm90(config: S.Fp8SkinnyConfig):
    """The kernel built for sm_90 as the runtime launches it (16-divisible pointers, N, K, x/w/y row
    strides — true for every Flash weight; the scale row stride is left unaligned, the worst case),
    with `cuobjdump -res-usage`'s line for it."""
    kern = S._fp8_linear_swap_ab_kernel
    consts = dict(BLOCK_W=config.block_w, BLOCK_X=S.BLOCK_X, BLOCK_K=config.block_k, DOT_FP32=False)
    pointers = {"x_ptr": "*fp32", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "y_ptr": "*fp32"}
    sig = {n: "constexpr" if n in consts else pointers.get(n, "i32") for n in kern.arg_names}
    aligned = set(pointers) | {"N", "K", "stride_xm", "stride_wn", "stride_ym"}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kern.arg_names) if n in aligned}
    return compile_for_sm90(kern, sig, consts, {"num_warps": config.num_warps, "num_stages": config.num_stages},
                            attrs)


def test_kernel_compiles_for_hopper_without_spills_and_pipelines_the_weight() -> None:
    if INTERPRETED:
        pytest.skip("compiled kernel only")
    cfg = S.SWAP_AB_CONFIG
    compiled, usage = compiled_for_sm90(cfg)
    assert "STACK:0 " in usage + " " and "LOCAL:0 " in usage + " ", usage
    ptx = compiled.asm["ptx"]
    assert "wgmma.mma_async" in ptx
    assert "ld.global" not in ptx                                    # every tile load goes through cp.async
    weight_copies = re.findall(r"cp\.async\.cg\.shared\.global \[[^]]*\], \[[^]]*\], 0x10", ptx)
    # one 16-byte copy per thread per 32-column sub-step of the [BLOCK_W, BLOCK_K] E4M3 tile per stage
    per_stage = cfg.block_w * cfg.block_k // (16 * 32 * cfg.num_warps)
    assert len(weight_copies) >= per_stage * (cfg.num_stages - 1), len(weight_copies)
    assert compiled.metadata.shared <= 227 * 1024
    print(f"\n[fp8_linear_swap_ab {cfg}] {usage}; shared memory {compiled.metadata.shared} B; "
          f"{len(weight_copies)} 16-byte weight cp.async in the PTX")


if not INTERPRETED:

    def test_kernel_cases_in_triton_interpreter() -> None:
        """Run this file's kernel cases in a child pytest with TRITON_INTERPRET=1 (CPU)."""
        run_kernel_cases_in_interpreter(__file__, min_passed=14, exact=True)


# ---- GPU ----------------------------------------------------------------------------------------------

#: FP8 dense shapes of Flash layer 2 (benchmarks/fp8_linear.py `layer_fp8_shapes(2)`)
FLASH_SHAPES = {"wq_a": (1280, 5120), "wkv": (512, 5120), "wq_b": (32768, 1280), "wo_a": (8192, 4096),
                "wo_b": (5120, 8192), "indexer_wq_b": (4096, 1280), "shared_w1": (2304, 5120),
                "shared_w2": (5120, 2304)}


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(FLASH_SHAPES))
def test_flash_shapes_within_bound_and_row_invariant_on_gpu(name: str) -> None:
    n, k = FLASH_SHAPES[name]
    g = torch.Generator().manual_seed(n + k)
    values, scales = fp8_weight(n, k, g, exp_range=(-40, 20), device="cuda")
    x = bf16_rows(300, k, g, device="cuda")
    full, worst = check_row_prefixes(S.fp8_linear_swap_ab, x, values, scales, (1, 5, 16, 17, 64, 300))
    for i in (0, 17, 299):                                        # bf16 x: the same bits as its fp32 holder
        assert torch.equal(S.fp8_linear_swap_ab(x[i:i + 1].to(BF16), values, scales), full[i:i + 1]), i
    if name == "wo_a":                                            # the runtime's group views (1024 rows)
        assert torch.equal(S.fp8_linear_swap_ab(x[:5], values[1024:2048], scales[32:64]), full[:5, 1024:2048])
    print(f"\n[fp8_linear_swap_ab {name}] worst |err| / GEMM_BOUND = {worst:.3g}")

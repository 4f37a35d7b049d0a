"""W8A8 FP8 GEMM for 32×32-tile weights: `kernels/fp8_w8a8.py` (spec §2.3, §3.8; issue 21).

The oracle is the reference's own dense FP8 linear, `reference.ops.linear_fp8` (plain torch):
activations fake-quantised per 1×32 to E4M3 with UE8M0 scales, the dequantised weight, an exact
product, one BF16 rounding. The kernel's result ŷ must satisfy, per element,

    |ŷ − linear_fp8(x, W)| ≤ 2⁻⁷·|y*| + 2·2⁻¹²·S + 2⁻¹³³,   y* = fq(x)·Wᵀ exactly, S = |fq(x)|·|W|ᵀ

Why this tolerance: ŷ = bf16(ỹ) with |ỹ − y*| ≤ ε; two BF16 roundings (ours and the oracle's)
are each ≤ 2⁻⁸ relative, so |ŷ − bf16(y*)| ≤ 2⁻⁷·|y*| + 2ε. ε = 2⁻¹²·S covers the tensor
cores' 32-product FP8 step (Hopper keeps ~14 bits while summing, DeepSeek-V3 report: ≤ 2⁻¹³·S)
plus ≤ K/32 fp32 additions (K·2⁻²⁴·S ≪ 2⁻¹³·S for K ≤ 2¹⁰·32); the interpreter's fp32 matmul is
far inside it. The last term is BF16's smallest subnormal (an all-zero row). It is tight enough
to matter: one weight tile's scale doubled, or one activation row swapped, or a group reading
the wrong x columns, breaks it (`test_kernel_case_bound_catches_*` — mutation checks).

What is pinned:
* kernel cases (interpreter child on CPU; compiled on CUDA): the activation quantiser gives
  exactly `ops.fp8_act_fake_quant`'s values (edge amax values included); every configuration
  (decode / mid / prefill, split-K or not, fused quantisation or not) is within the bound for
  fp32 and bf16 x, partial row/column blocks; on exact-sum inputs all configurations give the
  same bits; the grouped `wo_a` product is one GEMM launch and equals the per-group products;
  mutation checks; M = 0;
* main process: input validation, the shape-only K chunking, the row tiers, and the compiled
  sm_90 kernels (registers, no spills, wgmma on E4M3 for BLOCK_M ≥ 64, cp.async pipelining);
* GPU (`gpu`): Flash shapes at M = 1…300 within the bound, grouped wo_a, split-K == one-program
  bits, and a row alone == the row in a batch within one row tier.
"""
from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from sglang_dsv41.kernels import fp8_w8a8 as W
from sglang_dsv41.reference import ops

from fp8_cases import (BF16, DEVICE, F32, F64, CountingLaunch, assert_graph_replays_eager, dequantised, exact_sum_case,
                        fp8_weight, kernel)
from triton_checks import compile_for_sm90, no_spills, run_kernel_cases_in_interpreter

MMA_STEP_EPS = 2.0 ** -12
CONFIGS = {"decode": W.DECODE_CONFIG, "mid": W.MID_CONFIG, "prefill": W.PREFILL_CONFIG, "mid_fp8": W.MID_FP8_CONFIG,
           "decode_one_program": dataclasses.replace(W.DECODE_CONFIG, split_k=False),
           "prefill_split": W.W8A8Config(64, 64, 2, 4, 3, fused_quant=False, split_k=True)}


def oracle(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, groups: int = 1, act_quant: bool = True):
    """(reference result [M, N] fp32, per-element bound) for the (grouped) product: `linear_fp8`
    (W8A8), or with act_quant=False `linear_bf16` (W8A16, wo_a's arithmetic) whose fp32 sums get
    fp8_linear's K·2⁻²³·S. On x's device (the GPU tests: a test oracle, not the serving path)."""
    w = dequantised(values, scales).to(F32)
    xf = x.detach().float()
    n, k = w.shape
    ng = n // groups
    ys, ystar, s = [], [], []
    for g in range(groups):
        xg, wg = xf[:, g * k:(g + 1) * k], w[g * ng:(g + 1) * ng]
        ys.append(ops.linear_fp8(xg, wg) if act_quant else ops.linear_bf16(ops.bf16(xg), wg))
        xq = (ops.fp8_act_fake_quant(xg) if act_quant else ops.bf16(xg)).to(F64)
        ystar.append(xq @ wg.to(F64).t())
        s.append(xq.abs() @ wg.to(F64).abs().t())
    ystar, s = torch.cat(ystar, 1), torch.cat(s, 1)
    eps = MMA_STEP_EPS if act_quant else k * 2.0 ** -23
    return torch.cat(ys, 1), 2.0 ** -7 * ystar.abs() + 2 * eps * s + 2.0 ** -133


def within(y: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor) -> tuple[bool, float]:
    err = (y.detach().to(F64) - ref.to(F64)).abs()
    return bool((err <= bound).all()) and bool(torch.isfinite(y).all()), float((err / bound).max())


def random_x(m: int, k: int, g: torch.Generator, dtype: torch.dtype = BF16) -> torch.Tensor:
    """Rows whose 32-groups span magnitudes 2^-20…2^20 (different scales per group)."""
    mag = torch.exp2(torch.randint(-20, 21, (m, k // 32, 1), generator=g).float())
    return (torch.randn(m, k // 32, 32, generator=g) * mag).reshape(m, k).to(dtype).to(DEVICE)


# ---- kernel cases (interpreter child / CUDA) ---------------------------------------------------

@kernel
@pytest.mark.parametrize("dtype", [BF16, F32])
def test_kernel_case_quantize_matches_the_reference(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    x = random_x(7, 256, g, dtype).cpu().float()
    edges = torch.tensor([448.0, 448.0 * 2 ** -9, 449.0, 447.99997, 1.0, 1.75 * 2 ** -20, 2 ** -30, 0.0])
    x[0, :8 * 32].view(8, 32)[:, 5] = edges            # one edge amax per group (row 0, groups 0-7)
    x[1, :32] = 0.0                                     # an all-zero group (amax floor)
    x = x.to(dtype).to(DEVICE)
    q, s = W.quantize_activations(x)
    assert q.dtype == W.FP8 and s.shape == (7, 8) and s.dtype == F32
    deq = (q.float().view(7, 8, 32) * s[..., None]).view(7, 256)
    assert torch.equal(deq, ops.fp8_act_fake_quant(x.float()))
    mant, _ = torch.frexp(s)
    assert bool((mant == 0.5).all())                    # powers of two (UE8M0)
    assert q.float().abs().max() <= 448


@kernel
@pytest.mark.parametrize("label", [k for k, c in CONFIGS.items() if not (W.INTERPRETED and c.fp8_mma)])  # fp32 dot there
@pytest.mark.parametrize("m,n,k,dtype", [(1, 64, 256, BF16), (19, 96, 160, F32), (70, 160, 384, BF16)])
def test_kernel_case_within_bound_of_the_reference(label: str, m: int, n: int, k: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(m * 7 + n + k)
    values, scales = fp8_weight(n, k, g, exp_range=(-30, 10))
    x = random_x(m, k, g, dtype)
    y = W.fp8_w8a8_linear(x, values, scales, config=CONFIGS[label])
    assert y.dtype == BF16 and y.shape == (m, n)
    ok, worst = within(y, *oracle(x, values, scales))
    assert ok, worst


@kernel
def test_kernel_case_configurations_agree_bit_for_bit_on_exact_sums() -> None:
    """Exact-sum inputs (every partial sum exact in fp32, fp8_cases): the chunked summation order
    is the same in every configuration, so all give the oracle's bits."""
    g = torch.Generator().manual_seed(3)
    values, scales, x = exact_sum_case(21, 128, 640, g)
    ref, _ = oracle(x, values, scales)
    for label, cfg in CONFIGS.items():
        y = W.fp8_w8a8_linear(x, values, scales, config=cfg)
        assert torch.equal(y.float(), ref), label
    assert torch.equal(W.fp8_w8a8_linear(x[:1], values, scales).float(), ref[:1])


@kernel
def test_kernel_case_split_k_sums_inside_the_launch_with_counters(monkeypatch) -> None:
    """With `split_k_counters` the last chunk of each output tile sums the partials in the fixed
    order inside the GEMM launch: the same bits as the second-launch sum (too few counters), one
    launch, and the counters are zero again afterwards."""
    g = torch.Generator().manual_seed(10)
    values, scales = fp8_weight(96, 640, g, exp_range=(-20, 0))
    x = random_x(3, 640, g, F32)
    assert W.k_chunks(96, 640, W.DECODE_TARGET_PROGRAMS) > 1
    counters = W.split_k_counters(96, DEVICE)
    sums = CountingLaunch(W._sum_chunks_kernel)
    monkeypatch.setattr(W, "_sum_chunks_kernel", sums)
    two_launch = W.fp8_w8a8_linear(x, values, scales)
    assert len(sums.grids) == 1
    one_launch = W.fp8_w8a8_linear(x, values, scales, counters=counters)
    assert len(sums.grids) == 1 and torch.equal(one_launch, two_launch)
    assert not counters.any()
    too_few = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    assert torch.equal(W.fp8_w8a8_linear(x, values, scales, counters=too_few), two_launch) and len(sums.grids) == 2
    ok, worst = within(one_launch, *oracle(x, values, scales))
    assert ok, worst


@kernel
@pytest.mark.parametrize("label", ["decode", "prefill"])
def test_kernel_case_grouped_wo_a_is_one_launch_equal_to_the_groups(label: str, monkeypatch) -> None:
    g = torch.Generator().manual_seed(4)
    groups, rows, k, m = 4, 64, 192, 9
    values, scales = fp8_weight(groups * rows, k, g, exp_range=(-20, 0))
    x = random_x(m, groups * k, g)
    counting = CountingLaunch(W._w8a8_kernel)
    monkeypatch.setattr(W, "_w8a8_kernel", counting)
    y = W.fp8_w8a8_linear(x, values, scales, groups=groups, config=CONFIGS[label])
    assert len(counting.grids) == 1
    ok, worst = within(y, *oracle(x, values, scales, groups))
    assert ok, worst
    for gi in range(groups):
        rows_g = slice(gi * rows, (gi + 1) * rows)
        alone = W.fp8_w8a8_linear(x[:, gi * k:(gi + 1) * k].contiguous(), values[rows_g], scales[gi * 2:(gi + 1) * 2],
                                  config=CONFIGS[label])
        assert torch.equal(alone, y[:, rows_g]), gi


@kernel
@pytest.mark.parametrize("label", ["decode", "mid", "prefill", "bf16_gemm"])
def test_kernel_case_wo_a_without_activation_quantisation(label: str, monkeypatch) -> None:
    """act_quant=False (wo_a's W8A16 arithmetic): within the bound of the reference's per-group
    `linear_bf16` on the dequantised weight, one launch, and not the W8A8 result."""
    g = torch.Generator().manual_seed(9)
    groups, rows, k, m = 4, 64, 160, 5
    values, scales = fp8_weight(groups * rows, k, g, exp_range=(-20, 0))
    x = random_x(m, groups * k, g, F32)
    counting = CountingLaunch(W._w8a8_kernel)
    monkeypatch.setattr(W, "_w8a8_kernel", counting)
    kw = dict(bf16_gemm=True) if label == "bf16_gemm" else dict(config=CONFIGS[label])
    y = W.fp8_w8a8_linear(x, values, scales, groups=groups, act_quant=False, **kw)
    assert len(counting.grids) == (0 if label == "bf16_gemm" else 1)
    ok, worst = within(y, *oracle(x, values, scales, groups, act_quant=False))
    assert ok, worst
    assert not torch.equal(y, W.fp8_w8a8_linear(x, values, scales, groups=groups, **kw))     # W8A8 differs


@kernel
def test_kernel_case_bound_catches_a_wrong_tile_scale_and_a_wrong_row() -> None:
    """Mutation checks: the bound fails when one weight tile's scale is doubled, when two x rows
    are swapped, and when a group reads its neighbour's x columns."""
    g = torch.Generator().manual_seed(5)
    values, scales = fp8_weight(64, 256, g, exp_range=(-8, -4))
    x = random_x(4, 256, g)
    ref, bound = oracle(x, values, scales)
    assert within(W.fp8_w8a8_linear(x, values, scales), ref, bound)[0]
    bad_scales = scales.clone()
    bad_scales[1, 3] *= 2
    assert not within(W.fp8_w8a8_linear(x, values, bad_scales), ref, bound)[0]
    assert not within(W.fp8_w8a8_linear(x[[1, 0, 2, 3]], values, scales), ref, bound)[0]
    xg = random_x(4, 512, g)
    ref2, bound2 = oracle(xg, values, scales, groups=2)
    swapped = torch.cat([xg[:, 256:], xg[:, :256]], 1)
    assert within(W.fp8_w8a8_linear(xg, values, scales, groups=2), ref2, bound2)[0]
    assert not within(W.fp8_w8a8_linear(swapped, values, scales, groups=2), ref2, bound2)[0]


@kernel
@pytest.mark.parametrize("groups", [1, 3])
def test_kernel_case_prefill_form_within_bound(groups: int) -> None:
    """The dequantise + BF16 GEMM form (chosen from BF16_GEMM_MIN_ROWS rows): exact BF16 operands
    (fake-quantised x == the reference's values, dequantised W == the tiles' values), within the
    bound, grouped == per-group; the row tiers pick it from BF16_GEMM_MIN_ROWS rows."""
    g = torch.Generator().manual_seed(8 + groups)
    values, scales = fp8_weight(groups * 64, 96, g, exp_range=(-30, 10))
    x = random_x(W.BF16_GEMM_MIN_ROWS, groups * 96, g)
    xb = W.fake_quantize_activations_bf16(x)
    assert xb.dtype == BF16 and torch.equal(xb.float(), ops.fp8_act_fake_quant(x.float()))
    assert torch.equal(W.dequantize_weight_bf16(values, scales).float(), dequantised(values, scales))
    y = W.fp8_w8a8_linear(x, values, scales, groups=groups)
    ok, worst = within(y, *oracle(x, values, scales, groups))
    assert ok, worst
    assert torch.equal(y, W.fp8_w8a8_linear(x, values, scales, groups=groups, bf16_gemm=True))
    for gi in range(groups):
        rows_g = slice(gi * 64, (gi + 1) * 64)
        alone = W.fp8_w8a8_linear(x[:, gi * 96:(gi + 1) * 96], values[rows_g], scales[gi * 2:(gi + 1) * 2],
                                  bf16_gemm=True)
        assert torch.equal(alone, y[:, rows_g]), gi


@kernel
def test_kernel_case_empty_and_strided_x() -> None:
    g = torch.Generator().manual_seed(6)
    values, scales = fp8_weight(32, 64, g)
    x = random_x(3, 128, g)
    assert W.fp8_w8a8_linear(x[:0, :64], values, scales).shape == (0, 32)
    assert torch.equal(W.fp8_w8a8_linear(x[:, :64], values, scales),
                       W.fp8_w8a8_linear(x[:, :64].contiguous(), values, scales))


# ---- main process -------------------------------------------------------------------------------

def test_bad_inputs_raise_clear_errors() -> None:
    g = torch.Generator().manual_seed(7)
    values, scales = fp8_weight(64, 96, g, device="cpu")
    x = torch.zeros(2, 96)
    with pytest.raises(ValueError, match="multiple of 32"):
        W.fp8_w8a8_linear(torch.zeros(2, 80), values[:, :80], scales)
    with pytest.raises(ValueError, match="scales must be fp32 \\(2, 3\\)"):
        W.fp8_w8a8_linear(x, values, scales[:1])
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        W.fp8_w8a8_linear(x, values.float(), scales)
    with pytest.raises(ValueError, match="3 groups"):
        W.fp8_w8a8_linear(torch.zeros(2, 288), values, scales, groups=3)
    with pytest.raises(ValueError, match="x must be \\[M, 192\\]"):
        W.fp8_w8a8_linear(x, values, scales, groups=2)
    with pytest.raises(ValueError, match="multiple of 32"):
        W.quantize_activations(torch.zeros(2, 40))
    with pytest.raises(ValueError, match="counters must be 1-D int32"):
        W.fp8_w8a8_linear(x, values, scales, counters=torch.zeros(4))
    if not W.INTERPRETED:
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
            W.fp8_w8a8_linear(x, values, scales)


#: FP8 dense weights of one Flash layer (names.tensor_inventory with presets.flash_config_dict)
FLASH_SHAPES = {"wq_a": (1280, 5120), "wkv": (512, 5120), "wq_b": (32768, 1280), "wo_a": (8192, 4096),
                "wo_b": (5120, 8192), "shared_w1": (2304, 5120), "shared_w2": (5120, 2304),
                "indexer_wq_b": (4096, 1280), "engram_wkv": (25600, 6144)}


@pytest.mark.parametrize("target", [W.TARGET_PROGRAMS, W.DECODE_TARGET_PROGRAMS])
def test_k_chunks_are_shape_only_and_cover_k(target: int) -> None:
    for name, (n, k) in FLASH_SHAPES.items():
        chunks = W.k_chunks(n, k, target)
        blocks = k // 32
        per = -(-blocks // chunks)
        assert (chunks - 1) * per < blocks <= chunks * per, name            # no empty chunk
        assert per >= W.MIN_CHUNK_BLOCKS or chunks == 1, name
        column_programs = -(-n // W.CHUNK_BLOCK_N)
        assert chunks <= -(-target // column_programs), name                 # never more splits than needed
        assert column_programs * chunks >= target // 2 or per == W.MIN_CHUNK_BLOCKS or chunks == 1, name
    assert W.k_chunks(32768, 1280) == 1 and W.k_chunks(512, 5120) > 8
    assert W.k_chunks(32768, 1280, W.DECODE_TARGET_PROGRAMS) == 3 and W.k_chunks(512, 5120, W.DECODE_TARGET_PROGRAMS) == 40


def test_row_tiers() -> None:
    assert W.config_for_rows(1) is W.config_for_rows(16) is W.DECODE_CONFIG
    assert W.config_for_rows(17) is W.config_for_rows(256) is W.MID_CONFIG
    assert W.config_for_rows(257) is W.config_for_rows(8192) is W.PREFILL_CONFIG
    assert W.config_for_rows(16, fp8_mma=True) is W.DECODE_CONFIG and W.config_for_rows(17, fp8_mma=True) is W.MID_FP8_CONFIG
    assert not any(c.fp8_mma for _, c in W.ROW_TIERS) and W.MID_FP8_CONFIG.fp8_mma
    assert 16 < W.BF16_GEMM_MIN_ROWS <= 257                 # the Triton prefill tier is a forced-config option
    assert W.DECODE_CONFIG.fused_quant and W.DECODE_CONFIG.split_k and not W.PREFILL_CONFIG.split_k


def _compile(cfg: W.W8A8Config, act_quant: bool = True, fixup: bool = False, out_f32: bool = False,
             bf16_weight: bool = False):
    """sm_90 build of `_w8a8_kernel`; `bf16_weight`: `kernels.bf16_linear`'s form (BF16 values, no
    scales, fp32 sums stored unrounded)."""
    consts = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, SUB=cfg.sub_blocks, FUSED_QUANT=cfg.fused_quant,
                  SPLIT_K=cfg.split_k, ACT_QUANT=act_quant, FP8_MMA=cfg.fp8_mma, FIXUP=fixup, SWAP_AB=cfg.swap_ab,
                  OUT_F32=out_f32 or bf16_weight, W_SCALED=not bf16_weight, RAW_OUT=bf16_weight, INTERPRET=False)
    y_type = "*fp32" if out_f32 or bf16_weight else "*bf16"
    w_type = "*bf16" if bf16_weight else "*fp8e4nv"
    pointers = {"x_ptr": "*bf16" if cfg.fused_quant else "*fp8e4nv", "xs_ptr": "*fp32", "w_ptr": w_type,
                "ws_ptr": "*fp32", "out_ptr": "*fp32" if cfg.split_k else y_type, "y_ptr": y_type,
                "counters_ptr": "*i32"}
    kern = W._w8a8_kernel
    names = list(kern.arg_names)
    sig = {n: "constexpr" if n in consts else pointers.get(n, "i32") for n in names}
    # what the launcher specialises for 16-byte aligned arguments (Flash shapes: every pointer,
    # K, N and the row strides except the activation scales')
    aligned = [i for i, n in enumerate(names) if n.endswith("_ptr") or n in ("K", "N")
               or (n.startswith("stride") and n != "stride_xsm")]
    return compile_for_sm90(kern, sig, consts, {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages},
                            attrs={(i,): [["tt.divisibility", 16]] for i in aligned})


@pytest.mark.parametrize("label,act_quant", [("decode", True), ("mid", True), ("prefill", True), ("mid_fp8", True),
                                             ("decode", False), ("mid", False)])
def test_kernel_compiles_for_hopper_on_tensor_cores_without_spills(label: str, act_quant: bool) -> None:
    if W.INTERPRETED:
        pytest.skip("no sm_90 compile under the interpreter: the parent (compiled) process runs this")
    cfg = CONFIGS[label]
    fixup = cfg.split_k
    compiled, usage = _compile(cfg, act_quant, fixup)
    ptx = compiled.asm["ptx"]
    assert no_spills(usage), usage
    assert "cp.async" in ptx                                              # pipelined global loads
    if fixup:                  # partials stored, CTA barrier, one release/acquire arrival, L2 reads of partials
        stores, atom = ptx.find("st.global"), ptx.find("atom.global.gpu.acq_rel.add")
        assert 0 <= stores < ptx.find("bar.sync", stores) < atom and "ld.global.cg" in ptx[atom:]
    if not act_quant:                                                     # W8A16: BF16 MMA, no E4M3 rounding
        assert re.search(r"(wgmma\.mma_async|mma\.sync)\S*bf16", ptx) and "cvt.rn.satfinite.e4m3x2" not in ptx
        return
    fp8_wgmma = re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k32\.f32\.e4m3\.e4m3", ptx)
    assert bool(fp8_wgmma) == cfg.fp8_mma                                 # FP8 MMA sums only when asked
    if not cfg.fp8_mma:                                                   # E4M3 widened to f16: exact products
        assert re.search(r"(wgmma\.mma_async\S*|mma\.sync\S*)\.f32\.f16\.f16", ptx)
    if cfg.fused_quant:
        assert "cvt.rn.satfinite.e4m3x2.f32" in ptx                       # hardware RNE quantisation


if not W.INTERPRETED:

    def test_kernel_cases_in_triton_interpreter() -> None:
        """Run this file's kernel cases in a child pytest with TRITON_INTERPRET=1 (CPU)."""
        run_kernel_cases_in_interpreter(__file__, min_passed=29, exact=True)


# ---- GPU ------------------------------------------------------------------------------------------

def _flash_case(n: int, k: int, m: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    values, scales = fp8_weight(n, k, g, exp_range=(-12, -4))
    return values, scales, random_x(m, k, g)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(FLASH_SHAPES))
def test_gpu_flash_shapes_within_bound_at_every_row_tier(name: str) -> None:
    n, k = FLASH_SHAPES[name]
    values, scales, x = _flash_case(n, k, 300, seed=len(name))
    for m in (1, 8, 64, 256, 300):               # decode, mid, then the prefill (BF16 GEMM) form
        ok, worst = within(W.fp8_w8a8_linear(x[:m], values, scales), *oracle(x[:m], values, scales))
        assert ok, (m, worst)
    ok, worst = within(W.fp8_w8a8_linear(x, values, scales, config=W.PREFILL_CONFIG), *oracle(x, values, scales))
    assert ok, ("triton prefill tier", worst)


@pytest.mark.gpu
def test_gpu_grouped_wo_a_at_flash_shape() -> None:
    g = torch.Generator().manual_seed(11)
    values, scales = fp8_weight(8192, 4096, g)
    x = random_x(300, 8 * 4096, g)
    for m, cfg in ((1, None), (64, None), (300, None), (300, W.PREFILL_CONFIG)):
        y = W.fp8_w8a8_linear(x[:m], values, scales, groups=8, config=cfg)
        ok, worst = within(y, *oracle(x[:m], values, scales, groups=8))
        assert ok, (m, cfg, worst)


@pytest.mark.gpu
def test_gpu_wo_a_without_activation_quantisation_at_flash_shape() -> None:
    g = torch.Generator().manual_seed(13)
    values, scales = fp8_weight(8192, 4096, g)
    x = random_x(300, 8 * 4096, g)
    for m, cfg in ((1, None), (64, None), (300, None), (300, W.PREFILL_CONFIG)):
        y = W.fp8_w8a8_linear(x[:m], values, scales, groups=8, act_quant=False, config=cfg)
        ok, worst = within(y, *oracle(x[:m], values, scales, groups=8, act_quant=False))
        assert ok, (m, cfg, worst)


@pytest.mark.gpu
def test_gpu_split_k_inside_the_launch_replays_in_a_cuda_graph() -> None:
    """The in-launch split-K sum (counters) at every Flash shape: equal to the two-launch sum, and
    a captured call replayed 3 times gives the eager bits with the counters left at zero."""
    for name, (n, k) in sorted(FLASH_SHAPES.items()):
        values, scales, x = _flash_case(n, k, 8, seed=len(name) + 1)
        counters = W.split_k_counters(n, x.device)
        want = W.fp8_w8a8_linear(x, values, scales)
        assert torch.equal(W.fp8_w8a8_linear(x, values, scales, counters=counters), want), name
        assert_graph_replays_eager(lambda: W.fp8_w8a8_linear(x, values, scales, counters=counters), counters)


@pytest.mark.gpu
def test_gpu_split_k_equals_one_program_and_rows_are_batch_invariant_within_a_tier() -> None:
    values, scales, x = _flash_case(1280, 5120, 16, seed=12)
    cfg = W.config_for_rows(16, shape=(1280, 5120, 1))              # the shape's decode tier (SHAPE_CONFIGS)
    assert W.k_chunks(1280, 5120, cfg.target_programs) > 1
    split = W.fp8_w8a8_linear(x, values, scales, config=cfg)
    one = W.fp8_w8a8_linear(x, values, scales, config=dataclasses.replace(cfg, split_k=False))
    assert torch.equal(split, one)
    counters = W.split_k_counters(1280, x.device)
    assert torch.equal(W.fp8_w8a8_linear(x, values, scales, counters=counters), split) and not counters.any()
    for lo, hi in ((0, 1), (5, 6), (3, 11)):
        assert torch.equal(W.fp8_w8a8_linear(x[lo:hi], values, scales), split[lo:hi]), (lo, hi)

"""One-launch elementwise kernels (`sglang_dsv41.kernels.fused_elementwise`, `kernels.rope`, `kernels.swiglu`)
and the runtime's CUDA backend over them (`runtime.triton_backend.TritonBackend`) against the reference helpers
(spec §3, §3.4, §3.6, §3.8).

What is pinned:
* bit for bit: `round_bf16` == `ops.bf16`, `round_e4m3` == torch's float8_e4m3fn cast (every E4M3
  value, every midpoint (ties to even), their fp32 neighbours, 448 / 464 / >464 → NaN, ±inf, NaN,
  ±0, subnormals, random magnitudes), FP8 activation and both FP4 fake quantisations (incl. zero
  groups, −0, the 1e−10 amax clamp, exact powers of two as amax/448 — the pow2-ceil m == 0.5 case;
  FP4 scales from amax·fp32(1/6), probed where that differs from amax/6);
* RoPE (fp32 rotation of double-fp32 cos/sin rounded once): bit for bit on these inputs, also
  with Flash's tables at positions 0, 65,535, 65,536 and 1,048,575;
  top-k selection of `route` (NaN first, ties → lower id, all −inf rows, vision bias); `route_softplus`: the
  correctly rounded sqrt of the softplus, then `route_select`'s bits and the routed scale; RoPE written into
  cache rows (`into`) == `cache[rows] = result`;
* the double-fp32 ones (rms_norm, SwiGLU incl. gates far down the exp range, the routing weight
  sum; the renorm add and division are fp32, as upstream's gate): equal to the float64 reference on
  these inputs (their stated bound allows rare one-ulp flips; none occur here);
* batch invariance: every kernel's row of a batch == that row alone, bitwise;
* the backend: each `TritonBackend` primitive is its kernel; the runtime's project_q_kv /
  output_projection / shared_expert / route on `TritonBackend` (interpreter or CUDA) give the
  reference's bits; the reference has no backend switch left;
* compiled for sm_90 (no GPU needed): no approximate division / sqrt / exp instructions, no
  saturating fp8 cast, no float64 instruction;
* GPU (`gpu`): Flash widths vs the reference evaluated on the GPU, `route_softplus` == torch's sqrt then
  `route_select`, RoPE into cache rows at Flash shape, and CUDA-graph replay.

The kernel cases run in a child pytest with TRITON_INTERPRET=1 (`test_kernel_cases_in_triton_interpreter`),
as tests/test_kernels_indexer.py does; the interpreter's own fp32→bf16 cast truncation does not
matter here because the kernels round to BF16 arithmetically.
"""
from __future__ import annotations

import re

import pytest
import torch
import triton
import triton.language as tl

from sglang_dsv41.kernels import fused_elementwise as FE
from sglang_dsv41.kernels import rope as ROPE
from sglang_dsv41.kernels import route_select as RS
from sglang_dsv41.kernels import swiglu as SW
from sglang_dsv41.reference import attention as A
from sglang_dsv41.reference import moe, ops
from sglang_dsv41.runtime.attention_math import output_projection, project_q_kv
from sglang_dsv41.runtime.backend import ExactTorchBackend
from sglang_dsv41.runtime.triton_backend import TritonBackend
from sglang_dsv41.runtime.moe_ops import route, shared_expert

from triton_checks import flips_within_bound, run_kernel_cases_in_interpreter, same_bits

KERNEL_HERE = FE.INTERPRETED or torch.cuda.is_available()
DEVICE = "cuda" if torch.cuda.is_available() and not FE.INTERPRETED else "cpu"


def e4m3_probe_values() -> torch.Tensor:
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[~grid.isnan()].unique()
    mid = (grid[1:] + grid[:-1]) / 2
    extra = torch.tensor([448.0, 464.0, 472.0, 480.0, 1e30, float("inf"), float("nan"), 2.0**-10, 2.0**-12, 1e-45])
    base = torch.cat([grid, mid, extra, -grid, -mid, -extra])
    up = torch.nextafter(base, torch.full_like(base, float("inf")))
    down = torch.nextafter(base, torch.full_like(base, -float("inf")))
    g = torch.Generator().manual_seed(3)
    rand = torch.randn(4096, generator=g) * torch.exp2(torch.randint(-20, 12, (4096,), generator=g).float())
    return torch.cat([base, up, down, rand])


def quant_inputs(g: torch.Generator, rows: int, cols: int) -> list[torch.Tensor]:
    """Magnitudes from 1e−12 to 1e20, zero / −0 groups, a group below the amax clamp, groups whose
    amax/448 and amax/6 are exact powers of two (pow2_ceil's m == 0.5 case)."""
    out = []
    for scale in (1e-12, 1e-3, 1.0, 1e3, 1e20):
        x = torch.randn(rows, cols, generator=g) * scale
        x[0, :32] = 0.0
        x[1, :32] = -0.0
        x[2, :32] = 1e-12
        x[3, :32] = torch.linspace(-1, 1, 32) * 448.0 * 2.0**-3
        x[3, 5] = 448.0 * 2.0**-3
        x[4, :32] = 6.0 * 2.0**4 * torch.linspace(-1, 1, 32)
        out.append(x)
    return out


@triton.jit
def _swiglu_screen_probe_kernel(g_ptr, u_ptr, screened_ptr, exact_ptr, fast_ptr, n, limit, BLOCK: tl.constexpr):
    """Per lane: `swiglu_value` (screened), the exact path alone, and the raw fp32 estimate."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = offs < n
    g = tl.load(g_ptr + offs, mask=live, other=1.0)
    u = tl.load(u_ptr + offs, mask=live, other=1.0)
    tl.store(screened_ptr + offs, SW.swiglu_value(g, u, limit), mask=live)
    gc = tl.minimum(FE._round_bf16(g), limit)
    uc = tl.minimum(tl.maximum(FE._round_bf16(u), -limit), limit)
    tl.store(exact_ptr + offs, FE._round_bf16(SW._silu_mul_exact(gc, uc)), mask=live)
    tl.store(fast_ptr + offs, SW._silu_mul_fp32(gc, uc), mask=live)


def swiglu_screen_probe(gate: torch.Tensor, up: torch.Tensor, limit: float, block: int) -> tuple[torch.Tensor, ...]:
    """(screened, exact, fp32 estimate) of flat gate / up through `_swiglu_screen_probe_kernel`."""
    gate, up = gate.contiguous().view(-1), up.contiguous().view(-1)
    outs = [torch.empty_like(gate) for _ in range(3)]
    _swiglu_screen_probe_kernel[(triton.cdiv(gate.numel(), block),)](gate, up, *outs, gate.numel(), limit,
                                                                      BLOCK=block, **FE._launch_options())
    return tuple(outs)


def check_swiglu_screen(gate: torch.Tensor, up: torch.Tensor, block: int) -> float:
    """The screened SwiGLU gives the exact path's bits; the fp32 estimate is within 2^-20 of the float64
    value where |g| ≤ 60 (the screen's premise). Returns the worst estimate error / |value| in 2^-24 units."""
    screened, exact, fast = swiglu_screen_probe(gate, up, 10.0, block)
    assert same_bits(screened, exact)
    g64 = torch.minimum(ops.bf16(gate.double()), torch.tensor(10.0, dtype=torch.float64))
    u64 = ops.bf16(up.double()).clamp(-10.0, 10.0)
    value = (g64 * torch.sigmoid(g64) * u64).view(-1)
    keep = (g64.view(-1).abs() <= 60) & (value.abs() > 1e-30)
    ratio = ((fast.double() - value).abs() / value.abs())[keep]
    worst = float(ratio.max()) * 2.0**24
    assert worst <= 16.0, worst
    return worst


# ---- kernel cases (interpreter child, or CUDA) ----------------------------------------------------

if KERNEL_HERE:

    def test_kernel_case_round_bf16_and_e4m3_bitwise() -> None:
        x = e4m3_probe_values().to(DEVICE)
        assert same_bits(FE.round_e4m3(x).cpu(), x.cpu().to(torch.float8_e4m3fn).float())
        assert same_bits(FE.round_bf16(x).cpu(), ops.bf16(x.cpu()))
        g = torch.Generator().manual_seed(4)       # BF16 ties (low half 0x8000) and neighbours, both signs
        hi = torch.randint(0, 1 << 15, (512,), generator=g, dtype=torch.int32) << 16
        low = torch.tensor([0x8000, 0x7FFF, 0x8001, 0x0000, 0xFFFF], dtype=torch.int32)
        bits = (hi[:, None] | low[None, :]).flatten()
        ties = torch.cat([bits.view(torch.float32), -bits.view(torch.float32)]).to(DEVICE)
        assert same_bits(FE.round_bf16(ties).cpu(), ops.bf16(ties.cpu()))
        nan_at = FE.round_e4m3(torch.tensor([463.9, 464.0, 464.01, 480.0, -1e9], device=DEVICE)).cpu()
        assert nan_at[:2].tolist() == [448.0, 448.0] and bool(nan_at[2:].isnan().all())

    def test_kernel_case_group_quantisation_bitwise() -> None:
        g = torch.Generator().manual_seed(1)
        for x in quant_inputs(g, 24, 128):
            xd = x.to(DEVICE)
            assert same_bits(FE.fp8_act_fake_quant(xd).cpu(), ops.fp8_act_fake_quant(x))
            assert same_bits(FE.fp4_fake_quant(xd, 16, "e4m3").cpu(), ops.fp4_fake_quant_e4m3_scale(x))
            assert same_bits(FE.fp4_fake_quant(xd, 32, "ue8m0").cpu(), ops.fp4_fake_quant_ue8m0_scale(x))
        exact = torch.full((1, 32), 448.0 * 2.0**-5)               # amax/448 == 2^-5 exactly → scale 2^-5
        assert same_bits(FE.fp8_act_fake_quant(exact.to(DEVICE)).cpu(), exact)
        with pytest.raises(ValueError, match="multiple of the quantisation group"):
            FE.fp8_act_fake_quant(torch.zeros(2, 40, device=DEVICE))

    @pytest.mark.parametrize("D", [32, 96, 128, 1280])
    def test_kernel_case_rms_norm(D: int) -> None:
        g = torch.Generator().manual_seed(D)
        x = ops.bf16(torch.randn(6, D, generator=g) * 3)
        x[1] = 0.0                                                 # 0·rsqrt(ε) = 0
        w = ops.bf16(torch.rand(D, generator=g) + 0.5)
        for eps in (1e-20, 1e-6):
            got = FE.rms_norm(x.to(DEVICE), w.to(DEVICE), eps).cpu()
            assert same_bits(got, ops.rms_norm(x, w, eps))
            got32 = FE.rms_norm(x.to(DEVICE), w.to(DEVICE), eps, round_bf16=False).cpu()
            assert same_bits(got32, A.rms_norm_fp32(x, w, eps))

    @pytest.mark.parametrize("shape", [(5, 96), (5, 4, 96), (3, 2, 3, 64)], ids=["rows", "heads", "4d"])
    def test_kernel_case_rope_forward_inverse(shape: tuple[int, ...]) -> None:
        g = torch.Generator().manual_seed(len(shape))
        inv = ops.rope_inv_freq(32, 10000.0, None)
        x = torch.randn(*shape, generator=g)
        pos = torch.tensor([0, 1, 37, 1000, 65535][:shape[0]])
        d = lambda t: t.to(DEVICE)  # noqa: E731
        for inverse in (False, True):
            want = ops.apply_rope_tail(x, pos, inv, inverse)
            assert same_bits(ROPE.apply_rope_tail(d(x), d(pos), d(inv), inverse).cpu(), want)
            assert same_bits(ROPE.apply_rope_tail(d(x), d(pos), d(inv), inverse, round_bf16=True).cpu(), ops.bf16(want))
            held = ROPE.apply_rope_tail(d(x), d(pos), d(inv), inverse, round_bf16=True, out_dtype=torch.bfloat16).cpu()
            assert held.dtype == torch.bfloat16 and same_bits(held.float(), ops.bf16(want))     # BF16 out: same values
            rounded_first = ops.bf16(ops.apply_rope_tail(ops.bf16(x), pos, inv, inverse))      # round_input
            assert same_bits(ROPE.apply_rope_tail(d(x), d(pos), d(inv), inverse, round_bf16=True,
                                                  round_input=True).cpu(), rounded_first)
            assert not same_bits(rounded_first, ops.bf16(want))              # the case tells the two apart
            xb = ops.bf16(x)                                                # a BF16 input: its fp32 copy's bits
            assert same_bits(ROPE.apply_rope_tail(d(xb.to(torch.bfloat16)), d(pos), d(inv), inverse).cpu(),
                             ROPE.apply_rope_tail(d(xb), d(pos), d(inv), inverse).cpu())
        with pytest.raises(ValueError, match="bfloat16 only with round_bf16"):
            ROPE.apply_rope_tail(d(x), d(pos), d(inv), out_dtype=torch.bfloat16)
        back = ROPE.apply_rope_tail(ROPE.apply_rope_tail(d(x), d(pos), d(inv)), d(pos), d(inv), inverse=True).cpu()
        assert torch.allclose(back, x, rtol=0, atol=1e-5)          # the inverse undoes the rotation

    @pytest.mark.parametrize("table", ["compressed", "swa"])
    def test_kernel_case_rope_flash_tables_at_pinned_positions(table: str) -> None:
        """Flash's fp32 tables (ops.rope_inv_freq, pinned against upstream's formula in
        tests/test_reference_rounding.py) at positions 0, 65,535, 65,536 and 1,048,575: the
        kernel's fp32 rotation (cos/sin correctly rounded to fp32) equals the reference's bits."""
        from sglang_dsv41.config import RopeScaling
        scaling = RopeScaling(factor=16, original_max_position_embeddings=65536) if table == "compressed" else None
        inv = ops.rope_inv_freq(64, 160000.0 if table == "compressed" else 10000.0, scaling)
        g = torch.Generator().manual_seed(18)
        pos = torch.tensor([0, 65535, 65536, 1048575, 1048574, 524288])
        x = ops.bf16(torch.randn(6, 3, 128, generator=g))
        d = lambda t: t.to(DEVICE)  # noqa: E731
        for inverse in (False, True):
            want = ops.apply_rope_tail(x, pos, inv, inverse)
            assert same_bits(ROPE.apply_rope_tail(d(x), d(pos), d(inv), inverse).cpu(), want)
            assert same_bits(ROPE.apply_rope_tail(d(x), d(pos), d(inv), inverse, round_bf16=True).cpu(),
                             ops.bf16_rope_tail(x, pos, inv, inverse))

    def test_kernel_case_rope_into_cache_rows() -> None:
        """`into`: the BF16 rows written at their cache rows (as `cache[rows] = result`), the other rows kept."""
        g = torch.Generator().manual_seed(21)
        x = torch.randn(5, 96, generator=g) * 4
        pos = torch.tensor([0, 7, 300, 4095, 12])
        inv = ops.rope_inv_freq(32, 10000.0, None)
        cache = torch.randn(9, 96, generator=g).to(torch.bfloat16)
        rows = torch.tensor([8, 0, 3, 5, 1])
        want = cache.clone()
        want[rows] = ROPE.apply_rope_tail(x.to(DEVICE), pos.to(DEVICE), inv.to(DEVICE), round_bf16=True,
                                        out_dtype=torch.bfloat16, round_input=True).cpu()
        got = ROPE.apply_rope_tail(x.to(DEVICE), pos.to(DEVICE), inv.to(DEVICE), round_bf16=True,
                                 out_dtype=torch.bfloat16, round_input=True, into=(cache.to(DEVICE), rows.to(DEVICE)))
        assert same_bits(got.cpu().float(), want.float())
        with pytest.raises(ValueError, match="into a cache"):
            ROPE.apply_rope_tail(x.to(DEVICE), pos.to(DEVICE), inv.to(DEVICE), round_bf16=True,
                               into=(cache.to(DEVICE), rows.to(DEVICE)))             # written as fp32: refused

    @pytest.mark.parametrize("shape", [(5, 4, 96), (3, 64, 512)], ids=["heads", "flash_q"])
    def test_kernel_case_rope_in_place(shape: tuple[int, ...]) -> None:
        """`in_place`: a contiguous BF16 x rotated where it is — the copy's bits, x itself returned;
        refused for fp32 x, non-contiguous x, an fp32 output or `into`."""
        g = torch.Generator().manual_seed(33)
        inv = ops.rope_inv_freq(32, 10000.0, None)
        pos = torch.tensor([0, 1, 37, 1000, 65535][:shape[0]])
        x = torch.randn(*shape, generator=g).to(torch.bfloat16)
        d = lambda t: t.to(DEVICE)  # noqa: E731
        for inverse in (False, True):
            want = ROPE.apply_rope_tail(d(x), d(pos), d(inv), inverse, round_bf16=True, out_dtype=torch.bfloat16).cpu()
            xd = d(x.clone())
            got = ROPE.apply_rope_tail(xd, d(pos), d(inv), inverse, round_bf16=True, out_dtype=torch.bfloat16,
                                     in_place=True)
            assert got.data_ptr() == xd.data_ptr() and same_bits(got.cpu().float(), want.float())
            assert same_bits(got.cpu()[..., :-64].float(), x[..., :-64].float())     # the head dims untouched
        bad = dict(round_bf16=True, out_dtype=torch.bfloat16, in_place=True)
        with pytest.raises(ValueError, match="in_place"):
            ROPE.apply_rope_tail(d(x.float()), d(pos), d(inv), **bad)
        with pytest.raises(ValueError, match="in_place"):
            ROPE.apply_rope_tail(d(x).transpose(1, 2), d(pos), d(inv), **bad)
        with pytest.raises(ValueError, match="in_place"):
            ROPE.apply_rope_tail(d(x), d(pos), d(inv), round_bf16=True, in_place=True)

    def test_kernel_case_rope_cos_sin_equal_float64_rounded_once() -> None:
        """The kernel's double-fp32 cos/sin (read out through a rotation of (1, 0) pairs) equal
        `ops.rope_cos_sin` (float64, rounded once) bit for bit on Flash's two tables at 256 positions
        (0…127 and random up to 2²⁰): 16k angles (342k checked once, docs/runtime.md)."""
        from sglang_dsv41.config import RopeScaling
        from sglang_dsv41.numerics.rope import rope_cos_sin
        g = torch.Generator().manual_seed(21)
        pos = torch.cat([torch.arange(128), torch.randint(0, 1 << 20, (128,), generator=g)])
        for scaling, base in ((RopeScaling(factor=16, original_max_position_embeddings=65536), 160000.0), (None, 10000.0)):
            inv = ops.rope_inv_freq(64, base, scaling)
            x = torch.zeros(pos.numel(), 64)
            x[:, 0::2] = 1.0
            got = ROPE.apply_rope_tail(x.to(DEVICE), pos.to(DEVICE), inv.to(DEVICE)).cpu()
            cos, sin = rope_cos_sin(pos.float()[:, None] * inv[None, :])
            assert same_bits(got[:, 0::2], cos) and same_bits(got[:, 1::2], sin)

    def test_kernel_case_fp4_scales_take_the_fp32_reciprocal() -> None:
        """fp32 amax values near 6× an E4M3 rounding tie, where e4m3(amax·fp32(1/6)) and
        e4m3(amax/6) can differ, and 6·2^k (UE8M0 powers of two) ± one ulp: bitwise the reference."""
        ties = torch.tensor([(1 + (2 * j + 1) / 16) * 2.0**k for k in range(-8, 8) for j in range(8)]) * 6
        near = (ties.view(torch.int32)[:, None] + torch.arange(-3, 4, dtype=torch.int32)[None]).view(torch.float32)
        pow2 = (torch.tensor([6 * 2.0**k for k in range(-30, 8)]).view(torch.int32)[:, None]
                + torch.arange(-1, 2, dtype=torch.int32)[None]).view(torch.float32)
        amax = torch.cat((near.flatten(), pow2.flatten()))
        amax = torch.cat((amax, amax.new_zeros((-amax.numel()) % 32)))
        x = torch.zeros(amax.numel(), 32)
        x[:, 0], x[:, 5] = amax, amax * 0.3
        e4m3_mul = (amax * ops.INV_E2M1_MAX).clamp(2.0**-9, 448.0).to(torch.float8_e4m3fn).float()
        e4m3_div = (amax / 6.0).clamp(2.0**-9, 448.0).to(torch.float8_e4m3fn).float()
        assert not torch.equal(e4m3_mul, e4m3_div)                # the probe holds a differing amax
        assert same_bits(FE.fp4_fake_quant(x.to(DEVICE), 16, "e4m3").cpu(), ops.fp4_fake_quant_e4m3_scale(x))
        assert same_bits(FE.fp4_fake_quant(x.to(DEVICE), 32, "ue8m0").cpu(), ops.fp4_fake_quant_ue8m0_scale(x))

    def test_kernel_case_swiglu() -> None:
        """Double-fp32 silu·u against the float64 reference, bitwise on these inputs: random gates,
        the clamp, ±0, and gates far down the exp range (−87 … −250: tiny, subnormal, zero outputs,
        signs of zero from sign(g)·sign(u) incl. u = ±0)."""
        g = torch.Generator().manual_seed(5)
        gate, up = torch.randn(33, 256, generator=g) * 8, torch.randn(33, 256, generator=g) * 8
        gate[0, :4] = torch.tensor([10.0, 10.5, -0.0, -30.0])
        far = torch.tensor([-20.0, -60.0, -87.0, -88.5, -90.0, -95.0, -100.0, -104.0, -110.0, -150.0, -199.0, -250.0])
        gate[1, :12], gate[2, :12], gate[3, :12] = far, far, far
        up[1, :12], up[2, :12], up[3, :12] = 9.0, -0.0, 0.0
        assert same_bits(SW.clamped_swiglu(gate.to(DEVICE), up.to(DEVICE), 10.0).cpu(),
                         moe.clamped_swiglu(gate, up, 10.0))

    def test_kernel_case_swiglu_screen_gives_the_exact_bits() -> None:
        """`swiglu_value`'s screen: on 2^18 random lanes (gates N(0, 4²) and wide, ups N(0, 8²)) the screened
        result is the exact path's bit for bit, and the fp32 estimate stays within its 2^-20 bound."""
        g = torch.Generator().manual_seed(17)
        n = 1 << 18
        gate = torch.randn(n, generator=g) * torch.where(torch.rand(n, generator=g) < 0.5, 4.0, 30.0)
        up = torch.randn(n, generator=g) * 8
        check_swiglu_screen(gate.to(DEVICE), up.to(DEVICE), 1024)

    def test_kernel_case_batch_invariance() -> None:
        g = torch.Generator().manual_seed(7)
        x = ops.bf16(torch.randn(9, 4, 96, generator=g))
        pos = torch.arange(9) * 17
        inv, w = ops.rope_inv_freq(32, 10000.0, None), torch.rand(96, generator=g)
        scores, bias = torch.rand(9, 8, generator=g), torch.zeros(8)
        d = lambda t: t.to(DEVICE)  # noqa: E731
        calls = [lambda a, p, s: FE.rms_norm(a, d(w), 1e-20),
                 lambda a, p, s: FE.fp8_act_fake_quant(a),
                 lambda a, p, s: FE.fp4_fake_quant(a, 16, "e4m3"),
                 lambda a, p, s: ROPE.apply_rope_tail(a, p, d(inv), True),
                 lambda a, p, s: SW.clamped_swiglu(a, a * 0.5, 10.0),
                 lambda a, p, s: RS.route_select(s, d(bias), 3, 1e-20)[1]]
        for call in calls:
            batch = call(d(x), d(pos), d(scores)).cpu()
            for i in (0, 4, 8):
                alone = call(d(x[i:i + 1]), d(pos[i:i + 1]), d(scores[i:i + 1])).cpu()
                assert same_bits(batch[i:i + 1], alone)

    def test_kernel_case_dispatch_through_reference_layers() -> None:
        """The runtime's sublayer pieces on `TritonBackend` (CPU accepted under the interpreter,
        or CUDA) give the reference's bits — except the router scores, which the backend forms in
        fp32 (`acc`, no float64 on the GPU path): within 4 fp32 ulps, the same experts, weights
        within 8 fp32 ulps."""
        from reference_weights import random_reference_weights, tiny_config
        from runtime_values import with_linear_layers
        cfg = tiny_config(vision=False)
        t = cfg.text
        layer = next(r.layer for r in t.layer_roles() if r.ratio and not r.engram)
        w = with_linear_layers({k: v.to(DEVICE) for k, v in random_reference_weights(cfg, seed=2, vision=False).items()
                                if k.startswith(f"layers.{layer}.")}, cfg)
        g = torch.Generator().manual_seed(8)
        x = ops.bf16(torch.randn(3, t.hidden_size, generator=g)).to(DEVICE)
        o = ops.bf16(torch.randn(3, t.num_attention_heads, t.head_dim, generator=g)).to(DEVICE)
        pos = torch.tensor([0, 5, 77], device=DEVICE)
        inv = A.layer_inv_freq(t, 1).to(DEVICE)
        p, pa = f"layers.{layer}.ffn.", f"layers.{layer}.attn."

        r = moe.route(x, w[p + "gate.weight"], w[p + "gate.bias"], t.num_experts_per_tok)
        want = (*A.project_q_kv(t, w, pa, x, pos, inv, True), A.output_projection(t, w, pa, o, pos, inv, True),
                moe.shared_expert(x, w[p + "shared_experts.w1.weight"], w[p + "shared_experts.w2.weight"],
                                  w[p + "shared_experts.w3.weight"], t.swiglu_limit, True),
                r.experts, r.weights, r.scores)
        be = TritonBackend(ExactTorchBackend(), device_types=(DEVICE,))      # kernels + the exact product
        r = route(be, x, w[p + "gate"], w[p + "gate.bias"], t.num_experts_per_tok)
        got = (*project_q_kv(be, t, w, pa, x, pos, inv, True, t.num_attention_heads),
               output_projection(be, t, w, pa, o, pos, inv, True),
               shared_expert(be, x, w[p + "shared_experts.w1"], w[p + "shared_experts.w2"],
                             w[p + "shared_experts.w3"], t.swiglu_limit, True),
               r.experts, r.weights, r.scores)
        assert be.acc == torch.float32
        assert got[1].dtype == torch.bfloat16 and got[0].dtype == torch.float32   # q held as BF16 (BF16_OUT)
        assert all(same_bits(a.float(), b) for a, b in zip(got[:-3], want[:-3]))
        assert torch.equal(got[-3], want[-3])
        for g_, w_, ulps in ((got[-1], want[-1], 4), (got[-2], want[-2], 8)):
            assert bool(((g_ - w_).abs() <= ulps * 2.0 ** -23 * w_.abs()).all()), float((g_ - w_).abs().max())


# ---- the interpreter child, dispatch and compile checks (main process) -------------------------

if not FE.INTERPRETED:

    def test_kernel_cases_in_triton_interpreter() -> None:
        """Run this file's kernel cases in a child pytest with TRITON_INTERPRET=1 (CPU)."""
        run_kernel_cases_in_interpreter(__file__, min_passed=17)

    def test_cpu_without_interpreter_raises() -> None:
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
            FE.round_bf16(torch.zeros(4))
        with pytest.raises(ValueError, match="interpreter"):
            TritonBackend(ExactTorchBackend(), device_types=("cpu",))

    @pytest.mark.parametrize("name,sig,consts", [
        ("_round_e4m3_kernel", {"x_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32"}, {"BLOCK": 1024}),
        ("_group_quant_kernel", {"x_ptr": "*fp32", "out_ptr": "*fp32", "n_groups": "i32"}, {"GROUP": 32, "GPP": 16, "MODE": 0}),
        ("_group_quant_kernel", {"x_ptr": "*fp32", "out_ptr": "*fp32", "n_groups": "i32"}, {"GROUP": 16, "GPP": 16, "MODE": 1}),
        ("_group_quant_kernel", {"x_ptr": "*fp32", "out_ptr": "*fp32", "n_groups": "i32"}, {"GROUP": 32, "GPP": 16, "MODE": 2}),
        ("_rms_norm_kernel", {"x_ptr": "*fp32", "w_ptr": "*fp32", "out_ptr": "*fp32", "D": "i32"},
         {"EPS_HI": 1e-20, "EPS_LO": -5.6e-28, "BLOCK_D": 8192, "LOG2_D": 13, "ROUND_BF16": True}),
        ("_rope_tail_kernel", {"x_ptr": "*fp32", "pos_ptr": "*i64", "freq_ptr": "*fp32", "out_ptr": "*fp32",
                               "dst_ptr": "*i64", "out_stride": "i32", "T": "i32", "R": "i32", "D": "i32",
                               "HEAD": "i32"},
         {"HALF": 32, "BLOCK_T": 1, "BLOCK_R": 8, "BLOCK_HEAD": 128, "INVERSE": True, "ROUND_BF16": True,
          "ROUND_INPUT": True, "SCATTER": True, "COPY_HEAD": True}),
        ("_rope_tail_kernel", {"x_ptr": "*bf16", "pos_ptr": "*i64", "freq_ptr": "*fp32", "out_ptr": "*bf16",
                               "dst_ptr": "*i64", "out_stride": "i32", "T": "i32", "R": "i32", "D": "i32",
                               "HEAD": "i32"},
         {"HALF": 32, "BLOCK_T": 1, "BLOCK_R": 8, "BLOCK_HEAD": 128, "INVERSE": False, "ROUND_BF16": True,
          "ROUND_INPUT": False, "SCATTER": False, "COPY_HEAD": False}),
        ("_swiglu_kernel", {"g_ptr": "*fp32", "u_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32", "limit": "fp32"}, {"BLOCK": 1024}),
    ], ids=["e4m3", "fp8", "fp4_e4m3", "fp4_ue8m0", "rms_norm", "rope", "rope_in_place", "swiglu"])
    def test_kernels_compile_for_hopper_exactly(name: str, sig: dict, consts: dict) -> None:
        """sm_90 PTX (Triton's bundled compiler, no GPU): no approximate fp32 division / sqrt / exp,
        no saturating fp8 cast, no fp32 FMA; no float64 instruction at all (issue 21)."""
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        kern = getattr({"_rope_tail_kernel": ROPE, "_swiglu_kernel": SW}.get(name, FE), name)
        full = {n: ("constexpr" if n in consts else sig[n]) for n in kern.arg_names}
        compiled = triton.compile(ASTSource(kern, full, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": 8 if consts.get("BLOCK_D", 0) >= 4096 else 4,
                                           "enable_fp_fusion": False})
        ptx = compiled.asm["ptx"]
        bad = re.findall(r"\b(div\.full\.f32|div\.approx\.\w+|sqrt\.approx\.\w+|ex2\.approx\.\w+|lg2\.approx\.\w+|"
                         r"rcp\.approx\.ftz\.f32|cvt\.rn\.satfinite\.\w+|fma\.rn\.f32|sin\.approx\.\w+|cos\.approx\.\w+)", ptx)
        assert not bad, sorted(set(bad))
        f64 = re.findall(r"\.f64\b", ptx)
        assert not f64, f"{len(f64)} float64 instructions in {name}"
        if "RENORM_EPS" in consts:
            assert "0f1E3CE508" in ptx                    # fp32(1e-20): the renorm add is fp32, as upstream's
        if consts.get("SQRT"):
            assert "sqrt.rn.f32" in ptx                   # the correctly rounded sqrt (torch's fp32 sqrt on CUDA)


def test_reference_has_no_backend_switch() -> None:
    for name in ("fused_for", "fused_kernels", "current_fused_kernels", "dense_backend", "current_dense_backend"):
        assert not hasattr(ops, name), name
    x = torch.randn(2, 64)
    assert torch.equal(ops.bf16(x), x.to(torch.bfloat16).float())


def test_triton_backend_primitives_are_the_kernels(monkeypatch) -> None:
    calls: list[str] = []
    for name in ("round_bf16", "fp8_act_fake_quant", "fp4_fake_quant", "rms_norm", "apply_rope_tail",
                 "clamped_swiglu", "route_select"):
        owner = {"route_select": RS, "apply_rope_tail": ROPE, "clamped_swiglu": SW}.get(name, FE)   # backend calls it
        monkeypatch.setattr(owner, name, lambda *a, _n=name, **k: calls.append(_n) or (a[0], a[0]))
    be = TritonBackend(ExactTorchBackend())
    x, inv = torch.randn(2, 64), ops.rope_inv_freq(32, 10000.0, None)
    be.bf16(x), be.fp8_act_fake_quant(x), be.fp4_fake_quant_e4m3_scale(x), be.fp4_fake_quant_ue8m0_scale(x)
    be.rms_norm(x, torch.ones(64), 1e-6), be.apply_rope_tail(x, torch.arange(2), inv)
    be.clamped_swiglu(x, x, 10.0), be.route_select(x, torch.zeros(64), 2, 1e-20, None, None)
    assert calls == ["round_bf16", "fp8_act_fake_quant", "fp4_fake_quant", "fp4_fake_quant", "rms_norm",
                     "apply_rope_tail", "clamped_swiglu", "route_select"]
    assert torch.equal(be.matmul(x, torch.eye(64)), ExactTorchBackend().matmul(x, torch.eye(64)))


# ---- GPU: Flash widths, bitwise / within the stated bound vs the reference on the GPU ----------

@pytest.mark.gpu
def test_gpu_flash_widths_match_reference_on_gpu() -> None:
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    T = 64
    for D in (5120, 1280, 512, 128):                          # hidden, q_lora, head_dim, index_head_dim
        x = ops.bf16(torch.randn(T, D, generator=g, device=dev) * 2)
        w = ops.bf16(torch.rand(D, generator=g, device=dev) + 0.5)
        assert flips_within_bound(FE.rms_norm(x, w, 1e-20), ops.rms_norm(x, w, 1e-20), True)
        assert flips_within_bound(FE.rms_norm(x, w, 1e-20, False), A.rms_norm_fp32(x, w, 1e-20), False)
        assert same_bits(FE.fp8_act_fake_quant(x * 37.0), ops.fp8_act_fake_quant(x * 37.0))
        assert same_bits(FE.fp4_fake_quant(x, 16, "e4m3"), ops.fp4_fake_quant_e4m3_scale(x))
        assert same_bits(FE.fp4_fake_quant(x, 32, "ue8m0"), ops.fp4_fake_quant_ue8m0_scale(x))
        assert same_bits(FE.round_bf16(x * 1.37), ops.bf16(x * 1.37))
    probe = e4m3_probe_values().to(dev)
    assert same_bits(FE.round_e4m3(probe), ops.e4m3(probe))
    inv = (ops.rope_inv_freq(64, 160000.0, None)).to(dev)
    pos = torch.randint(0, 1 << 20, (T,), generator=g, device=dev)
    q = ops.bf16(torch.randn(T, 64, 512, generator=g, device=dev))
    for inverse in (False, True):
        assert flips_within_bound(ROPE.apply_rope_tail(q, pos, inv, inverse), ops.apply_rope_tail(q, pos, inv, inverse),
                                  False)
        assert flips_within_bound(ROPE.apply_rope_tail(q, pos, inv, inverse, True),
                                   ops.bf16(ops.apply_rope_tail(q, pos, inv, inverse)), True)
    gate, up = (ops.bf16(torch.randn(T, 2304, generator=g, device=dev) * 6) for _ in range(2))
    assert flips_within_bound(SW.clamped_swiglu(gate, up, 10.0), moe.clamped_swiglu(gate, up, 10.0), True)


@pytest.mark.gpu
def test_gpu_rope_into_cache_rows_at_flash_shape() -> None:
    """CUDA: 256 SWA rows of 512 dims (64 rotated) written at their cache rows by the RoPE launch equal the
    result written by `cache[rows] = …`, bit for bit; the other rows keep theirs."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(23)
    x = torch.randn(256, 512, generator=g, device=dev) * 3
    pos = torch.randint(0, 1 << 20, (256,), generator=g, device=dev)
    inv = ops.rope_inv_freq(64, 10000.0, None).to(dev)
    cache = torch.randn(5000, 512, generator=g, device=dev).to(torch.bfloat16)
    rows = torch.randperm(5000, generator=g, device=dev)[:256]
    want = cache.clone()
    want[rows] = ROPE.apply_rope_tail(x, pos, inv, round_bf16=True, out_dtype=torch.bfloat16, round_input=True)
    ROPE.apply_rope_tail(x, pos, inv, round_bf16=True, out_dtype=torch.bfloat16, round_input=True, into=(cache, rows))
    assert same_bits(cache.float(), want.float())


@pytest.mark.gpu
def test_gpu_rope_in_place_at_flash_shape() -> None:
    """CUDA: q of 256 tokens × 64 heads × 512 dims (64 rotated, forward and inverse) rotated in place equals
    the copy's result bit for bit, and the head dims keep their bits."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(5)
    q = torch.randn(256, 64, 512, generator=g, device=dev).to(torch.bfloat16)
    pos = torch.randint(0, 1 << 20, (256,), generator=g, device=dev)
    inv = ops.rope_inv_freq(32, 10000.0, None).to(dev)
    for inverse in (False, True):
        want = ROPE.apply_rope_tail(q, pos, inv, inverse, round_bf16=True, out_dtype=torch.bfloat16)
        got = ROPE.apply_rope_tail(q.clone(), pos, inv, inverse, round_bf16=True, out_dtype=torch.bfloat16,
                                 in_place=True)
        assert same_bits(got.float(), want.float()) and same_bits(got[..., :448].float(), q[..., :448].float())


@pytest.mark.gpu
def test_gpu_graph_capture_replays_the_fused_helpers() -> None:
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(1)
    x = ops.bf16(torch.randn(4, 1280, generator=g, device=dev))
    w = torch.rand(1280, generator=g, device=dev) + 0.5
    q = ops.bf16(torch.randn(4, 8, 512, generator=g, device=dev))
    pos = torch.tensor([3, 9, 100, 4097], device=dev)
    inv = ops.rope_inv_freq(64, 10000.0, None).to(dev)
    scores, bias = torch.rand(4, 384, generator=g, device=dev), torch.zeros(384, device=dev)

    be = TritonBackend(ExactTorchBackend())

    def step():
        n = be.rms_norm(x, w, 1e-20)
        return (be.fp8_act_fake_quant(n), be.apply_rope_tail(q, pos, inv), be.clamped_swiglu(n, x, 10.0),
                be.fp4_fake_quant_ue8m0_scale(n), *RS.route_select(scores, bias, 6, 1e-20))
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        step()                                              # compile / warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for t in (x, q, scores):
        t.copy_(ops.bf16(torch.randn(t.shape, generator=g, device=dev)).abs())
    graph.replay()
    torch.cuda.synchronize()
    assert all(same_bits(a, b) for a, b in zip(outs, step()))


@pytest.mark.gpu
def test_gpu_swiglu_screen_gives_the_exact_bits_at_flash_prefill() -> None:
    """The compiled screen at the shared expert's 8K prefill shape (8,192 × 2,304, the serving block): the
    exact path's bits everywhere; prints the estimate's worst error and the share of blocks sent exact."""
    g = torch.Generator(device="cuda").manual_seed(23)
    gate, up = (ops.bf16(torch.randn(8192, 2304, generator=g, device="cuda") * 6) for _ in range(2))
    worst = check_swiglu_screen(gate, up, SW.SWIGLU_BLOCK)
    screened, exact, fast = swiglu_screen_probe(gate, up, 10.0, SW.SWIGLU_BLOCK)
    low = (fast.view(torch.int32) & 0xFFFF) - 0x8000
    unsure = (low.abs() <= SW.SWIGLU_SCREEN_ULPS).view(-1, SW.SWIGLU_BLOCK).any(dim=1).float().mean()
    print(f"\n[swiglu screen] worst estimate error {worst:.2f} × 2^-24; blocks sent exact {float(unsure):.2%}")
    assert torch.equal(SW.clamped_swiglu(gate, up, 10.0).view(torch.int32), exact.view(torch.int32).view(gate.shape))

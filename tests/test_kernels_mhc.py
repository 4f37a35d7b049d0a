"""Fused mHC kernels (`sglang_dsv41.kernels.mhc`) and their device dispatch
(`sglang_dsv41.runtime.mhc_ops`) vs the reference (`reference.mhc`, spec §3.2).

What is pinned:
* `hc_coefficients` (fp32 inside; the reference: float64 rounded once): pre / post / comb within
  `K.COEFFICIENT_BOUND` (2⁻¹⁴ absolute) of the reference, at T ∈ {1, 3, 5, 20} (20 > the `rows`
  kernel's 16-token block; T = 40 > `dot`'s 32 below), H ∈ {64, 96} (96: a partial 128-column slice), 1 and 20 Sinkhorn steps; the
  bound fails for α scaled by 1.001 (`test_kernel_case_coefficient_bound_can_fail`);
* `hc_residual_update`, `hc_collapse`: bit-identical to the reference on the reference's coefficients;
* `hc_sublayer_input` (fp32 norm): every element the reference's or one BF16 ulp from it (with a
  carried pre and with `carried_pre=None` = stream 0), and at most 1 % of them differ; BF16
  rounding is bit arithmetic, so the interpreter gives the compiled bits too;
* batch invariance: a row of a batch == the row alone, bitwise, for every op (and for each
  partial-dot kernel of `K.MIX_KERNELS` at the edges of its token tiles, T = 40), in the
  deterministic configuration (`TritonMhc(deterministic=True)`: one kernel at every T);
* `fused` (one launch, `kernels/mhc_decode.py`): within the bound at T ∈ {1, 3, 17, 64} for one
  split and nine (a partial last one, two split blocks), at Flash width (T = 1, 3, one Sinkhorn
  step), counters back to zero after each call and reused, bad counters raise; its sm_90 code;
* `coeff="registers"` (`kernels/mhc_coef.py`, opt-in): within the bound at T ∈ {1, 3, 17, 64}
  after `rows` and `dot`, bit-equal to the `tile` kernel under the interpreter at small H, at
  Flash width (T = 1, 5), a token == alone; its sm_90 code has no barrier, shared memory or
  shuffle after the partial sums; the env choice (default `tile`);
* `auto` (the serving default) runs `mhc_ops.mix_for_tokens`'s kernel per call — bit for bit that
  kernel's output on both sides of MIX_DOT_MIN_TOKENS (lowered for the interpreter) — and the two
  kernels agree within 2 × the bound; the choice logic (env, deterministic pinning) on CPU;
* BF16-typed residual / sublayer output are read like the reference's `.to(fp32)`; R held as BF16 (the
  CUDA path's `TritonMhc.residual_dtype`) gives every op the bits of R held as fp32 — the coefficients
  of each partial-dot kernel (`dot`, `rows`, `fused`, `tc`) and coefficient kernel, the sublayer input
  (also quantised), the collapse, `stream_mean` — and `hc_residual_update` writes R's dtype: the BF16
  R' is the fp32 R' exactly (`out_dtype` overrides); `TritonMhc.streams` builds R⁰ as BF16;
* the runtime's CPU implementation (`mhc_ops.TorchMhc`) equals the reference bit for bit, `mhc_for` raises for other devices;
  the kernels raise for CPU tensors without the interpreter;
* the compiled sm_90 code (built here with Triton's bundled ptxas, no GPU) has no fp32 FMA in
  the stream kernels, IEEE fp32 division / square root and no float64 at all in the coefficient
  kernels, and no register spills.
GPU (`gpu` marker): the same bounds at tiny and Flash widths (hc = 4, H = 4096, T = 1 / 7 / 64),
BF16 R == fp32 R bitwise at Flash width for every partial-dot kernel (T = 1, 300, the `tc` tensor cores),
`fused` at Flash width for T = 1 … 256 (bound, counters back to zero, batch invariance, first call
inside a graph capture), coeff="registers" at Flash width (T = 1 … 256),
batch invariance at T = 64, both partial-dot kernels (`MIX_KERNELS`) at T = 300, `auto` dispatch at Flash
width on both sides of the threshold, whether `dot` and `rows` agree bitwise (printed: the reason
deterministic mode pins one), and CUDA-graph captures (T = 7 and MIX_DOT_MIN_TOKENS, `auto`) + replay == eager, bitwise.

Kernel cases run in a child pytest with TRITON_INTERPRET=1 (the interpreter must be enabled
before triton is first imported); with CUDA they run here, compiled.
"""
from __future__ import annotations

import re


import pytest
import torch

from sglang_dsv41.kernels import mhc as K
from sglang_dsv41.kernels import mhc_decode
from sglang_dsv41.reference import mhc as ref
from sglang_dsv41.reference.ops import bf16
from sglang_dsv41.runtime import mhc_ops
from triton_checks import compile_for_sm90, run_kernel_cases_in_interpreter

KERNEL_HERE = K.INTERPRETED or torch.cuda.is_available()
DEVICE = "cuda" if torch.cuda.is_available() and not K.INTERPRETED else "cpu"
RMS_EPS, HC_EPS = 1e-20, 1e-6
PER_TOKEN = ("R", "y", "pre")   # the case entries with a token axis


class Shaped:
    """A runtime mHC implementation (`mhc_ops.TorchMhc` / `TritonMhc`) in the reference's call shape."""

    def __init__(self, impl) -> None:
        self.impl = impl

    def hc_coefficients(self, *args, **kwargs) -> ref.HcCoefficients:
        co = self.impl.coefficients(*args, **kwargs)
        return ref.HcCoefficients(co.pre, co.post, co.comb)

    def hc_sublayer_input(self, residual, carried_pre, weight, eps):
        return self.impl.sublayer_input(residual, carried_pre, weight, eps)

    def hc_residual_update(self, residual, y, co):
        return self.impl.residual_update(residual, y, co)

    def hc_collapse(self, residual, pre):
        return self.impl.collapse(residual, pre)


KO = Shaped(mhc_ops.TritonMhc(deterministic=True))   # the kernels through the runtime's CUDA implementation (one kernel)


#: the `tc` partial-dot launch's spill ceiling: 4 warps at 64 × 512 spill, and measured faster than the
#: spill-free 8 warps at an 8K prefill (docs/performance.md "Session 34")
TC_STACK_CEILING = 1024


def tc_stack_ok(usage: str) -> bool:
    """The sm_90 build's stack (spills) within TC_STACK_CEILING bytes a thread."""
    return int(re.search(r"STACK:(\d+)", usage).group(1)) <= TC_STACK_CEILING


def hc_case(T: int, hc: int, H: int, seed: int, device: str = DEVICE) -> dict:
    """Residual of BF16 values, F ~ N(0, 1/(hc·H)), base, scale, norm weight, sublayer output, a carried pre."""
    g = torch.Generator().manual_seed(seed)
    rows = hc * (2 + hc)
    case = dict(
        R=bf16(torch.randn(T, hc, H, generator=g) * 2.0 ** torch.randint(-2, 3, (T, 1, 1), generator=g)),
        fn=torch.randn(rows, hc * H, generator=g) / (hc * H) ** 0.5,
        base=0.5 * torch.randn(rows, generator=g),
        scale=0.5 + 0.5 * torch.rand(3, generator=g),
        weight=1.0 + 0.1 * torch.randn(H, generator=g),
        y=bf16(torch.randn(T, H, generator=g)),
        pre=torch.sigmoid(torch.randn(T, hc, generator=g)) + HC_EPS,
    )
    return {k: v.to(device) for k, v in case.items()}


def invariance_case(T: int, hc: int, H: int, seed: int) -> dict:
    """`hc_case` for a bitwise batch-invariance check. Compiled, the random case: the kernel's own sums
    decide. Under the interpreter `tl.dot` is numpy's matmul, whose summation order is the host BLAS's and
    depends on the shape (OpenBLAS Haswell: a one-row product goes to sgemv, a tile to sgemm), so R and F
    take grid values whose products and partial sums are exact in fp32 (docs/validation.md "Host-independent
    tests"): R = integer in [−8, 8] · 2^e per token (e in [−2, 2], BF16-exact), F = integer in [−8, 8] · 2⁻⁷.
    Products are multiples of 2⁻⁹ of magnitude ≤ 2, so a sum over hc·H ≤ 4,096 terms needs ≤ 22 bits; the
    squares for the RMS are multiples of 2⁻⁴ ≤ 1,024 (≤ 24 bits up to hc·H = 1,024)."""
    c = hc_case(T, hc, H, seed)
    if not K.INTERPRETED:
        return c
    if hc * H > 1024:
        raise ValueError(f"invariance_case: hc·H = {hc * H} > 1024 breaks the exact-sum grid")
    g = torch.Generator().manual_seed(seed + 1)
    R = torch.randint(-8, 9, (T, hc, H), generator=g) * 2.0 ** torch.randint(-2, 3, (T, 1, 1), generator=g)
    fn = torch.randint(-8, 9, tuple(c["fn"].shape), generator=g) * 2.0 ** -7
    return {**c, "R": R.float().to(c["R"].device), "fn": fn.float().to(c["fn"].device)}


def test_invariance_case_sums_are_exact_in_any_order() -> None:
    """The grid of `invariance_case` (built here whatever the mode): every dot of R and F and every sum of
    squares is the same in fp32 summed forwards, backwards and pairwise as in float64."""
    g = torch.Generator().manual_seed(0)
    R = torch.randint(-8, 9, (6, 4 * 96), generator=g) * 2.0 ** torch.randint(-2, 3, (6, 1), generator=g)
    F = torch.randint(-8, 9, (24, 4 * 96), generator=g) * 2.0 ** -7
    exact = R.double() @ F.double().T
    prods = (R[:, None, :] * F[None, :, :]).float()
    assert torch.equal(prods.cumsum(-1)[..., -1].double(), exact)
    assert torch.equal(prods.flip(-1).cumsum(-1)[..., -1].double(), exact)
    assert torch.equal(prods.reshape(6, 24, -1, 2).sum(-1).sum(-1).double(), exact)
    squares = (R * R).float()
    assert torch.equal(squares.cumsum(-1)[:, -1].double(), (R.double() ** 2).sum(-1))


def coefficients(impl, c: dict, iters: int = 20) -> ref.HcCoefficients:
    return impl.hc_coefficients(c["R"], c["fn"], c["base"], c["scale"], rms_eps=RMS_EPS, hc_eps=HC_EPS,
                                sinkhorn_iters=iters)


def reference_coefficients(c: dict, iters: int = 20) -> ref.HcCoefficients:
    return coefficients(ref, {k: v.cpu() for k, v in c.items()}, iters)


def assert_coefficients_close(got: ref.HcCoefficients, want: ref.HcCoefficients) -> None:
    for name in ("pre", "post", "comb"):
        g, w = getattr(got, name).cpu(), getattr(want, name).cpu()
        assert g.dtype == w.dtype == torch.float32 and g.shape == w.shape
        assert bool(((g - w).abs() <= K.COEFFICIENT_BOUND).all()), (name, float((g - w).abs().max()))


def assert_within_one_bf16_ulp(got: torch.Tensor, want: torch.Tensor) -> None:
    """Every element the reference's or its BF16 neighbour; at most 1 % differ."""
    got, want = got.cpu(), want.cpu()
    _, e = torch.frexp(want.abs().clamp(min=2.0 ** -126))
    ulp = torch.ldexp(torch.ones_like(want), e - 8)
    assert bool(((got - want).abs() <= ulp).all()), float((got - want).abs().max())
    assert int((got != want).sum()) <= 0.01 * want.numel() + 1, int((got != want).sum())


def all_ops(impl, c: dict, co: ref.HcCoefficients) -> dict[str, torch.Tensor]:
    """Every op's output on case c (coefficients `co` for the update)."""
    mine = coefficients(impl, c)
    return dict(
        coeff_pre=mine.pre, coeff_post=mine.post, coeff_comb=mine.comb,
        x_in=impl.hc_sublayer_input(c["R"], c["pre"], c["weight"], RMS_EPS),
        x_in_first=impl.hc_sublayer_input(c["R"], None, c["weight"], RMS_EPS),
        update=impl.hc_residual_update(c["R"], c["y"], co),
        collapse=impl.hc_collapse(c["R"], c["pre"]))


def check_against_reference(c: dict, iters: int = 20) -> None:
    want = reference_coefficients(c, iters)
    assert_coefficients_close(coefficients(KO, c, iters), want)
    cpu = {k: v.cpu() for k, v in c.items()}
    on_dev = ref.HcCoefficients(*(t.to(c["R"].device) for t in (want.pre, want.post, want.comb)))
    for pre in (c["pre"], None):
        got = K.hc_sublayer_input(c["R"], pre, c["weight"], RMS_EPS).cpu()
        expected = ref.hc_sublayer_input(cpu["R"], None if pre is None else cpu["pre"], cpu["weight"], RMS_EPS)
        assert got.dtype == torch.float32
        assert_within_one_bf16_ulp(got, expected)
        held = K.hc_sublayer_input(c["R"], pre, c["weight"], RMS_EPS, out_dtype=torch.bfloat16).cpu()
        assert held.dtype == torch.bfloat16 and torch.equal(held.float(), got)      # BF16_OUT: the same values
    assert torch.equal(KO.hc_residual_update(c["R"], c["y"], on_dev).cpu(), ref.hc_residual_update(cpu["R"], cpu["y"], want))
    assert torch.equal(K.hc_collapse(c["R"], c["pre"]).cpu(), ref.hc_collapse(cpu["R"], cpu["pre"]))


def check_bf16_residual_bits(c: dict, impl: mhc_ops.TritonMhc, coefficient_bits: bool = True) -> None:
    """R held as BF16 gives every stream op the bits of R held as fp32, and `impl`'s coefficients those bits too —
    or, with `coefficient_bits` False, coefficients within 2 × COEFFICIENT_BOUND of them; the residual update's
    BF16 R' is the fp32 R' cast (exact: BF16 values)."""
    R16 = c["R"].to(torch.bfloat16)
    want, got = coefficients(Shaped(impl), c), coefficients(Shaped(impl), dict(c, R=R16))
    for name in ("pre", "post", "comb"):
        a, b = getattr(got, name), getattr(want, name)
        if coefficient_bits:
            assert torch.equal(a, b), (impl.mix, impl.coeff, name)
        else:
            assert float((a - b).abs().max()) <= 2 * K.COEFFICIENT_BOUND, (impl.mix, impl.coeff, name)
    co = mhc_ops.HcCoefficients(want.pre, want.post, want.comb)
    for pre in (c["pre"], None):
        assert torch.equal(impl.sublayer_input(R16, pre, c["weight"], RMS_EPS),
                           impl.sublayer_input(c["R"], pre, c["weight"], RMS_EPS))
    pair16, pair32 = (impl.sublayer_inputs(r, c["pre"], c["weight"], RMS_EPS) for r in (R16, c["R"]))
    assert all(torch.equal(a, b) for a, b in zip(pair16, pair32))
    update16, update32 = impl.residual_update(R16, c["y"], co), impl.residual_update(c["R"], c["y"], co)
    assert update16.dtype == torch.bfloat16 and update32.dtype == torch.float32
    assert torch.equal(update16, update32.to(torch.bfloat16)) and torch.equal(update16.float(), update32)
    assert torch.equal(impl.collapse(R16, c["pre"]), impl.collapse(c["R"], c["pre"]))


def check_batch_invariance(c: dict, rows: list[int]) -> None:
    co = reference_coefficients(c)
    co = ref.HcCoefficients(*(t.to(c["R"].device) for t in (co.pre, co.post, co.comb)))
    batch = all_ops(KO, c, co)
    for t in rows:
        alone = {k: v[t:t + 1] if k in PER_TOKEN else v for k, v in c.items()}
        single = all_ops(KO, alone, ref.HcCoefficients(co.pre[t:t + 1], co.post[t:t + 1], co.comb[t:t + 1]))
        for name, out in single.items():
            assert torch.equal(out, batch[name][t:t + 1]), (name, t)


# ---- kernel cases (interpreter child, or CUDA) ----------------------------------------------

if KERNEL_HERE:

    @pytest.mark.parametrize("T", [1, 3, 5, 20])
    @pytest.mark.parametrize("H", [64, 96])
    def test_kernel_case_matches_reference(T: int, H: int) -> None:
        check_against_reference(hc_case(T, 4, H, seed=10 * T + H))

    def test_kernel_case_single_sinkhorn_step() -> None:
        check_against_reference(hc_case(3, 4, 64, seed=7), iters=1)

    def test_kernel_case_coefficient_bound_can_fail() -> None:
        c = hc_case(5, 4, 96, seed=4)
        want = reference_coefficients(c)
        assert_coefficients_close(coefficients(KO, c), want)
        bad = coefficients(KO, dict(c, scale=c["scale"] * 1.001))
        assert not all(bool(((getattr(bad, n).cpu() - getattr(want, n)).abs() <= K.COEFFICIENT_BOUND).all())
                       for n in ("pre", "post", "comb"))

    def test_kernel_case_batch_invariant() -> None:
        check_batch_invariance(invariance_case(20, 4, 96, seed=3), rows=[0, 7, 16, 19])

    @pytest.mark.parametrize("mix", K.MIX_KERNELS)
    def test_kernel_case_mix_kernels_within_bound_and_batch_invariant(mix: str) -> None:
        """Each partial-dot kernel: coefficients within the bound past one 32-token tile (T = 40),
        and a token's coefficients == the token alone, bitwise, at tile edges."""
        c = invariance_case(40, 4, 96, seed=21)
        impl = Shaped(mhc_ops.TritonMhc(mix))
        got = coefficients(impl, c)
        assert_coefficients_close(got, reference_coefficients(c))
        for t in (0, 15, 16, 31, 32, 39):
            alone = coefficients(impl, {k: v[t:t + 1] if k in PER_TOKEN else v for k, v in c.items()})
            for name in ("pre", "post", "comb"):
                assert torch.equal(getattr(alone, name), getattr(got, name)[t:t + 1]), (mix, name, t)

    def test_kernel_case_tc_split_is_exact_to_single_precision() -> None:
        """`tc` splits F into three BF16 parts summing to F exactly: under the interpreter (fp32
        accumulation, round to nearest) its coefficients stay within 2⁻¹⁹ of the reference (measured
        2⁻²³; without the third part 2⁻¹⁶·⁸, so a lost part fails). Compiled, Hopper's MMA truncates
        while it accumulates, so the check there is 2⁻¹⁶ (the contract's bound is 2⁻¹⁴)."""
        c = hc_case(5, 4, 4096, seed=23)
        got = coefficients(Shaped(mhc_ops.TritonMhc("tc")), c)
        want = reference_coefficients(c)
        limit = 2.0 ** (-19 if K.INTERPRETED else -16)
        for name in ("pre", "post", "comb"):
            err = float((getattr(got, name).cpu() - getattr(want, name)).abs().max())
            assert err <= limit, (name, err)

    def test_kernel_case_auto_runs_the_kernel_of_the_token_count(monkeypatch) -> None:
        """`auto` at T = 1, 8, 20 and 40 with the thresholds lowered to 8 (`fused`) and 32 (`tc`):
        each call == the kernel `mix_for_tokens` names, bitwise (1, 8: `fused`; 20: `rows`; 40:
        `tc`); the kernels within 2 × the bound of each other."""
        monkeypatch.setattr(mhc_ops, "MIX_DOT_MIN_TOKENS", 32)
        monkeypatch.setattr(mhc_ops, "FUSED_MAX_TOKENS", 8)
        c = hc_case(40, 4, 96, seed=22)
        auto = Shaped(mhc_ops.TritonMhc("auto"))
        kernels = {m: Shaped(mhc_ops.TritonMhc(m)) for m in K.MIX_KERNELS}
        assert [mhc_ops.mix_for_tokens(T) for T in (1, 8, 9, 20, 31, 32, 40)] == ["fused", "fused", "rows", "rows",
                                                                                   "rows", "tc", "tc"]
        for T in (1, 8, 20, 40):
            part = {k: v[:T] if k in PER_TOKEN else v for k, v in c.items()}
            got = coefficients(auto, part)
            want = coefficients(kernels[mhc_ops.mix_for_tokens(T)], part)
            for name in ("pre", "post", "comb"):
                assert torch.equal(getattr(got, name), getattr(want, name)), (T, name)
        dot, rows, fused, tc = (coefficients(kernels[m], c) for m in ("dot", "rows", "fused", "tc"))
        for name in ("pre", "post", "comb"):
            for other in (rows, fused, tc):
                assert float((getattr(dot, name) - getattr(other, name)).abs().max()) <= 2 * K.COEFFICIENT_BOUND, name

    @pytest.mark.parametrize("T", [1, 3, 17, 64])
    @pytest.mark.parametrize("H", [64, 1040])
    def test_kernel_case_fused_matches_reference(T: int, H: int) -> None:
        """`fused` (one launch): within the bound at T across token blocks of FUSED_BLOCK_T (17, 64)
        and widths of one split (H = 64) and of 9 splits, the last partial, over two split blocks
        (H = 1040: hc·H = 4160); the counters (shared by the calls) are zero after every call."""
        c = hc_case(T, 4, H, seed=31 * T + H)
        counters = mhc_decode.fused_counters(64, DEVICE)
        got = K.hc_coefficients(c["R"], c["fn"], c["base"], c["scale"], rms_eps=RMS_EPS, hc_eps=HC_EPS,
                                sinkhorn_iters=20, mix="fused", counters=counters)
        assert_coefficients_close(ref.HcCoefficients(*got), reference_coefficients(c))
        assert int(counters.abs().sum()) == 0
        again = K.hc_coefficients(c["R"], c["fn"], c["base"], c["scale"], rms_eps=RMS_EPS, hc_eps=HC_EPS,
                                  sinkhorn_iters=20, mix="fused", counters=counters)
        assert all(torch.equal(a, b) for a, b in zip(got, again)) and int(counters.abs().sum()) == 0

    def test_kernel_case_fused_at_flash_width() -> None:
        """`fused` at Flash width (hc = 4, H = 4096: 32 splits), T = 1 (decode) and T = 3 through
        the runtime (SGLANG_DSV41_MHC_MIX=fused, persistent counters): within the bound, counters zero
        after, a token == the token alone, bitwise; one Sinkhorn step too."""
        c = hc_case(3, 4, 4096, seed=41)
        impl = mhc_ops.TritonMhc("fused")
        assert impl.mix_for(3) == impl.mix_for(1) == "fused"
        assert impl.counters_for(256, torch.device(DEVICE)) is not None      # decode graph sizes: no per-call buffer
        got = coefficients(Shaped(impl), c)
        assert_coefficients_close(got, reference_coefficients(c))
        counters = impl.counters_for(1, torch.device(DEVICE))
        assert counters is not None and counters.numel() >= 1 and int(counters.abs().sum()) == 0
        alone = coefficients(Shaped(impl), {k: v[2:3] if k in PER_TOKEN else v for k, v in c.items()})
        assert all(torch.equal(getattr(alone, n), getattr(got, n)[2:3]) for n in ("pre", "post", "comb"))
        one = {k: v[:1] if k in PER_TOKEN else v for k, v in c.items()}
        assert_coefficients_close(coefficients(Shaped(impl), one, iters=1), reference_coefficients(one, iters=1))
        assert int(counters.abs().sum()) == 0

    @pytest.mark.parametrize("T", [1, 3, 17, 64])
    @pytest.mark.parametrize("mix", ["rows", "dot"])
    def test_kernel_case_register_coefficients(T: int, mix: str) -> None:
        """coeff="registers" after each partial-dot kernel (small H, two chunks): within the bound,
        a token == the token alone, bitwise; under the interpreter bit-equal to the `tile` kernel
        (same operations; ≤ 8 chunk partials are summed in the same order)."""
        c = invariance_case(T, 4, 64, seed=70 + T)
        regs = coefficients(Shaped(mhc_ops.TritonMhc(mix, coeff="registers")), c)
        assert_coefficients_close(regs, reference_coefficients(c))
        alone = coefficients(Shaped(mhc_ops.TritonMhc(mix, coeff="registers")),
                             {k: v[T - 1:] if k in PER_TOKEN else v for k, v in c.items()})
        assert all(torch.equal(getattr(alone, n), getattr(regs, n)[T - 1:]) for n in ("pre", "post", "comb"))
        tile = coefficients(Shaped(mhc_ops.TritonMhc(mix, coeff="tile")), c)
        for n in ("pre", "post", "comb"):
            diff = float((getattr(regs, n) - getattr(tile, n)).abs().max())
            assert torch.equal(getattr(regs, n), getattr(tile, n)) if K.INTERPRETED else diff <= 2 * K.COEFFICIENT_BOUND

    def test_kernel_case_register_coefficients_at_flash_width() -> None:
        """coeff="registers" at Flash width (128 chunks, 4 chunk blocks), T = 1 and 5 (two token
        blocks): within the bound, a token == alone, one Sinkhorn step too; hc ≠ 4 and unknown
        values raise."""
        c = hc_case(5, 4, 4096, seed=71)
        impl = Shaped(mhc_ops.TritonMhc("rows", coeff="registers"))
        got = coefficients(impl, c)
        assert_coefficients_close(got, reference_coefficients(c))
        one = {k: v[4:] if k in PER_TOKEN else v for k, v in c.items()}
        alone = coefficients(impl, one)
        assert all(torch.equal(getattr(alone, n), getattr(got, n)[4:]) for n in ("pre", "post", "comb"))
        assert_coefficients_close(coefficients(impl, one, iters=1), reference_coefficients(one, iters=1))
        small = hc_case(1, 2, 64, seed=72)
        with pytest.raises(ValueError, match="hc_mult = 4"):
            K.hc_coefficients(small["R"], small["fn"], small["base"], small["scale"], rms_eps=RMS_EPS, hc_eps=HC_EPS,
                              sinkhorn_iters=20, mix="rows", coeff="registers")
        with pytest.raises(ValueError, match="coeff must be one of"):
            K.hc_coefficients(c["R"], c["fn"], c["base"], c["scale"], rms_eps=RMS_EPS, hc_eps=HC_EPS,
                              sinkhorn_iters=20, coeff="lanes")

    def test_kernel_case_fused_counters_checked() -> None:
        c = hc_case(17, 4, 64, seed=42)
        with pytest.raises(ValueError, match="counters must be"):
            K.hc_coefficients(c["R"], c["fn"], c["base"], c["scale"], rms_eps=RMS_EPS, hc_eps=HC_EPS,
                              sinkhorn_iters=20, mix="fused", counters=mhc_decode.fused_counters(1, DEVICE))

    def test_kernel_case_deterministic_batch_invariant_across_the_threshold(monkeypatch) -> None:
        """Deterministic mode (one kernel) with the threshold lowered to 8: rows of T = 20 (what
        `auto` would run with `rows`) == the rows alone (what `auto` would run with `dot`), bitwise."""
        monkeypatch.setattr(mhc_ops, "MIX_DOT_MIN_TOKENS", 8)
        det = mhc_ops.TritonMhc(deterministic=True)
        assert det.mix == mhc_ops.DETERMINISTIC_MIX and {det.mix_for(T) for T in (1, 2, 7, 8, 20)} == {det.mix}
        check_batch_invariance(invariance_case(20, 4, 64, seed=23), rows=[0, 5, 19])

    def test_kernel_case_bf16_inputs_read_as_fp32() -> None:
        c = hc_case(3, 4, 64, seed=5)
        co = reference_coefficients(c)
        co_dev = ref.HcCoefficients(*(t.to(DEVICE) for t in (co.pre, co.post, co.comb)))
        R16, y16 = c["R"].to(torch.bfloat16), c["y"].to(torch.bfloat16)
        assert_coefficients_close(KO.hc_coefficients(R16, c["fn"], c["base"], c["scale"], rms_eps=RMS_EPS,
                                                    hc_eps=HC_EPS, sinkhorn_iters=20), co)
        want = KO.hc_residual_update(c["R"], c["y"], co_dev)
        assert torch.equal(K.hc_residual_update(R16, y16, co_dev.post, co_dev.comb, out_dtype=torch.float32), want)
        assert torch.equal(KO.hc_residual_update(R16, y16, co_dev), want.to(torch.bfloat16))      # R's dtype
        assert torch.equal(K.hc_residual_update(c["R"], y16, co_dev.post, co_dev.comb, out_dtype=torch.bfloat16),
                           want.to(torch.bfloat16))
        assert torch.equal(K.hc_sublayer_input(R16, c["pre"], c["weight"], RMS_EPS),
                           K.hc_sublayer_input(c["R"], c["pre"], c["weight"], RMS_EPS))
        with pytest.raises(ValueError, match="out_dtype"):
            K.hc_residual_update(c["R"], c["y"], co_dev.post, co_dev.comb, out_dtype=torch.float16)
        with pytest.raises(TypeError, match="float32 or bfloat16"):
            K.hc_collapse(c["R"].half(), c["pre"])

    @pytest.mark.parametrize("mix,coeff", [("dot", "tile"), ("rows", "tile"), ("fused", "tile"), ("tc", "tile"),
                                           ("dot", "registers"), ("rows", "registers")])
    def test_kernel_case_bf16_residual_gives_the_fp32_bits(mix: str, coeff: str) -> None:
        """Each partial-dot and coefficient kernel, and every stream op, on R held as BF16 == on R held
        as fp32, bitwise (T = 40: past a 32-token tile; H = 1056: nine 512-column slices, a partial one)."""
        check_bf16_residual_bits(hc_case(40, 4, 1056 if mix in ("fused", "tc") else 96, seed=24),
                                 mhc_ops.TritonMhc(mix, coeff=coeff))

    def test_kernel_case_serving_streams_are_bf16() -> None:
        """`TritonMhc` holds R as BF16 (`TorchMhc`: fp32): R⁰ = the embedding rows on every stream, exactly;
        `stream_mean` (the DSpark feature) has the same bits from either dtype."""
        c = hc_case(5, 4, 64, seed=25)
        rows = c["R"][:, 0]
        impl, cpu = mhc_ops.TritonMhc(), mhc_ops.mhc_for(torch.device("cpu"))
        assert impl.residual_dtype == torch.bfloat16
        assert cpu.residual_dtype == mhc_ops.Fp32TorchMhc.residual_dtype == torch.float32
        R0, R0_cpu = impl.streams(rows, 4), cpu.streams(rows, 4)
        assert R0.dtype == torch.bfloat16 and R0.is_contiguous() and R0_cpu.dtype == torch.float32
        assert R0_cpu.is_contiguous() and torch.equal(R0.float(), R0_cpu) and torch.equal(R0_cpu[:, 2], rows)
        assert torch.equal(mhc_ops.stream_mean(c["R"].to(torch.bfloat16)), mhc_ops.stream_mean(c["R"]))

    def test_kernel_case_sublayer_input_with_its_quantised_copy() -> None:
        """`quantised=True`: the same x_in (fp32 or BF16 out) and, from the same launch, its values quantised
        per 1×32 — bit for bit what `fake_quantize_activations_bf16` makes of x_in (the FP8 hand-off);
        `TritonMhc.sublayer_inputs` is that launch with BF16 x_in."""
        from sglang_dsv41.kernels.fp8_quant import fake_quantize_activations_bf16

        c = hc_case(3, 4, 96, seed=6)
        for pre in (c["pre"], None):
            for out_dtype in (torch.float32, torch.bfloat16):
                plain = K.hc_sublayer_input(c["R"], pre, c["weight"], RMS_EPS, out_dtype=out_dtype)
                x, q = K.hc_sublayer_input(c["R"], pre, c["weight"], RMS_EPS, out_dtype=out_dtype, quantised=True)
                assert torch.equal(x, plain) and q.dtype == torch.bfloat16
                assert torch.equal(q, fake_quantize_activations_bf16(plain)) and not torch.equal(q.float(), x.float())
        pair = mhc_ops.TritonMhc().sublayer_inputs(c["R"], c["pre"], c["weight"], RMS_EPS)
        assert torch.equal(pair[0], K.hc_sublayer_input(c["R"], c["pre"], c["weight"], RMS_EPS,
                                                        out_dtype=torch.bfloat16))
        with pytest.raises(ValueError, match="32-column"):
            K.hc_sublayer_input(c["R"][..., :80], None, c["weight"][:80], RMS_EPS, quantised=True)

    def test_kernel_case_empty_batch_and_bad_shapes() -> None:
        c = hc_case(2, 4, 64, seed=1)
        empty = {k: v[:0] if k in PER_TOKEN else v for k, v in c.items()}
        assert coefficients(KO, empty).comb.shape == (0, 4, 4)
        assert K.hc_sublayer_input(empty["R"], None, c["weight"], RMS_EPS).shape == (0, 64)
        with pytest.raises(ValueError, match="out_dtype"):
            K.hc_sublayer_input(c["R"], None, c["weight"], RMS_EPS, out_dtype=torch.float16)
        with pytest.raises(ValueError, match="fn has shape"):
            KO.hc_coefficients(c["R"], c["fn"][:, :-1], c["base"], c["scale"], rms_eps=RMS_EPS, hc_eps=HC_EPS,
                              sinkhorn_iters=20)
        with pytest.raises(ValueError, match="at least one iteration"):
            coefficients(KO, c, iters=0)
        with pytest.raises(ValueError, match="power of two"):
            K.hc_collapse(c["R"][:, :3], c["pre"][:, :3])


# ---- the interpreter child, dispatch, compiled code -------------------------------------------

if not K.INTERPRETED:

    def test_kernel_cases_in_triton_interpreter() -> None:
        """Run this file's kernel cases in a child pytest with TRITON_INTERPRET=1 (CPU)."""
        run_kernel_cases_in_interpreter(__file__, min_passed=47, exact=True)

    def test_cpu_without_interpreter_raises() -> None:
        c = hc_case(1, 4, 64, seed=0, device="cpu")
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
            KO.hc_residual_update(c["R"], c["y"], reference_coefficients(c))

    def test_torch_implementation_equals_the_reference_on_cpu() -> None:
        c = hc_case(3, 4, 64, seed=2, device="cpu")
        co = reference_coefficients(c)
        expected = all_ops(ref, c, co)
        got = all_ops(Shaped(mhc_ops.mhc_for(torch.device("cpu"))), c, co)
        assert isinstance(mhc_ops.mhc_for(torch.device("cpu")), mhc_ops.TorchMhc)
        for name, out in got.items():
            assert torch.equal(out, expected[name]), name

    def test_mix_kernel_choice(monkeypatch) -> None:
        """SGLANG_DSV41_MHC_MIX picks the partial-dot kernel of a TritonMhc: default `auto` (per call:
        `fused` up to FUSED_MAX_TOKENS, `tc` at ≥ MIX_DOT_MIN_TOKENS tokens, `rows` between), DETERMINISTIC_MIX in deterministic
        mode; `dot` / `rows` forced at every T; `auto` with deterministic and an unknown value raise,
        at build and in the kernel wrapper."""
        assert mhc_ops.MIX_CHOICES == ("auto", *K.MIX_KERNELS) and mhc_ops.DETERMINISTIC_MIX in K.MIX_KERNELS
        n = mhc_ops.MIX_DOT_MIN_TOKENS
        assert n > 2
        monkeypatch.delenv(mhc_ops.MHC_MIX_ENV, raising=False)
        auto = mhc_ops.TritonMhc()
        assert auto.mix == "auto" and mhc_ops.mhc_for.__defaults__[-1] is False
        f = mhc_ops.FUSED_MAX_TOKENS
        assert 0 <= f < n - 1
        Ts = (0, 1, 2, 64, 256, n - 1, n, 8192)
        assert [auto.mix_for(T) for T in Ts] == ["fused" if 1 <= T <= f else "tc" if T >= n else "rows" for T in Ts]
        assert auto.mix_for(1) == auto.mix_for(256) == "rows"     # session 21's H200 sweep (docs/performance.md)
        monkeypatch.setattr(mhc_ops, "FUSED_MAX_TOKENS", 8)
        assert [auto.mix_for(T) for T in (0, 1, 8, 9)] == ["rows", "fused", "fused", "rows"]
        monkeypatch.setattr(mhc_ops, "FUSED_MAX_TOKENS", f)
        det = mhc_ops.TritonMhc(deterministic=True)
        assert {det.mix_for(T) for T in (1, 2, 64, n - 1, n, 8192)} == {mhc_ops.DETERMINISTIC_MIX}
        for forced in K.MIX_KERNELS:
            monkeypatch.setenv(mhc_ops.MHC_MIX_ENV, forced)
            for deterministic in (False, True):
                impl = mhc_ops.TritonMhc(deterministic=deterministic)
                assert {impl.mix_for(T) for T in (1, 2, 64, n, 8192)} == {forced}
        assert mhc_ops.TritonMhc("dot").mix == "dot"
        monkeypatch.setenv(mhc_ops.MHC_MIX_ENV, "auto")
        assert mhc_ops.TritonMhc().mix == "auto"
        with pytest.raises(ValueError, match="not batch invariant"):
            mhc_ops.TritonMhc(deterministic=True)
        with pytest.raises(ValueError, match="not batch invariant"):
            mhc_ops.TritonMhc("auto", deterministic=True)
        with pytest.raises(ValueError, match="expected one of"):
            mhc_ops.TritonMhc("tiles")
        monkeypatch.setenv(mhc_ops.MHC_MIX_ENV, "tiles")
        with pytest.raises(ValueError, match="SGLANG_DSV41_MHC_MIX"):
            mhc_ops.TritonMhc()
        c = hc_case(1, 4, 64, seed=0, device="cpu")
        with pytest.raises(ValueError, match="mix must be one of"):
            K.hc_coefficients(c["R"], c["fn"], c["base"], c["scale"], rms_eps=RMS_EPS, hc_eps=HC_EPS,
                              sinkhorn_iters=20, mix="tiles")

    def test_coefficient_kernel_choice(monkeypatch) -> None:
        """SGLANG_DSV41_MHC_COEFF: default `tile` (the current kernel), `registers` opt-in, an
        argument wins, unknown values raise."""
        assert mhc_ops.COEFF_CHOICES == K.COEFF_KERNELS and K.COEFF_KERNELS[0] == "tile"
        monkeypatch.delenv(mhc_ops.MHC_COEFF_ENV, raising=False)
        assert mhc_ops.TritonMhc().coeff == mhc_ops.TritonMhc(deterministic=True).coeff == "tile"
        monkeypatch.setenv(mhc_ops.MHC_COEFF_ENV, "registers")
        assert mhc_ops.TritonMhc().coeff == "registers" and mhc_ops.TritonMhc(coeff="tile").coeff == "tile"
        with pytest.raises(ValueError, match="expected one of"):
            mhc_ops.TritonMhc(coeff="lanes")
        monkeypatch.setenv(mhc_ops.MHC_COEFF_ENV, "lanes")
        with pytest.raises(ValueError, match="SGLANG_DSV41_MHC_COEFF"):
            mhc_ops.TritonMhc()

    def test_other_devices_raise() -> None:
        with pytest.raises(ValueError, match="no mHC implementation"):
            mhc_ops.mhc_for(torch.device("meta"))

    def _compiled(kernel, constexprs: dict, fp64_ptrs: tuple[str, ...] = (), num_warps: int = 4,
                  bf16_ptrs: tuple[str, ...] = ()) -> tuple[str, str]:
        """PTX and `cuobjdump -res-usage` of `kernel` built for sm_90 with the wrappers' options."""
        sig = {n: "constexpr" if n in constexprs else ("*fp64" if n in fp64_ptrs else "*bf16" if n in bf16_ptrs
                                                       else "*fp32") if n.endswith("_ptr") else "i32"
               for n in kernel.arg_names}
        compiled, usage = compile_for_sm90(kernel, sig, constexprs, {"num_warps": num_warps, **K._launch_options()})
        return compiled.asm["ptx"], usage + " "

    def test_compiled_sm90_code_has_the_reference_rounding() -> None:
        stream = [(K._hc_residual_update_kernel, dict(HC=4, BLOCK=K.STREAM_BLOCK_H)),
                  (K._hc_weighted_sum_kernel, dict(HC=4, BLOCK=K.STREAM_BLOCK_H)),
                  (K._hc_sublayer_input_kernel, dict(HC=4, HAS_PRE=True, BLOCK=4096, RMS_EPS=RMS_EPS, QUANT=False,
                                                     INTERPRET=False))]
        for kernel, consts in stream:
            ptx, usage = _compiled(kernel, consts)
            assert "mul.rn.f32" in ptx and "add.rn.f32" in ptx and "fma.rn.f32" not in ptx, kernel
            assert "STACK:0 " in usage and "LOCAL:0 " in usage, usage
        for block, warps in ((K.COEFF_CHUNKS_BLOCK, K.COEFF_NUM_WARPS), (256, 4)):     # `dot`, `rows` at Flash
            ptx, usage = _compiled(K._hc_coefficients_kernel, dict(HC=4, SLOT=32, CHUNKS_BLOCK=block, RMS_EPS=RMS_EPS,
                                                                   HC_EPS=HC_EPS), num_warps=warps)
            assert "sqrt.rn.f32" in ptx and "div.rn.f32" in ptx and "div.full" not in ptx and "sqrt.approx" not in ptx
            assert ".f64" not in ptx                                 # no float64 on the GPU path (issue 21)
            assert "STACK:0 " in usage and "LOCAL:0 " in usage, usage
        ptx, usage = _compiled(K._hc_mix_partials_kernel, dict(ROWS=24, ROWS_PAD=32, SLOT=32, BLOCK_K=K.MIX_BLOCK_K,
                                                               BLOCK_T=K.MIX_BLOCK_T))
        assert ".f64" not in ptx and "STACK:0 " in usage and "LOCAL:0 " in usage, usage
        ptx, usage = _compiled(K._hc_mix_dot_kernel, dict(ROWS=24, ROWS_PAD=32, SLOT=32, BLOCK_K=K.MIX_BLOCK_K,
                                                          BLOCK_T=K.MIX_DOT_BLOCK_T, SUB_K=K.MIX_DOT_SUB_K,
                                                          SPLIT3=False, INTERPRET=False))
        assert ".f64" not in ptx and "STACK:0 " in usage and "LOCAL:0 " in usage, usage
        assert "fma.rn.f32" in ptx and "tf32" not in ptx and "mma" not in ptx     # the fp32 dot on FMA, not TF32 MMA
        ptx, usage = _compiled(K._hc_mix_dot_kernel, dict(ROWS=24, ROWS_PAD=32, SLOT=32, BLOCK_K=K.MIX_TC_BLOCK_K,
                                                          BLOCK_T=K.MIX_TC_BLOCK_T, SUB_K=K.MIX_TC_SUB_K,
                                                          SPLIT3=True, INTERPRET=False), num_warps=K.MIX_TC_NUM_WARPS)
        assert ".f64" not in ptx and tc_stack_ok(usage) and "LOCAL:0 " in usage, usage    # `tc`
        assert "bf16" in ptx and "mma" in ptx and "tf32" not in ptx               # BF16 tensor-core products
        ptx, _ = _compiled(K._hc_sublayer_input_kernel, dict(HC=4, HAS_PRE=True, BLOCK=4096, RMS_EPS=RMS_EPS,
                                                             QUANT=False, INTERPRET=False))
        assert ".f64" not in ptx and "sqrt.rn.f32" in ptx and "e4m3" not in ptx
        ptx, usage = _compiled(K._hc_sublayer_input_kernel, dict(HC=4, HAS_PRE=True, BLOCK=8192, RMS_EPS=RMS_EPS,
                                                                 QUANT=True, INTERPRET=False), num_warps=16)
        assert "cvt.rn.satfinite.e4m3x2.f32" in ptx and ".f64" not in ptx     # Flash's quantised copy, hardware RNE
        assert "STACK:0 " in usage and "LOCAL:0 " in usage, usage

    def test_compiled_sm90_code_with_a_bf16_residual() -> None:
        """R as BF16 (`TritonMhc.residual_dtype`): the stream kernels still have no fp32 FMA and no spills,
        the residual update stores BF16 (no fp32 store), the mix kernels build without spills and `tc`
        feeds the loaded BF16 R to its MMA without a round trip through fp32."""
        stream = [(K._hc_residual_update_kernel, dict(HC=4, BLOCK=K.STREAM_BLOCK_H), ("r_ptr", "out_ptr")),
                  (K._hc_weighted_sum_kernel, dict(HC=4, BLOCK=K.STREAM_BLOCK_H), ("r_ptr",)),
                  (K._hc_sublayer_input_kernel, dict(HC=4, HAS_PRE=True, BLOCK=4096, RMS_EPS=RMS_EPS, QUANT=False,
                                                     INTERPRET=False), ("r_ptr",))]
        for kernel, consts, bf16_ptrs in stream:
            ptx, usage = _compiled(kernel, consts, bf16_ptrs=bf16_ptrs)
            assert "mul.rn.f32" in ptx and "add.rn.f32" in ptx and "fma.rn.f32" not in ptx, kernel
            assert "STACK:0 " in usage and "LOCAL:0 " in usage, usage
            if kernel is K._hc_residual_update_kernel:
                assert "st.global.b32" not in ptx and "st.global.v4.b32" not in ptx, "R' stored as fp32"
        ptx, usage = _compiled(K._hc_mix_partials_kernel, dict(ROWS=24, ROWS_PAD=32, SLOT=32, BLOCK_K=K.MIX_BLOCK_K,
                                                               BLOCK_T=K.MIX_BLOCK_T), bf16_ptrs=("x_ptr",))
        assert "STACK:0 " in usage and "LOCAL:0 " in usage, usage
        for block_k, block_t, sub_k, warps, split3 in K.DOT_LAUNCHES.values():
            ptx, usage = _compiled(K._hc_mix_dot_kernel, dict(ROWS=24, ROWS_PAD=32, SLOT=32, BLOCK_K=block_k,
                                                              BLOCK_T=block_t, SUB_K=sub_k, SPLIT3=split3,
                                                              INTERPRET=False), num_warps=warps, bf16_ptrs=("x_ptr",))
            assert (tc_stack_ok(usage) if split3 else "STACK:0 " in usage) and "LOCAL:0 " in usage, usage
            if split3:
                assert "mma" in ptx and "cvt.rn.bf16x2.f32" not in ptx    # x not packed from fp32 (fp32 R: it is)
        kernel = mhc_decode._hc_fused_coefficients_kernel
        consts = dict(HC=4, ROWS_PAD=32, SLOT=32, SPLITS=32, SPLITS_BLOCK=mhc_decode.FUSED_SPLITS_BLOCK,
                      SPLIT_K=mhc_decode.FUSED_SPLIT_K, SUB_K=mhc_decode.FUSED_SUB_K, BLOCK_T=mhc_decode.FUSED_BLOCK_T,
                      RMS_EPS=RMS_EPS, HC_EPS=HC_EPS)
        sig = {n: "constexpr" if n in consts else ("*i32" if n == "cnt_ptr" else "*bf16" if n == "x_ptr" else "*fp32")
               if n.endswith("_ptr") else "i32" for n in kernel.arg_names}
        _, usage = compile_for_sm90(kernel, sig, consts, {"num_warps": mhc_decode.FUSED_NUM_WARPS, **K._launch_options()})
        assert "STACK:0 " in usage + " " and "LOCAL:0 " in usage + " ", usage

    def test_compiled_sm90_fused_kernel() -> None:
        """`fused` at Flash width: fp32 FMA dot (no TF32 / MMA), IEEE division and square root, no
        float64, no spills; one acq_rel arrival ticket and one reset, the Sinkhorn loop in warp
        shuffles (no barrier between its `div.rn`s)."""
        kernel = mhc_decode._hc_fused_coefficients_kernel
        consts = dict(HC=4, ROWS_PAD=32, SLOT=32, SPLITS=32, SPLITS_BLOCK=mhc_decode.FUSED_SPLITS_BLOCK,
                      SPLIT_K=mhc_decode.FUSED_SPLIT_K, SUB_K=mhc_decode.FUSED_SUB_K, BLOCK_T=mhc_decode.FUSED_BLOCK_T,
                      RMS_EPS=RMS_EPS, HC_EPS=HC_EPS)
        sig = {n: "constexpr" if n in consts else ("*i32" if n == "cnt_ptr" else "*fp32") if n.endswith("_ptr")
               else "i32" for n in kernel.arg_names}
        compiled, usage = compile_for_sm90(kernel, sig, consts, {"num_warps": mhc_decode.FUSED_NUM_WARPS,
                                                                 **K._launch_options()})
        ptx = compiled.asm["ptx"]
        assert "STACK:0 " in usage + " " and "LOCAL:0 " in usage + " ", usage
        assert ".f64" not in ptx and "tf32" not in ptx and "mma" not in ptx and "fma.rn.f32" in ptx
        assert "sqrt.rn.f32" in ptx and "div.rn.f32" in ptx and "div.full" not in ptx and "sqrt.approx" not in ptx
        assert "atom.global.gpu.acq_rel.add" in ptx and "atom.global.gpu.relaxed.exch" in ptx, \
            [line for line in ptx.splitlines() if "atom" in line]
        last_bar = ptx.rindex("bar.sync", 0, ptx.rindex("div.rn.f32"))
        assert ptx.count("div.rn.f32", last_bar) >= 8, "Sinkhorn phases separated by barriers"


    def test_compiled_sm90_register_coefficient_kernel() -> None:
        """coeff="registers" at Flash width: IEEE division and square root, no float64, no spills,
        no barrier / shared memory / shuffle anywhere after the partial sums (the Sinkhorn is per
        lane), where the `tile` kernel's Sinkhorn loop row-sums in shuffles."""
        from sglang_dsv41.kernels import mhc_coef
        consts = dict(SLOT=32, CHUNKS_BLOCK=mhc_coef.REG_CHUNKS_BLOCK, BLOCK_T=mhc_coef.REG_BLOCK_T,
                      RMS_EPS=RMS_EPS, HC_EPS=HC_EPS)
        ptx, usage = _compiled(mhc_coef._hc_coefficients_regs_kernel, consts, num_warps=mhc_coef.REG_NUM_WARPS)
        assert "STACK:0 " in usage and "LOCAL:0 " in usage and "SHARED:0 " in usage, usage
        assert ".f64" not in ptx and "sqrt.rn.f32" in ptx and "div.rn.f32" in ptx and "div.full" not in ptx
        assert "bar.sync" not in ptx and ".shared" not in ptx.replace(".extern .shared", "")
        after_sums = ptx[ptx.index("sqrt.rn.f32"):]
        assert "shfl" not in after_sums and after_sums.count("div.rn.f32") >= 32, "Sinkhorn not per lane"


# ---- GPU ------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 7, 64])
@pytest.mark.parametrize("H", [64, 4096], ids=["tiny", "flash"])
def test_gpu_matches_reference(T: int, H: int) -> None:
    check_against_reference(hc_case(T, 4, H, seed=T + H, device="cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 300])
@pytest.mark.parametrize("mix,coeff", [(m, "tile") for m in K.MIX_KERNELS] + [("rows", "registers")])
def test_gpu_bf16_residual_gives_the_fp32_bits_at_flash_width(T: int, mix: str, coeff: str) -> None:
    """Compiled at Flash width: R held as BF16 == R held as fp32, bitwise, for every stream op and for the `rows`
    coefficients (`tc`: the loaded BF16 R fed to the tensor cores as is). The `dot`, `fused` and `tc` coefficients
    differed in the last bits at T = 300 on an H100 (session 32): within 2 × the bound of each other there."""
    check_bf16_residual_bits(hc_case(T, 4, 4096, seed=90 + T), mhc_ops.TritonMhc(mix, coeff=coeff),
                             coefficient_bits=mix == "rows")


@pytest.mark.gpu
def test_gpu_batch_invariant_at_flash_width() -> None:
    check_batch_invariance(hc_case(64, 4, 4096, seed=11, device="cuda"), rows=[0, 15, 16, 63])


@pytest.mark.gpu
@pytest.mark.parametrize("mix", K.MIX_KERNELS)
def test_gpu_mix_kernels_at_prefill_rows(mix: str) -> None:
    """Each partial-dot kernel at Flash width over several 32-token tiles: within the bound, and
    tokens at tile edges == alone, bitwise."""
    c = hc_case(300, 4, 4096, seed=15, device="cuda")
    impl = Shaped(mhc_ops.TritonMhc(mix))
    got = coefficients(impl, c)
    assert_coefficients_close(got, reference_coefficients(c))
    for t in (0, 31, 32, 299):
        alone = coefficients(impl, {k: v[t:t + 1] if k in PER_TOKEN else v for k, v in c.items()})
        assert all(torch.equal(getattr(alone, n), getattr(got, n)[t:t + 1]) for n in ("pre", "post", "comb")), t


@pytest.mark.gpu
def test_gpu_dispatch_uses_kernels(monkeypatch) -> None:
    """The serving default (`auto`) runs `mix_for_tokens`'s kernel at T = 1, 7 and
    MIX_DOT_MIN_TOKENS (Flash width), bit for bit; deterministic mode runs DETERMINISTIC_MIX."""
    monkeypatch.delenv(mhc_ops.MHC_MIX_ENV, raising=False)
    big = hc_case(mhc_ops.MIX_DOT_MIN_TOKENS, 4, 4096, seed=16, device="cuda")
    runtime = mhc_ops.mhc_for(torch.device("cuda"))
    assert isinstance(runtime, mhc_ops.TritonMhc) and runtime.mix == "auto"
    assert mhc_ops.mhc_for(torch.device("cuda"), deterministic=True).mix == mhc_ops.DETERMINISTIC_MIX
    for T in (1, 7, mhc_ops.MIX_DOT_MIN_TOKENS):
        part = {k: v[:T] if k in PER_TOKEN else v for k, v in big.items()}
        mine = coefficients(Shaped(runtime), part)
        want = coefficients(Shaped(mhc_ops.TritonMhc(mhc_ops.mix_for_tokens(T))), part)
        assert all(torch.equal(getattr(mine, n), getattr(want, n)) for n in ("pre", "post", "comb")), T
    c = hc_case(7, 4, 4096, seed=12, device="cuda")
    co = coefficients(KO, c)
    assert torch.equal(runtime.residual_update(c["R"], c["y"], co), K.hc_residual_update(c["R"], c["y"], co.post,
                                                                                          co.comb))


@pytest.mark.gpu
def test_gpu_dot_and_rows_bitwise_agreement_at_flash_width() -> None:
    """Whether `dot` and `rows` give the same bits (the reason deterministic mode pins one kernel):
    printed; within 2 × the bound of each other either way."""
    c = hc_case(64, 4, 4096, seed=17, device="cuda")
    dot, rows = (coefficients(Shaped(mhc_ops.TritonMhc(m)), c) for m in ("dot", "rows"))
    diff = {n: float((getattr(dot, n) - getattr(rows, n)).abs().max()) for n in ("pre", "post", "comb")}
    differing = sum(int((getattr(dot, n) != getattr(rows, n)).sum()) for n in ("pre", "post", "comb"))
    print(f"[mhc dot vs rows] T = 64 Flash width: max |Δ| {diff}, {differing} coefficients differ bitwise")
    assert max(diff.values()) <= 2 * K.COEFFICIENT_BOUND, diff


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 2, 16, 17, 64, 256])
def test_gpu_fused_matches_reference_at_flash_width(T: int) -> None:
    """`fused` (decode path) at Flash width: within the bound, counters zero after the call, the
    last token == alone, bitwise, and within 2 × the bound of `dot`."""
    c = hc_case(T, 4, 4096, seed=50 + T, device="cuda")
    impl = mhc_ops.TritonMhc("fused")
    got = coefficients(Shaped(impl), c)
    assert_coefficients_close(got, reference_coefficients(c))
    assert int(impl.counters_for(T, torch.device("cuda")).abs().sum()) == 0
    alone = coefficients(Shaped(impl), {k: v[T - 1:] if k in PER_TOKEN else v for k, v in c.items()})
    assert all(torch.equal(getattr(alone, n), getattr(got, n)[T - 1:]) for n in ("pre", "post", "comb"))
    dot = coefficients(Shaped(mhc_ops.TritonMhc("dot")), c)
    assert all(float((getattr(dot, n) - getattr(got, n)).abs().max()) <= 2 * K.COEFFICIENT_BOUND
               for n in ("pre", "post", "comb"))


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 5, 64, 256])
def test_gpu_register_coefficients_at_flash_width(T: int) -> None:
    """coeff="registers" after `rows` at Flash width, compiled: within the bound, the last token ==
    alone, bitwise, and within 2 × the bound of the `tile` kernel (bits printed)."""
    c = hc_case(T, 4, 4096, seed=80 + T, device="cuda")
    impl = Shaped(mhc_ops.TritonMhc("rows", coeff="registers"))
    got = coefficients(impl, c)
    assert_coefficients_close(got, reference_coefficients(c))
    alone = coefficients(impl, {k: v[T - 1:] if k in PER_TOKEN else v for k, v in c.items()})
    assert all(torch.equal(getattr(alone, n), getattr(got, n)[T - 1:]) for n in ("pre", "post", "comb"))
    tile = coefficients(Shaped(mhc_ops.TritonMhc("rows", coeff="tile")), c)
    diff = {n: float((getattr(got, n) - getattr(tile, n)).abs().max()) for n in ("pre", "post", "comb")}
    print(f"[mhc registers vs tile] T = {T}: max |Δ| {diff}")
    assert max(diff.values()) <= 2 * K.COEFFICIENT_BOUND, diff


@pytest.mark.gpu
def test_gpu_fused_captured_without_counters_replays_correctly() -> None:
    """A `TritonMhc` whose first `fused` call is inside a capture (no counters yet: a zeroed buffer
    is allocated in the graph): three replays == eager, bitwise."""
    c = hc_case(5, 4, 4096, seed=60, device="cuda")
    coefficients(Shaped(mhc_ops.TritonMhc("fused")), c)             # compile outside the capture
    impl = Shaped(mhc_ops.TritonMhc("fused"))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = coefficients(impl, c)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    eager = coefficients(impl, c)
    assert all(torch.equal(getattr(captured, n), getattr(eager, n)) for n in ("pre", "post", "comb"))


@pytest.mark.gpu
@pytest.mark.parametrize("T", [7, 300, mhc_ops.MIX_DOT_MIN_TOKENS], ids=["decode_side", "rows_side", "dot_side"])
def test_gpu_cuda_graph_replay_equals_eager(T: int, monkeypatch) -> None:
    """`auto` captured at T (a graph per batch size, as SGLang's) replays == eager, bitwise."""
    monkeypatch.delenv(mhc_ops.MHC_MIX_ENV, raising=False)
    c = hc_case(T, 4, 4096, seed=13, device="cuda")
    fresh = hc_case(T, 4, 4096, seed=14, device="cuda")

    runtime = Shaped(mhc_ops.mhc_for(torch.device("cuda")))

    def step() -> tuple[torch.Tensor, ...]:
        co = coefficients(runtime, c)
        x = runtime.hc_sublayer_input(c["R"], c["pre"], c["weight"], RMS_EPS)
        R2 = runtime.hc_residual_update(c["R"], c["y"], co)
        return co.pre, co.post, co.comb, x, R2, runtime.hc_collapse(R2, co.pre)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for name in ("R", "y", "pre"):
        c[name].copy_(fresh[name])
    graph.replay()
    torch.cuda.synchronize()
    eager = step()
    for got, want in zip(captured, eager):
        assert torch.equal(got, want)
    # the replay read fresh R / y / pre with c's own F, base and scale (not copied): compare with those
    assert_coefficients_close(ref.HcCoefficients(*captured[:3]), reference_coefficients(c))


@pytest.mark.gpu
def test_gpu_sublayer_input_quantised_copy_at_flash_width() -> None:
    """Flash's 5120 columns at 1 and 16 tokens: the quantised copy (hardware E4M3 rounding in the mHC launch)
    equals `fake_quantize_activations_bf16` of x_in, and x_in is the plain launch's."""
    from sglang_dsv41.kernels.fp8_quant import fake_quantize_activations_bf16

    for T in (1, 16):
        c = hc_case(T, 4, 5120, seed=30 + T, device="cuda")
        plain = K.hc_sublayer_input(c["R"], c["pre"], c["weight"], RMS_EPS, out_dtype=torch.bfloat16)
        x, q = K.hc_sublayer_input(c["R"], c["pre"], c["weight"], RMS_EPS, out_dtype=torch.bfloat16, quantised=True)
        assert torch.equal(x, plain) and torch.equal(q, fake_quantize_activations_bf16(plain)), T

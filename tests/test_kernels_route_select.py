"""The router's selection launch (`sglang_dsv41.kernels.route_select`) against `reference.moe.route` (spec §3.6).

What is pinned:
* `route_select`: top-k selection bit for bit (NaN first, ties → lower id, all −inf rows, the vision bias on image
  rows); weights = upstream's gate (fp32(Σ) + fp32(1e-20), the fp32 division) bit for bit on these inputs;
* `route_softplus`: the correctly rounded fp32 sqrt of the softplus, then `route_select`'s bits and the routed scale;
  a scale fp32 cannot hold raises; `route_logits` under the interpreter: torch's softplus first;
* batch invariance: a row of a batch == that row alone, bitwise;
* compiled for sm_90 (no GPU needed): no approximate division / sqrt / exp, no fp32 FMA, no float64; the softplus
  launch keeps libdevice's subnormals;
* GPU (`gpu`): Flash widths against the reference on the GPU, `route_softplus` == torch's sqrt then `route_select`,
  `route_logits` == torch's `F.softplus` then `route_softplus`.

The kernel cases run in a child pytest with TRITON_INTERPRET=1 (`test_kernel_cases_in_triton_interpreter`).
"""
from __future__ import annotations

import re

import pytest
import torch

from sglang_dsv41.kernels import route_select as RS
from sglang_dsv41.reference import moe
from triton_checks import flips_within_bound, run_kernel_cases_in_interpreter, same_bits

KERNEL_HERE = RS.INTERPRETED or torch.cuda.is_available()
DEVICE = "cuda" if torch.cuda.is_available() and not RS.INTERPRETED else "cpu"


# ---- kernel cases (interpreter child, or CUDA) ----------------------------------------------------

if KERNEL_HERE:

    def test_kernel_case_route_select() -> None:
        g = torch.Generator().manual_seed(6)
        scores = torch.tensor([[0.5, 0.25, 0.25, 1.0, float("nan"), 0.0, 3.0, 0.25]] * 4)
        scores[1, 4], scores[2], scores[3] = 0.1, float("-inf"), 0.25
        scores = torch.cat([scores, torch.rand(5, 8, generator=g)])
        bias = torch.zeros(8)
        bias[7] = 0.25
        for k in (1, 2, 5, 8):
            e, w = RS.route_select(scores.to(DEVICE), bias.to(DEVICE), k, moe.RENORM_EPS)
            want_e = moe.topk_lower_id_on_ties(scores + bias, k)
            chosen = scores.gather(-1, want_e)
            # upstream's gate: fp32(Σ) + fp32(1e-20) in fp32, then the fp32 division
            denom = chosen.double().sum(-1, keepdim=True).float() + torch.tensor(moe.RENORM_EPS, dtype=torch.float32)
            want_w = chosen / denom
            assert torch.equal(e.cpu(), want_e) and same_bits(w.cpu(), want_w)
        vl = torch.randn(8, generator=g)
        image = torch.tensor([True, False] * 4 + [True])
        e, _ = RS.route_select(scores.to(DEVICE), bias.to(DEVICE), 3, moe.RENORM_EPS, vl.to(DEVICE), image.to(DEVICE))
        row_bias = torch.where(image[:, None], vl.expand(9, 8), bias.expand(9, 8))
        assert torch.equal(e.cpu(), moe.topk_lower_id_on_ties(scores + row_bias, 3))

    def test_kernel_case_route_softplus() -> None:
        """`route_softplus` == the correctly rounded fp32 sqrt of the softplus (float64 sqrt rounded once,
        what torch's fp32 sqrt gives on CUDA), then `route_select`'s bits on those scores, and
        fp32(weights · 1.5); a scale fp32 cannot hold raises."""
        g = torch.Generator().manual_seed(16)
        soft = torch.cat([torch.rand(6, 40, generator=g) * 4, torch.rand(1, 40, generator=g) * 1e-30,
                          torch.full((1, 40), 20.5), torch.zeros(1, 40)])
        soft[0, 3], soft[1, :] = float("nan"), 2.0 ** torch.arange(-40, 0, dtype=torch.float32)
        bias = torch.randn(40, generator=g) * 0.05
        vl, image = torch.randn(40, generator=g) * 0.05, torch.tensor([False, True] * 4 + [True])
        want_s = soft.double().sqrt().float()
        for extra in ((), (vl, image)):
            d = [t.to(DEVICE) for t in extra]
            s, e, w, scaled = RS.route_softplus(soft.to(DEVICE), bias.to(DEVICE), 6, moe.RENORM_EPS, 1.5, *d)
            want_e, want_w = RS.route_select(want_s.to(DEVICE), bias.to(DEVICE), 6, moe.RENORM_EPS, *d)
            assert same_bits(s.cpu(), want_s) and torch.equal(e.cpu(), want_e.cpu())
            assert same_bits(w.cpu(), want_w.cpu())
            assert same_bits(scaled.cpu(), want_w.cpu() * 1.5)
        with pytest.raises(ValueError, match="fp32"):
            RS.route_softplus(soft.to(DEVICE), bias.to(DEVICE), 6, moe.RENORM_EPS, 0.1)

    def test_kernel_case_route_logits() -> None:
        """`route_logits` under the interpreter: torch's fp32 softplus of the logits, then `route_softplus`."""
        g = torch.Generator().manual_seed(18)
        logits = torch.randn(9, 40, generator=g) * 8
        logits[0, :4] = torch.tensor([-100.0, 25.0, 0.0, float("nan")])
        bias = torch.randn(40, generator=g) * 0.05
        got = RS.route_logits(logits.to(DEVICE), bias.to(DEVICE), 6, moe.RENORM_EPS, 1.5, moe.SOFTPLUS_THRESHOLD)
        soft = torch.nn.functional.softplus(logits, threshold=moe.SOFTPLUS_THRESHOLD)
        want = RS.route_softplus(soft.to(DEVICE), bias.to(DEVICE), 6, moe.RENORM_EPS, 1.5)
        assert all(same_bits(a.cpu(), b.cpu()) for a, b in zip(got, want))

    def test_kernel_case_batch_invariance() -> None:
        g = torch.Generator().manual_seed(7)
        scores, bias = torch.rand(9, 8, generator=g), torch.rand(8, generator=g) * 0.1
        vl, image = torch.rand(8, generator=g) * 0.1, torch.tensor([True, False, True] * 3)
        d = lambda t: t.to(DEVICE)  # noqa: E731
        batch = RS.route_softplus(d(scores), d(bias), 3, 1e-20, 1.5, d(vl), d(image))
        for i in (0, 4, 8):
            alone = RS.route_softplus(d(scores[i:i + 1]), d(bias), 3, 1e-20, 1.5, d(vl), d(image[i:i + 1]))
            assert all(same_bits(b[i:i + 1].cpu(), a.cpu()) for b, a in zip(batch, alone))


# ---- the interpreter child and compile checks (main process) -------------------------------------

ROUTE_SIG = {"score_ptr": "*fp32", "bias_ptr": "*fp32", "vl_bias_ptr": "*fp32", "image_ptr": "*u8",
             "expert_ptr": "*i64", "weight_ptr": "*fp32", "E": "i32", "scores_out_ptr": "*fp32", "scaled_ptr": "*fp32",
             "scale": "fp32"}
ROUTE_CONSTS = {"K": 6, "BLOCK_K": 8, "BLOCK_E": 512, "HAS_VL": True, "RENORM_EPS": 1e-20, "SOFTPLUS": False,
                "THRESHOLD": 20.0}

if not RS.INTERPRETED:

    def test_kernel_cases_in_triton_interpreter() -> None:
        """Run this file's kernel cases in a child pytest with TRITON_INTERPRET=1 (CPU)."""
        run_kernel_cases_in_interpreter(__file__, min_passed=4, exact=True)

    def test_cpu_without_interpreter_raises() -> None:
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
            RS.route_select(torch.zeros(2, 8), torch.zeros(8), 2, 1e-20)

    @pytest.mark.parametrize("consts", [{"SQRT": False, "SCALED": False}, {"SQRT": True, "SCALED": True}],
                             ids=["route", "route_softplus"])
    def test_kernel_compiles_for_hopper_exactly(consts: dict) -> None:
        """sm_90 PTX (Triton's bundled compiler, no GPU): no approximate fp32 division / sqrt / exp, no fp32 FMA, no
        float64 instruction; the renorm add is fp32 (upstream's gate); with SQRT the correctly rounded sqrt."""
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        kern = RS._route_select_kernel
        consts = {**ROUTE_CONSTS, **consts}
        full = {n: ("constexpr" if n in consts else ROUTE_SIG[n]) for n in kern.arg_names}
        ptx = triton.compile(ASTSource(kern, full, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                             options={"num_warps": 4, "enable_fp_fusion": False}).asm["ptx"]
        bad = re.findall(r"\b(div\.full\.f32|div\.approx\.\w+|sqrt\.approx\.\w+|ex2\.approx\.\w+|lg2\.approx\.\w+|"
                         r"rcp\.approx\.ftz\.f32|fma\.rn\.f32)", ptx)
        assert not bad, sorted(set(bad))
        assert not re.findall(r"\.f64\b", ptx)
        assert "0f1E3CE508" in ptx                        # fp32(1e-20): the renorm add is fp32, as upstream's
        if consts["SQRT"]:
            assert "sqrt.rn.f32" in ptx                   # the correctly rounded sqrt (torch's fp32 sqrt on CUDA)

    def test_route_logits_compiles_with_libdevice_unflushed() -> None:
        """sm_90 PTX of the fused softplus route (`route_logits`'s launch options): libdevice's expf / log1pf
        without flushing subnormals — no `.ftz` instruction but expf's own `ex2.approx.ftz` core, as in CUDA's
        expf — the correctly rounded sqrt, no float64; Triton's default (`enable_reflect_ftz`) would flush."""
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        kern = RS._route_select_kernel
        opts = RS._route_options(20.0)
        consts = {**ROUTE_CONSTS, "SQRT": True, "SCALED": True, "SOFTPLUS": opts.pop("SOFTPLUS"),
                  "THRESHOLD": opts.pop("THRESHOLD")}
        full = {n: ("constexpr" if n in consts else ROUTE_SIG[n]) for n in kern.arg_names}

        def ftz_ops(options: dict) -> set[str]:
            ptx = triton.compile(ASTSource(kern, full, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                                 options=options).asm["ptx"]
            assert "sqrt.rn.f32" in ptx and not re.findall(r"\.f64\b", ptx)
            return set(re.findall(r"\b[a-z0-9]+(?:\.[a-z0-9]+)*\.ftz\.f32", ptx))

        assert ftz_ops(opts) == {"ex2.approx.ftz.f32"}
        assert ftz_ops(opts | {"enable_reflect_ftz": True}) - {"ex2.approx.ftz.f32"}


# ---- GPU: Flash widths ---------------------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_route_select_at_flash_width_matches_reference_on_gpu() -> None:
    """CUDA, 384 experts, top-6: the reference's experts, weights within the stated one-ulp flips."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    logits = torch.randn(64, 384, generator=g, device=dev) * 3
    scores, bias = moe.sqrt_softplus(logits), torch.randn(384, generator=g, device=dev) * 0.1
    e, w = RS.route_select(scores, bias, 6, moe.RENORM_EPS)
    assert torch.equal(e, moe.topk_lower_id_on_ties(scores + bias, 6))
    chosen = scores.gather(-1, e)
    assert flips_within_bound(w, chosen / moe.renorm_denominator(chosen), False)


@pytest.mark.gpu
def test_gpu_route_softplus_is_torch_sqrt_then_route_select() -> None:
    """CUDA, Flash widths: the fused router's scores are torch's fp32 sqrt of the softplus bit for bit
    (`sqrt.rn`, as torch's), so experts and weights are what the two-launch composition gave."""
    from sglang_dsv41.runtime.moe_ops import softplus_fp32
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(17)
    soft = softplus_fp32(torch.randn(256, 384, generator=g, device=dev) * 4, torch.float32)
    bias = torch.randn(384, generator=g, device=dev) * 0.05
    s, e, w, scaled = RS.route_softplus(soft, bias, 6, moe.RENORM_EPS, 1.5)
    want_s = torch.sqrt(soft)
    want_e, want_w = RS.route_select(want_s, bias, 6, moe.RENORM_EPS)
    assert same_bits(s, want_s) and torch.equal(e, want_e) and same_bits(w, want_w)
    assert same_bits(scaled, want_w * 1.5)


@pytest.mark.gpu
def test_gpu_route_logits_is_torch_softplus_then_route_softplus() -> None:
    """CUDA, Flash widths: the router's softplus inside the routing launch is torch's `F.softplus` bit for bit
    (libdevice expf / log1pf, subnormals kept), over logits from −120 (subnormal softplus) past the threshold,
    ±0, ±inf and NaN; experts, weights and scaled weights are then `route_softplus`'s."""
    from sglang_dsv41.runtime.moe_ops import SOFTPLUS_THRESHOLD, softplus_fp32
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(29)
    logits = torch.randn(256, 384, generator=g, device=dev) * 4
    logits[0] = torch.linspace(-120.0, 30.0, 384, device=dev)
    logits[1, :8] = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 20.0, 20.000002, -87.5],
                                 device=dev)
    logits[2] = torch.randn(384, generator=g, device=dev) * 40
    bias = torch.randn(384, generator=g, device=dev) * 0.05
    got = RS.route_logits(logits, bias, 6, moe.RENORM_EPS, 1.5, SOFTPLUS_THRESHOLD)
    soft = softplus_fp32(logits, torch.float32)
    assert same_bits(soft, torch.nn.functional.softplus(logits))
    want = RS.route_softplus(soft, bias, 6, moe.RENORM_EPS, 1.5)
    assert same_bits(got[0], want[0]) and torch.equal(got[1], want[1])
    assert same_bits(got[2], want[2]) and same_bits(got[3], want[3])

"""CPU checks of benchmarks/fp8_linear.py (the timing itself needs the GPU; docs/validation.md run 9)."""
from __future__ import annotations

import json

import pytest
import torch

from benchmark_loader import load_benchmark

bench = load_benchmark("fp8_linear.py")


def test_layer_pass_is_the_flash_layers_fp8_dense_weights() -> None:
    shapes = bench.layer_fp8_shapes(2)
    names = {name for name, _, _ in shapes}
    assert {"attn.wq_a.weight", "attn.wq_b.weight", "attn.wkv.weight", "attn.wo_a.weight", "attn.wo_b.weight",
            "ffn.shared_experts.w1.weight", "ffn.shared_experts.w2.weight", "ffn.shared_experts.w3.weight"} <= names
    assert not any(".experts." in n for n in names)           # routed experts are MXFP4, timed elsewhere
    assert 150e6 < sum(n * k for _, n, k in shapes) < 180e6    # ≈ 155 MiB of E4M3 per layer


def test_alternative_configurations_are_valid_tile_shapes() -> None:
    from sglang_dsv41.kernels import fp8_linear as F

    for label, tiles in bench.ALTERNATIVES.items():
        cfg = F.Fp8LinearConfig(*tiles)
        assert F.TILE % cfg.block_n == 0 or cfg.block_n % F.TILE == 0, label


def test_random_weights_have_power_of_two_scales_in_the_exact_range() -> None:
    from sglang_dsv41.kernels import fp8_linear as F

    values, scales = bench.random_fp8(64, 96, torch.Generator().manual_seed(0), torch.device("cpu"))
    assert values.dtype == torch.float8_e4m3fn and scales.shape == (2, 3)
    assert F.scales_are_bf16_exact(scales)


def test_plot_from_a_result(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    point = {"rows": 1, "runtime": {"us": 400.0, "gbs": 400.0, "fraction_of_copy": 0.09},
             "cublas_bf16": {"us": 280.0, "gbs": 1200.0, "fraction_of_copy": 0.28}}
    result = dict(layer=2, rows=[point, dict(point, rows=64)])
    bench.plot(json.loads(json.dumps(result)), tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 0


def test_refuses_without_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("CPU-only check")
    with pytest.raises(SystemExit, match="CUDA"):
        bench.main(["--rows", "1"])


def test_variants_include_the_swap_ab_candidate() -> None:
    """Every label maps to a call; the swap-AB alternatives are valid skinny configurations
    (BLOCK_W and BLOCK_K multiples of the 32-row scale tile) and differ from its default."""
    from sglang_dsv41.kernels import fp8_linear as F
    from sglang_dsv41.kernels import fp8_linear_skinny as SK

    calls = bench.variant_calls(F, SK)
    assert {"runtime", "swap_ab"} | set(bench.ALTERNATIVES) | set(bench.SWAP_AB_ALTERNATIVES) == set(calls)
    assert set(bench.PER_WEIGHT_LABELS) <= set(calls)
    for label, cfg in bench.SWAP_AB_ALTERNATIVES.items():
        c = SK.Fp8SkinnyConfig(*cfg)
        assert c.block_w % F.TILE == 0 and c.block_k % F.TILE == 0 and c != SK.SWAP_AB_CONFIG, label
    if not torch.cuda.is_available() and not F.INTERPRETED:
        values, scales = bench.random_fp8(64, 96, torch.Generator().manual_seed(0), torch.device("cpu"))
        with pytest.raises(RuntimeError, match="fp8_linear_swap_ab: .*TRITON_INTERPRET"):
            calls["swap_ab"](torch.zeros(1, 96), values, scales)     # the label reaches the candidate


def test_variant_selection_keeps_runtime_and_refuses_unknown_labels() -> None:
    from sglang_dsv41.kernels import fp8_linear as F
    from sglang_dsv41.kernels import fp8_linear_skinny as SK

    calls = bench.variant_calls(F, SK)
    assert bench.select_variants(calls, None) is calls
    picked = bench.select_variants(calls, ["bm64_bn32_bk64_w4", "swap_ab"])
    assert list(picked) == ["runtime", "bm64_bn32_bk64_w4", "swap_ab"]
    with pytest.raises(SystemExit, match="unknown variants \\['bm99'\\]"):
        bench.select_variants(calls, ["bm99"])


def test_alternatives_are_distinct_and_differ_from_the_runtime_configuration() -> None:
    from sglang_dsv41.kernels import fp8_linear as F

    cfgs = [F.Fp8LinearConfig(*t) for t in bench.ALTERNATIVES.values()]
    assert len(set(cfgs)) == len(cfgs) and F.DEFAULT_CONFIG not in cfgs


def test_bit_agreement_reports_equal_and_different_variants() -> None:
    """On CPU with stand-in calls: an identical product is `bit_equal`, a perturbed one is not and
    its difference is reported; a failing variant lands in errors."""
    g = torch.Generator().manual_seed(0)
    values, scales = bench.random_fp8(64, 96, g, torch.device("cpu"))
    exact = lambda x, v, s: x @ (v.float() * s.repeat_interleave(32, 0).repeat_interleave(32, 1)).t()  # noqa: E731

    def broken(x, v, s):
        raise RuntimeError("no compile")
    variants = {"runtime": exact, "same": exact, "off": lambda x, v, s: exact(x, v, s) + 1e-3, "broken": broken}
    errors: list[str] = []
    out = bench.bit_agreement([("w", values, scales)], variants, g, torch.device("cpu"), errors, rows=5)
    assert out["same"] == {"bit_equal": True, "max_abs_diff": 0.0}
    assert out["off"]["bit_equal"] is False and out["off"]["max_abs_diff"] == pytest.approx(1e-3, rel=1e-3)
    assert "broken" not in out and errors == ["agreement broken: RuntimeError: no compile"]

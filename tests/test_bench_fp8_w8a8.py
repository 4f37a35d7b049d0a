"""CPU checks of benchmarks/fp8_w8a8.py (the timing itself needs the GPU; docs/validation.md).

* main process: the layer pass is the Flash layer's FP8 dense weights with `wo_a` grouped; the
  fixed configurations are valid and distinct; argument handling; the plot; no CUDA → refusal;
* kernel case (Triton interpreter child): the whole pipeline end to end on the CPU with small
  stand-in shapes — every variant timed (no errors), the JSON's fields, agreement and accuracy
  filled in, the PNG written.
"""
from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from benchmark_loader import load_benchmark
from sglang_dsv41.kernels.fp8_w8a8 import INTERPRETED
from triton_checks import run_kernel_cases_in_interpreter

bench = load_benchmark("fp8_w8a8.py")


def test_layer_pass_is_the_flash_layers_fp8_dense_weights_with_wo_a_grouped() -> None:
    shapes = {name: (n, k, groups) for name, n, k, groups in bench.layer_shapes(2)}
    assert shapes["attn.wo_a.weight"] == (8192, 4096, 8)                 # 8 groups × [1024, 4096]
    assert shapes["attn.wq_b.weight"] == (32768, 1280, 1)
    assert {"attn.wq_a.weight", "attn.wkv.weight", "attn.wo_b.weight", "ffn.shared_experts.w1.weight",
            "ffn.shared_experts.w2.weight", "ffn.shared_experts.w3.weight"} <= set(shapes)
    assert not any(".experts." in n for n in shapes)
    assert all(g == 1 for name, (_, _, g) in shapes.items() if name != "attn.wo_a.weight")
    assert "engram.wkv.weight" in {name for name, *_ in bench.layer_shapes(1)}


def test_fixed_configurations_are_valid_and_distinct() -> None:
    from sglang_dsv41.kernels import fp8_w8a8 as W

    cfgs = [W.W8A8Config(*v[0]) for v in bench.ALTERNATIVES.values()]
    assert len(set(cfgs)) == len(cfgs)
    for c in cfgs:
        assert c.block_m in ((W.GEMV_CONFIG.block_m,) if c.gemv else (16, 32, 64, 128)), c
        assert c.block_n % 16 == 0 and 1024 % c.block_n == 0                                     # wo_a groups
    assert W.GEMV_CONFIG in cfgs and set(bench.GEMV_VARIANTS) <= set(bench.ALTERNATIVES)
    assert all(bench.ALTERNATIVES[v][1] == (1, W.GEMV_CONFIG.block_m) for v in bench.GEMV_VARIANTS)
    assert set(bench.variant_configs(W, None)) == {"w8a8", "w8a8_bf16_gemm"} | {f"w8a8_{k}" for k in bench.ALTERNATIVES}
    assert bench.variant_configs(W, []) == {"w8a8": None, "w8a8_bf16_gemm": bench.BF16_GEMM}
    assert bench.timed_at("w8a8_bf16_gemm", 1) and bench.timed_at("w8a8_bf16_gemm", 8192)
    with pytest.raises(SystemExit, match="unknown variants \\['nope'\\]"):
        bench.variant_configs(W, ["nope"])
    assert bench.timed_at("cublas_bf16", 8192) and bench.timed_at("w8a8", 1)
    assert bench.timed_at("w8a8_bm16_bn64_sub8", 64) and not bench.timed_at("w8a8_bm16_bn64_sub8", 8192)
    assert set(bench.SPEED3_VARIANTS) <= set(bench.ALTERNATIVES)
    for label, (_, (lo, hi)) in bench.ALTERNATIVES.items():                # decode shapes stay at decode sizes
        assert 1 <= lo <= hi <= 8192 and (hi <= 64 or bench.ALTERNATIVES[label][0][0] >= 64), label


def test_arguments() -> None:
    args = bench.parse_args([])
    assert args.rows == [1, 8, 64, 256, 8192] and args.layer == 2 and args.variants is None and not args.no_per_weight
    args = bench.parse_args(["--rows", "1", "64", "--variants", "bm16_bn64_sub8", "--no-per-weight", "--cap-s", "0.1"])
    assert args.rows == [1, 64] and args.variants == ["bm16_bn64_sub8"] and args.no_per_weight and args.cap_s == 0.1
    assert bench.parse_args(["--per-weight-rows", "1"]).per_weight_rows == [1]
    with pytest.raises(SystemExit):
        bench.parse_args(["--rows", "0"])


def test_refuses_without_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("CPU-only check")
    with pytest.raises(SystemExit, match="CUDA"):
        bench.main(["--rows", "1"])


def test_plot_from_a_result(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    point = {"rows": 1, "w8a8": {"eager_us": 400.0, "graph_us": 150.0, "tflops": 0.1},
             "cublas_bf16": {"eager_us": 300.0, "graph_us": 280.0, "tflops": 0.1}}
    bench.plot(json.loads(json.dumps(dict(layer=2, device="H200", rows=[point, dict(point, rows=8192)]))),
               tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 0


@pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET child (CPU tensors)")
def test_kernel_case_end_to_end_on_cpu_with_small_shapes(tmp_path, monkeypatch) -> None:
    from sglang_dsv41.kernels import fp8_w8a8 as W

    small = [("attn.wq_a.weight", 64, 96, 1), ("attn.wo_a.weight", 128, 64, 2), ("attn.wo_b.weight", 96, 128, 1)]
    monkeypatch.setattr(bench, "layer_shapes", lambda layer: small)
    args = bench.parse_args(["--rows", "1", "64", "--variants", "bm16_bn64_sub8", "bm64_bn128_prequant", "gemv",
                             "--cap-s", "0.01", "--out", str(tmp_path)])
    status = bench.run(args, torch.device("cpu"), copy_gbs=1000.0)
    result = json.loads((tmp_path / "fp8_w8a8.json").read_text())
    assert status == 0 and result["errors"] == [], result["errors"]
    assert [p["rows"] for p in result["rows"]] == [1, 64]
    labels = {"w8a8", "w8a8_bf16_gemm", "w8a8_bm16_bn64_sub8", "w8a8_bm64_bn128_prequant", "fp8_linear", "cublas_bf16"}
    assert set(result["rows"][0]) == {"rows", "w8a8_gemv"} | labels - {"w8a8_bm64_bn128_prequant"}  # timed from 8 rows
    for point in result["rows"][1:]:
        assert labels <= set(point) and "w8a8_gemv" not in point                        # ≤ 4 rows only
        for label in labels & set(point):
            assert point[label]["eager_us"] > 0 and point[label]["bytes"] > 0 and "graph_error" in point[label]
    assert result["fp8_bytes"] == sum(n * k + 4 * (n // 32) * (k // 32) for _, n, k, _ in small)
    assert set(result["agreement"]) == {"mid_tier", "prefill_tier", "w8a8_bf16_gemm", "w8a8_bm16_bn64_sub8",
                                        "w8a8_bm64_bn128_prequant"}
    # the interpreter's fp32 MMA: a configuration with the decode tier's chunking gives its bits
    assert result["agreement"]["w8a8_bm16_bn64_sub8"] == (W.k_chunks(64, 96, 264) == W.k_chunks(64, 96, W.DECODE_TARGET_PROGRAMS))
    for key in ("accuracy_over_bound", "accuracy_over_bound_gemv"):
        assert set(result[key]) == {n for n, *_ in small}
        assert all(0 <= v <= 1 for v in result[key].values())
    assert len(result["per_weight"]) == 2
    assert set(result["per_weight"][0]["attn.wo_a.weight"]) == set(bench.PER_WEIGHT) | {"w8a8_gemv"}     # 1 row
    assert set(result["per_weight"][1]["attn.wo_a.weight"]) == set(bench.PER_WEIGHT)                     # 64 rows
    assert (tmp_path / "fp8_w8a8.png").exists() == (importlib.util.find_spec("matplotlib") is not None)


if not INTERPRETED:

    def test_kernel_cases_in_triton_interpreter() -> None:
        """Run this file's kernel case in a child pytest with TRITON_INTERPRET=1 (CPU)."""
        run_kernel_cases_in_interpreter(__file__, min_passed=2, exact=True)


# ---- --sweep (benchmarks/fp8_w8a8_sweep.py) -------------------------------------------------------

def test_sweep_candidates_are_valid_and_distinct_per_tier() -> None:
    from sglang_dsv41.kernels import fp8_w8a8 as W

    sweep = load_benchmark("fp8_w8a8_sweep.py")
    assert set(sweep.TIER_ROWS) == {limit for limit, _ in W.ROW_TIERS} == {16, 256}
    assert max(sweep.TIER_ROWS[16]) <= 16 < min(sweep.TIER_ROWS[256]) <= max(sweep.TIER_ROWS[256]) < W.BF16_GEMM_MIN_ROWS
    for tier in sweep.TIER_ROWS:
        cfgs = sweep.tier_candidates(W, tier)
        assert list(cfgs)[0] == sweep.CURRENT and len(set(cfgs.values())) == len(cfgs)
        assert 20 <= sum(len(sweep.tier_candidates(W, t)) for t in sweep.TIER_ROWS) <= 40
        for label, c in cfgs.items():
            assert c.block_m <= (16 if tier == 16 else 64) and 1024 % c.block_n == 0, label   # wo_a groups
            assert c.fused_quant and c.split_k and not c.fp8_mma, label
    assert bench.parse_args(["--sweep", "--jobs", "0"]).sweep


def test_sweep_suggests_shape_configs_only_past_the_gain() -> None:
    """`shape_config_suggestions`: a line keyed (tier limit, N, K, groups) for a weight whose best
    candidate beats `current` by more than --min-gain, none for the others (fixed timings)."""
    from sglang_dsv41.kernels import fp8_w8a8 as W

    sweep = load_benchmark("fp8_w8a8_sweep.py")
    label = next(k for k, (t, _) in sweep.CANDIDATES.items() if t == 16)
    summary = {"16": {"per_weight": {"a": dict(best=label, us_sum=90.0, current_us_sum=100.0),
                                     "b": dict(best=label, us_sum=99.0, current_us_sum=100.0),
                                     "c": dict(best=sweep.CURRENT, us_sum=50.0, current_us_sum=50.0)}}}
    shapes = [("a", 64, 96, 1), ("b", 128, 64, 2), ("c", 32, 32, 1)]
    lines = sweep.shape_config_suggestions(W, summary, shapes, 0.05)
    assert len(lines) == 1 and lines[0].startswith("(16, 64, 96, 1): W8A8Config(") and "# a 100.0 → 90.0 µs" in lines[0]
    assert len(sweep.shape_config_suggestions(W, summary, shapes, -1.0)) == 2


@pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET child (CPU tensors)")
def test_kernel_case_sweep_end_to_end_on_cpu_with_small_shapes(tmp_path, monkeypatch) -> None:
    sweep = load_benchmark("fp8_w8a8_sweep.py")
    monkeypatch.setattr(sweep, "TIER_ROWS", {16: (1, 3), 256: (20,)})
    monkeypatch.setattr(sweep, "CANDIDATES", {k: sweep.CANDIDATES[k] for k in (
        "sw_m16_n64_s4_w4_p3_t1056", "m16_n128_s4_w4_p3_t1056", "sw_m64_n64_s4_w4_p3_t1056")})
    small = [("attn.wq_a.weight", 64, 96, 1), ("attn.wo_a.weight", 128, 64, 2)]
    args = bench.parse_args(["--sweep", "--jobs", "0", "--cap-s", "0.001", "--min-gain", "-1", "--out", str(tmp_path)])
    assert sweep.run_sweep(args, torch.device("cpu"), 1000.0, shapes=small) == 0
    result = json.loads((tmp_path / "fp8_w8a8_sweep.json").read_text())
    assert result["errors"] == [] and result["skipped"] == []
    assert len(result["points"]) == 2 * (2 * 3 + 1 * 2)          # weights × (decode rows × 3 + mid rows × 2)
    assert all(p["us"] > 0 and p["fraction_of_copy"] > 0 for p in result["points"])
    for tier in ("16", "256"):
        s = result["summary"][tier]
        assert set(s["per_weight"]) == {n for n, *_ in small} and s["best_single"] in s["totals_us"]
    # --min-gain -1: one line per (tier, weight) whose fastest candidate (timed here, so any) is not `current`
    beaten = [(tier, w) for tier, s in result["summary"].items() for w, b in s["per_weight"].items()
              if b["best"] != sweep.CURRENT]
    assert len(result["shape_configs"]) == len(beaten)
    assert all("W8A8Config(" in line for line in result["shape_configs"])
    for tier, w in beaten:
        n, k, groups = next((n, k, g) for name, n, k, g in small if name == w)
        assert any(line.startswith(f"({tier}, {n}, {k}, {groups}): ") for line in result["shape_configs"]), (tier, w)

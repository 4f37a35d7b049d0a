"""`benchmarks/vision.py --dry-run` on the tiny checkpoint: no server, the per-resolution grids,
span tokens and preprocessing times (the served run writes benchmarks/results/vision_cpu.json)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from benchmark_loader import load_benchmark
from sglang_dsv41.config import DeepseekV41Config


def test_dry_run_plans_each_resolution(tiny_checkpoint: Path, tmp_path: Path) -> None:
    bench = load_benchmark("vision.py")
    out = tmp_path / "vision.json"
    assert bench.main(["--model-path", str(tiny_checkpoint), "--dry-run", "--reps", "1", "--sizes", "84x84,1024x768",
                       "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert "cases" not in result and result["machine"] and result["date"]
    cap = DeepseekV41Config.from_file(tiny_checkpoint).vision.max_image_tokens
    small, large = result["preprocessing"]["84x84"], result["preprocessing"]["1024x768"]
    for row in (small, large):
        n_h, n_w = row["grid_tokens"]
        assert row["span_tokens"] == n_h * (n_w + 1) + 2 and n_h * n_w <= cap and row["preprocess_ms_median"] > 0
    assert small["grid_tokens"] == [2, 2] and large["span_tokens"] > small["span_tokens"]


def test_vit_only_run_reports_images_per_second(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """`--vit --no-server` on the tiny dims: the tower alone, per resolution and at the token cap."""
    bench = load_benchmark("vision.py")
    out = tmp_path / "vit.json"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)            # tiny matrices: more threads only contend on a shared CI host
    try:
        assert bench.main(["--model-path", str(tiny_checkpoint), "--vit", "--vit-images", "1", "--no-server",
                           "--reps", "1", "--sizes", "84x84", "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    vit = json.loads(out.read_text())["vit"]
    cap = DeepseekV41Config.from_file(tiny_checkpoint).vision.max_image_tokens
    assert vit["dims"] == "checkpoint" and set(vit["cases"]) == {"84x84", "cap"}
    assert vit["cases"]["cap"]["vit_patches"] == 9 * 25 and 25 <= cap          # 5 × 5 tokens: the square at the cap
    assert all(c["images_per_s"] > 0 for c in vit["cases"].values())
    assert "cap_peak_activation" not in vit                                      # CUDA only

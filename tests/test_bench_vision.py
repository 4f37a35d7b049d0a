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


def test_peak_rows_compare_each_call_with_the_planners_figure(tiny_checkpoint: Path) -> None:
    """The CUDA-only peak rows on CPU with a stand-in measure: one cap image, and the first packed
    call of the first case (three 84×84 images share one call at the tiny budget)."""
    bench = load_benchmark("vision.py")
    from sglang_dsv41.deploy.vision_config import vit_activation_bytes
    from sglang_dsv41.runtime.image_io import load_image
    from sglang_dsv41.vision_preprocess import preprocess_image

    cfg = DeepseekV41Config.from_file(tiny_checkpoint)
    tower = bench._random_tower(cfg, "sdpa")
    cases = {"84x84": [preprocess_image(load_image(bench.make_png(i, (84, 84))), cfg.vision) for i in range(3)],
             "cap": [bench._cap_image(cfg.vision)]}
    seen = []
    rows = bench.peak_rows(tower, cfg, cases, "sdpa", lambda t, pres, dev: seen.append(len(pres)) or 1000)
    assert seen == [1, 3] and set(rows) == {"cap", "packed_3x84x84"}
    plan = vit_activation_bytes(cfg.vision, cfg.text.hidden_size, "sdpa")     # the call budget: 9·32 patches
    assert rows["cap"]["planned_bytes"] == vit_activation_bytes(          # 5 × 5 tokens: the tiny cap's square
        cfg.vision, cfg.text.hidden_size, "sdpa", patches=225, longest=225, tokens=25, span_tokens=32, images=1)
    assert all(r["plan_bytes"] == plan >= r["planned_bytes"] for r in rows.values())
    packed = rows["packed_3x84x84"]
    assert packed["patches"] == 3 * 36 and packed["planned_bytes"] == vit_activation_bytes(
        cfg.vision, cfg.text.hidden_size, "sdpa", patches=108, longest=36, tokens=12, span_tokens=24, images=3)

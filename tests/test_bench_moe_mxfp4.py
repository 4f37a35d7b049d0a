"""CPU checks of benchmarks/moe_mxfp4.py's argument handling and path selection (the timing needs
the GPU; docs/validation.md): the FlashInfer CUTLASS path is built only behind its JIT-ready
marker and is otherwise reported as not built; --skip-bf16 drops the BF16 copies; no CUDA → refusal."""
from __future__ import annotations

import pytest
import torch

from benchmark_loader import load_benchmark

bench = load_benchmark("moe_mxfp4.py")


def test_defaults() -> None:
    args = bench.parse_args([])
    assert args.tokens == [1, 8, 64, 256] and not args.skip_bf16 and args.flashinfer_ready is None


def test_flashinfer_path_only_behind_its_marker(tmp_path) -> None:
    marker = tmp_path / "ready"
    comparisons, not_built = bench.comparison_paths(bench.parse_args(["--flashinfer-ready", str(marker)]), 100)
    assert [c[0] for c in comparisons] == ["bf16", "marlin"]
    assert "not built" in not_built["flashinfer_cutlass"]["error"] and str(marker) in not_built["flashinfer_cutlass"]["error"]
    marker.write_text("1234\n")
    comparisons, not_built = bench.comparison_paths(
        bench.parse_args(["--flashinfer-ready", str(marker), "--skip-bf16"]), 100)
    assert [c[0] for c in comparisons] == ["marlin", "flashinfer_cutlass"] and not_built == {}
    assert comparisons[1][1] is bench.flashinfer_cutlass_path and comparisons[1][2] == 100
    assert bench.comparison_paths(bench.parse_args([]), 7)[0][0] == ("bf16", bench.bf16_baseline,
                                                                      2 * 3 * bench.INTER * bench.HIDDEN)


def test_refuses_without_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("CPU-only check")
    with pytest.raises(SystemExit, match="CUDA"):
        bench.main(["--tokens", "1"])

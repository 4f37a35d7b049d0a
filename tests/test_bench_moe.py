"""CPU checks of benchmarks/moe.py (the timing needs the H200; `scripts/gpu/moe.sh`): defaults,
the roofline arithmetic, a candidate that fails to build is an error entry while the others are
built, FlashInfer runs only when its SM90 module is already built (never a JIT build), and without
CUDA the script writes its JSON with the reason and exits."""
from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch

from benchmark_loader import load_benchmark

bench = load_benchmark("moe.py")


def test_defaults_and_jit_disabled() -> None:
    args = bench.parse_args([])
    assert args.tokens == [1, 8, 64, 256, 4096] and args.hbm_tbs == 4.8
    assert args.candidates == ["mxfp4", "marlin", "flashinfer_cutlass"] and not args.with_bf16
    assert os.environ.get("FLASHINFER_DISABLE_JIT") == "1"


def test_roofline_ratio() -> None:
    e = bench.roofline({"eager_us": 100.0, "graph_us": 50.0}, nbytes=int(4.8e6) * 10, hbm_tbs=4.8, copy_gbs=4000.0)
    assert e["roofline_us"] == pytest.approx(10.0)
    assert e["eager_roofline_ratio"] == pytest.approx(0.1) and e["graph_roofline_ratio"] == pytest.approx(0.2)
    assert e["graph_fraction_of_copy_bw"] == pytest.approx(48e6 / 50e-6 / 1e9 / 4000.0)
    assert "eager_roofline_ratio" not in bench.roofline({"error": "x"}, 10, 4.8, None)


def test_failed_build_is_recorded_and_others_built(monkeypatch) -> None:
    def broken(raw):
        raise ValueError("repack failed")
    mm = SimpleNamespace(marlin_path=broken, bf16_baseline=lambda raw: (lambda x, ids, w: x),
                         flashinfer_cutlass_path=lambda raw: pytest.fail("must not build without the module"),
                         INTER=2304, HIDDEN=5120)
    monkeypatch.setattr(bench, "flashinfer_status", lambda: dict(aot=False, compiled=False))
    fns, info = bench.build_candidates(["marlin", "flashinfer_cutlass", "bf16"], {}, mm, torch.device("cpu"))
    assert list(fns) == ["bf16"] and info["bf16"]["bytes_per_expert"] == 2 * 3 * 2304 * 5120
    assert "ValueError: repack failed" in info["marlin"]["error"]
    assert "not built" in info["flashinfer_cutlass"]["error"] and info["flashinfer_cutlass"]["status"]["aot"] is False
    assert bench.mm_mxfp4_bytes(mm) == 3 * 2304 * 5120 * 17 // 32


def test_no_cuda_writes_the_reason(tmp_path) -> None:
    if torch.cuda.is_available():
        pytest.skip("CPU-only check")
    with pytest.raises(SystemExit, match="CUDA"):
        bench.main(["--out", str(tmp_path)])
    assert "CUDA" in json.loads((tmp_path / "moe.json").read_text())["error"]

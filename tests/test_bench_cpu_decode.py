"""CPU checks of benchmarks/cpu_decode.py: both backends run, report the backend they used and a rate."""
from __future__ import annotations

import pytest

from benchmark_loader import load_benchmark

bench = load_benchmark("cpu_decode.py")


@pytest.mark.parametrize("backend", ["torch", "exact"])
def test_decode_rate_reports_its_backend(tiny_checkpoint, backend: str) -> None:
    out = bench.decode_rate(tiny_checkpoint, 2, backend)
    assert out["backend"] == backend and out["steps"] == 2 and out["tokens_per_s"] > 0


def test_bad_steps_are_refused(tiny_checkpoint) -> None:
    with pytest.raises(SystemExit):
        bench.main([str(tiny_checkpoint), "--steps", "0"])

"""CPU checks of benchmarks/sparse_attention.py (the timing needs the GPU; docs/validation.md)."""
from __future__ import annotations

import pytest
import torch

from benchmark_loader import load_benchmark

bench = load_benchmark("sparse_attention.py")


def test_packed_split_counts_stay_within_the_kernels_limits() -> None:
    """Fixed key-split candidates: duplicates and out-of-range counts dropped, at most one split per
    key tile of the Flash decode shape (W 128 + K 512 keys in tiles of block_n) and MAX_SPLITS."""
    sa = bench.sa
    planned = sa.plan_config(1, bench.HEADS, bench.HEAD_DIM, bench.WINDOW, bench.TOPK, 132)
    tiles = -(-bench.WINDOW // planned.block_n) + -(-bench.TOPK // planned.block_n)
    got = bench.packed_split_counts([0, 1, 5, 5, 10, 16, 64], planned)
    assert got == sorted({k for k in (1, 5, 10, 16) if k <= min(sa.MAX_SPLITS, tiles)})
    assert all(sa.SparseAttentionConfig(**{**planned.__dict__, "num_splits": k}) for k in got)


def test_refuses_without_cuda(monkeypatch) -> None:
    if torch.cuda.is_available():
        pytest.skip("CPU-only check")
    monkeypatch.setattr("sys.argv", ["sparse_attention.py", "--packed-splits", "1", "5"])
    with pytest.raises(SystemExit, match="CUDA"):
        bench.main()

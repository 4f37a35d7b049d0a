"""Test backends: the exact torch primitives with the CUDA backend's tensor-core products, so the
CUDA path's dense arithmetic (`dense_ops.BlockedBf16Gemm`) runs on CPU tensors."""
from __future__ import annotations

from sglang_dsv41.runtime import backend, triton_backend
from sglang_dsv41.runtime.dense_ops import BlockedBf16Gemm


class TensorCoreProducts(triton_backend.TensorCoreProducts, backend.ExactTorchBackend):
    """`ExactTorchBackend` whose dense product is `dense.matmul` (and whose `finish` reports its audit)."""

    name = "exact+blocked-gemm"
    deterministic = False

    def __init__(self, dense: BlockedBf16Gemm) -> None:
        self.dense = dense

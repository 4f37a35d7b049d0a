"""The dense-product switch (`ops.dense_backend`) and the tensor-core backend (`runtime/dense_ops.py`) on CPU.

* default backend: every dense helper is bit-identical to the float64 formula it had before the
  switch, with and without an explicitly entered default (`dense_backend(None)`);
* the switch is context-local (threads, copied contexts) and restored after exceptions;
* `BlockedBf16Gemm` on CPU tensors (same operands, fp32 accumulation) is within `error_bound` of
  the exact reference for every helper, and the bound is tight enough to catch an fp32-output
  helper that rounds to BF16;
* a row's result does not depend on how many rows share the call (row blocks);
* weight cache: views resolve, unregistered weights raise, BF16 weights pass through;
* the input audit flags a non-BF16 activation; no float64 tensor is created inside the backend;
* the tiny reference model runs end to end under the backend with the audit on (every weight
  registered and BF16-exact, every activation BF16-valued).
"""
from __future__ import annotations

import contextvars
import threading

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from reference_weights import TINY_TEST_COMPRESSED_VOCAB, random_reference_weights, tiny_config
from sglang_dsv41.reference import compressor, ops
from sglang_dsv41.reference.model import ReferenceModel
from sglang_dsv41.runtime.dense_ops import (BlockedBf16Gemm, DenseWeightCache, backend_for, dense_math,
                                            error_bound)

F32, F64, BF16 = torch.float32, torch.float64, torch.bfloat16


def _fp8_like_weight(n: int, k: int, g: torch.Generator) -> torch.Tensor:
    """E4M3 values × a power-of-two scale per 32×32 tile (what the loader produces, BF16-exact)."""
    w = torch.randn(n, k, generator=g) / k**0.5
    tiles = w.reshape(n // 32, 32, k // 32, 32)
    scale = ops.pow2_ceil(tiles.abs().amax(dim=(1, 3), keepdim=True) / ops.E4M3_MAX)
    return (ops.e4m3(tiles / scale) * scale).reshape(n, k)


def _bf16_values(*shape: int, g: torch.Generator, positive: bool = False) -> torch.Tensor:
    v = torch.randn(*shape, generator=g)
    return ops.bf16(v.abs() if positive else v)


def _helpers(x: torch.Tensor, w: torch.Tensor) -> dict[str, torch.Tensor]:
    return {
        "linear_fp8": ops.linear_fp8(x, w),
        "linear_fp8_noquant": ops.linear_fp8(x, w, act_quant=False),
        "linear_bf16": ops.linear_bf16(x, w),
        "linear_bf16_fp32": ops.linear_bf16(x, w, out_fp32=True),
        "matmul_fp32_exact": ops.matmul_fp32_exact(x, w),
        "linear_fp32_out": compressor.linear_fp32_out(x, w),
    }


def _before_switch(x: torch.Tensor, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """The helpers' float64 formulas as they were before the switch existed."""
    exact = lambda a: (a.to(F64) @ w.to(F64).t()).to(F32)  # noqa: E731
    return {
        "linear_fp8": ops.bf16(exact(ops.fp8_act_fake_quant(x))),
        "linear_fp8_noquant": ops.bf16(exact(x.to(F32))),
        "linear_bf16": ops.bf16(exact(x)),
        "linear_bf16_fp32": exact(x),
        "matmul_fp32_exact": exact(x),
        "linear_fp32_out": exact(x),
    }


BF16_OUTPUT = {"linear_fp8": True, "linear_fp8_noquant": True, "linear_bf16": True,
               "linear_bf16_fp32": False, "matmul_fp32_exact": False, "linear_fp32_out": False}


def test_default_backend_is_bit_identical_to_the_float64_formulas() -> None:
    g = torch.Generator().manual_seed(0)
    x, w = _bf16_values(7, 96, g=g), _fp8_like_weight(64, 96, g)
    before = _before_switch(x, w)
    plain = _helpers(x, w)
    with ops.dense_backend(None):
        explicit = _helpers(x, w)
    for name in before:
        assert torch.equal(plain[name], before[name]), name
        assert torch.equal(explicit[name], before[name]), name


class _Tag:
    def matmul(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return torch.full((*x.shape[:-1], weight.shape[0]), 7.0)


def test_switch_is_context_local_and_restored_after_exceptions() -> None:
    x, w = torch.ones(2, 4), torch.ones(3, 4)
    tag = _Tag()
    assert ops.current_dense_backend() is None
    with ops.dense_backend(tag):
        assert ops.current_dense_backend() is tag
        assert torch.equal(ops.matmul_fp32_exact(x, w), torch.full((2, 3), 7.0))
        with ops.dense_backend(None):                       # nested: exact again, then back
            assert torch.equal(ops.matmul_fp32_exact(x, w), torch.full((2, 3), 4.0))
        assert ops.current_dense_backend() is tag
        seen: list[object] = []
        t = threading.Thread(target=lambda: seen.append(ops.current_dense_backend()))
        t.start()
        t.join()
        assert seen == [None]                               # another thread starts on the default
        assert contextvars.copy_context().run(ops.current_dense_backend) is tag
    assert ops.current_dense_backend() is None
    with pytest.raises(RuntimeError, match="boom"):
        with ops.dense_backend(tag):
            raise RuntimeError("boom")
    assert ops.current_dense_backend() is None
    assert torch.equal(ops.matmul_fp32_exact(x, w), torch.full((2, 3), 4.0))


@pytest.mark.parametrize("rows,k,n", [(1, 64, 32), (9, 512, 96), (130, 1024, 64), (3, 4096, 32)])
def test_backend_within_the_derived_bound(rows: int, k: int, n: int) -> None:
    g = torch.Generator().manual_seed(rows * 7 + k)
    x, w = _bf16_values(rows, k, g=g), _fp8_like_weight(n, k, g)
    backend = BlockedBf16Gemm(DenseWeightCache.from_weights({"a.weight": w}), audit_inputs=True)
    ref = _helpers(x, w)
    with dense_math(backend):
        out = _helpers(x, w)
    for name in ref:
        xq = ops.fp8_act_fake_quant(x) if name == "linear_fp8" else x
        bound = error_bound(xq, w, out[name], ref[name], bf16_output=BF16_OUTPUT[name])
        err = (out[name].to(F64) - ref[name].to(F64)).abs()
        assert bool((err <= bound).all()), (name, float((err - bound).max()))


def test_bound_catches_an_fp32_helper_rounded_to_bf16() -> None:
    """Positive data (|y| = S): rounding an fp32-output product to BF16 errs by up to 2⁻⁹·S, far
    above K·2⁻²³·S at Flash widths — the bound test would fail on that bug."""
    g = torch.Generator().manual_seed(5)
    x, w = _bf16_values(16, 4096, g=g, positive=True), ops.bf16(torch.rand(64, 4096, generator=g))
    backend = BlockedBf16Gemm(DenseWeightCache.from_weights({"a.weight": w}))
    ref = ops.matmul_fp32_exact(x, w)
    wrong = ops.bf16(backend.matmul(x, w))
    right = backend.matmul(x, w)
    assert bool(((right.to(F64) - ref.to(F64)).abs() <= error_bound(x, w, right, ref, False)).all())
    assert bool(((wrong.to(F64) - ref.to(F64)).abs() > error_bound(x, w, wrong, ref, False)).any())


def test_rows_do_not_depend_on_the_batch() -> None:
    g = torch.Generator().manual_seed(2)
    x, w = _bf16_values(300, 256, g=g), _fp8_like_weight(96, 256, g)
    backend = BlockedBf16Gemm(DenseWeightCache.from_weights({"a.weight": w}), row_block=64)
    full = backend.matmul(x, w)
    for lo, hi in [(0, 1), (5, 6), (3, 70), (250, 300), (17, 17 + 130)]:
        assert torch.equal(backend.matmul(x[lo:hi], w), full[lo:hi]), (lo, hi)
    assert torch.equal(backend.matmul(x.reshape(3, 100, 256), w), full.reshape(3, 100, 96))
    assert backend.matmul(x[:0], w).shape == (0, 96)


def test_weight_cache_views_unregistered_and_bf16_weights() -> None:
    g = torch.Generator().manual_seed(3)
    wo_a = _fp8_like_weight(128, 64, g)
    cache = DenseWeightCache.from_weights({"layers.0.attn.wo_a.weight": wo_a, "embed.weight": wo_a.clone(),
                                           "layers.0.attn_norm.weight": torch.ones(64)})
    assert cache.bf16_elements == wo_a.numel() and cache.fp32_elements == 0   # embed / 1-D skipped
    part = wo_a[32:64]
    assert torch.equal(cache.lookup(part).to(F32), part)
    assert torch.equal(cache.lookup(wo_a.t()).to(F32), wo_a.t())
    with pytest.raises(KeyError, match="not registered"):
        cache.lookup(wo_a.clone())
    w16 = wo_a.to(BF16)
    assert cache.lookup(w16) is w16
    with pytest.raises(ValueError, match="contiguous fp32"):
        cache.add(wo_a.t())
    odd = torch.randn(8, 64, generator=g)                    # not BF16-exact: kept fp32, fp32 GEMM
    cache.add(odd)
    assert cache.lookup(odd).dtype == F32 and cache.fp32_elements == odd.numel()
    x = _bf16_values(4, 64, g=g)
    out = BlockedBf16Gemm(cache).matmul(x, odd)
    ref = ops.matmul_fp32_exact(x, odd)
    assert bool(((out.to(F64) - ref.to(F64)).abs() <= error_bound(x, odd, out, ref, False)).all())
    assert backend_for({"a.weight": wo_a}) is None          # CPU weights: the exact reference math


def test_input_audit() -> None:
    g = torch.Generator().manual_seed(4)
    w = _fp8_like_weight(32, 64, g)
    backend = BlockedBf16Gemm(DenseWeightCache.from_weights({"a.weight": w}), audit_inputs=True)
    with dense_math(backend):
        ops.linear_bf16(_bf16_values(3, 64, g=g), w)
    with pytest.raises(ValueError, match="not BF16-valued"):
        with dense_math(backend):
            ops.matmul_fp32_exact(torch.randn(3, 64, generator=g), w)
    with pytest.raises(RuntimeError, match="inner"):         # the forward's own error wins ...
        with dense_math(backend):
            ops.matmul_fp32_exact(torch.randn(3, 64, generator=g), w)
            raise RuntimeError("inner")
    with dense_math(backend):                                 # ... and its audit is discarded
        ops.linear_bf16(_bf16_values(3, 64, g=g), w)


class DtypeAudit(TorchDispatchMode):
    """Records the dtype of every tensor an op produces (shared with the GPU file)."""

    def __init__(self) -> None:
        super().__init__()
        self.dtypes: set[torch.dtype] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                self.dtypes.add(t.dtype)
        return out


def test_backend_creates_no_float64_tensor() -> None:
    g = torch.Generator().manual_seed(6)
    w = _fp8_like_weight(64, 128, g)
    backend = BlockedBf16Gemm(DenseWeightCache.from_weights({"a.weight": w}), row_block=8, audit_inputs=True)
    x = _bf16_values(20, 128, g=g)
    audit = DtypeAudit()
    with audit:
        backend.matmul(x, w)
        backend.matmul(x[:, :64].contiguous(), w[:, :64])   # a strided view of a registered weight
    assert F64 not in audit.dtypes and F32 in audit.dtypes
    exact_audit = DtypeAudit()                              # the audit does see the exact path's float64
    with exact_audit:
        ops.matmul_fp32_exact(x, w)
    assert F64 in exact_audit.dtypes


def test_tiny_reference_forward_under_the_backend() -> None:
    cfg = tiny_config(vision=False)
    weights = random_reference_weights(cfg, seed=3, vision=False, dspark=False)
    model = ReferenceModel(cfg, weights, engram_token_map=np.arange(TINY_TEST_COMPRESSED_VOCAB))
    cache = DenseWeightCache.from_weights(model.weights)
    assert cache.fp32_elements == 0 and cache.bf16_elements > 0    # every dense weight is BF16-exact
    calls = []
    backend = BlockedBf16Gemm(cache, audit_inputs=True)
    inner = backend.matmul
    backend.matmul = lambda x, w: calls.append(1) or inner(x, w)  # type: ignore[method-assign]
    ids = list(range(5, 5 + 9))
    exact = model.forward(model.new_request(), ids).logits
    with dense_math(backend):
        fast = model.forward(model.new_request(), ids).logits
    assert len(calls) > 0 and bool(torch.isfinite(fast).all())
    assert fast.shape == exact.shape

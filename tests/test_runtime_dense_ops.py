"""The runtime's dense products (`runtime/backend.py`, `runtime/dense_ops.py`) on CPU.

* the exact torch backend's linears equal the reference's helpers bit for bit;
* the tensor-core product (`BlockedBf16Gemm`, fp32 accumulation of BF16 operands) is within
  `error_bound` of the exact reference for every linear, and the bound is tight enough to catch
  an fp32-output linear that rounds to BF16;
* a row's result does not depend on how many rows share the call (row blocks);
* weight cache: views resolve, unregistered weights raise, BF16 weights pass through;
* the input audit flags a non-BF16 activation and is dropped after a failed forward; no float64
  tensor is created inside the product;
* the tiny checkpoint's runtime forward runs end to end on the tensor-core products with the
  audit on (every weight registered and BF16-exact, every activation BF16-valued).
"""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from backend_helpers import TensorCoreProducts
from runtime_scenarios import fixed_decode_tokens, run_scenario, runtime_engine, scenario_caches
from sglang_dsv41.reference import compressor, ops
from sglang_dsv41.runtime.backend import ExactTorchBackend, backend_for
from sglang_dsv41.runtime.dense_ops import BlockedBf16Gemm, error_bound
from sglang_dsv41.runtime.dense_weights import DenseWeightCache

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


def _reference(x: torch.Tensor, w: torch.Tensor) -> dict[str, torch.Tensor]:
    return {
        "linear_fp8": ops.linear_fp8(x, w),
        "linear_fp8_noquant": ops.linear_fp8(x, w, act_quant=False),
        "linear_bf16": ops.linear_bf16(x, w),
        "linear_bf16_fp32": ops.linear_bf16(x, w, out_fp32=True),
        "matmul_fp32_exact": ops.matmul_fp32_exact(x, w),
        "linear_fp32_out": compressor.linear_fp32_out(x, w),
    }


def _runtime(be, x: torch.Tensor, w: torch.Tensor) -> dict[str, torch.Tensor]:
    return {
        "linear_fp8": be.linear_fp8(x, w),
        "linear_fp8_noquant": be.linear_fp8(x, w, act_quant=False),
        "linear_bf16": be.linear_bf16(x, w),
        "linear_bf16_fp32": be.linear_bf16(x, w, out_fp32=True),
        "matmul_fp32_exact": be.matmul(x, w),
        "linear_fp32_out": be.linear_bf16(x, w, out_fp32=True),
    }


BF16_OUTPUT = {"linear_fp8": True, "linear_fp8_noquant": True, "linear_bf16": True,
               "linear_bf16_fp32": False, "matmul_fp32_exact": False, "linear_fp32_out": False}


def test_exact_backend_is_bit_identical_to_the_reference_helpers() -> None:
    g = torch.Generator().manual_seed(0)
    x, w = _bf16_values(7, 96, g=g), _fp8_like_weight(64, 96, g)
    want, got = _reference(x, w), _runtime(ExactTorchBackend(), x, w)
    for name in want:
        assert torch.equal(got[name], want[name]), name


@pytest.mark.parametrize("rows,k,n", [(1, 64, 32), (9, 512, 96), (130, 1024, 64), (3, 4096, 32)])
def test_backend_within_the_derived_bound(rows: int, k: int, n: int) -> None:
    g = torch.Generator().manual_seed(rows * 7 + k)
    x, w = _bf16_values(rows, k, g=g), _fp8_like_weight(n, k, g)
    backend = TensorCoreProducts(BlockedBf16Gemm(DenseWeightCache.from_weights({"a.weight": w}), audit_inputs=True))
    ref = _reference(x, w)
    out = _runtime(backend, x, w)
    backend.finish()
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


def test_whole_rows_one_gemm_within_the_bound(monkeypatch) -> None:
    """`whole_rows` (SGLANG_DSV41_BF16_GEMM=whole, the CUDA serving default before session 35): more than a
    block of rows in one GEMM, within the same bound; a batch of ≤ one block is the blocked call. The switch:
    `direct` serving, `blocked` deterministic when unset; the variable overrides either; unknown values
    and `whole` with the deterministic backend raise."""
    from sglang_dsv41.runtime import backend as B
    from sglang_dsv41.runtime import dense_ops as D
    g = torch.Generator().manual_seed(4)
    x, w = _bf16_values(300, 256, g=g), _fp8_like_weight(96, 256, g)
    calls = []
    mm = D._mm_fp32_out
    monkeypatch.setattr(D, "_mm_fp32_out", lambda a, wt: calls.append(a.shape[0]) or mm(a, wt))
    whole = BlockedBf16Gemm(DenseWeightCache.from_weights({"a.weight": w}), row_block=64, whole_rows=True)
    out = whole.matmul(x, w)
    ref = ops.matmul_fp32_exact(x, w)
    assert calls == [300] and bool(((out.to(F64) - ref.to(F64)).abs() <= error_bound(x, w, out, ref, False)).all())
    assert torch.equal(whole.matmul(x[:50], w), BlockedBf16Gemm(whole.cache, row_block=64).matmul(x[:50], w))
    monkeypatch.delenv(B.BF16_GEMM_ENV, raising=False)
    assert (B.bf16_gemm_for(False), B.bf16_gemm_for(True)) == ("direct", "blocked")
    monkeypatch.setenv(B.BF16_GEMM_ENV, "Triton")
    assert B.bf16_gemm_for(False) == "triton"
    with pytest.raises(ValueError, match="triton is not row invariant"):
        B.bf16_gemm_for(True)
    monkeypatch.setenv(B.BF16_GEMM_ENV, "Blocked")
    assert B.bf16_gemm_for(False) == B.bf16_gemm_for(True) == "blocked"
    monkeypatch.setenv(B.BF16_GEMM_ENV, "Whole")
    assert B.bf16_gemm_for(False) == "whole"
    with pytest.raises(ValueError, match="not row invariant"):
        B.bf16_gemm_for(True)
    monkeypatch.setenv(B.BF16_GEMM_ENV, "split")
    with pytest.raises(ValueError, match="SGLANG_DSV41_BF16_GEMM='split'"):
        B.bf16_gemm_for(False)


def test_unpadded_rows_one_gemm_on_the_operand_as_given(monkeypatch) -> None:
    """`unpadded` (SGLANG_DSV41_BF16_GEMM=direct, opt-in): every row count, one block's worth or fewer included, is
    one GEMM on x itself when x is contiguous BF16 (no padded block, no copy), within the bound; only with
    `whole_rows`, and `direct` with the deterministic backend raises."""
    from sglang_dsv41.runtime import backend as B
    from sglang_dsv41.runtime import dense_ops as D
    g = torch.Generator().manual_seed(6)
    x, w = _bf16_values(300, 256, g=g), _fp8_like_weight(96, 256, g)
    with pytest.raises(ValueError, match="whole_rows"):
        BlockedBf16Gemm(DenseWeightCache(), unpadded=True)
    operands = []
    mm = D._mm_fp32_out
    monkeypatch.setattr(D, "_mm_fp32_out", lambda a, wt: operands.append(a) or mm(a, wt))
    direct = BlockedBf16Gemm(DenseWeightCache.from_weights({"a.weight": w}), row_block=64, whole_rows=True,
                             unpadded=True)
    xb = x.to(torch.bfloat16)
    ref = ops.matmul_fp32_exact(x, w)
    for m in (1, 7, 64, 300):
        out = direct.matmul(xb[:m], w)
        assert operands[-1].shape[0] == m and operands[-1].data_ptr() == xb.data_ptr(), m
        assert bool(((out.to(F64) - ref[:m].to(F64)).abs() <= error_bound(x[:m], w, out, ref[:m], False)).all()), m
    direct.matmul(x[:3], w)                                                    # fp32 activations: one BF16 copy
    assert operands[-1].dtype == torch.bfloat16 and operands[-1].shape[0] == 3
    monkeypatch.setenv(B.BF16_GEMM_ENV, "direct")
    assert B.bf16_gemm_for(False) == "direct"
    assert B.backend_for(torch.device("cuda"), {}, False).dense.unpadded
    with pytest.raises(ValueError, match="direct is not row invariant"):
        B.bf16_gemm_for(True)


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
    assert isinstance(backend_for(torch.device("cpu"), {"a.weight": wo_a}), ExactTorchBackend)   # CPU: exact


def test_input_audit() -> None:
    g = torch.Generator().manual_seed(4)
    w = _fp8_like_weight(32, 64, g)
    backend = TensorCoreProducts(BlockedBf16Gemm(DenseWeightCache.from_weights({"a.weight": w}), audit_inputs=True))
    backend.linear_bf16(_bf16_values(3, 64, g=g), w)
    backend.finish()
    backend.matmul(torch.randn(3, 64, generator=g), w)
    with pytest.raises(ValueError, match="not BF16-valued"):
        backend.finish()
    backend.matmul(torch.randn(3, 64, generator=g), w)
    backend.finish(ok=False)                                 # a failed forward's audit is dropped ...
    backend.linear_bf16(_bf16_values(3, 64, g=g), w)
    backend.finish()                                         # ... and not reported by the next one


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


def test_tiny_runtime_forward_on_tensor_core_products(tiny_checkpoint) -> None:
    cpu = torch.device("cpu")
    engine = runtime_engine(tiny_checkpoint, cpu)
    cache = DenseWeightCache.from_weights(engine.weights)
    assert cache.fp32_elements == 0 and cache.bf16_elements > 0    # every dense weight is BF16-exact
    dense = BlockedBf16Gemm(cache, audit_inputs=True)
    calls = []
    inner = dense.matmul
    dense.matmul = lambda x, w: calls.append(1) or inner(x, w)  # type: ignore[method-assign]
    engine.backend = TensorCoreProducts(dense)
    got = run_scenario(engine, scenario_caches(engine, cpu), cpu, fixed_decode_tokens())
    assert len(calls) > 0 and all(bool(torch.isfinite(v).all()) for v in got.values())


def test_whole_rows_operand_used_as_is_only_when_bf16_contiguous_and_aligned() -> None:
    """`_usable_as_is`: the whole-rows GEMM skips the copy for a contiguous, 16-byte-aligned operand of its
    dtype only (a fresh allocation's alignment)."""
    from sglang_dsv41.runtime.dense_ops import _usable_as_is
    x = torch.zeros(8, 64, dtype=torch.bfloat16)
    assert _usable_as_is(x, torch.bfloat16) and _usable_as_is(x[2:], torch.bfloat16)
    assert not _usable_as_is(x.float(), torch.bfloat16) and not _usable_as_is(x[:, :32], torch.bfloat16)
    assert not _usable_as_is(x.view(-1)[1:449].view(7, 64), torch.bfloat16)      # a 2-byte offset

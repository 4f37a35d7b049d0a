"""The dense products of the CUDA forward on tensor cores (spec `model.md` §3.8; `ops.DenseBackend`).

The reference evaluates every dense product (`ops.linear_fp8`, `ops.linear_bf16`,
`ops.matmul_fp32_exact`, `compressor.linear_fp32_out`) as `x.f64 @ w.f64ᵀ` rounded once — exact,
but on CUDA a float64 copy of every weight per call. `BlockedBf16Gemm` replaces only that product
(`ops.dense_backend`); quantisation and the final rounding stay the reference's code.

Arithmetic. Weights registered in a `DenseWeightCache` are held once as a BF16 device copy (FP8
values × UE8M0 scales, BF16 and MXFP4 weights are all BF16-exact; a weight that is not keeps its
fp32 tensor). Activations reaching these products are BF16-valued (FP8 fake-quant or a BF16
rounding upstream), so `x.to(bf16)` is exact; the product is `torch.mm(x_bf16, w_bf16ᵀ,
out_dtype=fp32)`: exact products, fp32 accumulation, fp32 result (CPU, which lacks that kernel:
the same operands upcast to fp32, same arithmetic class). fp32 weights: fp32 GEMM (TF32 must be
off — checked).

Error bound (per output element, S = Σ_k |x_k|·|w_k| the output scale, K the inner dimension):

    |ŷ − x·wᵀ| ≤ K·2⁻²³·S                                            (GEMM_BOUND)

Products of BF16 operands are exact in fp32 (8 + 8 ≤ 24 significand bits); each of the ≤ K
additions of the fp32 accumulation (any order, any split-K / tree, tensor-core alignment with
truncation) errs by at most one fp32 ulp of a partial sum whose magnitude is ≤ S, i.e. ≤ 2⁻²³·S
(truncation: 1 ulp = 2⁻²³ relative, round-to-nearest half that). Summed over K additions. Per
function, with y the exact product, ref the reference's output and m = max(|out|, |ref|):
* `matmul_fp32_exact` / `linear_fp32_out` / `linear_bf16(out_fp32=True)`: ref = fp32(y), so
  |out − ref| ≤ K·2⁻²³·S + 2⁻²³·m;
* `linear_fp8` / `linear_bf16`: both round the product to BF16 (the reference via fp32), so
  |out − ref| ≤ K·2⁻²³·S + 2⁻²³·m + ulp_bf16(m) — two values within the first two terms of each
  other round to BF16 values at most half an ulp of each (≤ one ulp of m) further apart.
The bound is worst-case (all partial sums as large as S, every addition erring fully); for
mixed-sign data the observed error is ~√K smaller. `error_bound` computes these; the tests assert them on CPU and on the H200.

Row-block invariance. cuBLAS picks its kernel (tile, split-K) by the problem shape, so a row's
fp32 result can depend on how many rows share a call — the CUDA forward would no longer be batch
invariant. `BlockedBf16Gemm` therefore multiplies rows in zero-padded blocks of exactly
`row_block` rows, one fixed-shape GEMM per block: a row's result depends only on its own values
and the weight, never on the batch (decode pads to one block; decode GEMMs are weight-bandwidth
bound, so the padding is nearly free).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping

import torch
from torch import Tensor

from ..reference import ops

BF16 = torch.bfloat16
F32 = torch.float32
#: rows per fixed-shape GEMM (see the module doc, "Row-block invariance")
ROW_BLOCK = 128
#: fp32 accumulation: one ulp (truncation) relative to a partial sum
ACCUMULATION_UNIT = 2.0**-23


def is_dense_linear_weight(name: str, value: object) -> bool:
    """Weights consumed by the dense helpers: 2-D floating `*.weight` tensors other than the
    token / Engram embedding tables (read by row, not multiplied). hc_*_fn, q/k_weight are not
    `*.weight` names and are not routed through the helpers; non-tensor values (e.g. packed MXFP4
    experts, `runtime/weights.py`) are skipped."""
    return isinstance(value, Tensor) and value.dim() == 2 and value.is_floating_point() \
        and name.endswith(".weight") and not name.endswith("embed.weight")


@dataclass(frozen=True)
class _Entry:
    original: Tensor   # keeps the fp32 storage alive, so its address cannot be reused
    compute: Tensor    # contiguous BF16 copy, or `original` itself when not BF16-exact
    offset: int        # storage offset of `original` (elements)


class DenseWeightCache:
    """fp32 weights → their compute copies, made once (at load), looked up per call.

    Keyed by the weight's storage, so views of a registered weight (e.g. the per-group rows of
    `wo_a`) resolve to the same view of the copy. A weight must be registered before use: an
    unregistered fp32 weight raises (no silent per-call conversion). BF16 tensors are used as is.
    """

    def __init__(self) -> None:
        self._by_storage: dict[int, list[_Entry]] = {}
        self.bf16_elements = 0
        self.fp32_elements = 0

    @classmethod
    def from_weights(cls, weights: Mapping[str, object],
                     include: Callable[[str, object], bool] = is_dense_linear_weight) -> "DenseWeightCache":
        """Register every weight `include` selects (default: the dense linear weights)."""
        cache = cls()
        for name, value in weights.items():
            if include(name, value):
                assert isinstance(value, Tensor)
                cache.add(value)
        return cache

    def add(self, weight: Tensor) -> None:
        """Register a contiguous fp32 weight: BF16 copy if every value is BF16-exact (one check,
        one host sync, at load), else the fp32 tensor itself."""
        if weight.dtype != F32 or not weight.is_contiguous():
            raise ValueError(f"dense weight cache: expected a contiguous fp32 weight, got {weight.dtype} "
                             f"{tuple(weight.shape)} strides {weight.stride()}")
        if self._find(weight) is not None:
            return
        as_bf16 = weight.to(BF16)
        exact = bool(torch.equal(as_bf16.to(F32), weight))
        compute = as_bf16 if exact else weight
        if exact:
            self.bf16_elements += weight.numel()
        else:
            del as_bf16
            self.fp32_elements += weight.numel()
        key = weight.untyped_storage().data_ptr()
        self._by_storage.setdefault(key, []).append(_Entry(weight, compute, weight.storage_offset()))

    def _find(self, weight: Tensor) -> Tensor | None:
        for entry in self._by_storage.get(weight.untyped_storage().data_ptr(), ()):
            rel = weight.storage_offset() - entry.offset
            last = rel + sum((n - 1) * s for n, s in zip(weight.shape, weight.stride()))
            if rel >= 0 and last < entry.original.numel() and entry.original.device == weight.device:
                return entry.compute.as_strided(weight.shape, weight.stride(), entry.compute.storage_offset() + rel)
        return None

    def lookup(self, weight: Tensor) -> Tensor:
        """The compute copy (same shape and strides) of a registered weight or of a view of one."""
        if weight.dtype == BF16:
            return weight
        found = self._find(weight)
        if found is None:
            raise KeyError(f"dense backend: weight {tuple(weight.shape)} {weight.dtype} on {weight.device} is not "
                           "registered (DenseWeightCache.add / from_weights at load)")
        return found

    def describe(self) -> str:
        return (f"dense weight cache: {self.bf16_elements / 1e6:.1f} M BF16 elements "
                f"({2 * self.bf16_elements / 2**30:.2f} GiB), {self.fp32_elements / 1e6:.1f} M kept fp32")


class BlockedBf16Gemm:
    """`ops.DenseBackend` on tensor cores: BF16 operands, fp32 accumulation and output, rows in
    fixed blocks of `row_block` (module doc). `audit_inputs` checks, without a host sync per
    call, that every activation multiplied in BF16 is BF16-exact; `raise_if_inputs_inexact`
    (called by `dense_math` on exit) reports a violation."""

    def __init__(self, cache: DenseWeightCache, row_block: int = ROW_BLOCK, audit_inputs: bool = False) -> None:
        if row_block < 1:
            raise ValueError(f"row_block must be ≥ 1, got {row_block}")
        self.cache = cache
        self.row_block = row_block
        self.audit_inputs = audit_inputs
        self._inexact: Tensor | None = None

    def matmul(self, x: Tensor, weight: Tensor) -> Tensor:
        """fp32 approximation of x·weightᵀ within GEMM_BOUND; x [..., K], weight [N, K]."""
        w = self.cache.lookup(weight)
        if x.shape[-1] != w.shape[1]:
            raise ValueError(f"dense backend: x [..., {x.shape[-1]}] against weight {tuple(w.shape)}")
        lead, K, N = x.shape[:-1], w.shape[1], w.shape[0]
        x2 = x.reshape(-1, K)
        if w.dtype == BF16:
            a = _fresh(x2, BF16)
            if self.audit_inputs:
                bad = (a.to(x2.dtype) != x2).any()
                self._inexact = bad if self._inexact is None else (self._inexact | bad)
        else:
            if x.is_cuda and torch.backends.cuda.matmul.allow_tf32:
                raise RuntimeError("dense backend: fp32 weight GEMM with TF32 enabled (its bound needs fp32)")
            a = _fresh(x2, F32)
        return self._blocked(a, w).reshape(*lead, N)

    def _blocked(self, a: Tensor, w: Tensor) -> Tensor:
        M, B = a.shape[0], self.row_block
        if M == 0:
            return a.new_zeros(0, w.shape[0], dtype=F32)
        pad = (-M) % B
        if pad:
            a = torch.cat((a, a.new_zeros(pad, a.shape[1])))
        wt = w.t()
        blocks = [_mm_fp32_out(a[i:i + B], wt) for i in range(0, M + pad, B)]
        out = blocks[0] if len(blocks) == 1 else torch.cat(blocks)
        return out[:M]

    def discard_audit(self) -> None:
        """Forget the audit of a forward that failed (its own error is the one reported)."""
        self._inexact = None

    def raise_if_inputs_inexact(self) -> None:
        """Raise if an audited activation was not BF16-exact since the last call (one host sync)."""
        flag, self._inexact = self._inexact, None
        if flag is not None and bool(flag):
            raise ValueError("dense backend: an activation multiplied in BF16 was not BF16-valued — the "
                             "stated error bound does not hold (a caller passed unrounded fp32 values)")


def _fresh(x: Tensor, dtype: torch.dtype) -> Tensor:
    """A new contiguous copy of x in `dtype`: every row block then starts at an allocator-aligned
    address + a multiple of row_block·K elements, so the GEMM sees the same shape and alignment
    for every block of every call (a cuBLAS kernel choice depends on both)."""
    return x.to(dtype, copy=True, memory_format=torch.contiguous_format)


def _mm_fp32_out(a: Tensor, wt: Tensor) -> Tensor:
    """a·wt with fp32 accumulation and an fp32 result; BF16 operands on CUDA use the tensor cores."""
    if a.dtype == BF16 and a.is_cuda:
        return torch.mm(a, wt, out_dtype=F32)
    return torch.mm(a.to(F32), wt.to(F32))


@contextlib.contextmanager
def dense_math(backend: BlockedBf16Gemm | None) -> Iterator[None]:
    """Run the block with `backend` as the dense backend (`ops.dense_backend`); None = the exact
    float64 reference math. On a normal exit an auditing backend reports inexact inputs."""
    try:
        with ops.dense_backend(backend):
            yield
    except BaseException:
        if backend is not None:
            backend.discard_audit()
        raise
    if backend is not None:
        backend.raise_if_inputs_inexact()


def backend_for(weights: Mapping[str, object]) -> BlockedBf16Gemm | None:
    """The backend the runtime uses for `weights` (all on one device): CUDA → `BlockedBf16Gemm`
    over a cache of the dense weights (built now, once, at load); CPU → None (the exact
    reference math, bit-identical)."""
    devices = {t.device for t in weights.values() if isinstance(t, Tensor)}
    if len(devices) > 1:
        raise ValueError(f"dense backend: weights on several devices {sorted(map(str, devices))}")
    if not devices or next(iter(devices)).type != "cuda":
        return None
    return BlockedBf16Gemm(DenseWeightCache.from_weights(weights))


def error_bound(x: Tensor, weight: Tensor, out: Tensor, ref: Tensor, bf16_output: bool) -> Tensor:
    """Per-element bound on |out − ref| (module doc): K·2⁻²³·S, plus 2⁻²³·max(|out|, |ref|) for
    the reference's own fp32 rounding of the exact product, plus one BF16 ulp of max(|out|, |ref|)
    when both round to BF16. x is the activation as multiplied (after any fake-quant). Evaluated
    in float64 on any device (a test-side helper, never called by the backend)."""
    f64 = torch.float64
    K = x.shape[-1]
    S = x.to(f64).abs() @ weight.to(f64).abs().t()
    mag = torch.maximum(out.to(f64).abs(), ref.to(f64).abs())
    bound = K * ACCUMULATION_UNIT * S + 2.0**-23 * mag
    if not bf16_output:
        return bound
    _, e = torch.frexp(mag)                               # mag = m·2^e, m ∈ [0.5, 1)
    ulp = torch.where(mag > 0, torch.ldexp(torch.ones_like(mag), e - 8), 0.0)   # BF16 spacing 2^(e−1−7)
    return bound + ulp


__all__ = ["ACCUMULATION_UNIT", "BlockedBf16Gemm", "DenseWeightCache", "ROW_BLOCK", "backend_for", "dense_math",
           "error_bound", "is_dense_linear_weight"]

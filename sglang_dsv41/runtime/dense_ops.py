"""The dense products of the CUDA forward on tensor cores (spec `model.md` §3.8; `triton_backend.TritonBackend.matmul`).

The reference evaluates every dense product as `x.f64 @ w.f64ᵀ` rounded once — exact, but on
CUDA a float64 copy of every weight per call. The CUDA backend (`runtime/triton_backend.py`) computes
that product with `BlockedBf16Gemm`; quantisation and the final rounding are the backend's.

Weights: `runtime/dense_weights.py` (`DenseWeightCache`: FP8-stored weights as stored, `Fp8Weight`; other
weights as BF16 copies where exact, else fp32).

Arithmetic. Activations reaching these products are BF16-valued (FP8 fake-quant or a BF16
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

For FP8 weights the same bound holds (`kernels/fp8_linear.py`: the dequantised tile is exactly
BF16, so the products are the same exact BF16 products). Row invariance there is the kernel's
own: one fixed launch configuration, fixed K order, no split-K (no row blocks needed).

Row-block invariance (BF16 / fp32 weights). cuBLAS picks its kernel (tile, split-K) by the problem shape, so a row's
fp32 result can depend on how many rows share a call — the CUDA forward would no longer be batch
invariant. `BlockedBf16Gemm` therefore multiplies rows in zero-padded blocks of exactly
`row_block` rows, one fixed-shape GEMM per block: a row's result depends only on its own values
and the weight, never on the batch (decode pads to one block; decode GEMMs are weight-bandwidth
bound, so the padding is nearly free). At prefill that is one small GEMM per 128 rows (64 cuBLAS
calls and a concatenation per linear at 8K tokens); `whole_rows=True` (`backend.bf16_gemm_for`'s `whole`)
multiplies a batch of more than `row_block` rows in one GEMM instead: the
same operands and fp32 accumulation, so the same GEMM_BOUND, but a row's bits then depend on the
batch's row count (like the FP8 row tiers of `w8a8_f16`); never with the deterministic backend.
`triton_rows=True` (with `whole_rows`; `backend.bf16_gemm_for`'s opt-in `triton`) multiplies fewer than
`kernels.bf16_linear.MAX_ROWS` rows by a BF16 weight of at most BF16_KERNEL_MAX_ELEMENTS on that Triton
kernel instead of a padded cuBLAS block (one launch, no copy): exact products, fp32 sums, the same
GEMM_BOUND, the bits of its row tiers. `unpadded=True` (with `whole_rows`; `backend.bf16_gemm_for`'s `direct`,
the CUDA serving default) multiplies any row count in one cuBLAS GEMM on the activation as given: no padded block and no copy
(a decode row is one GEMV-shaped call), the same GEMM_BOUND, bits that depend on the row count.
"""
from __future__ import annotations

from typing import Mapping

import torch
from torch import Tensor

from .dense_weights import BF16, BF16_KERNEL_MAX_ELEMENTS, F32, FP8, TILE, DenseWeightCache, Fp8Weight

#: rows per fixed-shape GEMM (see the module doc, "Row-block invariance")
ROW_BLOCK = 128
#: fp32 accumulation: one ulp (truncation) relative to a partial sum
ACCUMULATION_UNIT = 2.0**-23


class BlockedBf16Gemm:
    """The CUDA backend's dense product on tensor cores: BF16 operands, fp32 accumulation and output. E4M3
    weights (`Fp8Weight`) go to `kernels.fp8_linear` (row invariant by itself), or — the backend's
    W8A8 FP8 linears — to `kernels.fp8_w8a8` through `w8a8`; BF16 / fp32
    weights to cuBLAS with rows in fixed blocks of `row_block` (module doc), or with `triton_rows` BF16 weights of at
    most BF16_KERNEL_MAX_ELEMENTS to `kernels.bf16_linear` below its row limit. `audit_inputs` checks, without a host sync per
    call, that every activation multiplied in BF16 is BF16-exact; `raise_if_inputs_inexact`
    (called by the backend after each forward) reports a violation."""

    def __init__(self, cache: DenseWeightCache, row_block: int = ROW_BLOCK, audit_inputs: bool = False,
                 whole_rows: bool = False, triton_rows: bool = False, unpadded: bool = False) -> None:
        if row_block < 1:
            raise ValueError(f"row_block must be ≥ 1, got {row_block}")
        if (triton_rows or unpadded) and not whole_rows:
            raise ValueError("triton_rows / unpadded BF16 products are not row invariant: they go with whole_rows")
        self.cache = cache
        self.row_block = row_block
        #: more than `row_block` rows in one GEMM (module doc, "Row-block invariance"): not row invariant
        self.whole_rows = whole_rows
        #: BF16 weights below `kernels.bf16_linear.MAX_ROWS` rows on that kernel (module doc)
        self.triton_rows = triton_rows
        #: any row count in one GEMM on x as given (no padded block, no copy when x is already in the operand
        #: dtype and contiguous; module doc)
        self.unpadded = unpadded
        self.audit_inputs = audit_inputs
        self._inexact: Tensor | None = None

    def matmul(self, x: Tensor, weight: Tensor) -> Tensor:
        """fp32 approximation of x·weightᵀ within GEMM_BOUND; x [..., K], weight [N, K]."""
        w = self.cache.lookup(weight)
        if x.shape[-1] != w.shape[1]:
            raise ValueError(f"dense backend: x [..., {x.shape[-1]}] against weight {tuple(w.shape)}")
        lead, K = x.shape[:-1], w.shape[1]
        x2 = _rows(x, K)
        if isinstance(w, Fp8Weight):
            from ..kernels.fp8_linear import fp8_linear

            if x2.dtype not in (F32, BF16):
                x2 = x2.to(F32)
            if self.audit_inputs:
                self._audit(x2)
            return _unrows(fp8_linear(x2, w.values, w.scales), lead)
        if w.dtype == BF16:
            if self.audit_inputs:
                self._audit(x2)
            if self.triton_rows and _takes_bf16_kernel(x2, w):
                from ..kernels.bf16_linear import bf16_linear

                return _unrows(bf16_linear(x2, w, self.cache.bf16_counters(w)), lead)
            dtype = BF16
        else:
            if x.is_cuda and torch.backends.cuda.matmul.allow_tf32:
                raise RuntimeError("dense backend: fp32 weight GEMM with TF32 enabled (its bound needs fp32)")
            dtype = F32
        return _unrows(self._blocked(x2, dtype, w), lead)

    def fp8_operand(self, weight: Tensor) -> Fp8Weight | None:
        """The E4M3 tiles of a registered FP8 weight (or a tile-row view of one); None for a
        weight held as BF16 / fp32; an unregistered weight raises (`DenseWeightCache.lookup`)."""
        w = self.cache.lookup(weight)
        return w if isinstance(w, Fp8Weight) else None

    def w8a8(self, x: Tensor, w: Fp8Weight, *, act_quant: bool, groups: int, fp8_mma: bool = False,
             gemv: bool = False, fold: bool = False, out_dtype: torch.dtype = F32, x_quantised: bool = False,
             quantise_out: bool = False) -> Tensor:
        """`kernels.fp8_w8a8.fp8_w8a8_linear` of x [..., groups·K] (BF16 / fp32) and the tiles `w`:
        BF16-valued fp32 [..., N], or BF16 with `out_dtype` (bound: that module); `fp8_mma`: its
        FP8-MMA row tiers; `gemv`: its CUDA-core tier for ≤ 4 rows; `fold`: its scale-folded tier for ≤ 16 rows;
        `x_quantised` / `quantise_out`: its quantised hand-off (`kernels.fp8_fold` module doc).
        `act_quant=False` (W8A16 arithmetic) multiplies x rounded to BF16, so x is audited like
        the BF16 products."""
        from ..kernels.fp8_w8a8 import fp8_w8a8_linear

        K = groups * w.shape[1]
        if x.shape[-1] != K:
            raise ValueError(f"dense backend: x [..., {x.shape[-1]}] against {groups} group(s) of FP8 weight "
                             f"{tuple(w.shape)}")
        lead = x.shape[:-1]
        x2 = _rows(x, K)
        if x2.dtype not in (F32, BF16):
            x2 = x2.to(F32)
        if self.audit_inputs and not act_quant:
            self._audit(x2)
        y = fp8_w8a8_linear(x2, w.values, w.scales, groups=groups, act_quant=act_quant, fp8_mma=fp8_mma,
                            counters=w.counters, out_dtype=out_dtype, gemv=gemv, fold=fold, x_quantised=x_quantised,
                            quantise_out=quantise_out)
        return _unrows(y, lead)

    def _audit(self, x2: Tensor) -> None:
        """Accumulate (no host sync) whether x2 holds a value that is not BF16-exact."""
        bad = (x2.to(BF16).to(x2.dtype) != x2).any()
        self._inexact = bad if self._inexact is None else (self._inexact | bad)

    def _blocked(self, x2: Tensor, dtype: torch.dtype, w: Tensor) -> Tensor:
        """x2·wᵀ in fp32 with x2 in `dtype`: in row blocks of row_block rows (the last one padded), or
        whole when `whole_rows` and x2 has more than one block."""
        M, B = x2.shape[0], self.row_block
        if M == 0:
            return x2.new_zeros(0, w.shape[0], dtype=F32)
        if self.unpadded:
            a = x2 if x2.dtype == dtype and x2.is_contiguous() else x2.to(dtype, memory_format=torch.contiguous_format)
            return _mm_fp32_out(a, w.t())
        if self.whole_rows and M > B:
            return _mm_fp32_out(x2 if _usable_as_is(x2, dtype) else _fresh(x2, dtype), w.t())
        rows = -(-M // B) * B
        a = _fresh(x2, dtype, rows)
        wt = w.t()
        blocks = [_mm_fp32_out(a[i:i + B], wt) for i in range(0, rows, B)]
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


def _takes_bf16_kernel(x2: Tensor, w: Tensor) -> bool:
    """Whether a `triton_rows` product of x2 [M, K] and the BF16 weight w [N, K] runs `kernels.bf16_linear`
    (CUDA tensors, or any under Triton's interpreter)."""
    from ..kernels.bf16_linear import MAX_ROWS
    from ..kernels.fp8_w8a8 import INTERPRETED

    return ((x2.is_cuda or INTERPRETED) and x2.shape[0] < MAX_ROWS and w.numel() <= BF16_KERNEL_MAX_ELEMENTS
            and w.stride(1) == 1 and w.shape[1] % TILE == 0)


def _rows(x: Tensor, K: int) -> Tensor:
    """x [..., K] as [M, K]: x itself when already 2-D (no view op)."""
    return x if x.dim() == 2 else x.reshape(-1, K)


def _unrows(y: Tensor, lead: torch.Size) -> Tensor:
    """y [M, N] as [*lead, N]: y itself when `lead` is one dimension (no view op)."""
    return y if len(lead) == 1 else y.reshape(*lead, y.shape[-1])


def _usable_as_is(x: Tensor, dtype: torch.dtype) -> bool:
    """Whether x can be a whole-rows GEMM's operand without the copy `_fresh` makes: already `dtype`,
    contiguous and 16-byte aligned (what a fresh allocation gives the GEMM's kernel choice)."""
    return x.dtype == dtype and x.is_contiguous() and x.data_ptr() % 16 == 0


def _fresh(x: Tensor, dtype: torch.dtype, rows: int | None = None) -> Tensor:
    """A new contiguous [rows, K] tensor in `dtype` whose first M rows are x (one copy kernel): every
    row block then starts at an allocator-aligned address + a multiple of row_block·K elements, so
    the GEMM sees the same shape and alignment for every block of every call (a cuBLAS kernel choice
    depends on both). Rows past M are left unwritten: a product row depends on its own row only, and
    the caller drops theirs."""
    M = x.shape[0]
    if rows is None or rows == M:
        return x.to(dtype, copy=True, memory_format=torch.contiguous_format)
    a = torch.empty(rows, x.shape[1], dtype=dtype, device=x.device)
    a[:M].copy_(x)
    return a


def _mm_fp32_out(a: Tensor, wt: Tensor) -> Tensor:
    """a·wt with fp32 accumulation and an fp32 result; BF16 operands on CUDA use the tensor cores."""
    if a.dtype == BF16 and a.is_cuda:
        return torch.mm(a, wt, out_dtype=F32)
    return torch.mm(a.to(F32), wt.to(F32))


def check_weights_for_cpu(weights: Mapping[str, object]) -> None:
    """The CPU backends multiply dequantised weights: E4M3 dense weights on CPU raise."""
    fp8 = [n for n, t in weights.items() if isinstance(t, Tensor) and t.dtype == FP8]
    if fp8:
        raise ValueError(f"dense backend: {len(fp8)} FP8 (E4M3) dense weight(s) on CPU, e.g. {fp8[0]}: the CPU "
                         "path multiplies dequantised weights (runtime_weights(..., dense_fp8=False))")


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


__all__ = ["ACCUMULATION_UNIT", "BlockedBf16Gemm", "ROW_BLOCK", "check_weights_for_cpu", "error_bound"]

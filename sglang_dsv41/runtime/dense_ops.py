"""The dense products of the CUDA forward on tensor cores (spec `model.md` §3.8; `triton_backend.TritonBackend.matmul`).

The reference evaluates every dense product as `x.f64 @ w.f64ᵀ` rounded once — exact, but on
CUDA a float64 copy of every weight per call. The CUDA backend (`runtime/triton_backend.py`) computes
that product with `BlockedBf16Gemm`; quantisation and the final rounding are the backend's.

Weights. FP8-stored dense weights (spec §2.3, 32×32 tiles) reach the CUDA runtime **as stored**:
`runtime/weights.py` puts the E4M3 tensor [N, K] under the weight's name and its fp32
power-of-two tile scales [⌈N/32⌉, ⌈K/32⌉] under the checkpoint's scale name (`….scale`); no
fp32 or BF16 copy exists. `DenseWeightCache` registers them as `Fp8Weight` and `BlockedBf16Gemm`
multiplies them with the Triton W8A16 GEMM `kernels.fp8_linear` (E4M3 tile → fp32 × scale → BF16,
exact; BF16 tensor-core products, fp32 accumulation; 1 + 4/1024 bytes per element). Every other
registered weight (fp32 tensors: BF16-kind weights, and an FP8 weight whose scales are outside
the BF16-exact range) is held once as a BF16 device copy when all its values are BF16-exact,
else kept fp32. The reference helpers receive the weight tensor the model code holds (an E4M3
tensor, or a view of one such as `wo_a`'s per-group rows); the cache resolves it — and any
view — by storage and offset, never by copying. E4M3 tensors must never reach the exact float64
math: `backend_for` refuses them on CPU.

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
calls and a concatenation per linear at 8K tokens); `whole_rows=True` (the CUDA serving default,
`backend.bf16_gemm_for`) multiplies a batch of more than `row_block` rows in one GEMM instead: the
same operands and fp32 accumulation, so the same GEMM_BOUND, but a row's bits then depend on the
batch's row count (like the FP8 row tiers of `w8a8_f16`); never with the deterministic backend.
`triton_rows=True` (with `whole_rows`; `backend.bf16_gemm_for`'s opt-in `triton`) multiplies fewer than
`kernels.bf16_linear.MAX_ROWS` rows by a BF16 weight of at most BF16_KERNEL_MAX_ELEMENTS on that Triton
kernel instead of a padded cuBLAS block (one launch, no copy): exact products, fp32 sums, the same
GEMM_BOUND, the bits of its row tiers. `unpadded=True` (with `whole_rows`; `backend.bf16_gemm_for`'s opt-in
`direct`) multiplies any row count in one cuBLAS GEMM on the activation as given: no padded block and no copy
(a decode row is one GEMV-shaped call), the same GEMM_BOUND, bits that depend on the row count.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import torch
from torch import Tensor


BF16 = torch.bfloat16
F32 = torch.float32
FP8 = torch.float8_e4m3fn
TILE = 32
#: rows per fixed-shape GEMM (see the module doc, "Row-block invariance")
ROW_BLOCK = 128
#: fp32 accumulation: one ulp (truncation) relative to a partial sum
ACCUMULATION_UNIT = 2.0**-23
#: `triton_rows` BF16 products (module doc): weights of at most this many elements take the Triton
#: kernel below its row limit; larger ones (the vocabulary head) stay on cuBLAS
BF16_KERNEL_MAX_ELEMENTS = 1 << 24


def is_dense_linear_name(name: str, ndim: int) -> bool:
    """Names of the weights the dense helpers multiply: 2-D `*.weight` other than the token /
    Engram embedding tables (read by row, not multiplied); hc_*_fn, q/k_weight are not `*.weight`
    names. Also used by the planner (`deploy/runtime_residency.py`) on the checkpoint inventory."""
    return ndim == 2 and name.endswith(".weight") and not name.endswith("embed.weight")


def is_dense_linear_weight(name: str, value: object) -> bool:
    """Weights consumed by the dense helpers: floating tensors with a dense-linear name
    (`is_dense_linear_name`); non-tensor values (packed MXFP4 experts, stored Engram tables,
    `runtime/weights.py`) are skipped."""
    return isinstance(value, Tensor) and value.is_floating_point() and is_dense_linear_name(name, value.dim())


def fp8_scale_key(name: str) -> str:
    """Where `runtime/weights.py` stores the fp32 tile scales of the E4M3 weight `name`
    (`….weight` → `….scale`, the checkpoint's own scale name, spec §2.1)."""
    if not name.endswith(".weight"):
        raise ValueError(f"{name}: an FP8 dense weight name ends with '.weight'")
    return name[: -len("weight")] + "scale"


@dataclass(frozen=True)
class Fp8Weight:
    """An FP8 weight (or a tile-row-aligned row slice of one) as the kernel takes it: E4M3 values
    [N, K] (unit stride along K) and the fp32 power-of-two scales [⌈N/32⌉, ⌈K/32⌉] of those rows;
    `counters`: the registered weight's split-K arrival counters (`kernels.fp8_w8a8.split_k_counters`,
    made at load, shared by its views), or None."""
    values: Tensor
    scales: Tensor
    counters: Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        return self.values.shape


@dataclass(frozen=True)
class _Entry:
    original: Tensor   # keeps the registered storage alive, so its address cannot be reused
    compute: Tensor    # contiguous BF16 copy, or `original` itself (fp32 kept, or E4M3 values)
    offset: int        # storage offset of `original` (elements)
    scales: Tensor | None = None   # FP8 entries: fp32 tile scales of `original`
    counters: Tensor | None = None  # FP8 entries on CUDA: split-K arrival counters (kernels.fp8_w8a8)


class DenseWeightCache:
    """Registered dense weights → what the backend multiplies, made once (at load), looked up per call.

    fp32 weights get a BF16 copy (or stay fp32, module doc); E4M3 weights are registered with
    their tile scales and used in place (`Fp8Weight`, no copy). Keyed by the weight's storage, so
    views of a registered weight (e.g. the per-group rows of `wo_a`) resolve to the same view of
    the copy / the same rows of the E4M3 tensor and scales. A weight must be registered before
    use: an unregistered fp32 or E4M3 weight raises (no silent per-call conversion). BF16 tensors
    are used as is. A lookup's result is kept per view (storage, offset, shape, strides, dtype,
    device), so a forward's repeated lookups of a view issue no tensor op; `add` / `add_fp8`
    forget the kept results.
    """

    def __init__(self) -> None:
        self._by_storage: dict[int, list[_Entry]] = {}
        self._found: dict[tuple, Tensor | Fp8Weight] = {}
        self._bf16_counters: dict[int, Tensor] = {}
        self.bf16_elements = 0
        self.fp32_elements = 0
        self.fp8_elements = 0
        self.scale_elements = 0

    @classmethod
    def from_weights(cls, weights: Mapping[str, object],
                     include: Callable[[str, object], bool] = is_dense_linear_weight) -> "DenseWeightCache":
        """A cache with `register(weights, include)`."""
        cache = cls()
        cache.register(weights, include)
        return cache

    def register(self, weights: Mapping[str, object],
                 include: Callable[[str, object], bool] = is_dense_linear_weight) -> None:
        """Register every weight `include` selects (default: the dense linear weights); an E4M3
        weight `name` takes its scales from `weights[fp8_scale_key(name)]`. Larger tensors first, so
        a stack (`runtime/stacked_linear.py`) is registered before its members, which resolve as its
        row views. Weights already registered (or views of one) are skipped."""
        by_size = sorted(weights.items(), key=lambda kv: -kv[1].numel() if isinstance(kv[1], Tensor) else 0)
        for name, value in by_size:
            if include(name, value):
                assert isinstance(value, Tensor)
                if value.dtype == FP8:
                    key = fp8_scale_key(name)
                    scales = weights.get(key)
                    if not isinstance(scales, Tensor):
                        raise KeyError(f"dense weight cache: FP8 weight {name} has no tile scales under {key}")
                    self.add_fp8(value, scales)
                else:
                    self.add(value)

    def add_fp8(self, values: Tensor, scales: Tensor) -> None:
        """Register a contiguous E4M3 weight [N, K] with its fp32 power-of-two tile scales
        [⌈N/32⌉, ⌈K/32⌉] (same device), used in place. The scales must make every value
        BF16-exact (`fp8_linear.scales_are_bf16_exact`; one host sync, at load)."""
        from ..kernels.fp8_linear import scales_are_bf16_exact

        if values.dtype != FP8 or values.dim() != 2 or not values.is_contiguous():
            raise ValueError(f"dense weight cache: expected a contiguous 2-D float8_e4m3fn weight, got "
                             f"{values.dtype} {tuple(values.shape)} strides {values.stride()}")
        want = (-(-values.shape[0] // TILE), -(-values.shape[1] // TILE))
        if scales.dtype != F32 or tuple(scales.shape) != want or not scales.is_contiguous() \
                or scales.device != values.device:
            raise ValueError(f"dense weight cache: FP8 tile scales must be contiguous fp32 {want} on {values.device}, "
                             f"got {scales.dtype} {tuple(scales.shape)} on {scales.device}")
        if not scales_are_bf16_exact(scales):
            raise ValueError("dense weight cache: FP8 tile scales outside 2^-124..2^119 (or not powers of two): "
                             "E4M3 × scale would not be BF16-exact; load this weight dequantised instead")
        if self._find(values) is not None:
            return
        self.fp8_elements += values.numel()
        self.scale_elements += scales.numel()
        key = values.untyped_storage().data_ptr()
        self._found.clear()
        counters = None
        if values.device.type == "cuda":
            from ..kernels.fp8_w8a8 import split_k_counters

            counters = split_k_counters(values.shape[0], values.device)
        self._by_storage.setdefault(key, []).append(_Entry(values, values, values.storage_offset(), scales, counters))

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
        self._found.clear()
        self._by_storage.setdefault(key, []).append(_Entry(weight, compute, weight.storage_offset()))
        if exact and weight.numel() <= BF16_KERNEL_MAX_ELEMENTS:
            from ..kernels.fp8_w8a8 import split_k_counters

            self._bf16_counters[as_bf16.untyped_storage().data_ptr()] = split_k_counters(weight.shape[0], weight.device)

    def bf16_counters(self, compute: Tensor) -> Tensor | None:
        """The split-K arrival counters (`kernels.bf16_linear`) of the BF16 copy `compute` (a lookup's
        result, or a view of one) belongs to, made at `add`; None for other tensors."""
        return self._bf16_counters.get(compute.untyped_storage().data_ptr())

    def _find(self, weight: Tensor) -> Tensor | Fp8Weight | None:
        for entry in self._by_storage.get(weight.untyped_storage().data_ptr(), ()):
            if entry.original.dtype != weight.dtype or entry.original.device != weight.device:
                continue
            rel = weight.storage_offset() - entry.offset
            last = rel + sum((n - 1) * s for n, s in zip(weight.shape, weight.stride()))
            if rel >= 0 and last < entry.original.numel():
                if entry.scales is not None:
                    return _fp8_rows(entry, weight, rel)
                return entry.compute.as_strided(weight.shape, weight.stride(), entry.compute.storage_offset() + rel)
        return None

    def lookup(self, weight: Tensor) -> Tensor | Fp8Weight:
        """What the backend multiplies for a registered weight or a view of one: the compute copy
        (same shape and strides) of an fp32 weight, `Fp8Weight` (the same rows, no copy) of an
        E4M3 weight, a BF16 tensor itself."""
        if weight.dtype == BF16:
            return weight
        view = (weight.untyped_storage().data_ptr(), weight.storage_offset(), tuple(weight.shape), weight.stride(),
                weight.dtype, weight.device)
        found = self._found.get(view)
        if found is None:
            found = self._find(weight)
            if found is not None:
                self._found[view] = found
        if found is None:
            raise KeyError(f"dense backend: weight {tuple(weight.shape)} {weight.dtype} on {weight.device} is not "
                           "registered (DenseWeightCache.add / add_fp8 / from_weights at load)")
        return found

    def resident_bytes(self) -> int:
        """Device bytes of what the cache multiplies: BF16 copies, kept fp32 weights, E4M3 values
        and their fp32 tile scales (the fp32 originals of BF16 copies are the caller's)."""
        return 2 * self.bf16_elements + 4 * self.fp32_elements + self.fp8_elements + 4 * self.scale_elements

    def describe(self) -> str:
        return (f"dense weight cache: {self.fp8_elements / 1e6:.1f} M FP8 elements in place "
                f"({(self.fp8_elements + 4 * self.scale_elements) / 2**30:.2f} GiB with scales), "
                f"{self.bf16_elements / 1e6:.1f} M BF16 elements ({2 * self.bf16_elements / 2**30:.2f} GiB), "
                f"{self.fp32_elements / 1e6:.1f} M kept fp32")


def _fp8_rows(entry: _Entry, view: Tensor, rel: int) -> Fp8Weight:
    """`Fp8Weight` of a view of a registered E4M3 weight: only whole rows starting on a tile row
    (the kernel applies one scale row per 32 weight rows); anything else raises."""
    assert entry.scales is not None
    N, K = entry.original.shape
    if view.dim() != 2 or view.shape[1] != K or view.stride(1) != 1 or (view.shape[0] > 1 and view.stride(0) != K) \
            or rel % K or (rel // K) % TILE:
        raise ValueError(f"dense backend: view {tuple(view.shape)} strides {view.stride()} at element {rel} of FP8 "
                         f"weight [{N}, {K}] is not a row slice starting on a {TILE}-row tile boundary")
    row0 = rel // K
    scales = entry.scales[row0 // TILE: -(-(row0 + view.shape[0]) // TILE)]
    return Fp8Weight(view, scales, entry.counters)


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
            return _mm_fp32_out(_fresh(x2, dtype), w.t())
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


__all__ = ["ACCUMULATION_UNIT", "BlockedBf16Gemm", "DenseWeightCache", "FP8", "Fp8Weight", "ROW_BLOCK", "TILE",
           "check_weights_for_cpu", "error_bound", "fp8_scale_key", "is_dense_linear_name",
           "is_dense_linear_weight"]

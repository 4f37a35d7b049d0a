"""The dense linear weights the CUDA backend multiplies, registered once at load (spec `model.md` §2.3, §3.8;
`runtime/dense_ops.py` multiplies them).

FP8-stored dense weights (spec §2.3, 32×32 tiles) reach the CUDA runtime **as stored**:
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
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import torch
from torch import Tensor

BF16 = torch.bfloat16
F32 = torch.float32
FP8 = torch.float8_e4m3fn
#: FP8 weight tiles are TILE × TILE (spec §2.3)
TILE = 32
#: `triton_rows` BF16 products (`dense_ops`): weights of at most this many elements take the Triton kernel below its row
#: limit, and get its split-K counters here; larger ones (the vocabulary head) stay on cuBLAS
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


__all__ = ["BF16_KERNEL_MAX_ELEMENTS", "DenseWeightCache", "FP8", "Fp8Weight", "TILE", "fp8_scale_key",
           "is_dense_linear_name", "is_dense_linear_weight"]

"""The mHC hyper-connection ops, implemented per device (spec `model.md` §3.2).

Each function has the signature of its `reference.mhc` namesake and dispatches on the
residual's device — explicitly, never as a fallback for a failing kernel:

| residual on | implementation |
|---|---|
| CPU  | `reference.mhc` (the oracle itself, float64 torch ops) |
| CUDA | `kernels.mhc` (fused Triton: 2 launches for the coefficients, 1 per other op) |

Any other device raises `ValueError`; kernel errors propagate.

Numerics on CUDA (stated in `kernels/mhc.py`): `hc_residual_update`, `hc_collapse` and the
weighted sum of `hc_sublayer_input` are bit-identical to the reference; the sublayer input's
RMSNorm (float64, rounded once) is bitwise equal except where the float64 summation order of
Σx² moves a value across an fp32 rounding boundary (probability ~2⁻²⁹ per element);
`hc_coefficients` (float64 inside, rounded once to fp32) is within 1 fp32 ulp of the reference.
Every op is batch invariant and CUDA-graph capturable.
"""
from __future__ import annotations

from torch import Tensor

from ..reference import mhc as reference
from ..reference.mhc import HcCoefficients

__all__ = ["HcCoefficients", "hc_coefficients", "hc_sublayer_input", "hc_residual_update", "hc_collapse"]


def _on_cuda(op: str, residual: Tensor) -> bool:
    """True for CUDA tensors (kernels), False for CPU tensors (reference); other devices raise."""
    kind = residual.device.type
    if kind == "cuda":
        return True
    if kind == "cpu":
        return False
    raise ValueError(f"{op}: no mHC implementation for {residual.device} tensors (CPU → reference, CUDA → kernels)")


def _kernels():
    from ..kernels import mhc as kernels   # Triton is imported only where the kernels run
    return kernels


def hc_coefficients(residual: Tensor, fn: Tensor, base: Tensor, scale: Tensor, *,
                    rms_eps: float, hc_eps: float, sinkhorn_iters: int) -> HcCoefficients:
    """pre/post/comb of one hyper-connection from the residual entering it (spec §3.2)."""
    impl = _kernels() if _on_cuda("hc_coefficients", residual) else reference
    return impl.hc_coefficients(residual, fn, base, scale, rms_eps=rms_eps, hc_eps=hc_eps,
                                sinkhorn_iters=sinkhorn_iters)


def hc_sublayer_input(residual: Tensor, carried_pre: Tensor | None, norm_weight: Tensor,
                      rms_eps: float) -> Tensor:
    """RMSNorm(bf16(Σ_j pre_j·R_j)) with the lagged pre; stream 0 when `carried_pre` is None (spec §3.2)."""
    impl = _kernels() if _on_cuda("hc_sublayer_input", residual) else reference
    return impl.hc_sublayer_input(residual, carried_pre, norm_weight, rms_eps)


def hc_residual_update(residual: Tensor, sublayer_out: Tensor, coeffs: HcCoefficients) -> Tensor:
    """R'_k = bf16(post_k·y + Σ_j comb_jk·R_j) in fp32 math (spec §3.2)."""
    impl = _kernels() if _on_cuda("hc_residual_update", residual) else reference
    return impl.hc_residual_update(residual, sublayer_out, coeffs)


def hc_collapse(residual: Tensor, last_pre: Tensor) -> Tensor:
    """Final stream reduction h = bf16(Σ_j pre_j·R_j) with the last ffn-hc's pre (spec §3.2)."""
    impl = _kernels() if _on_cuda("hc_collapse", residual) else reference
    return impl.hc_collapse(residual, last_pre)

"""The CUDA forward's one-launch elementwise helpers (`ops.FusedKernels` on Triton; issue 3).

The reference helpers (`ops.bf16`, `ops.e4m3`, `ops.fp8_act_fake_quant`, `ops.fp4_fake_quant_*`,
`ops.rms_norm`, `ops.apply_rope_tail`, `attention.rms_norm_fp32`, `moe.clamped_swiglu`, the
selection of `moe.route`) each run 8–25 small torch kernels. Inside `fused_elementwise()` they
run one Triton kernel each (`kernels/fused_elementwise.py`) for tensors on a CUDA device — and
their own code for any other tensor, so a CPU forward inside the block is unchanged.

Numerics (kernels/fused_elementwise.py states the details): `bf16`, `e4m3`, the FP8 / FP4 fake
quantisations and the top-k selection are bit-identical to the reference; RoPE is the
reference's fp32 rotation of fp32-rounded float64 cos/sin; `rms_norm`, SwiGLU and the routing
weights evaluate the reference's float64 formula and round once — all equal to the reference
except for rare one-ulp flips (fp32 ulp, or BF16 ulp where the output is BF16) where a float64
value sits within a few float64 ulps of a rounding boundary. Every kernel is
batch invariant and CUDA-graph capturable (no host sync, no host→device copy).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

from torch import Tensor

from ..kernels import fused_elementwise as fe
from ..reference import ops


class TritonFusedElementwise:
    """`ops.FusedKernels` on the Triton kernels of `kernels.fused_elementwise`.

    `device_types`: the tensor devices it accepts — ("cuda",) in the runtime; ("cpu",) only in
    tests, where the kernels run under Triton's interpreter (TRITON_INTERPRET=1 before triton is
    imported), to emulate the CUDA forward's dispatch on CPU."""

    def __init__(self, device_types: tuple[str, ...] = ("cuda",)) -> None:
        unknown = set(device_types) - {"cuda", "cpu"}
        if unknown:
            raise ValueError(f"TritonFusedElementwise: unknown device types {sorted(unknown)}")
        if "cpu" in device_types and not fe.INTERPRETED:
            raise ValueError("TritonFusedElementwise: CPU tensors need Triton's interpreter "
                             "(TRITON_INTERPRET=1 set before triton is first imported)")
        self.device_types = tuple(device_types)

    def accepts(self, x: Tensor) -> bool:
        return x.device.type in self.device_types

    def bf16(self, x: Tensor) -> Tensor:
        return fe.round_bf16(x)

    def e4m3(self, x: Tensor) -> Tensor:
        return fe.round_e4m3(x)

    def fp8_act_fake_quant(self, x: Tensor, group: int) -> Tensor:
        return fe.fp8_act_fake_quant(x, group)

    def fp4_fake_quant_e4m3_scale(self, x: Tensor, group: int) -> Tensor:
        return fe.fp4_fake_quant(x, group, "e4m3")

    def fp4_fake_quant_ue8m0_scale(self, x: Tensor, group: int) -> Tensor:
        return fe.fp4_fake_quant(x, group, "ue8m0")

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float, round_bf16: bool) -> Tensor:
        return fe.rms_norm(x, weight, eps, round_bf16)

    def apply_rope_tail(self, x: Tensor, positions: Tensor, inv_freq: Tensor, inverse: bool) -> Tensor:
        return fe.apply_rope_tail(x, positions, inv_freq, inverse)

    def clamped_swiglu(self, gate: Tensor, up: Tensor, limit: float) -> Tensor:
        return fe.clamped_swiglu(gate, up, limit)

    def route_select(self, scores: Tensor, bias: Tensor, top_k: int, renorm_eps: float,
                     bias_vl: Tensor | None, image_rows: Tensor | None) -> tuple[Tensor, Tensor]:
        return fe.route_select(scores, bias, top_k, renorm_eps, bias_vl, image_rows)


@contextlib.contextmanager
def fused_elementwise(kernels: ops.FusedKernels | None = None) -> Iterator[None]:
    """Run the block's reference helpers through `kernels` (default: `TritonFusedElementwise()`,
    CUDA tensors only) — `ops.fused_kernels`; entered by the CUDA forward next to
    `dense_ops.dense_math`."""
    with ops.fused_kernels(TritonFusedElementwise() if kernels is None else kernels):
        yield


__all__ = ["TritonFusedElementwise", "fused_elementwise"]

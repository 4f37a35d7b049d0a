"""The runtime's activations in fp32 again, for the duration of a scope: the dtypes before session 26
(`runtime/backend.py` BF16_OUT), so one benchmark process can time both (`prefill_profile.py` variant
`fp32_activations`, `model_step.py` MODEL_STEP_ACTIVATIONS=fp32). Same values; nothing in `runtime/`
changes outside the scope.
"""
from __future__ import annotations

import torch


class Fp32Activations:
    """Scope in which `backend` (an instance) ignores `bf16_out`, the CUDA mHC writes its sublayer input
    as fp32 (its quantised copy for the FP8 hand-off stays BF16) and the CUDA attention widens its output to
    fp32: the activations' dtypes before session 26 (same values; `runtime/backend.py` BF16_OUT). The SWA
    row's input rounding stays in the RoPE launch."""

    METHODS = ("linear_fp8", "linear_bf16_grouped", "bf16_rope_tail")

    def __init__(self, backend) -> None:
        self.backend = backend

    def __enter__(self) -> "Fp32Activations":
        from sglang_dsv41.runtime import attention_ops, mhc_ops

        for name in self.METHODS:
            method = getattr(self.backend, name)
            setattr(self.backend, name, lambda *a, _m=method, bf16_out=False, **kw: _m(*a, **kw))
        self.saved_input = mhc_ops.TritonMhc.sublayer_input
        self.saved_inputs = mhc_ops.TritonMhc.sublayer_inputs
        mhc_ops.TritonMhc.sublayer_input = (lambda mhc, residual, pre, weight, eps:
                                            mhc.k.hc_sublayer_input(residual, pre, weight, eps))
        mhc_ops.TritonMhc.sublayer_inputs = (lambda mhc, residual, pre, weight, eps:
                                             mhc.k.hc_sublayer_input(residual, pre, weight, eps, quantised=True))
        attend = self.saved_attend = attention_ops.KernelAttentionOps.attend
        attention_ops.KernelAttentionOps.attend = lambda ops, *a, **kw: attend(ops, *a, **kw).to(torch.float32)
        return self

    def __exit__(self, *exc) -> None:
        from sglang_dsv41.runtime import attention_ops, mhc_ops

        for name in self.METHODS:
            self.backend.__dict__.pop(name, None)
        mhc_ops.TritonMhc.sublayer_input = self.saved_input
        mhc_ops.TritonMhc.sublayer_inputs = self.saved_inputs
        attention_ops.KernelAttentionOps.attend = self.saved_attend

"""The ViT's attention core and linear operand precision, per device (issue 17; docs/vision.md
"Vision tower"; spec `model.md` §5.2).

Backends (`pick_backend`; `VisionTower(cfg, attention=...)` overrides ``auto``):

* ``sdpa`` — torch's `scaled_dot_product_attention` on fp32 operands holding BF16 values, linears
  multiplied in fp32. The CPU path (``auto`` on every device but CUDA).
* ``triton`` — SGLang's `VisionTritonAttention` (its non-causal `context_attention_fwd` Triton
  kernel) on BF16 operands. ``auto`` on CUDA: it met the reference bound on the H200
  (docs/vision.md); it also runs on CPU tensors under ``TRITON_INTERPRET=1``.
* ``fa3`` — SGLang 0.5.17's `VisionFlash3Attention` (sgl_kernel's FA3 varlen kernel, the one its
  `VisionAttention` runs with ``qkv_backend="fa3"``) on BF16 operands, CUDA SM 9.x only. Named
  only: its tower test failed on the H200 (docs/vision.md "Not done").

With ``fa3`` / ``triton`` the tower's linears take BF16 operands too (`linear`): the weights hold
BF16 values, so casting them is exact, and a BF16 GEMM accumulates in fp32 and rounds its output
once — the reference's "fp32 product rounded once" up to the accumulation order.

Invariant: `attend(q, k, v)` with q, k, v [N, heads, hd] (fp32 holding BF16 values, one image,
bidirectional) returns [N, heads·hd] fp32 holding the BF16 rounding of softmax(q·kᵀ/√hd)·v.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

BF16, F32 = torch.bfloat16, torch.float32
BACKENDS = ("sdpa", "fa3", "triton")


def _bf16(x: Tensor) -> Tensor:
    """fp32 holding the BF16 rounding of `x` (the same live tensors as `vision._bf16`, which the
    planner's activation formula counts: tests/test_vision_activation.py)."""
    return x.to(BF16).to(F32)


def pick_backend(requested: str, device: torch.device) -> str:
    """The backend for `device`: ``auto`` → triton on CUDA, sdpa elsewhere;
    a named backend is checked against the device (a clear error, never a silent fallback)."""
    if requested not in ("auto", *BACKENDS):
        raise ValueError(f"unknown ViT attention backend {requested!r}: one of auto, {', '.join(BACKENDS)}")
    if requested == "auto":
        return "triton" if device.type == "cuda" else "sdpa"
    if requested == "fa3" and (device.type != "cuda" or torch.cuda.get_device_capability(device)[0] != 9):
        raise ValueError(f"ViT attention 'fa3' needs a CUDA SM 9.x device, not {device}")
    return requested


class ViTAttention:
    """One backend's attention core and linear precision (module doc). Holds no parameters."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self.fast = backend != "sdpa"
        self._core = None
        if backend == "fa3":
            from sglang.srt.layers.attention.vision import VisionFlash3Attention

            self._core = VisionFlash3Attention(use_data_parallel=True)
        elif backend == "triton":
            from sglang.srt.layers.attention.vision import VisionTritonAttention

            self._core = VisionTritonAttention(use_data_parallel=True)

    def describe(self) -> str:
        return {"sdpa": "torch SDPA, fp32 operands", "fa3": "SGLang VisionFlash3Attention (FA3), BF16 operands",
                "triton": "SGLang VisionTritonAttention, BF16 operands"}[self.backend]

    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        """fp32 holding the BF16 rounding of x·Wᵀ + b (x and W BF16-valued)."""
        if self.fast:
            return F.linear(x.to(BF16), weight.to(BF16), None if bias is None else bias.to(BF16)).to(F32)
        return _bf16(F.linear(x, weight, bias))

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        n, heads, hd = q.shape
        if self._core is None:
            out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
            return _bf16(out.transpose(0, 1).reshape(n, heads * hd))
        cu_seqlens = torch.tensor([0, n], dtype=torch.int32, device=q.device)
        out = self._core.forward(q.to(BF16).contiguous(), k.to(BF16).contiguous(), v.to(BF16).contiguous(),
                                 cu_seqlens=cu_seqlens, bsz=1, seq_len=n, softmax_scale=hd ** -0.5, max_seqlen=n)
        return out.reshape(n, heads * hd).to(F32)

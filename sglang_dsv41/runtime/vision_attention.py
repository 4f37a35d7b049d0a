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

Invariant: `attend(q, k, v, segs)` with q, k, v [N, heads, hd] (fp32 holding BF16 values) packing
the images of `segs` (`Segments`: row i of image j at `segs.cu[j] + i`) returns [N, heads·hd] fp32
holding the BF16 rounding of softmax(q·kᵀ/√hd)·v, each image attending to itself only
(bidirectional). ``fa3`` / ``triton`` make one varlen kernel call over `segs.cu_seqlens`; ``sdpa``
runs one SDPA per image (its math kernel holds one image's heads × L × L scores at a time).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .vision_calls import auto_backend

BF16, F32 = torch.bfloat16, torch.float32
BACKENDS = ("sdpa", "fa3", "triton")


@dataclass(frozen=True)
class Segments:
    """The images packed into one ViT call: host offsets `cu` [0, L₀, L₀+L₁, …], their int32 copy
    on the device (built once per call, not per layer) and the longest image."""
    cu: tuple[int, ...]
    cu_seqlens: Tensor
    max_len: int

    @classmethod
    def of(cls, lengths: list[int], device: torch.device) -> "Segments":
        if not lengths or min(lengths) < 1:
            raise ValueError(f"a ViT call needs images of at least one patch, got lengths {lengths}")
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        return cls(tuple(cu), torch.tensor(cu, dtype=torch.int32, device=device), max(lengths))


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
        return auto_backend(device.type)
    if requested == "fa3" and (device.type != "cuda" or torch.cuda.get_device_capability(device)[0] != 9):
        raise ValueError(f"ViT attention 'fa3' needs a CUDA SM 9.x device, not {device}")
    return requested


class ViTAttention:
    """One backend's attention core and linear precision (module doc). Holds no parameters."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self.fast = backend != "sdpa"
        #: the dtype the tower's patches enter the first linear in (BF16-valued either way)
        self.operand_dtype = BF16 if self.fast else F32
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

    def attend(self, q: Tensor, k: Tensor, v: Tensor, segs: Segments) -> Tensor:
        n, heads, hd = q.shape
        if n != segs.cu[-1]:
            raise ValueError(f"attention over {n} rows, the call's segments cover {segs.cu[-1]}")
        if self._core is None:
            out = torch.empty(n, heads * hd, dtype=F32, device=q.device)
            for s, e in zip(segs.cu[:-1], segs.cu[1:]):
                o = F.scaled_dot_product_attention(q[s:e].transpose(0, 1), k[s:e].transpose(0, 1),
                                                   v[s:e].transpose(0, 1))
                out[s:e] = o.transpose(0, 1).reshape(e - s, heads * hd)
                del o
            return _bf16(out)
        out = self._core.forward(q.to(BF16).contiguous(), k.to(BF16).contiguous(), v.to(BF16).contiguous(),
                                 cu_seqlens=segs.cu_seqlens, bsz=len(segs.cu) - 1, seq_len=segs.max_len,
                                 softmax_scale=hd ** -0.5, max_seqlen=segs.max_len)
        return out.reshape(n, heads * hd).to(F32)

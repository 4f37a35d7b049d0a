"""Load-time conversion of checkpoint MXFP4 experts into the Hopper layout of `triton_kernels.matmul_ogs`
(spec `model.md` §2.3: E2M1 pairs + UE8M0 scales per 32 values), and its exact inverse for checks.

Invariant: `dequantize_prepared(prepare_mxfp4_stacked(...))` gives the checkpoint's logical fp32
weights bit for bit (zero padding with scale byte 127 keeps the padded GEMMs exact); a UE8M0 NaN
scale byte is refused at load. The kernel that multiplies by these weights, its routing plan and
the decision to reuse `matmul_ogs` are in `kernels/moe_mxfp4.py`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from triton_kernels.tensor import FP4, Storage
from triton_kernels.tensor import Tensor as TKTensor
from triton_kernels.tensor_details.layout import HopperMXScaleLayout, HopperMXValueLayout

from sglang_dsv41.checkpoint.codecs import E2M1_VALUES, TILE, UE8M0_NAN_BYTE, packed_fp4_bytes, scale_bytes

HIDDEN_ALIGN = 256        # N tile of the Hopper scale swizzle (2·warps·2·8 with 8 warps); K of GEMM1
INTERMEDIATE_ALIGN = 128  # K tile (block_k) of the Hopper mxfp4 kernel; 2·I is then a multiple of 256
SCALE_NUM_WARPS = 8       # the kernel's num_warps equals the scale layout's (opt_flags_nvidia)
UE8M0_ONE = 127           # scale byte of padding groups (their codes are 0 → value 0)
PREPARE_CHUNK = 16        # experts converted at a time (bounds the swizzle's temporaries)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


@dataclass(frozen=True)
class PreparedMxfp4Experts:
    """Experts in the Hopper mxfp4 layout of `matmul_ogs` (logical shapes, K before N):
    w13 [E, H_pad, 2·I_pad] (columns interleaved gate/up), w2 [E, I_pad, H_pad], each with its
    UE8M0 scale tensor [E, K/32, N]. Zero padding (scale byte 127) makes the padded GEMM exact."""

    w13: TKTensor
    w13_scale: TKTensor
    w2: TKTensor
    w2_scale: TKTensor
    n_experts: int
    hidden: int
    intermediate: int
    hidden_padded: int
    intermediate_padded: int

    def checkpoint_bytes_per_expert(self) -> int:
        """Bytes one expert occupies in the checkpoint (packed values + scales, unpadded)."""
        H, I = self.hidden, self.intermediate
        return 2 * (I * H // 2 + I * H // TILE) + (H * I // 2 + H * I // TILE)


def _check_scales(s: Tensor, what: str) -> None:
    if bool((s == UE8M0_NAN_BYTE).any()):
        raise ValueError(f"{what}: UE8M0 scale byte 255 (NaN) present; refusing to load it")


def _pad_last2(t: Tensor, rows: int, cols: int, value: int) -> Tensor:
    return F.pad(t, (0, cols - t.shape[-1], 0, rows - t.shape[-2]), value=value)


def _swizzle_into(out: Tensor | None, chunk: Tensor, layout, e0: int, n_experts: int) -> Tensor:
    """Swizzle `chunk` [c, K', N] (a transposed view) and place it at experts e0.. of `out`."""
    data = layout.swizzle_data(chunk)          # the .mT of a contiguous [c, ·, ·] tensor
    base = data.mT
    if not base.is_contiguous():
        raise RuntimeError("triton_kernels swizzle returned an unexpected memory layout")
    if out is None:
        out = torch.empty((n_experts,) + tuple(base.shape[1:]), dtype=base.dtype, device=base.device)
    out[e0:e0 + base.shape[0]].copy_(base)
    return out


def prepare_mxfp4_stacked(w1: Tensor, w1_scale: Tensor, w3: Tensor, w3_scale: Tensor,
                          w2: Tensor, w2_scale: Tensor, *, device: torch.device | str | None = None
                          ) -> PreparedMxfp4Experts:
    """Stacked checkpoint tensors → `PreparedMxfp4Experts` on `device` (default: w1's device).

    w1, w3 [E, I, H/2] and w2 [E, H, I/2] packed E2M1 (uint8/int8/float4_e2m1fn_x2); scales
    [E, I, H/32] and [E, H, I/32] (float8_e8m0fnu or uint8). Spec §2.3 layout, as stored.
    Inputs may stay on the CPU: each chunk of experts is moved to `device` before it is swizzled
    (do it on the GPU at Flash size: the swizzle's temporaries are ~20× a chunk's bytes).
    """
    b1, b3, b2 = (packed_fp4_bytes(t) for t in (w1, w3, w2))
    s1, s3, s2 = (scale_bytes(t) for t in (w1_scale, w3_scale, w2_scale))
    if b1.dim() != 3:
        raise ValueError(f"w1 must be stacked [E, I, H/2], got {tuple(b1.shape)}")
    E, I, H = b1.shape[0], b1.shape[1], 2 * b1.shape[2]
    want = {"w1": (b1, (E, I, H // 2)), "w3": (b3, (E, I, H // 2)), "w2": (b2, (E, H, I // 2)),
            "w1.scale": (s1, (E, I, H // TILE)), "w3.scale": (s3, (E, I, H // TILE)),
            "w2.scale": (s2, (E, H, I // TILE))}
    for name, (t, shape) in want.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"{name}: shape {tuple(t.shape)}, expected {shape} (E={E}, I={I}, H={H})")
    if H % TILE or I % TILE:
        raise ValueError(f"hidden {H} and intermediate {I} must be multiples of {TILE} (MXFP4 groups)")
    for name, s in (("w1.scale", s1), ("w3.scale", s3), ("w2.scale", s2)):
        _check_scales(s, name)
    dev = torch.device(device) if device is not None else b1.device
    Hp, Ip = _round_up(H, HIDDEN_ALIGN), _round_up(I, INTERMEDIATE_ALIGN)
    lay13 = HopperMXValueLayout([E, Hp // 2, 2 * Ip], mx_axis=1)
    lay13s = HopperMXScaleLayout([E, Hp // TILE, 2 * Ip], mx_axis=1, num_warps=SCALE_NUM_WARPS)
    lay2 = HopperMXValueLayout([E, Ip // 2, Hp], mx_axis=1)
    lay2s = HopperMXScaleLayout([E, Ip // TILE, Hp], mx_axis=1, num_warps=SCALE_NUM_WARPS)
    o13 = o13s = o2 = o2s = None
    for e0 in range(0, E, PREPARE_CHUNK):
        sl = slice(e0, min(E, e0 + PREPARE_CHUNK))
        c = sl.stop - sl.start
        g, u = (_pad_last2(t[sl].to(dev), Ip, Hp // 2, 0) for t in (b1, b3))
        gs, us = (_pad_last2(t[sl].to(dev), Ip, Hp // TILE, UE8M0_ONE) for t in (s1, s3))
        w13 = torch.stack((g, u), dim=2).reshape(c, 2 * Ip, Hp // 2)       # rows: g0 u0 g1 u1 ...
        s13 = torch.stack((gs, us), dim=2).reshape(c, 2 * Ip, Hp // TILE)
        d2 = _pad_last2(b2[sl].to(dev), Hp, Ip // 2, 0)
        d2s = _pad_last2(s2[sl].to(dev), Hp, Ip // TILE, UE8M0_ONE)
        o13 = _swizzle_into(o13, w13.mT, lay13, e0, E)
        o13s = _swizzle_into(o13s, s13.mT, lay13s, e0, E)
        o2 = _swizzle_into(o2, d2.mT, lay2, e0, E)
        o2s = _swizzle_into(o2s, d2s.mT, lay2s, e0, E)
    return PreparedMxfp4Experts(
        w13=TKTensor(Storage(o13.mT, lay13), dtype=FP4, shape=[E, Hp, 2 * Ip]),
        w13_scale=TKTensor(Storage(o13s.mT, lay13s), dtype=torch.uint8, shape=[E, Hp // TILE, 2 * Ip]),
        w2=TKTensor(Storage(o2.mT, lay2), dtype=FP4, shape=[E, Ip, Hp]),
        w2_scale=TKTensor(Storage(o2s.mT, lay2s), dtype=torch.uint8, shape=[E, Ip // TILE, Hp]),
        n_experts=E, hidden=H, intermediate=I, hidden_padded=Hp, intermediate_padded=Ip)


def prepare_mxfp4_experts(weights: Mapping[str, Tensor], prefix: str, n_experts: int, *,
                          experts: Sequence[int] | None = None,
                          device: torch.device | str | None = None) -> PreparedMxfp4Experts:
    """Checkpoint tensors `{prefix}ffn.experts.{e}.w1/w2/w3.weight` and `.scale` (as stored;
    `prefix` = `layers.3.` or `mtp.0.`) → prepared experts. `experts` selects (and orders) the
    experts to load (default: all `n_experts`); routing ids then index that list."""
    ids = list(range(n_experts)) if experts is None else [int(e) for e in experts]
    if not ids or any(not 0 <= e < n_experts for e in ids):
        raise ValueError(f"experts must be a non-empty subset of 0..{n_experts - 1}")
    p = f"{prefix}ffn.experts."

    def stack(e_name: str) -> Tensor:
        missing = [f"{p}{e}.{e_name}" for e in ids if f"{p}{e}.{e_name}" not in weights]
        if missing:
            raise KeyError(f"missing checkpoint tensors: {missing[:3]}{' …' if len(missing) > 3 else ''}")
        raw = scale_bytes if e_name.endswith(".scale") else packed_fp4_bytes
        return torch.stack([raw(weights[f"{p}{e}.{e_name}"]) for e in ids])

    return prepare_mxfp4_stacked(stack("w1.weight"), stack("w1.scale"), stack("w3.weight"),
                                 stack("w3.scale"), stack("w2.weight"), stack("w2.scale"), device=device)


def _decode_as_kernel(values: TKTensor, scales: TKTensor) -> Tensor:
    """Logical [E, N, K] fp32 of a prepared weight, decoded the way the kernel does: unswizzle,
    E2M1 (low nibble = even k), scale byte b → the BF16 with bits b<<7 (2^(b−127); b = 0 → 0)."""
    packed = values.storage.layout.unswizzle_data(values.storage.data).mT      # [E, N, K/2]
    sb = scales.storage.layout.unswizzle_data(scales.storage.data).mT          # [E, N, K/32]
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2).long()
    scale = (sb.to(torch.int32) << 23).view(torch.float32)                     # b = 0 → +0.0
    E, N, K = codes.shape
    return (table[codes].view(E, N, K // TILE, TILE) * scale[:, :N, :K // TILE, None]).view(E, N, K)


def dequantize_prepared(prepared: PreparedMxfp4Experts, *, crop: bool = True) -> dict[str, Tensor]:
    """fp32 weights the kernel multiplies by: `w1`, `w3` [E, I, H] and `w2` [E, H, I] (with
    `crop=False`: padded shapes, padding included). For checks; not used on the hot path."""
    w13 = _decode_as_kernel(prepared.w13, prepared.w13_scale)                  # [E, 2·I_pad, H_pad]
    w2 = _decode_as_kernel(prepared.w2, prepared.w2_scale)                     # [E, H_pad, I_pad]
    H, I = (prepared.hidden, prepared.intermediate) if crop else (prepared.hidden_padded,
                                                                  prepared.intermediate_padded)
    return {"w1": w13[:, 0::2][:, :I, :H], "w3": w13[:, 1::2][:, :I, :H], "w2": w2[:, :H, :I]}

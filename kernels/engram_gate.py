"""The Engram gate in fp32, one Triton launch (spec `model.md` §3.3.2; issue 21: no float64 on the GPU path).

`engram_gate(residual, keys, q_weight, k_weight, eps)` → g [T, hc] fp32, with h = residual[t, j],
k = keys[t, j] (BF16 or fp32 values, [T, hc, H]) and w = q_weight[j]·k_weight[j] ([hc, H]):

    dot = Σ h·w·k · rsqrt(mean h² + eps) · rsqrt(mean k² + eps) · H^−½
    g   = sigmoid(copysign(sqrt(max(|dot|, 1e−6)), dot))

the formula of `reference.engram.engram_gate`, which evaluates it in float64 and rounds once.
Here every operation is fp32: one program per (t, j) row, the three sums accumulated per lane
over fixed BLOCK_H-wide steps then reduced by `tl.sum` — an order that depends on H only, so a
row's bits depend on that row alone (batch invariant). Division, square roots: IEEE
(`div_rn`, `sqrt_rn`); exp: the device's. Bound (tests/test_kernels_engram_gate.py): each sum
is within H·2⁻²³ of its magnitude sum, the product of three such factors and H^−½ within
≈ (3H + 8)·2⁻²⁴ relative of dot; sigmoid of the signed square root halves that relative error
and scales it by ≤ ¼·|√dot| — |g − g_ref| ≤ 2⁻¹⁴ for H ≤ 4096 (asserted with margin on
Flash widths on the GPU, on random rows under the interpreter).

`engram_residual(residual, keys, value, q_weight, k_weight, eps, image_rows)` → (R', g): the same gate, then in the
same program the residual update of `runtime.engram_gate.engram_update`, R'[t, j] = bf16(R[t, j] + g·value[t]) (fp32
product, then fp32 sum, rounded to BF16 on the bit pattern: torch's bits for that g; image rows keep R) — one launch
where the torch update took five. Launches compile with `enable_fp_fusion=False` (no FMA contraction), which the
update's bits need; the gate's sums then round per operation, within the same bound.

Under `TRITON_INTERPRET=1` the kernel runs on CPU tensors (tests); otherwise CPU tensors raise.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.interpreter import InterpretedFunction

from sglang_dsv41.kernels.fused_elementwise import _round_bf16, check_device

#: |dot| is clamped below by this before the square root (spec §3.3.2)
GATE_DOT_FLOOR = 1e-6
#: lanes per step along H (fixed: the summation order depends on H only)
MAX_BLOCK_H = 1024
NUM_WARPS = 4


@triton.jit
def _engram_gate_kernel(h_ptr, k_ptr, qw_ptr, kw_ptr, out_ptr, HC, H, stride_ht, stride_hj, stride_kt, stride_kj,
                        v_ptr, stride_vt, image_ptr, r_out_ptr, stride_ot, stride_oj,
                        EPS: tl.constexpr, FLOOR: tl.constexpr, BLOCK_H: tl.constexpr,
                        UPDATE: tl.constexpr = False, HAS_IMAGE: tl.constexpr = False, OUT_BF16: tl.constexpr = False):
    """One (t, j) row: g; with UPDATE also R'[t, j] = bf16(R + g·value[t]) (R itself on image rows)."""
    row = tl.program_id(0)
    t = row // HC
    j = row % HC
    offs = tl.arange(0, BLOCK_H)
    h_row = h_ptr + t.to(tl.int64) * stride_ht + j * stride_hj
    k_row = k_ptr + t.to(tl.int64) * stride_kt + j * stride_kj
    inner = tl.zeros((BLOCK_H,), tl.float32)
    hh = tl.zeros((BLOCK_H,), tl.float32)
    kk = tl.zeros((BLOCK_H,), tl.float32)
    for start in range(0, H, BLOCK_H):
        d = start + offs
        live = d < H
        h = tl.load(h_row + d, mask=live, other=0.0).to(tl.float32)
        k = tl.load(k_row + d, mask=live, other=0.0).to(tl.float32)
        w = tl.load(qw_ptr + j * H + d, mask=live, other=0.0) * tl.load(kw_ptr + j * H + d, mask=live, other=0.0)
        inner += h * w * k
        hh += h * h
        kk += k * k
    n = H.to(tl.float32)
    h_inv = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(tl.sum(hh, axis=0), n) + EPS))
    k_inv = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(tl.sum(kk, axis=0), n) + EPS))
    dot = tl.sum(inner, axis=0) * h_inv * k_inv * tl.div_rn(1.0, tl.sqrt_rn(n))
    root = tl.sqrt_rn(tl.maximum(tl.abs(dot), FLOOR))
    negative = (dot.to(tl.int32, bitcast=True) >> 31) != 0          # copysign: −0 gives −1e−3 (reference)
    signed = tl.where(negative, -root, root)
    g = tl.div_rn(1.0, 1.0 + tl.exp(-signed))
    tl.store(out_ptr + row, g)
    if UPDATE:
        o_row = r_out_ptr + t.to(tl.int64) * stride_ot + j * stride_oj
        v_row = v_ptr + t.to(tl.int64) * stride_vt
        for start in range(0, H, BLOCK_H):
            d = start + offs
            live = d < H
            h = tl.load(h_row + d, mask=live, other=0.0).to(tl.float32)
            y = _round_bf16(h + g * tl.load(v_row + d, mask=live, other=0.0).to(tl.float32))
            if HAS_IMAGE:
                y = tl.where(tl.load(image_ptr + t + 0 * d) != 0, h, y)
            tl.store(o_row + d, y.to(tl.bfloat16) if OUT_BF16 else y, mask=live)


INTERPRETED = isinstance(_engram_gate_kernel, InterpretedFunction)


def engram_gate(residual: Tensor, keys: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float) -> Tensor:
    """g [T, hc] fp32 (module doc). residual, keys [T, hc, H] (fp32 / BF16, unit stride along H);
    q_weight, k_weight [hc, H]. No host sync; one launch."""
    return _launch(residual, keys, q_weight, k_weight, eps, None, None)[1]


def engram_residual(residual: Tensor, keys: Tensor, value: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float,
                    image_rows: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(R' [T, hc, H] in residual's dtype, g [T, hc]) (module doc): `engram_gate` and the residual update in one
    launch. value [T, H] (fp32 / BF16, unit stride along H); image_rows [T] bool or None."""
    T, _, H = residual.shape
    if value.dim() != 2 or tuple(value.shape) != (T, H) or value.stride(1) != 1:
        raise ValueError(f"engram_residual: value must be [{T}, {H}] with unit stride along H, got "
                         f"{tuple(value.shape)}")
    if image_rows is not None and tuple(image_rows.shape) != (T,):
        raise ValueError(f"engram_residual: image_rows must be [{T}], got {tuple(image_rows.shape)}")
    return _launch(residual, keys, q_weight, k_weight, eps, value, image_rows)


def _launch(residual: Tensor, keys: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float, value: Tensor | None,
            image_rows: Tensor | None) -> tuple[Tensor, Tensor]:
    if residual.dim() != 3 or keys.shape != residual.shape:
        raise ValueError(f"engram_gate: residual and keys must be [T, hc, H] of one shape, got "
                         f"{tuple(residual.shape)} and {tuple(keys.shape)}")
    T, hc, H = residual.shape
    if tuple(q_weight.shape) != (hc, H) or tuple(k_weight.shape) != (hc, H):
        raise ValueError(f"engram_gate: q_weight / k_weight must be [{hc}, {H}], got {tuple(q_weight.shape)} "
                         f"and {tuple(k_weight.shape)}")
    for name, t in (("residual", residual), ("keys", keys)):
        if t.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"engram_gate: {name} must be fp32 or bf16, got {t.dtype}")
    check_device("engram_gate", residual, keys, q_weight, k_weight, *(() if value is None else (value,)),
                 *(() if image_rows is None else (image_rows,)))
    residual = residual if residual.stride(2) == 1 else residual.contiguous()
    keys = keys if keys.stride(2) == 1 else keys.contiguous()
    qw = q_weight.to(torch.float32).contiguous()
    kw = k_weight.to(torch.float32).contiguous()
    out = torch.empty(T, hc, dtype=torch.float32, device=residual.device)
    update = value is not None
    r_out = torch.empty_like(residual, memory_format=torch.contiguous_format) if update else out
    image = image_rows.contiguous().view(torch.uint8) if image_rows is not None else out
    if out.numel():
        block = min(MAX_BLOCK_H, triton.next_power_of_2(H))
        _engram_gate_kernel[(T * hc,)](residual, keys, qw, kw, out, hc, H, residual.stride(0), residual.stride(1),
                                       keys.stride(0), keys.stride(1), value if update else out,
                                       value.stride(0) if update else 0, image, r_out,
                                       r_out.stride(0) if update else 0, r_out.stride(1) if update else 0,
                                       EPS=float(eps), FLOOR=GATE_DOT_FLOOR, BLOCK_H=block, UPDATE=update,
                                       HAS_IMAGE=image_rows is not None, OUT_BF16=r_out.dtype == torch.bfloat16,
                                       **({} if INTERPRETED else {"num_warps": NUM_WARPS, "enable_fp_fusion": False}))
    return r_out, out


__all__ = ["GATE_DOT_FLOOR", "engram_gate", "engram_residual"]

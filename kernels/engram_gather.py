"""Engram row gather + dequantisation in one Triton kernel (spec `model.md` §2.3, §3.3.2; runtime.md §A.7).

`engram_gather(values, scales, ids, *, sorted_reads=False)` → fp32 rows [n, d], n = ids.numel(),
row i = the logical (dequantised) table row `ids.reshape(-1)[i]`:

    engram_gather(values, scales, ids) == dequantize_engram_rows(values[ids], scales[ids]).float()

**bit for bit** (`checkpoint.codecs.dequantize_engram_rows`: E4M3 · 2^(s−127) in fp32, rounded
once to BF16 round-to-nearest-even), NaN positions included (spec §2.3: scale byte 255 and the
E4M3 codes 0x7F/0xFF are NaN; the kernel writes the canonical NaN 0x7FC00000, whose payload
torch does not specify either, so tests compare NaN positions and every other bit).

Inputs. `values` [rows, d] E4M3 (or its uint8 bytes), `scales` [rows, d/32] UE8M0 bytes
(`float8_e8m0fnu` or uint8), both row-major contiguous, d a multiple of 32; each is a torch
tensor on the ids' device, or — ids on CUDA — a `RowMajorBytes` object: the uint8 rows of a
host table registered with CUDA (mapped + portable, `runtime/engram_host.py`), which Triton's
launcher turns into a device pointer through UVA. `ids` int64/int32 of any shape on the device
(flattened), every id in [0, rows): the kernel cannot check the range without a host sync (the
readers guarantee it: `reference.engram.engram_embedding` checks on the host, the TP lookup
clamps), and an id outside it reads outside the table (a fault for registered host memory).
The output lies on the ids' device. No host sync, no host→device copy, one launch (plus one
`torch.sort` with `sorted_reads`): capturable in a CUDA graph; each id's row depends on that
id only (batch invariant).

Arithmetic — integer only, so neither fp32 flush-to-zero on the GPU nor the interpreter's
truncating fp32→BF16 casts can change a bit. An E4M3 code is m·2^k with m ≤ 15 (normal:
m = 8 + mantissa, k = exponent − 10; subnormal: m = mantissa, k = −9); the scale is 2^(e−127)
(byte 0 → 2^−127); the product m·2^K (K = k + e − 127 ≥ −136) is therefore exact in fp32 unless
it reaches 2^128 (→ ∞, as the fp32 multiply of the reference overflows), because fp32 subnormals
are multiples of 2^−149. The kernel builds those fp32 bits (normal or subnormal encoding), then
rounds them to BF16 with round-to-nearest-even on the bit pattern — only values below 2^−126 can
round (four significant bits fit BF16's eight) — and re-applies the sign (−0.0 stays −0.0).

`sorted_reads=True`: the ids are sorted on the device first (`torch.sort`) and program i reads
the i-th smallest row, writing it back to that id's original position — the same bits in the
same order. Host reads in ascending row order are what upstream does for host tables on GPUs
without ATS (runtime.md §A.7); **the benefit is unmeasured here** (no H200 timing of either
order yet), as is the UVA read bandwidth of this kernel over PCIe and the effect of huge pages.

Launch: one program per id, BLOCK_D = next power of two ≥ d (256 for Flash: one 256-byte row
read + its 8 scale bytes), 2 warps — an untimed choice. `enable_fp_fusion=False` (no float
arithmetic remains to contract; kept so a future float edit cannot silently fuse).
Under `TRITON_INTERPRET=1` (set before triton is imported) the kernel runs on CPU tensors (tests);
otherwise CPU tensors raise, and `RowMajorBytes` objects need CUDA ids.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.interpreter import InterpretedFunction

#: values per UE8M0 scale byte along a row (spec §2.3)
GROUP = 32
NUM_WARPS = 2


@runtime_checkable
class RowMajorBytes(Protocol):
    """A 2-D uint8 row-major contiguous block Triton reads through a pointer: `data_ptr()` (an
    address Triton's launcher can translate, e.g. registered host memory), `dtype` (torch.uint8)
    and `shape` (rows, columns)."""

    dtype: torch.dtype
    shape: tuple[int, int]

    def data_ptr(self) -> int: ...


@triton.jit
def _engram_gather_kernel(values_ptr, scales_ptr, ids_ptr, dest_ptr, out_ptr,
                          D: tl.constexpr, BLOCK_D: tl.constexpr, SORTED: tl.constexpr):
    i = tl.program_id(0)
    row = tl.load(ids_ptr + i).to(tl.int64)
    if SORTED:
        dest = tl.load(dest_ptr + i).to(tl.int64)
    else:
        dest = i.to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    ok = offs < D
    code = tl.load(values_ptr + row * D + offs, mask=ok, other=0).to(tl.int32)          # E4M3 byte
    e = tl.load(scales_ptr + row * (D // 32) + offs // 32, mask=ok, other=127).to(tl.int32)   # UE8M0 byte
    exp4 = (code >> 3) & 15
    mant = code & 7
    m = tl.where(exp4 == 0, mant, mant + 8)                     # value = m · 2^K, 0 ≤ m ≤ 15
    K = tl.where(exp4 == 0, -9, exp4 - 10) + e - 127
    lead = tl.where(m >= 8, 8, tl.where(m >= 4, 4, tl.where(m >= 2, 2, 1)))
    p = tl.where(m >= 8, 3, tl.where(m >= 4, 2, tl.where(m >= 2, 1, 0)))
    X = K + p                                                   # binary exponent of m · 2^K
    normal = ((X + 127) << 23) | ((m - lead) << (23 - p))
    subnormal = m << tl.minimum(tl.maximum(K + 149, 0), 31)     # K ≥ −136: exact, < 2^23 when X < −126
    mag = tl.where(X >= -126, normal, subnormal)
    mag = tl.where(X >= 128, 0x7F800000, mag)
    mag = tl.where(m == 0, 0, mag)
    mag = (mag + 0x7FFF + ((mag >> 16) & 1)) & -65536           # fp32 → BF16, round to nearest even
    bits = tl.where(code >= 128, mag | -2147483648, mag)        # sign bit
    nan = ((code & 0x7F) == 0x7F) | (e == 255)
    bits = tl.where(nan, 0x7FC00000, bits)
    tl.store(out_ptr + dest * D + offs, bits.to(tl.float32, bitcast=True), mask=ok)


INTERPRETED = isinstance(_engram_gather_kernel, InterpretedFunction)


def _as_bytes(x: Tensor | RowMajorBytes, what: str, allowed: tuple[torch.dtype, ...]) -> Tensor | RowMajorBytes:
    """`x` as Triton's uint8 pointer argument: a tensor viewed as uint8 (checked 2-D contiguous), or
    a `RowMajorBytes` object as is (checked uint8 2-D)."""
    if isinstance(x, Tensor):
        if x.dtype not in allowed + (torch.uint8,) or x.dim() != 2 or not x.is_contiguous():
            raise ValueError(f"engram_gather: {what} must be a 2-D contiguous {allowed[0]} or uint8 tensor, got "
                             f"{x.dtype} {tuple(x.shape)} strides {x.stride()}")
        return x.view(torch.uint8)
    if not isinstance(x, RowMajorBytes) or x.dtype != torch.uint8 or len(tuple(x.shape)) != 2:
        raise TypeError(f"engram_gather: {what} must be a tensor or a RowMajorBytes object (uint8, 2-D, "
                        f"data_ptr()), got {type(x).__name__}")
    return x


def engram_gather(values: Tensor | RowMajorBytes, scales: Tensor | RowMajorBytes, ids: Tensor, *,
                  sorted_reads: bool = False) -> Tensor:
    """fp32 rows [ids.numel(), d] of the logical Engram table at `ids` (module doc: bit-identical
    to `dequantize_engram_rows(values[ids], scales[ids]).float()`, no host sync)."""
    if not isinstance(ids, Tensor) or ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"engram_gather: ids must be an int64 or int32 tensor, got "
                        f"{getattr(ids, 'dtype', type(ids).__name__)}")
    values = _as_bytes(values, "values", (torch.float8_e4m3fn,))
    scales = _as_bytes(scales, "scales", (torch.float8_e8m0fnu,))
    rows, d = (int(s) for s in values.shape)
    if d % GROUP or tuple(int(s) for s in scales.shape) != (rows, d // GROUP):
        raise ValueError(f"engram_gather: scales {tuple(scales.shape)} do not match values {(rows, d)} "
                         f"(d a multiple of {GROUP}, one scale byte per {GROUP} values)")
    device = ids.device
    for what, x in (("values", values), ("scales", scales)):
        if isinstance(x, Tensor) and x.device != device:
            raise ValueError(f"engram_gather: {what} on {x.device}, ids on {device} (host tables are passed as "
                             "RowMajorBytes objects)")
        if not isinstance(x, Tensor) and device.type != "cuda":
            raise ValueError(f"engram_gather: a RowMajorBytes {what} is read through UVA and needs ids on a CUDA "
                             f"device, got {device}")
    if device.type != "cuda" and not INTERPRETED:
        raise RuntimeError(f"engram_gather: ids on {device} need a CUDA device, or TRITON_INTERPRET=1 set before "
                           "triton is imported (tests)")
    flat = ids.reshape(-1).contiguous()
    n = flat.numel()
    out = torch.empty(n, d, dtype=torch.float32, device=device)
    if n == 0:
        return out
    if sorted_reads:
        read, dest = torch.sort(flat)
    else:
        read, dest = flat, flat                  # dest unused (SORTED=False)
    if INTERPRETED:
        _engram_gather_kernel[(n,)](values, scales, read, dest, out, D=d, BLOCK_D=triton.next_power_of_2(d),
                                    SORTED=sorted_reads)
        return out
    with torch.cuda.device(device):              # Triton launches on the current device
        _engram_gather_kernel[(n,)](values, scales, read, dest, out, D=d, BLOCK_D=triton.next_power_of_2(d),
                                    SORTED=sorted_reads, num_warps=NUM_WARPS, enable_fp_fusion=False)
    return out


__all__ = ["GROUP", "INTERPRETED", "NUM_WARPS", "RowMajorBytes", "engram_gather"]

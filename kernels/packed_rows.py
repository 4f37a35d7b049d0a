"""Native reads of packed FP4 compressed entries for the Triton kernels (contracts phase 2 §1, §2, §5;
spec `model.md` §3.4.3 / §3.4.4 for the quantisers).

One compressed entry of a kv source has two parts, each stored in a row buffer of its own (§2):
the **latent** part (D/2 + D/16 bytes, Flash 288) — latent payload (D/2 B: E2M1 codes, dim 2i in
the low nibble of byte i, dim 2i+1 in the high nibble), then latent scales (D/16 B: float8_e4m3fn
bits, scale g covers dims 16g..16g+15) — in the latent rows, read by `sparse_attention`; the
**key** part (Dk/2 + Dk/32 bytes, Flash 68) — key payload (Dk/2 B, same nibble rule), then key
scales (Dk/32 B: UE8M0 exponents, scale 2^(b−127), group of 32) — in the index-key rows, read by
`indexer`. In a part's rows a source of ratio r with column share `share` = ⌈P/r⌉ (P the part's
bytes) at column `offset` stores byte j of the part of entry e at row e·r + j // share, column
offset + j % share of the uint8 row tensor.

Decoded values are exact: value = e2m1(code) × scale, a ≤ 6-significant-bit product (E4M3 scale)
or a power-of-two multiple of an E2M1 value (UE8M0), so every decoded latent and key is a BF16
value, computed here in fp32 without rounding and then cast to BF16 exactly. Hence a kernel that
feeds decoded values into the same dots as its BF16-cache path returns the same bits.

The jit helpers below are called from `sparse_attention` and `indexer` kernels; this module is
imported by both, so all of them are defined under the same TRITON_INTERPRET setting.
"""
from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl
from torch import Tensor
import torch


def latent_entry_bytes(head_dim: int) -> int:
    """Bytes of the latent part of one entry (payload + E4M3 scales): D/2 + D/16 [Flash 288]."""
    return head_dim // 2 + head_dim // 16


def key_entry_bytes(index_head_dim: int) -> int:
    """Bytes of the index-key part of one entry (payload + UE8M0 scales): Dk/2 + Dk/32 [Flash 68]."""
    return index_head_dim // 2 + index_head_dim // 32


#: The parts of an entry, each in its own row buffer: latents (attention), index keys (indexer).
PARTS = ("latent", "key")


@dataclass(frozen=True)
class PackedSource:
    """One part (`part`: "latent" or "key") of one kv source's packed compressed entries inside
    that part's per-token rows (contracts §5).

    `rows` uint8 [S, row_bytes] (any row stride, unit last stride): the latent rows for "latent",
    the index-key rows for "key"; entries e ∈ [0, S // ratio) of this source; `share` must equal
    ⌈entry_bytes / ratio⌉ (`entry_bytes`: the part's bytes) and [offset, offset + share) must lie
    inside a row (checked here)."""

    rows: Tensor
    offset: int
    share: int
    ratio: int
    head_dim: int
    index_head_dim: int
    part: str

    def __post_init__(self) -> None:
        r = self.rows
        if r.dim() != 2 or r.dtype != torch.uint8 or (r.shape[1] > 1 and r.stride(1) != 1):
            raise ValueError(f"PackedSource.rows must be uint8 [S, row_bytes] with unit last stride, got "
                             f"{tuple(r.shape)} {r.dtype} strides {tuple(r.stride())}")
        if self.head_dim < 16 or self.head_dim % 16 or self.index_head_dim < 32 or self.index_head_dim % 32:
            raise ValueError(f"PackedSource: head_dim {self.head_dim} must be a multiple of 16 and index_head_dim "
                             f"{self.index_head_dim} a multiple of 32 (one scale per 16 / 32 dims)")
        if self.part not in PARTS:
            raise ValueError(f"PackedSource: part {self.part!r} is not one of {PARTS} (an entry's latent and "
                             "index-key parts live in separate row buffers)")
        if self.ratio < 1:
            raise ValueError(f"PackedSource: ratio must be ≥ 1, got {self.ratio}")
        want = -(-self.entry_bytes // self.ratio)
        if self.share != want:
            raise ValueError(f"PackedSource: share {self.share} != ⌈{self.entry_bytes}/{self.ratio}⌉ = {want} "
                             "(contracts §2)")
        if self.offset < 0 or self.offset + self.share > r.shape[1]:
            raise ValueError(f"PackedSource: columns [{self.offset}, {self.offset + self.share}) do not fit rows "
                             f"of {r.shape[1]} bytes")

    @property
    def entry_bytes(self) -> int:
        """Bytes of this part of one entry: D/2 + D/16 (latent) or Dk/2 + Dk/32 (key), contracts §1."""
        return latent_entry_bytes(self.head_dim) if self.part == "latent" else key_entry_bytes(self.index_head_dim)

    @property
    def num_entries(self) -> int:
        """Entries addressable in `rows`: e·ratio + ratio − 1 < S."""
        return self.rows.shape[0] // self.ratio

    def require_part(self, part: str, reader: str) -> None:
        """Raise unless this source addresses `part` (a reader of latents handed key rows, say)."""
        if self.part != part:
            raise ValueError(f"{reader}: reads the {part} part of packed entries, got a PackedSource of the "
                             f"{self.part} rows")


# ---- jit helpers (inlined into the kernels) -------------------------------------------------

@triton.jit
def e2m1_bf16(code):
    """BF16 value of E2M1 codes (int32, low 4 bits used): bit 3 sign, bits 0–2 index into
    {0, .5, 1, 1.5, 2, 3, 4, 6} (code 8 is −0), built as BF16 bit patterns: index 1 is 2^-1
    (0x3F00), index m ≥ 2 has exponent m>>1 − 1 and mantissa bit m&1."""
    mag = code & 7
    bits = tl.where(mag < 2, mag * 0x3F00, ((126 + (mag >> 1)) << 7) | ((mag & 1) << 6)) | ((code & 8) << 12)
    return bits.to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def e4m3_value(b):
    """fp32 value of float8_e4m3fn bit patterns (int32 0..255); 0x7F/0xFF are NaN."""
    exp = (b >> 3) & 15
    man = b & 7
    normal = (((exp + 120) << 23) | (man << 20)).to(tl.float32, bitcast=True)
    v = tl.where(exp == 0, man.to(tl.float32) * 0.001953125, normal)       # subnormal: man·2^-9
    v = tl.where((b & 127) == 127, float("nan"), v)
    return tl.where((b & 128) != 0, -v, v)


@triton.jit
def ue8m0_value(b):
    """fp32 value 2^(b−127) of UE8M0 exponent bytes (int32 0..255); b = 0 is 2^-127 (fp32
    subnormal), b = 255 is NaN."""
    bits = tl.where(b == 0, 1 << 22, b << 23)
    v = bits.to(tl.float32, bitcast=True)
    return tl.where(b == 255, float("nan"), v)


@triton.jit
def _pair_bytes(rows_ptr, entry_base, valid, dims, row_stride, offset, SHARE: tl.constexpr, BLOCK_P: tl.constexpr,
                PAIRS_PER_SCALE: tl.constexpr):
    """(payload byte, its scale byte) uint8 [N, BLOCK_P] of the pair tiles below: column i holds entry
    byte i and entry byte dims/2 + i // PAIRS_PER_SCALE; masked columns and entries read 0."""
    i = tl.arange(0, BLOCK_P)
    mask = valid[:, None] & (i < dims // 2)[None, :]
    byte_off = (i // SHARE) * row_stride + offset + i % SHARE
    byte = tl.load(rows_ptr + entry_base[:, None] + byte_off[None, :], mask=mask, other=0)
    js = dims // 2 + i // PAIRS_PER_SCALE
    scale_off = (js // SHARE) * row_stride + offset + js % SHARE
    sbyte = tl.load(rows_ptr + entry_base[:, None] + scale_off[None, :], mask=mask, other=0)
    return byte, sbyte


@triton.jit
def _nibbles_e4m3(byte):
    """(low, high) float8_e4m3fn = e2m1(nibble) × 2^-6 of each byte's low / high nibble: the nibble
    s|e1 e0 m moved to bits 7|4 3 2 (one mantissa bit in both formats, the same subnormal step)."""
    low = (((byte << 2) & 0x1C) | ((byte << 4) & 0x80)).to(tl.float8e4nv, bitcast=True)
    high = (((byte >> 2) & 0x1C) | (byte & 0x80)).to(tl.float8e4nv, bitcast=True)
    return low, high


@triton.jit
def _pinned(x):
    """x through an identity inline-asm move marked impure: keeps a decode in the layout it was
    loaded in (see `load_latent_pair_tiles`)."""
    return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=tl.bfloat16, is_pure=False, pack=2)


@triton.jit
def load_latent_pair_tiles(rows_ptr, entry_base, valid, dims, row_stride, offset, SHARE: tl.constexpr,
                           BLOCK_P: tl.constexpr, COMPILED: tl.constexpr):
    """(even, odd): BF16 [N, BLOCK_P] decoded latents (exact) of the entries at `entry_base` [N]
    int64 = e·ratio·row_stride (contracts §2 rule); column i of `even` is dim 2i and column i of
    `odd` dim 2i+1 — the low and high nibble of payload byte i (entry byte i). Byte i's E4M3 scale
    is entry byte dims/2 + i // 8 (group of 16 dims = 8 bytes). Entry byte j lives at row offset
    (j // SHARE)·row_stride, column offset + j % SHARE. Pairs ≥ dims/2 and entries not `valid`
    read byte 0 and decode to +0.

    Two plain byte gathers per payload byte (the byte, its scale byte — repeats of a scale byte
    are L1 hits): half the loads of a per-dim decode, and no join / reshape / interleave (those
    lowered wrongly on the H200). Callers keep dims split by parity (q·k = q_even·k_even +
    q_odd·k_odd, P·V per half).

    COMPILED (GPU): hardware FP8 conversions (`_nibbles_e4m3`), so value = e4m3(nibble bits) ×
    (e4m3(scale byte) × 2^6): BF16 operands and product exact (≤ 2 × 4 significant bits, |value| ∈
    [2^-10, 2688]); a 0x7F/0xFF scale is NaN. The result then passes an identity inline-asm move
    marked impure (`_pinned`): it pins the decode to the load layout, decoded once per tile —
    without it Triton 3.6 rematerialises the decode in both dot-operand layouts (measured on the
    sm_90 build: 2.2× the loop's instructions and register spills). Otherwise (interpreter):
    integer decode in fp32 (`e2m1_bf16`, `e4m3_value`; Triton 3.6's interpreter multiplies BF16
    tensors as raw integers), same values."""
    byte, sbyte = _pair_bytes(rows_ptr, entry_base, valid, dims, row_stride, offset, SHARE, BLOCK_P, 8)
    if COMPILED:
        scale = sbyte.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16) * 64.0
        low, high = _nibbles_e4m3(byte)
        return _pinned(low.to(tl.bfloat16) * scale), _pinned(high.to(tl.bfloat16) * scale)
    code = byte.to(tl.int32)
    scale32 = e4m3_value(sbyte.to(tl.int32))
    return ((e2m1_bf16(code).to(tl.float32) * scale32).to(tl.bfloat16),
            (e2m1_bf16(code >> 4).to(tl.float32) * scale32).to(tl.bfloat16))


@triton.jit
def load_key_pair_tiles(rows_ptr, entry_base, valid, dims, row_stride, offset, SHARE: tl.constexpr,
                        BLOCK_P: tl.constexpr, COMPILED: tl.constexpr):
    """(even, odd): BF16 [N, BLOCK_P] decoded index keys (exact), the key part's counterpart of
    `load_latent_pair_tiles` (same addressing and parity split): payload byte i's UE8M0 scale is
    entry byte dims/2 + i // 16 (group of 32 dims = 16 bytes). Values e2m1 × 2^(b−127) for every
    byte (2^-127 at b = 0, NaN at b = 255; the interpreter's fp32 products flush results below
    2^-126, which a quantiser never stores with nonzero codes). COMPILED: e4m3(nibble bits) × 2^6 (exact) × the scale as BF16 bits (b << 7); two
    BF16 products rather than one with a 2^6-folded scale, which would overflow past b = 248;
    pinned like the latents. Otherwise the interpreter's integer decode in fp32."""
    byte, sbyte = _pair_bytes(rows_ptr, entry_base, valid, dims, row_stride, offset, SHARE, BLOCK_P, 16)
    if COMPILED:
        b = sbyte.to(tl.int32)
        bits = tl.where(b == 0, 0x0040, tl.where(b == 255, 0x7FC0, b << 7))
        scale = bits.to(tl.int16).to(tl.bfloat16, bitcast=True)
        low, high = _nibbles_e4m3(byte)
        return (_pinned(low.to(tl.bfloat16) * 64.0 * scale), _pinned(high.to(tl.bfloat16) * 64.0 * scale))
    code = byte.to(tl.int32)
    scale32 = ue8m0_value(sbyte.to(tl.int32))
    return ((e2m1_bf16(code).to(tl.float32) * scale32).to(tl.bfloat16),
            (e2m1_bf16(code >> 4).to(tl.float32) * scale32).to(tl.bfloat16))

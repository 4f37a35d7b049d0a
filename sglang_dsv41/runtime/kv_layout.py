"""Packed FP4 compressed entries and the per-token row layout of the global KV (spec §3.4.3, §3.8;
phase-2 contracts §1–§2).

One **entry** per compressed position of a kv-source layer holds, in this order (Flash sizes in
brackets, D = head_dim 512, Dk = index_head_dim 128):

1. latent codes, D/2 bytes [256]: E2M1 codes of the stored latent FP4fake_c(RoPE(latent)) —
   byte i: dim 2i in the low nibble, dim 2i+1 in the high nibble; code = sign (bit 3) +
   magnitude index (bits 0–2) into {0, .5, 1, 1.5, 2, 3, 4, 6};
2. latent scales, D/16 bytes [32]: float8_e4m3fn bit patterns, scale g covers dims 16g..16g+15;
3. key codes, Dk/2 bytes [64]: E2M1 codes of the FP4 index key FP4fake_i(...), same nibble rule;
4. key scales, Dk/32 bytes [4]: UE8M0 exponent bytes e (scale 2^(e−127)), group of 32.

E = D/2 + D/16 + Dk/2 + Dk/32 bytes [356; tiny 88]. Decoding gives the reference's fake-quant
values bit for bit (`ops.fp4_fake_quant_e4m3_scale` / `ops.fp4_fake_quant_ue8m0_scale`, spec
§3.4.3): the encoders take the **pre-quantisation** values and compute scale and codes with the
reference's formulas; value = e2m1(code) × scale is then the reference's own product. (Encoding
already fake-quantised values would not do: the E4M3-scale round trip is not idempotent when the
scale is an E4M3 subnormal — e.g. amax/6 = 1.6·2⁻⁹ → scale 2·2⁻⁹, max value 4·scale, whose
second round trip picks scale 2⁻⁹ and clamps 8 to 6.)

The **rows** (contract §2, SGLang's "full" pool, one row of each per token slot) are two
buffers: the **latent rows** hold parts 1–2 of every entry (P_lat = D/2 + D/16 bytes [288]), the
**index-key rows** parts 3–4 (P_key = Dk/2 + Dk/32 [68]), so attention reads latents only, the
indexer keys only, and PD's K/V halving sends both (`kv_pool`). In each part's buffer a source
of ratio r owns share = ⌈P/r⌉ bytes of every row at a cumulative offset (sources in
`kv_source_layer_ids` order). Its entry e — compressed position j of a request, completed by
the token at position j·r + r − 1 — is e = slot(that token) // r, and byte b of the entry's part
lives at row e·r + b // share, column offset + b % share. With SGLang's page_size a multiple of r
the r tokens of one entry occupy exactly the slots e·r .. e·r + r − 1 (aligned pages), so the
entry lives in its own request's rows. Payload per token: latent Σ share [720 at Flash; 108 tiny],
key Σ share [170; 68]; each buffer's row is padded to a multiple of 16 B (`latent_row_stride`
720 / 112, `key_row_stride` 176 / 80: Flash 896 B/token in all; formula shared with the planner
in `kv_rows`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..config import TextConfig
from .kv_rows import (KEY_GROUP, LATENT_GROUP, ROW_ALIGN, key_part_bytes as key_bytes,
                      latent_part_bytes as latent_bytes, part_shares, round_up)
from ..numerics.rounding import E2M1_MAX, E4M3_MAX, INV_E2M1_MAX, e2m1_rne, e4m3, pow2_ceil

#: E2M1 magnitudes indexed by the 3-bit magnitude code (the MXFP4 code of `checkpoint/codecs.py`).
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
#: The two parts of an entry, each in a row buffer of its own.
PARTS = ("latent", "key")
#: Smallest latent scale (before the E4M3 cast) and smallest key amax (spec §3.4.3).
LATENT_SCALE_MIN = 2.0 ** -9
KEY_AMAX_MIN = E2M1_MAX * 2.0 ** -126


@dataclass(frozen=True)
class SourceColumns:
    """Where one part (latent or index key) of kv source `layer`'s entries lives in that part's
    rows: `share` bytes at column `offset`; each entry's part is `entry_bytes` long, spread over
    `ratio` rows."""

    layer: int
    ratio: int
    offset: int
    share: int
    entry_bytes: int


@dataclass(frozen=True)
class KvSource:
    """Kv source `layer` (compress ratio `ratio`): the columns of its latents in the latent rows
    and of its index keys in the index-key rows."""

    layer: int
    ratio: int
    latent: SourceColumns
    key: SourceColumns


@dataclass(frozen=True)
class CompressedRowLayout:
    """The row layout of contract §2 for one model config (see the module docstring)."""

    head_dim: int
    index_head_dim: int
    sources: tuple[KvSource, ...]

    @classmethod
    def from_config(cls, cfg: TextConfig) -> "CompressedRowLayout":
        D, Dk = cfg.head_dim, cfg.index_head_dim
        if D % (2 * LATENT_GROUP) or Dk % KEY_GROUP or Dk % 2:
            raise ValueError(f"packed FP4 entries need head_dim % 32 == 0 and index_head_dim % 32 == 0, "
                             f"got {D} and {Dk}")
        sources, lat_off, key_off = [], 0, 0
        for layer in cfg.kv_source_layer_ids:
            ratio = cfg.compress_ratios[layer]
            if ratio not in (1, 2):
                raise ValueError(f"kv source {layer}: compress ratio {ratio} is not a V4.1 ratio (1 or 2)")
            (lat_share,) = part_shares(latent_bytes(D), (ratio,))
            (key_share,) = part_shares(key_bytes(Dk), (ratio,))
            sources.append(KvSource(
                layer=layer, ratio=ratio,
                latent=SourceColumns(layer, ratio, offset=lat_off, share=lat_share, entry_bytes=latent_bytes(D)),
                key=SourceColumns(layer, ratio, offset=key_off, share=key_share, entry_bytes=key_bytes(Dk))))
            lat_off, key_off = lat_off + lat_share, key_off + key_share
        return cls(head_dim=D, index_head_dim=Dk, sources=tuple(sources))

    @property
    def entry_bytes(self) -> int:
        return latent_bytes(self.head_dim) + key_bytes(self.index_head_dim)

    @property
    def latent_row_bytes(self) -> int:
        """Latent bytes per token (Σ latent share; 720 at Flash, 108 tiny)."""
        return sum(s.latent.share for s in self.sources)

    @property
    def key_row_bytes(self) -> int:
        """Index-key bytes per token (Σ key share; 170 at Flash, 68 tiny)."""
        return sum(s.key.share for s in self.sources)

    @property
    def latent_row_stride(self) -> int:
        """Bytes of one stored latent row, padded to 16 B (`kv_rows`; Flash 720, tiny 112)."""
        return round_up(self.latent_row_bytes, ROW_ALIGN)

    @property
    def key_row_stride(self) -> int:
        """Bytes of one stored index-key row, padded to 16 B (`kv_rows`; Flash 176, tiny 80)."""
        return round_up(self.key_row_bytes, ROW_ALIGN)

    @property
    def row_bytes(self) -> int:
        """Packed bytes of global KV per token over both buffers (890 at Flash, 176 tiny)."""
        return self.latent_row_bytes + self.key_row_bytes

    @property
    def row_stride(self) -> int:
        """Stored bytes of global KV per token: latent row + index-key row (Flash 896, tiny 192)."""
        return self.latent_row_stride + self.key_row_stride

    @property
    def max_ratio(self) -> int:
        return max((s.ratio for s in self.sources), default=1)

    def source(self, layer: int) -> KvSource:
        for s in self.sources:
            if s.layer == layer:
                return s
        raise KeyError(f"layer {layer} is not a kv source (sources: {[s.layer for s in self.sources]})")


# ---- E2M1 nibbles --------------------------------------------------------------------------------

def _e2m1_codes(v: Tensor) -> Tensor:
    """4-bit codes (uint8) of values on the signed E2M1 grid (sign bit 3, also for −0)."""
    a = v.abs()
    mag = torch.where(a < 2.0, a * 2.0, torch.where(a < 4.0, a + 2.0, a * 0.5 + 4.0)).to(torch.uint8)
    return mag | (torch.signbit(v).to(torch.uint8) << 3)


def _pack_nibbles(codes: Tensor) -> Tensor:
    """[n, d] 4-bit codes → [n, d/2] bytes: dim 2i low nibble, dim 2i+1 high nibble."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def _e2m1_values(packed: Tensor) -> Tensor:
    """[n, d/2] bytes → [n, d] fp32 signed E2M1 grid values (inverse of `_pack_nibbles`)."""
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2).to(torch.int32)
    m = (codes & 7).to(torch.float32)                  # magnitude index into E2M1_GRID, computed (no
    mag = torch.where(m < 4, m * 0.5, torch.where(m < 6, m - 2.0, (m - 4.0) * 2.0))   # host→device copy)
    return torch.where((codes & 8) != 0, -mag, mag)    # code 8..15: sign bit set (8 → −0.0)


def _check_2d(values: Tensor, dim: int, what: str) -> Tensor:
    if values.dim() != 2 or values.shape[1] != dim:
        raise ValueError(f"{what}: expected [n, {dim}] values, got {tuple(values.shape)}")
    return values.to(torch.float32)


# ---- codecs (spec §3.4.3) ------------------------------------------------------------------------

def encode_latents(values: Tensor) -> Tensor:
    """[n, D] finite pre-quantisation (RoPE'd) latents → uint8 [n, D/2 + D/16]: E2M1 codes then E4M3
    scale bytes, with scale = e4m3(clamp(amax₁₆·fp32(1/6), 2⁻⁹, 448)) and code = rne_e2m1(x/scale) —
    the reference's `fp4_fake_quant_e4m3_scale` (spec §3.4.3, contract §1 items 1–2)."""
    if values.dim() != 2 or values.shape[1] % (2 * LATENT_GROUP):
        raise ValueError(f"encode_latents: expected [n, D] with D % 32 == 0, got {tuple(values.shape)}")
    x = values.to(torch.float32)
    n, D = x.shape
    g = x.reshape(n, D // LATENT_GROUP, LATENT_GROUP)
    amax = g.abs().amax(dim=-1, keepdim=True)
    scale = e4m3((amax * INV_E2M1_MAX).clamp(min=LATENT_SCALE_MIN, max=E4M3_MAX))
    v = e2m1_rne((g / scale).clamp(-E2M1_MAX, E2M1_MAX)).reshape(n, D)
    scale_bytes = scale.reshape(n, -1).to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.cat((_pack_nibbles(_e2m1_codes(v)), scale_bytes), dim=1)


def decode_latents(packed: Tensor, head_dim: int) -> Tensor:
    """uint8 [n, D/2 + D/16] → fp32 [n, D] = e2m1(code) × e4m3(scale), bit-identical to
    `ops.fp4_fake_quant_e4m3_scale` of the encoded values (spec §3.4.3)."""
    _expect_bytes(packed, latent_bytes(head_dim), "decode_latents")
    n = packed.shape[0]
    values = _e2m1_values(packed[:, : head_dim // 2]).reshape(n, head_dim // LATENT_GROUP, LATENT_GROUP)
    scale = packed[:, head_dim // 2:].contiguous().view(torch.float8_e4m3fn).to(torch.float32)
    return (values * scale[..., None]).reshape(n, head_dim)


def encode_keys(values: Tensor) -> Tensor:
    """[n, Dk] finite pre-quantisation (RoPE'd) index keys → uint8 [n, Dk/2 + Dk/32]: E2M1 codes then
    UE8M0 exponent bytes, scale = 2^⌈log2(max(amax₃₂, 6·2⁻¹²⁶)·fp32(1/6))⌉ — the reference's
    `fp4_fake_quant_ue8m0_scale` (spec §3.4.3, contract §1 items 3–4)."""
    if values.dim() != 2 or values.shape[1] % KEY_GROUP:
        raise ValueError(f"encode_keys: expected [n, Dk] with Dk % 32 == 0, got {tuple(values.shape)}")
    x = values.to(torch.float32)
    n, Dk = x.shape
    g = x.reshape(n, Dk // KEY_GROUP, KEY_GROUP)
    amax = g.abs().amax(dim=-1, keepdim=True)
    scale = pow2_ceil(amax.clamp(min=KEY_AMAX_MIN) * INV_E2M1_MAX)
    v = e2m1_rne((g / scale).clamp(-E2M1_MAX, E2M1_MAX)).reshape(n, Dk)
    # a normal power of two 2^k has fp32 bits (k + 127) << 23: the biased exponent is the byte
    exponent = ((scale.reshape(n, -1).view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
    return torch.cat((_pack_nibbles(_e2m1_codes(v)), exponent), dim=1)


def decode_keys(packed: Tensor, index_head_dim: int) -> Tensor:
    """uint8 [n, Dk/2 + Dk/32] → fp32 [n, Dk] = e2m1(code) × 2^(e − 127), bit-identical to
    `ops.fp4_fake_quant_ue8m0_scale` of the encoded values (spec §3.4.3). Exponent bytes the
    encoder never writes decode like `kernels/packed_rows.py`: 0 → 2^−127, 255 → NaN (an
    all-zero, never-written entry decodes to zeros)."""
    _expect_bytes(packed, key_bytes(index_head_dim), "decode_keys")
    n = packed.shape[0]
    values = _e2m1_values(packed[:, : index_head_dim // 2]).reshape(n, index_head_dim // KEY_GROUP, KEY_GROUP)
    e = packed[:, index_head_dim // 2:].to(torch.int32)
    scale = torch.where(e == 0, torch.full_like(e, 1 << 22), e << 23).view(torch.float32)   # 0: 2^−127
    scale = torch.where(e == 255, torch.nan, scale)
    return (values * scale[..., None]).reshape(n, index_head_dim)


def _expect_bytes(packed: Tensor, width: int, what: str) -> None:
    if packed.dtype != torch.uint8 or packed.dim() != 2 or packed.shape[1] != width:
        raise ValueError(f"{what}: expected uint8 [n, {width}], got {packed.dtype} {tuple(packed.shape)}")


def encode_entries(layout: CompressedRowLayout, latents: Tensor, keys: Tensor) -> Tensor:
    """uint8 [n, E]: one packed entry per row of (pre-quantisation latents [n, D], keys [n, Dk])."""
    _check_2d(latents, layout.head_dim, "encode_entries latents")
    _check_2d(keys, layout.index_head_dim, "encode_entries keys")
    return torch.cat((encode_latents(latents), encode_keys(keys)), dim=1)


def decode_entry_latents(layout: CompressedRowLayout, entries: Tensor) -> Tensor:
    """fp32 [n, D] stored latents of packed entries [n, E] (bytes 1–2 of contract §1)."""
    return decode_latents(entries[:, : latent_bytes(layout.head_dim)], layout.head_dim)


def decode_entry_keys(layout: CompressedRowLayout, entries: Tensor) -> Tensor:
    """fp32 [n, Dk] index keys of packed entries [n, E] (bytes 3–4 of contract §1)."""
    return decode_keys(entries[:, latent_bytes(layout.head_dim):], layout.index_head_dim)


# ---- row scatter / gather (contract §2) ----------------------------------------------------------

def entry_positions(compressed: Tensor, ratio: int) -> Tensor:
    """Absolute position of the token that completes compressed position j: j·ratio + ratio − 1
    (spec §3.4.3); its slot // ratio is the entry index."""
    return compressed * ratio + (ratio - 1)


def _entry_row_index(source: SourceColumns, entry_idx: Tensor) -> Tensor:
    """[n, r] rows e·r .. e·r + r − 1 of entries e (e ≥ 0)."""
    r = source.ratio
    return entry_idx.to(torch.int64)[:, None] * r + torch.arange(r, device=entry_idx.device)[None, :]


def write_entries(rows: Tensor, source: SourceColumns, entry_idx: Tensor, entry_bytes: Tensor) -> None:
    """Scatter one part of packed entries, uint8 [n, P] (P = `source.entry_bytes`), into that
    part's `rows` uint8 [S, ≥ offset + share] by the contract §2 rule (byte b of entry e → row
    e·r + b // share, column offset + b % share).

    Entry −1 means "nothing to write": those rows go to entry 0 — rows 0..r−1, inside SGLang's
    reserved padding page 0 (page_size is a multiple of r), never read as a request's entry — so
    the write has no data-dependent shape (no host sync). Valid entries must be distinct."""
    n, E = entry_bytes.shape
    if E != source.entry_bytes or entry_bytes.dtype != torch.uint8:
        raise ValueError(f"write_entries: expected uint8 [n, {source.entry_bytes}], got "
                         f"{entry_bytes.dtype} {tuple(entry_bytes.shape)}")
    r, s = source.ratio, source.share
    padded = torch.nn.functional.pad(entry_bytes, (0, r * s - E)) if r * s > E else entry_bytes
    target = _entry_row_index(source, entry_idx.clamp(min=0)).reshape(-1)
    rows[target, source.offset: source.offset + s] = padded.reshape(n * r, s)


def read_entries(rows: Tensor, source: SourceColumns, entry_idx: Tensor) -> Tensor:
    """Gather one part of packed entries (inverse of `write_entries`): uint8 [n, P]; entry −1 →
    all-zero bytes (decodes to zeros; callers mask it as "no key")."""
    flat = entry_idx.reshape(-1).to(torch.int64)
    n = flat.numel()
    target = _entry_row_index(source, flat.clamp(min=0))                             # [n, r]
    data = rows[target, source.offset: source.offset + source.share].reshape(n, source.ratio * source.share)
    data = data[:, : source.entry_bytes]
    return torch.where((flat >= 0)[:, None], data, torch.zeros_like(data))


@dataclass(frozen=True)
class PackedSourceRows:
    """One kv source's packed entries inside the two row buffers, as attention (latents, from
    `latent_rows`) and the indexer (keys, from `key_rows`) read them; entry −1 = no key (zeros)."""

    latent_rows: Tensor
    key_rows: Tensor
    source: KvSource
    layout: CompressedRowLayout

    def entries(self, entry_idx: Tensor) -> Tensor:
        """uint8 [..., E] whole packed entries (latent part, then key part) at `entry_idx` [...]
        (−1 → zeros)."""
        both = torch.cat((read_entries(self.latent_rows, self.source.latent, entry_idx),
                          read_entries(self.key_rows, self.source.key, entry_idx)), dim=1)
        return both.reshape(*entry_idx.shape, self.layout.entry_bytes)

    def latents(self, entry_idx: Tensor) -> Tensor:
        """fp32 [..., D] stored latents (zeros where −1)."""
        flat = read_entries(self.latent_rows, self.source.latent, entry_idx)
        return decode_latents(flat, self.layout.head_dim).reshape(*entry_idx.shape, self.layout.head_dim)

    def keys(self, entry_idx: Tensor) -> Tensor:
        """fp32 [..., Dk] FP4 index keys (zeros where −1)."""
        flat = read_entries(self.key_rows, self.source.key, entry_idx)
        return decode_keys(flat, self.layout.index_head_dim).reshape(*entry_idx.shape, self.layout.index_head_dim)


def write_source_entries(latent_rows: Tensor, key_rows: Tensor, source: KvSource, entry_idx: Tensor,
                         entry_bytes: Tensor) -> None:
    """Whole packed entries uint8 [n, E] of `source` at `entry_idx` [n] (−1 = none): the latent
    part into `latent_rows`, the key part into `key_rows` (contract §2)."""
    if entry_bytes.dim() != 2 or entry_bytes.shape[1] != source.latent.entry_bytes + source.key.entry_bytes:
        raise ValueError(f"write_source_entries: expected uint8 [n, {source.latent.entry_bytes + source.key.entry_bytes}], "
                         f"got {entry_bytes.dtype} {tuple(entry_bytes.shape)}")
    split = source.latent.entry_bytes
    write_entries(latent_rows, source.latent, entry_idx, entry_bytes[:, :split])
    write_entries(key_rows, source.key, entry_idx, entry_bytes[:, split:])

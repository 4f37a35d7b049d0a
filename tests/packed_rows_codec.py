"""Test-side torch codec of the packed FP4 compressed entry (contracts phase 2 §1, §2).

Independent of the kernels (which decode with integer arithmetic in Triton): the encoder derives
codes and scale bytes from the reference fake-quantisers' own values (`reference.ops`), the
decoder uses table look-ups and torch's float8 cast. Used by tests/test_kernels_*.py to build
packed rows — latent rows and index-key rows are separate buffers — and the BF16 caches holding
the same decoded values.
"""
from __future__ import annotations

import torch
from torch import Tensor

from sglang_dsv41.reference import ops

E2M1_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def entry_bytes(head_dim: int, index_head_dim: int) -> int:
    """E = D/2 + D/16 + Dk/2 + Dk/32 (contracts §1): both parts."""
    return latent_part_bytes(head_dim) + key_part_bytes(index_head_dim)


def _codes(grid: Tensor) -> Tensor:
    """E2M1 codes (uint8) of values already on the E2M1 grid; −0 → code 8 (sign bit kept)."""
    hit = grid.abs()[..., None] == E2M1_MAGNITUDES
    if not bool(hit.any(dim=-1).all()):
        raise ValueError("value off the E2M1 grid")
    mag = hit.to(torch.uint8).argmax(dim=-1).to(torch.uint8)
    return mag | (torch.signbit(grid).to(torch.uint8) << 3)


def _nibbles(codes: Tensor) -> Tensor:
    """[..., d] codes → [..., d/2] bytes: dim 2i low nibble, dim 2i+1 high nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def encode_latent(x: Tensor) -> Tensor:
    """[n, D] fp32 latents → [n, D/2 + D/16] uint8: payload then E4M3 scale bytes, such that
    decode_latent(encode_latent(x)) == ops.fp4_fake_quant_e4m3_scale(x) bit for bit."""
    g = x.float().reshape(x.shape[0], -1, 16)
    scale = ops.e4m3((g.abs().amax(dim=-1, keepdim=True) / ops.E2M1_MAX).clamp(min=2.0**-9, max=ops.E4M3_MAX))
    grid = ops.e2m1_rne((g / scale).clamp(-ops.E2M1_MAX, ops.E2M1_MAX)).reshape(x.shape)
    scale_bytes = scale[..., 0].to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.cat([_nibbles(_codes(grid)), scale_bytes], dim=1)


def encode_index_key(k: Tensor) -> Tensor:
    """[n, Dk] fp32 index keys → [n, Dk/2 + Dk/32] uint8: payload then UE8M0 exponent bytes, such
    that decode_index_key(encode_index_key(k)) == ops.fp4_fake_quant_ue8m0_scale(k) bit for bit."""
    g = k.float().reshape(k.shape[0], -1, 32)
    scale = ops.pow2_ceil(g.abs().amax(dim=-1, keepdim=True).clamp(min=ops.E2M1_MAX * 2.0**-126) / ops.E2M1_MAX)
    grid = ops.e2m1_rne((g / scale).clamp(-ops.E2M1_MAX, ops.E2M1_MAX)).reshape(k.shape)
    _, exponent = torch.frexp(scale[..., 0])                    # scale = 0.5·2^exponent
    return torch.cat([_nibbles(_codes(grid)), (exponent - 1 + 127).to(torch.uint8)], dim=1)


def _decode_payload(payload: Tensor) -> Tensor:
    codes = torch.stack([payload & 15, payload >> 4], dim=-1).reshape(payload.shape[0], -1).long()
    mag = E2M1_MAGNITUDES[codes & 7]
    return torch.where((codes & 8) != 0, -mag, mag)


def decode_latent(part: Tensor, head_dim: int) -> Tensor:
    """[n, D/2 + D/16] uint8 → [n, D] fp32 (inverse of encode_latent on its image)."""
    vals = _decode_payload(part[:, :head_dim // 2])
    scale = part[:, head_dim // 2:head_dim // 2 + head_dim // 16].contiguous().view(torch.float8_e4m3fn).float()
    return (vals.reshape(part.shape[0], -1, 16) * scale[..., None]).reshape(part.shape[0], head_dim)


def decode_index_key(part: Tensor, index_head_dim: int) -> Tensor:
    """[n, Dk/2 + Dk/32] uint8 → [n, Dk] fp32 (inverse of encode_index_key on its image)."""
    vals = _decode_payload(part[:, :index_head_dim // 2])
    exps = part[:, index_head_dim // 2:index_head_dim // 2 + index_head_dim // 32].long() - 127
    scale = torch.ldexp(torch.ones(exps.shape), exps)
    return (vals.reshape(part.shape[0], -1, 32) * scale[..., None]).reshape(part.shape[0], index_head_dim)


def _byte_address(entries: Tensor, n_bytes: int, offset: int, share: int, ratio: int) -> tuple[Tensor, Tensor]:
    j = torch.arange(n_bytes)
    return entries.long()[:, None] * ratio + (j // share)[None, :], (offset + j % share)[None, :].expand(
        entries.numel(), -1)


def write_entries(rows: Tensor, entries: Tensor, data: Tensor, offset: int, share: int, ratio: int) -> None:
    """Scatter [n, E] entry bytes of entries `entries` into rows by the §2 address rule."""
    r, c = _byte_address(entries, data.shape[1], offset, share, ratio)
    rows[r, c] = data


def read_entries(rows: Tensor, entries: Tensor, n_bytes: int, offset: int, share: int, ratio: int) -> Tensor:
    """[n, n_bytes] bytes of entries `entries` gathered by the §2 address rule."""
    r, c = _byte_address(entries, n_bytes, offset, share, ratio)
    return rows[r, c]


def latent_part_bytes(head_dim: int) -> int:
    """Latent part of an entry, in the latent rows: D/2 + D/16 (contracts §1)."""
    return head_dim // 2 + head_dim // 16


def key_part_bytes(index_head_dim: int) -> int:
    """Index-key part of an entry, in the index-key rows: Dk/2 + Dk/32 (contracts §1)."""
    return index_head_dim // 2 + index_head_dim // 32


def part_layout(part_bytes: int, ratios: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """(offset, share, ratio) of each source in one part's rows, shares ⌈P/r⌉, offsets cumulative (§2)."""
    out, offset = [], 0
    for r in ratios:
        share = -(-part_bytes // r)
        out.append((offset, share, r))
        offset += share
    return out


def packed_rows_case(num_rows: int, head_dim: int, index_head_dim: int, ratios: tuple[int, ...], source: int,
                     seed: int, part: str, pad_columns: int = 0) -> dict:
    """One part's rows ("latent": the latent rows, "key": the index-key rows) of `num_rows` tokens
    holding several sources (random garbage everywhere) with every entry of source `source`
    written from random latents/keys; returns the rows (a column slice of a wider tensor when
    pad_columns > 0), the source's (offset, share, ratio) in them, and the decoded BF16 values of
    its entries' part (the BF16-path cache, indexed by entry: `latent_cache` or `key_cache`)."""
    if part not in ("latent", "key"):
        raise ValueError(f"part {part!r}")
    g = torch.Generator().manual_seed(seed)
    n_bytes = latent_part_bytes(head_dim) if part == "latent" else key_part_bytes(index_head_dim)
    layout = part_layout(n_bytes, ratios)
    row_bytes = sum(share for _, share, _ in layout)
    wide = torch.randint(0, 256, (num_rows, row_bytes + pad_columns), generator=g, dtype=torch.uint8)
    rows = wide[:, :row_bytes]
    offset, share, ratio = layout[source]
    n = num_rows // ratio
    scale = 2.0 ** torch.randint(-4, 5, (n, 1), generator=g)
    if part == "latent":
        values = torch.randn(n, head_dim, generator=g) * scale
        data = encode_latent(values)
    else:
        values = torch.randn(n, index_head_dim, generator=g) * scale
        data = encode_index_key(values)
    entries = torch.arange(n)
    write_entries(rows, entries, data, offset, share, ratio)
    back = read_entries(rows, entries, data.shape[1], offset, share, ratio)
    decoded = decode_latent(back, head_dim) if part == "latent" else decode_index_key(back, index_head_dim)
    return dict(rows=rows, offset=offset, share=share, ratio=ratio, part=part, values=values,
                decoded=decoded, **{f"{part}_cache": decoded.to(torch.bfloat16)})


def kernel_source_as_runtime_rows(c):
    """A kernel `PackedSource` (one part's rows) as the runtime's `kv_layout.PackedSourceRows`, so
    exact torch stand-ins of the kernels decode what the kernel would read. The other part's
    rows are an empty [S, 0] tensor: a stand-in that reads the wrong part fails."""
    from sglang_dsv41.runtime.kv_layout import CompressedRowLayout, KvSource, PackedSourceRows, SourceColumns

    this = SourceColumns(-1, c.ratio, c.offset, c.share, c.entry_bytes)
    none = SourceColumns(-1, c.ratio, 0, 1, 1)
    empty = c.rows.new_zeros(c.rows.shape[0], 0)
    layout = CompressedRowLayout(c.head_dim, c.index_head_dim, ())
    if c.part == "latent":
        return PackedSourceRows(c.rows, empty, KvSource(-1, c.ratio, latent=this, key=none), layout)
    return PackedSourceRows(empty, c.rows, KvSource(-1, c.ratio, latent=none, key=this), layout)

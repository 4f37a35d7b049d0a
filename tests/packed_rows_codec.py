"""Test-side torch codec of the packed FP4 compressed entry (contracts phase 2 §1, §2).

Independent of the kernels (which decode with integer arithmetic in Triton): the encoder derives
codes and scale bytes from the reference fake-quantisers' own values (`reference.ops`), the
decoder uses table look-ups and torch's float8 cast. Used by tests/test_kernels_*.py to build
packed rows and the BF16 caches holding the same decoded values.
"""
from __future__ import annotations

import torch
from torch import Tensor

from sglang_dsv41.reference import ops

E2M1_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def entry_bytes(head_dim: int, index_head_dim: int) -> int:
    """E = D/2 + D/16 + Dk/2 + Dk/32 (contracts §1)."""
    return head_dim // 2 + head_dim // 16 + index_head_dim // 2 + index_head_dim // 32


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


def tiny_like_layout(head_dim: int, index_head_dim: int, ratios: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """(offset, share, ratio) of each source in order, shares ⌈E/r⌉, offsets cumulative (§2)."""
    e = entry_bytes(head_dim, index_head_dim)
    out, offset = [], 0
    for r in ratios:
        share = -(-e // r)
        out.append((offset, share, r))
        offset += share
    return out


def packed_rows_case(num_rows: int, head_dim: int, index_head_dim: int, ratios: tuple[int, ...], source: int,
                     seed: int, pad_columns: int = 0) -> dict:
    """Rows of `num_rows` tokens holding several sources (random garbage everywhere) with every
    entry of source `source` written from random latents/keys; returns the rows (a column slice
    of a wider tensor when pad_columns > 0), the source's (offset, share, ratio), and the decoded
    BF16 latents / keys of its entries (the BF16-path caches, indexed by entry)."""
    g = torch.Generator().manual_seed(seed)
    layout = tiny_like_layout(head_dim, index_head_dim, ratios)
    row_bytes = sum(share for _, share, _ in layout)
    wide = torch.randint(0, 256, (num_rows, row_bytes + pad_columns), generator=g, dtype=torch.uint8)
    rows = wide[:, :row_bytes]
    offset, share, ratio = layout[source]
    n = num_rows // ratio
    scale = 2.0 ** torch.randint(-4, 5, (n, 1), generator=g)
    latents = torch.randn(n, head_dim, generator=g) * scale
    keys = torch.randn(n, index_head_dim, generator=g) * scale
    data = torch.cat([encode_latent(latents), encode_index_key(keys)], dim=1)
    entries = torch.arange(n)
    write_entries(rows, entries, data, offset, share, ratio)
    lat_bytes = head_dim // 2 + head_dim // 16
    back = read_entries(rows, entries, data.shape[1], offset, share, ratio)
    latent_values = decode_latent(back[:, :lat_bytes], head_dim)
    key_values = decode_index_key(back[:, lat_bytes:], index_head_dim)
    return dict(rows=rows, offset=offset, share=share, ratio=ratio, latents=latents, keys=keys,
                latent_values=latent_values, key_values=key_values,
                latent_cache=latent_values.to(torch.bfloat16), key_cache=key_values.to(torch.bfloat16))

"""Packed FP4 compressed entries and the per-token row layout (`runtime/kv_layout.py`; spec §3.4.3,
§3.8; contracts phase 2 §1–§2), and the cache accounting of `runtime/cache.py` (§4).

What is pinned:
* layout arithmetic: Flash entries of 356 B = 288 B latent + 68 B index key; latent shares
  144/144/144/288 (720 B), key shares 34/34/34/68 (170 B → 176), two buffers of 720 + 176 = 896 B
  per token (each 16-B aligned); tiny 88 B entries, 112 + 80 = 192 B;
* codecs: decode(encode(x)) equals the reference fake quantisation (`ops.fp4_fake_quant_e4m3_scale`
  for latents, `ops.fp4_fake_quant_ue8m0_scale` for index keys) bit for bit, signs of zeros
  included, on random values over many magnitudes and on edge values (zeros, negative, clamped
  maxima, E4M3-subnormal and UE8M0-floor scales, exact rounding ties); the byte order of contract
  §1 on a hand-made entry; why the encoders take pre-quantisation values (the E4M3 round trip is
  not idempotent);
* rows: write/read round trip for every source and part of both layouts, the §2 byte address
  rule, sources never touch each other's columns, latents land only in the latent rows and keys
  only in the key rows, entry −1 writes only the padding entry 0 and reads as zeros;
* accounting: `global_bytes_per_token` 896 (Flash, from the config) / 192 (tiny, allocated),
  SWA L·D·2, pair ring per request row; planned == allocated; `describe` states them.
"""
from __future__ import annotations

import pytest
import torch

from sglang_dsv41.config import DeepseekV41Config
from sglang_dsv41.presets import flash_config_dict, tiny_config_dict
from sglang_dsv41.reference import ops
from sglang_dsv41.runtime import kv_layout as K, kv_rows
from sglang_dsv41.runtime.cache import RuntimeCaches

FLASH = DeepseekV41Config.from_dict(flash_config_dict()).text
TINY = DeepseekV41Config.from_dict(tiny_config_dict(1000)).text


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


# ---- layout ----------------------------------------------------------------------------------------

def _columns(layout, part):
    return [(s.layer, s.ratio, getattr(s, part).offset, getattr(s, part).share) for s in layout.sources]


def test_flash_layout_is_890_packed_bytes_in_720_plus_176_byte_rows() -> None:
    layout = K.CompressedRowLayout.from_config(FLASH)
    assert layout.entry_bytes == 256 + 32 + 64 + 4 == 356
    assert _columns(layout, "latent") == [(2, 2, 0, 144), (8, 2, 144, 144), (14, 2, 288, 144), (20, 1, 432, 288)]
    assert _columns(layout, "key") == [(2, 2, 0, 34), (8, 2, 34, 34), (14, 2, 68, 34), (20, 1, 102, 68)]
    assert (layout.latent_row_bytes, layout.latent_row_stride) == (720, 720)
    assert (layout.key_row_bytes, layout.key_row_stride) == (170, 176)
    assert layout.row_bytes == 890 and layout.row_stride == 896
    assert RuntimeCaches.planned_global_bytes_per_token(FLASH) == 896
    assert kv_rows.text_row_stride_bytes(FLASH) == 896 and kv_rows.text_row_payload_bytes(FLASH) == 890


def test_tiny_layout_is_112_plus_80_bytes_per_token() -> None:
    layout = K.CompressedRowLayout.from_config(TINY)
    assert layout.entry_bytes == 48 + 6 + 32 + 2 == 88
    assert _columns(layout, "latent") == [(1, 2, 0, 27), (3, 2, 27, 27), (4, 1, 54, 54)]
    assert _columns(layout, "key") == [(1, 2, 0, 17), (3, 2, 17, 17), (4, 1, 34, 34)]
    assert (layout.latent_row_bytes, layout.latent_row_stride) == (108, 112)
    assert (layout.key_row_bytes, layout.key_row_stride) == (68, 80)
    assert layout.row_bytes == 176 and layout.row_stride == 192
    assert (kv_rows.text_latent_row_stride_bytes(TINY), kv_rows.text_key_row_stride_bytes(TINY)) == (112, 80)
    with pytest.raises(KeyError, match="not a kv source"):
        layout.source(0)


# ---- codecs ----------------------------------------------------------------------------------------

def _edge_values(d: int) -> torch.Tensor:
    """Rows of edge cases, each row of width d (a multiple of 32)."""
    g = torch.Generator().manual_seed(3)
    rows = [
        torch.zeros(d),
        -torch.zeros(d),                                        # signed zeros
        -torch.rand(d, generator=g) * 3,                         # all negative
        torch.full((d,), 1e30),                                  # latent scale clamps at 448 (x/scale clamps at 6)
        torch.full((d,), -6.0 * 448),                            # latent scale exactly 448
        torch.randn(d, generator=g) * 2.0 ** -14,               # latent scale floor 2^-9, E2M1 codes mostly 0
        torch.randn(d, generator=g) * 2.0 ** -130,              # key scale floor 2^-126 (fp32 subnormal inputs)
        torch.linspace(-1.6 * 6, 1.6 * 6, d) * 2.0 ** -9,       # E4M3-subnormal scales 1.6·2^-9 → 2·2^-9
        torch.tensor([6.0, 5.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5] * (d // 8)),   # exact E2M1 ties (scale 1)
        torch.tensor([1e-3] + [0.0] * (d - 1)),                 # one non-zero value
    ]
    return torch.stack(rows)


@pytest.mark.parametrize("d", [96, 512])
def test_latent_codec_equals_reference_fake_quant(d: int) -> None:
    g = torch.Generator().manual_seed(0)
    random = torch.randn(64, d, generator=g) * torch.logspace(-6, 4, 64)[:, None]
    x = torch.cat((random, _edge_values(d)))
    packed = K.encode_latents(x)
    assert packed.dtype == torch.uint8 and packed.shape == (x.shape[0], K.latent_bytes(d))
    assert _bits_equal(K.decode_latents(packed, d), ops.fp4_fake_quant_e4m3_scale(x))


@pytest.mark.parametrize("d", [64, 128])
def test_key_codec_equals_reference_fake_quant(d: int) -> None:
    g = torch.Generator().manual_seed(1)
    random = torch.randn(64, d, generator=g) * torch.logspace(-30, 30, 64)[:, None]
    x = torch.cat((random, _edge_values(d)))
    packed = K.encode_keys(x)
    assert packed.dtype == torch.uint8 and packed.shape == (x.shape[0], K.key_bytes(d))
    assert _bits_equal(K.decode_keys(packed, d), ops.fp4_fake_quant_ue8m0_scale(x))


def test_entry_byte_order_of_the_contract() -> None:
    """Dim 0 = 6 (amax 6: latent scale e4m3(1) = 0x38, key scale 2^0 = byte 127), dim 1 = −0.5:
    codes 7 and 8|1 → byte 0 = 0x97 (dim 0 low nibble); then scales, then the key part."""
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 1], x[0, 17] = 6.0, -0.5, 3.0          # group 1 (dims 16..31): amax 3 → scale 0.5, 3 → code 7
    latent = K.encode_latents(x)
    assert latent[0, :16].tolist() == [0x97, 0, 0, 0, 0, 0, 0, 0, 0x70, 0, 0, 0, 0, 0, 0, 0]
    assert latent[0, 16:].tolist() == [0x38, 0x30]        # e4m3 bits of 1.0 and 0.5
    key = K.encode_keys(x)
    # one key group (dims 0..31, amax 6): scale 2^0 = byte 127; dim 17 = 3 → code 5, high nibble of byte 8
    assert key[0, :16].tolist() == [0x97, 0, 0, 0, 0, 0, 0, 0, 0x50, 0, 0, 0, 0, 0, 0, 0]
    assert key[0, 16:].tolist() == [127]
    layout = K.CompressedRowLayout(head_dim=32, index_head_dim=32, sources=())
    entry = K.encode_entries(layout, x, x)
    assert torch.equal(entry, torch.cat((latent, key), dim=1))
    assert _bits_equal(K.decode_entry_latents(layout, entry), ops.fp4_fake_quant_e4m3_scale(x))
    assert _bits_equal(K.decode_entry_keys(layout, entry), ops.fp4_fake_quant_ue8m0_scale(x))


def test_encoders_need_pre_quantisation_values() -> None:
    """The E4M3-scale round trip is not idempotent: amax/6 = 1.6·2⁻⁹ → scale 2·2⁻⁹, max value
    4·scale; quantising that again picks scale 2⁻⁹ and clamps 8 to 6. Encoding fake-quantised
    values would therefore not reproduce them — the encoders take the values before rounding."""
    x = torch.zeros(1, 32)
    x[0, 0] = 1.6 * 6 * 2.0 ** -9
    once = ops.fp4_fake_quant_e4m3_scale(x)
    assert float(once[0, 0]) == 4 * 2 * 2.0 ** -9
    assert not torch.equal(ops.fp4_fake_quant_e4m3_scale(once), once)
    assert torch.equal(K.decode_latents(K.encode_latents(x), 32), once)


def test_codec_shape_errors() -> None:
    with pytest.raises(ValueError, match="D % 32"):
        K.encode_latents(torch.zeros(2, 40))
    with pytest.raises(ValueError, match="uint8"):
        K.decode_keys(torch.zeros(2, 34), 64)


# ---- rows ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("part", ["latent", "key"])
@pytest.mark.parametrize("cfg", [TINY, FLASH], ids=["tiny", "flash"])
def test_rows_round_trip_every_source_without_touching_the_others(cfg, part) -> None:
    layout = K.CompressedRowLayout.from_config(cfg)
    S = 64
    rows = torch.zeros(S, getattr(layout, f"{part}_row_stride"), dtype=torch.uint8)
    g = torch.Generator().manual_seed(2)
    written = {}
    for source in layout.sources:
        src = getattr(source, part)
        n_entries = S // src.ratio
        idx = torch.randperm(n_entries - 1, generator=g)[:10] + 1       # distinct, never the sink entry 0
        data = torch.randint(0, 256, (10, src.entry_bytes), generator=g, dtype=torch.uint8)
        K.write_entries(rows, src, idx, data)
        written[src.layer] = (idx, data)
    for source in layout.sources:
        src = getattr(source, part)
        idx, data = written[src.layer]
        assert torch.equal(K.read_entries(rows, src, idx), data), f"source {src.layer}"
        e, j = int(idx[3]), torch.arange(src.entry_bytes)                # the §2 address rule
        assert torch.equal(rows[e * src.ratio + j // src.share, src.offset + j % src.share], data[3])
    used = torch.zeros_like(rows, dtype=torch.bool)
    for source in layout.sources:
        src = getattr(source, part)
        idx, _ = written[src.layer]
        r = (idx[:, None] * src.ratio + torch.arange(src.ratio)).reshape(-1)
        used[r[:, None], torch.arange(src.offset, src.offset + src.share)[None, :]] = True
    assert not bool(rows[~used].any())                                   # nothing written elsewhere


def test_caches_write_latents_to_latent_rows_and_keys_to_key_rows() -> None:
    """The two buffers are separately addressable: a whole entry written through the caches puts
    its latent part (D/2 + D/16 B) only in the latent rows and its key part only in the key rows."""
    caches = RuntimeCaches.allocate(TINY, 32, 2)
    layout = caches.layout
    g = torch.Generator().manual_seed(5)
    lat, key = torch.randn(2, TINY.head_dim, generator=g), torch.randn(2, TINY.index_head_dim, generator=g)
    entries = K.encode_entries(layout, lat, key)
    caches.write_entries(1, torch.tensor([3, 6]), entries)
    src = layout.source(1)
    assert torch.equal(K.read_entries(caches.latent_rows, src.latent, torch.tensor([3, 6])), K.encode_latents(lat))
    assert torch.equal(K.read_entries(caches.key_rows, src.key, torch.tensor([3, 6])), K.encode_keys(key))
    view = caches.packed(1)
    assert torch.equal(view.entries(torch.tensor([3, 6])), entries)
    assert torch.equal(view.latents(torch.tensor([3])), K.decode_latents(K.encode_latents(lat[:1]), TINY.head_dim))
    caches.key_rows.zero_()                                              # keys gone, latents untouched
    assert not bool(view.keys(torch.tensor([3, 6])).any()) and torch.equal(
        view.latents(torch.tensor([3, 6])), K.decode_latents(K.encode_latents(lat), TINY.head_dim))


def test_entry_minus_one_writes_only_the_padding_entry_and_reads_zeros() -> None:
    layout = K.CompressedRowLayout.from_config(TINY)
    source = layout.source(1)                                            # ratio 2
    src = source.latent
    rows = torch.zeros(16, layout.latent_row_stride, dtype=torch.uint8)
    data = torch.full((3, src.entry_bytes), 7, dtype=torch.uint8)
    K.write_entries(rows, src, torch.tensor([-1, 5, -1]), data)
    assert torch.equal(K.read_entries(rows, src, torch.tensor([5, -1])),
                       torch.cat((data[1:2], torch.zeros(1, src.entry_bytes, dtype=torch.uint8))))
    touched = rows.any(dim=1).nonzero().flatten().tolist()
    assert touched == [0, 1, 10, 11]                                     # sink rows 0..1 and entry 5's rows
    key_rows = torch.zeros(16, layout.key_row_stride, dtype=torch.uint8)
    view = K.PackedSourceRows(rows, key_rows, source, layout)
    entries = torch.tensor([[5, -1], [-1, -1]])
    assert view.latents(entries).shape == (2, 2, 96) and view.keys(entries).shape == (2, 2, 64)
    assert not bool(view.keys(entries)[0, 1].any()) and not bool(view.latents(entries)[1].any())


# ---- accounting (cache.py, contract §4) -----------------------------------------------------------

def test_accounting_of_allocated_tiny_caches_matches_the_plan() -> None:
    caches = RuntimeCaches.allocate(TINY, 32, 5, page_size=4)
    assert caches.global_bytes_per_token() == 192 == RuntimeCaches.planned_global_bytes_per_token(TINY)
    assert caches.latent_rows.shape == (32, 112) and caches.latent_rows.dtype == torch.uint8
    assert caches.key_rows.shape == (32, 80) and caches.key_rows.dtype == torch.uint8
    assert caches.swa_bytes_per_token() == TINY.num_hidden_layers * TINY.head_dim * 2 \
        == RuntimeCaches.planned_swa_bytes_per_token(TINY)
    assert caches.request_state_bytes() == 2 * 2 * (2 * 96 * 4 + 8) == RuntimeCaches.planned_request_state_bytes(TINY)
    assert caches.pair_ring_slots == 2 and caches.pair_kv[1].shape == (5, 2, 96) and caches.pair_position[1].shape == (5, 2)
    assert torch.equal(caches.swa_slot_of, torch.arange(32))
    assert caches.engram_history.ids.shape == (5, TINY.engram_max_ngram_size - 1) and caches.num_req_rows == 5
    line = caches.describe()
    assert "global KV 192 B/token" in line and f"SWA {caches.swa_bytes_per_token()} B/token" in line
    assert caches.engram_history_bytes() == 3 * 4 + 8
    assert f"pair state {caches.request_state_bytes()} B + Engram history 20 B per request row" in line
    assert "page_size 4" in line


def test_flash_per_token_figures_from_the_config() -> None:
    assert RuntimeCaches.planned_swa_bytes_per_token(FLASH) == 40 * 512 * 2
    assert RuntimeCaches.planned_request_state_bytes(FLASH) == 3 * 2 * (2 * 512 * 4 + 8)
    assert RuntimeCaches.planned_request_state_bytes(FLASH, draft_tokens=5) == 3 * 8 * (2 * 512 * 4 + 8)


def test_from_buffers_checks_what_it_wraps() -> None:
    layout = K.CompressedRowLayout.from_config(TINY)
    swa = [torch.zeros(16, TINY.head_dim, dtype=torch.bfloat16) for _ in range(TINY.num_hidden_layers)]
    lat = torch.zeros(24, layout.latent_row_stride, dtype=torch.uint8)
    key = torch.zeros(24, layout.key_row_stride, dtype=torch.uint8)
    slot_of = torch.zeros(24, dtype=torch.int64)
    caches = RuntimeCaches.from_buffers(TINY, swa, slot_of, lat, key, 3, pool_id=7, page_size=2)
    assert caches.num_slots == 24 and caches.num_swa_slots == 16 and caches.engram_history.ids.shape[0] == 3
    assert caches.latent_rows is lat and caches.key_rows is key and caches.swa[0] is swa[0] and caches.pool_id == 7
    with pytest.raises(ValueError, match="FP8 profile"):
        RuntimeCaches.from_buffers(TINY, swa, slot_of, lat, key, 3, ops.CacheProfile.FP8)
    with pytest.raises(ValueError, match="packed latent rows"):
        RuntimeCaches.from_buffers(TINY, swa, slot_of, lat[:, :100], key, 3)
    with pytest.raises(ValueError, match="packed key rows"):
        RuntimeCaches.from_buffers(TINY, swa, slot_of, lat, key[:, :60], 3)
    with pytest.raises(ValueError, match="packed key rows"):
        RuntimeCaches.from_buffers(TINY, swa, slot_of, lat, key[:20], 3)
    with pytest.raises(ValueError, match="swa_slot_of"):
        RuntimeCaches.from_buffers(TINY, swa, slot_of[:10], lat, key, 3)
    with pytest.raises(ValueError, match="cannot hold the SWA kv exactly"):
        RuntimeCaches.from_buffers(TINY, [b.to(torch.float16) for b in swa], slot_of, lat, key, 3)
    with pytest.raises(ValueError, match="page_size 3"):
        RuntimeCaches.from_buffers(TINY, swa, slot_of, lat, key, 3, page_size=3)


def test_one_merged_buffer_is_refused() -> None:
    """The global KV is two buffers: views of one merged [S, latent + key] tensor are refused."""
    layout = K.CompressedRowLayout.from_config(TINY)
    swa = [torch.zeros(16, TINY.head_dim, dtype=torch.bfloat16) for _ in range(TINY.num_hidden_layers)]
    merged = torch.zeros(24, layout.row_stride, dtype=torch.uint8)
    with pytest.raises(ValueError, match="share one storage"):
        RuntimeCaches.from_buffers(TINY, swa, torch.zeros(24, dtype=torch.int64), merged[:, :112], merged[:, 112:], 3)

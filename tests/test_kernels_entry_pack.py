"""`kernels/entry_pack.py`: packed FP4 entries encoded and scattered into the row buffers in one launch.

What is pinned:
* kernel cases (interpreter child on CPU; compiled on CUDA): the row buffers after `write_packed_entries`
  equal those after `kv_layout.encode_entries` + `write_source_entries`, byte for byte — Flash and tiny
  widths, group counts that are not powers of two (96 dims), ratio 1 and 2 sources at an offset (one
  padding byte at ratio 2), fp32 and BF16 values, groups of zeros and −0, values small enough for
  E4M3-subnormal latent scales and the key scale's floor, values past every grid step; entry −1 writes
  nothing; the decoded entries are the reference's fake-quantised values;
* main process: bad shapes raise; the kernel builds for sm_90 without spills or float64;
* GPU (`gpu`): Flash widths at 1 … 512 entries against the torch path on the same device.
"""
from __future__ import annotations

import pytest
import torch

from sglang_dsv41.kernels import fused_elementwise as FE
from sglang_dsv41.kernels.entry_pack import _entry_pack_kernel, write_packed_entries
from sglang_dsv41.numerics import rounding as R
from sglang_dsv41.runtime import kv_layout as KL
from triton_checks import compile_for_sm90, no_spills, run_kernel_cases_in_interpreter

KERNEL_HERE = FE.INTERPRETED or torch.cuda.is_available()
DEVICE = "cuda" if torch.cuda.is_available() and not FE.INTERPRETED else "cpu"


def _source(D: int, Dk: int, ratio: int, lat_off: int, key_off: int) -> KL.KvSource:
    lat, key = KL.latent_bytes(D), KL.key_bytes(Dk)
    share = lambda p: -(-p // ratio)  # noqa: E731
    return KL.KvSource(layer=3, ratio=ratio,
                       latent=KL.SourceColumns(3, ratio, offset=lat_off, share=share(lat), entry_bytes=lat),
                       key=KL.SourceColumns(3, ratio, offset=key_off, share=share(key), entry_bytes=key))


def _values(g: torch.Generator, n: int, dim: int) -> torch.Tensor:
    x = torch.randn(n, dim, generator=g) * torch.exp2(torch.randint(-12, 12, (n, 1), generator=g).float())
    x[0, :32] = 0.0                                            # an all-zero group (scale floors)
    x[0, 1] = -0.0
    if n > 1:
        x[1, :16] *= 2.0 ** -140                               # E4M3-subnormal latent scale, key amax floor
        x[1, 16:32] = torch.tensor([6.5, 5.0, 3.5, 2.5, 1.75, 1.25, 0.75, 0.25] * 2) * 0.01
    if n > 2:
        x[2, :] = x[2, :].to(torch.bfloat16).float() * 448.0 * 6.0   # past the E4M3 clamp
    return x.to(torch.bfloat16).float()


def _check(D: int, Dk: int, ratio: int, n: int, dtype: torch.dtype, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    lat_off, key_off = 5, 3
    src = _source(D, Dk, ratio, lat_off, key_off)
    S = ratio * (2 * n + 4)
    lat_rows = torch.randint(0, 256, (S, lat_off + src.latent.share + 7), generator=g, dtype=torch.uint8)
    key_rows = torch.randint(0, 256, (S, key_off + src.key.share + 2), generator=g, dtype=torch.uint8)
    lat, key = _values(g, n, D), _values(g, n, Dk)
    entries = torch.randperm(2 * n + 3, generator=g)[:n] + 1
    if n > 1:
        entries[n // 2] = -1                                   # nothing to write
    want_lat, want_key = lat_rows.clone(), key_rows.clone()
    live = entries >= 0
    layout = KL.CompressedRowLayout(head_dim=D, index_head_dim=Dk, sources=(src,))
    KL.write_source_entries(want_lat, want_key, src, entries[live], KL.encode_entries(layout, lat[live], key[live]))
    got_lat, got_key = lat_rows.to(DEVICE), key_rows.to(DEVICE)
    write_packed_entries(got_lat, got_key, (src.latent.offset, src.latent.share), (src.key.offset, src.key.share),
                         ratio, entries.to(DEVICE), lat.to(DEVICE).to(dtype), key.to(DEVICE).to(dtype))
    assert torch.equal(got_lat.cpu(), want_lat) and torch.equal(got_key.cpu(), want_key)
    read = KL.PackedSourceRows(got_lat.cpu(), got_key.cpu(), src, layout)
    idx = entries[live]
    assert torch.equal(read.latents(idx), R.fp4_fake_quant_e4m3_scale(lat[live]))
    assert torch.equal(read.keys(idx), R.fp4_fake_quant_ue8m0_scale(key[live]))


if KERNEL_HERE:

    def test_kernel_case_bytes_equal_the_torch_encoder_and_scatter() -> None:
        for D, Dk, ratio, n, dtype, seed in ((512, 128, 2, 5, torch.float32, 0), (512, 128, 1, 4, torch.bfloat16, 1),
                                             (64, 32, 2, 6, torch.float32, 2), (96, 64, 1, 3, torch.bfloat16, 3),
                                             (96, 96, 2, 4, torch.float32, 4)):
            _check(D, Dk, ratio, n, dtype, seed)

    def test_kernel_case_no_entries_and_all_none() -> None:
        src = _source(64, 32, 2, 0, 0)
        rows = torch.zeros(8, 64, dtype=torch.uint8, device=DEVICE)
        keys = torch.zeros(8, 32, dtype=torch.uint8, device=DEVICE)
        cols = ((src.latent.offset, src.latent.share), (src.key.offset, src.key.share))
        write_packed_entries(rows, keys, *cols, 2, torch.zeros(0, dtype=torch.long, device=DEVICE),
                             torch.zeros(0, 64, device=DEVICE), torch.zeros(0, 32, device=DEVICE))
        write_packed_entries(rows, keys, *cols, 2, torch.full((3,), -1, device=DEVICE),
                             torch.ones(3, 64, device=DEVICE), torch.ones(3, 32, device=DEVICE))
        assert not rows.any() and not keys.any()


# ---- the interpreter child and the main-process checks -------------------------------------------

if not FE.INTERPRETED:

    def test_kernel_cases_in_triton_interpreter() -> None:
        """Run this file's kernel cases in a child pytest with TRITON_INTERPRET=1 (CPU)."""
        run_kernel_cases_in_interpreter(__file__, min_passed=2, exact=True)

    def test_bad_shapes_raise() -> None:
        rows, keys = torch.zeros(8, 64, dtype=torch.uint8), torch.zeros(8, 32, dtype=torch.uint8)
        e = torch.zeros(2, dtype=torch.long)
        with pytest.raises(ValueError, match="whole number"):
            write_packed_entries(rows, keys, (0, 18), (0, 9), 2, e, torch.zeros(2, 40), torch.zeros(2, 32))
        with pytest.raises(ValueError, match="columns"):
            write_packed_entries(rows, keys, (0, 10), (0, 9), 2, e, torch.zeros(2, 64), torch.zeros(2, 32))
        with pytest.raises(ValueError, match="entries"):
            write_packed_entries(rows, keys, (0, 18), (0, 9), 2, e[:1], torch.zeros(2, 64), torch.zeros(2, 32))

    def test_builds_for_sm90_without_spills_or_float64() -> None:
        sig = {"lat_ptr": "*fp32", "key_ptr": "*fp32", "entry_ptr": "*i64", "lat_rows_ptr": "*u8",
               "key_rows_ptr": "*u8", "lat_row_stride": "i32", "key_row_stride": "i32", "lat_offset": "i32",
               "lat_share": "i32", "lat_pad": "i32", "key_offset": "i32", "key_share": "i32", "key_pad": "i32",
               "ratio": "i32"}
        consts = {"D": 512, "DK": 128, "GB": 32, "GBK": 4, "PAD": 4}
        compiled, usage = compile_for_sm90(_entry_pack_kernel, sig | {k: "constexpr" for k in consts}, consts,
                                           {"num_warps": 4, "enable_fp_fusion": False})
        assert no_spills(usage), usage
        assert ".f64" not in compiled.asm["ptx"]


@pytest.mark.gpu
def test_gpu_flash_entries_equal_the_torch_path() -> None:
    for n, ratio, seed in ((1, 2, 10), (8, 1, 11), (64, 2, 12), (512, 2, 13)):
        _check(512, 128, ratio, n, torch.float32, seed)

"""`sglang_dsv41.kernels.entry_decode.decode_entry_rows`: packed entries decoded into BF16 rows (the prefill
workspaces of `runtime/attention_prefill.py`).

CPU cases run the kernel under Triton's interpreter in one child process (`test_interpreter_cases`, as in
tests/test_kernels_key_gather.py). What is pinned: row i is the decoded part of entry entries.flat[i], bit
for bit the runtime's torch codec (`kv_layout.decode_latents` / `decode_keys` rounded to BF16) and the test
codec's BF16 cache; zeros for −1; int32 and int64 entry lists of any shape; ratio 1 and 2 sources inside
rows holding other sources; NaN scale bytes decode to NaN. On the GPU: the same at the Flash shape, compiled.
"""
from __future__ import annotations

import pytest
import torch

import child_runs
from packed_rows_codec import packed_rows_case
from sglang_dsv41.kernels import entry_decode as ED
from sglang_dsv41.runtime import kv_layout

INTERPRETED = ED.INTERPRETED
interpreter = pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 child process of "
                                                         "test_interpreter_cases")
INTERPRETER_ARGV = child_runs.interpreter_argv(__file__, "-m", "not gpu", "-k", "not test_interpreter_cases")


@pytest.mark.skipif(INTERPRETED, reason="this process is the interpreter child")
@pytest.mark.child_run(*INTERPRETER_ARGV)
def test_interpreter_cases():
    """This file's CPU cases under Triton's interpreter, in one child pytest process."""
    child_runs.assert_all_passed(INTERPRETER_ARGV)


def _torch_rows(case: dict, entries: torch.Tensor, dims: int) -> torch.Tensor:
    """The runtime's torch codec on the same bytes: `read_entries` then `decode_*`, rounded to BF16."""
    cols = kv_layout.SourceColumns(-1, case["ratio"], case["offset"], case["share"],
                                   (kv_layout.latent_bytes if case["part"] == "latent" else kv_layout.key_bytes)(dims))
    raw = kv_layout.read_entries(case["rows"], cols, entries.reshape(-1))
    decode = kv_layout.decode_latents if case["part"] == "latent" else kv_layout.decode_keys
    return decode(raw, dims).to(torch.bfloat16)


def _decode(case: dict, entries: torch.Tensor, dims: int) -> torch.Tensor:
    return ED.decode_entry_rows(case["rows"], entries, offset=case["offset"], share=case["share"],
                                ratio=case["ratio"], dims=dims, part=case["part"])


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal BF16 bits where neither is NaN, and NaN at the same places."""
    nan = torch.isnan(a)
    return bool(torch.equal(nan, torch.isnan(b))) and torch.equal(a[~nan].view(torch.int16), b[~nan].view(torch.int16))


@interpreter
@pytest.mark.parametrize("part, dims, ratios, source", [("latent", 64, (2, 2, 1), 1), ("latent", 48, (1,), 0),
                                                         ("key", 64, (2, 1), 1), ("key", 32, (1, 2), 1)])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_rows_are_the_decoded_entries(part, dims, ratios, source, dtype):
    case = packed_rows_case(48, dims if part == "latent" else 64, dims if part == "key" else 32, ratios, source,
                            seed=dims + len(ratios), part=part)
    n = 48 // case["ratio"]
    g = torch.Generator().manual_seed(5)
    entries = torch.randint(0, n, (3, 7), generator=g)
    entries[torch.rand(3, 7, generator=g) < 0.3] = -1
    entries[0, 0], entries[2, 6] = -1, n - 1
    got = _decode(case, entries.to(dtype), dims)
    assert got.dtype == torch.bfloat16 and got.shape == (21, dims)
    flat = entries.reshape(-1)
    cache = case[f"{part}_cache"]
    for i, e in enumerate(flat.tolist()):
        want = torch.zeros(dims, dtype=torch.bfloat16) if e < 0 else cache[e]
        assert torch.equal(got[i].view(torch.int16), want.view(torch.int16)), (i, e)
    assert _same_bits(got, _torch_rows(case, entries, dims))


@interpreter
@pytest.mark.parametrize("part", ["latent", "key"])
def test_garbage_bytes_match_the_runtime_codec(part):
    """Every byte random (NaN scale codes included): the kernel and the runtime's codec agree, NaNs at the same
    places (key exponent bytes below 2 are avoided: the interpreter flushes fp32 subnormal products)."""
    dims = 64
    case = packed_rows_case(32, dims, dims, (1,), 0, seed=11, part=part)
    g = torch.Generator().manual_seed(2)
    low = 2 if part == "key" else 0
    case["rows"] = torch.randint(low, 256, case["rows"].shape, generator=g, dtype=torch.uint8)
    case["rows"][3, case["offset"] + dims // 2] = 255 if part == "key" else 0x7F      # entry 3's first scale: NaN
    entries = torch.arange(-1, 32)
    got = _decode(case, entries, dims)
    assert _same_bits(got, _torch_rows(case, entries, dims))
    group = 32 if part == "key" else 16                                     # row 4 = entry 3: its first group NaN
    assert torch.isnan(got[4, :group]).all() and not torch.isnan(got[5]).any()


def test_refuses_bad_arguments():
    rows = torch.zeros(8, 40, dtype=torch.uint8)
    entries = torch.zeros(3, dtype=torch.int64)
    ok = dict(offset=0, share=36, ratio=1, dims=64, part="latent")
    with pytest.raises(ValueError, match="part"):
        ED.decode_entry_rows(rows, entries, **(ok | dict(part="value")))
    with pytest.raises(ValueError, match="multiple of 16"):
        ED.decode_entry_rows(rows, entries, **(ok | dict(dims=40)))
    with pytest.raises(ValueError, match="contracts §2"):
        ED.decode_entry_rows(rows, entries, **(ok | dict(share=35)))
    with pytest.raises(ValueError, match="contracts §2"):
        ED.decode_entry_rows(rows, entries, **(ok | dict(offset=8)))
    with pytest.raises(ValueError, match="int32 / int64"):
        ED.decode_entry_rows(rows, entries.float(), **ok)
    with pytest.raises(ValueError, match="uint8"):
        ED.decode_entry_rows(rows.to(torch.int16), entries, **ok)
    assert ED.decode_entry_rows(rows, entries[:0], **ok).shape == (0, 64)
    if not INTERPRETED:
        with pytest.raises(ValueError, match="CUDA device"):
            ED.decode_entry_rows(rows, entries, **ok)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("part", ["latent", "key"])
def test_gpu_flash_shape_matches_the_runtime_codec(part):
    """Flash widths (latents 512, keys 128), a ratio-2 source beside a ratio-1 one, 4,096 entries plus holes:
    the compiled kernel gives the runtime codec's bits on the GPU."""
    case = packed_rows_case(8192, 512, 128, (1, 2), 1, seed=7, part=part)
    dims = 512 if part == "latent" else 128
    case["rows"] = case["rows"].cuda()
    entries = torch.randperm(4096 + 64, device="cuda") - 64
    entries[entries < -1] = -1
    got = _decode(case, entries.view(64, -1), dims)
    assert _same_bits(got, _torch_rows(case, entries.view(64, -1), dims))
    cache = case[f"{part}_cache"].cuda()
    live = entries >= 0
    assert torch.equal(got[live].view(torch.int16), cache[entries[live]].view(torch.int16))
    assert not got[~live].any()

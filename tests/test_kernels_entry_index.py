"""`kernels/entry_index.py`: a selection's compressed entry indices in one launch.

What is pinned:
* kernel cases (interpreter child on CPU; compiled on CUDA): `compressed_entry_index` equals the torch
  formula (`runtime.attention.compressed_entries`) exactly — two requests of an extend batch at their own
  `req_to_token` rows, ratios 1 and 2, −1 columns, int32 and int64 selections, K not a power of two and K
  past one program's columns, a selection column slice (row stride wider than K);
* main process: bad shapes raise;
* GPU (`gpu`): a Flash-sized decode batch (256 queries × 512 columns).
"""
from __future__ import annotations

import pytest
import torch

from sglang_dsv41.kernels import fused_elementwise as FE
from sglang_dsv41.kernels.entry_index import compressed_entry_index
from sglang_dsv41.runtime.attention import compressed_entries
from sglang_dsv41.runtime.batch import make_layout
from triton_checks import run_kernel_cases_in_interpreter

KERNEL_HERE = FE.INTERPRETED or torch.cuda.is_available()
DEVICE = "cuda" if torch.cuda.is_available() and not FE.INTERPRETED else "cpu"


def _layout(prefix: tuple[int, int], extend: tuple[int, int], width: int, device: str):
    """Two requests at req_to_token rows 3 and 1 (slots 64-aligned, distinct per request)."""
    table = torch.zeros(5, width, dtype=torch.int32)
    table[3] = 128 + torch.arange(width, dtype=torch.int32)
    table[1] = 128 + 64 * (width // 64 + 1) + torch.arange(width, dtype=torch.int32)
    positions = torch.cat([torch.arange(p, p + e) for p, e in zip(prefix, extend)])
    token_req = torch.cat([torch.full((e,), b) for b, e in enumerate(extend)])
    rows = torch.tensor([3, 1])
    out = table[rows[token_req], positions].long()
    layout = make_layout(rows, torch.tensor(prefix), torch.tensor(extend), positions, out, table)
    return layout if device == "cpu" else make_layout(*(x.to(device) for x in (rows, torch.tensor(prefix),
                                                                                 torch.tensor(extend), positions,
                                                                                 out, table)))


def _selection(g: torch.Generator, layout, K: int, ratio: int, dtype: torch.dtype) -> torch.Tensor:
    visible = (layout.positions.cpu() + 1) // ratio                 # compressed positions each token sees
    sel = torch.stack([torch.randint(0, max(1, int(v)), (K,), generator=g) for v in visible])
    sel[torch.rand(sel.shape, generator=g) < 0.3] = -1
    sel[:, 0] = -1
    return sel.to(dtype)


def _check(prefix, extend, K: int, ratio: int, dtype: torch.dtype, seed: int, wide: bool = False) -> None:
    g = torch.Generator().manual_seed(seed)
    layout = _layout(prefix, extend, 4096, DEVICE)
    sel = _selection(g, layout, K, ratio, dtype).to(DEVICE)
    if wide:
        sel = torch.cat((sel, torch.full_like(sel[:, :7], 5)), dim=1)[:, :K]      # row stride K + 7
    got = compressed_entry_index(sel, layout.token_req, layout.req_rows, layout.req_to_token, ratio)
    want = compressed_entries(sel.long(), layout, ratio)
    assert got.dtype == torch.int64 and torch.equal(got, want)
    assert (got[:, 0] == -1).all() and (got >= 0).any()


if KERNEL_HERE:

    def test_kernel_case_equals_the_torch_formula() -> None:
        _check((100, 37), (5, 3), 24, 2, torch.int32, 0)
        _check((0, 600), (40, 1), 13, 1, torch.int64, 1)
        _check((2000, 900), (2, 2), 700, 2, torch.int32, 2, wide=True)


# ---- the interpreter child and the main-process checks -------------------------------------------

if not FE.INTERPRETED:

    def test_kernel_cases_in_triton_interpreter() -> None:
        """Run this file's kernel cases in a child pytest with TRITON_INTERPRET=1 (CPU)."""
        run_kernel_cases_in_interpreter(__file__, min_passed=1, exact=True)

    def test_bad_shapes_raise() -> None:
        sel, req, rows, table = torch.zeros(3, 4), torch.zeros(3, dtype=torch.long), torch.zeros(1), torch.zeros(1, 8)
        with pytest.raises(ValueError, match="selection"):
            compressed_entry_index(sel[0], req, rows, table, 2)
        with pytest.raises(ValueError, match="token_req"):
            compressed_entry_index(sel, req[:2], rows, table, 2)
        with pytest.raises(ValueError, match="ratio"):
            compressed_entry_index(sel, req, rows, table, 0)


@pytest.mark.gpu
def test_gpu_flash_decode_batch() -> None:
    g = torch.Generator().manual_seed(3)
    dev = "cuda"
    table = torch.zeros(300, 8192, dtype=torch.int32)
    table[1:257] = (128 + torch.arange(256 * 8192, dtype=torch.int32)).view(256, 8192)
    rows = torch.arange(1, 257)
    positions = torch.full((256,), 8191)
    layout = make_layout(*(x.to(dev) for x in (rows, positions, torch.ones(256, dtype=torch.long), positions,
                                                table[rows, positions].long(), table)))
    for ratio in (1, 2):
        sel = _selection(g, layout, 512, ratio, torch.int32).to(dev)
        got = compressed_entry_index(sel, layout.token_req, layout.req_rows, layout.req_to_token, ratio)
        assert torch.equal(got, compressed_entries(sel.long(), layout, ratio))

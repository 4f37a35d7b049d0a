"""`kernels/indexer_tables.py`: the indexer's entry-index table and query tiles in one launch each.

What is pinned:
* kernel cases (interpreter child on CPU; compiled on CUDA): both equal the torch formulas
  (`entry_index._entry_index_table_torch`, `indexer._query_tiles_torch`) exactly, and
  `entry_index.entry_index_table` takes the kernel —
  - the table at ratios 1 and 2, widths past one program and past the longest request (−1 columns),
    positions clamped at the table's last column, a request with no entry;
  - the tiles of decode batches (one query per request), of extend batches with requests of 0, 1 and
    many queries, several block sizes, grouped (identity order) and not (any order, torch's argsort);
* main process: bad shapes raise; the kernels build for sm_90 (no GPU);
* GPU (`gpu`): a Flash decode batch (256 requests, 4096 columns) and an 8K-token prefill.
"""
from __future__ import annotations

import pytest
import torch

from sglang_dsv41.kernels import entry_index as EI
from sglang_dsv41.kernels import fused_elementwise as FE
from sglang_dsv41.kernels import indexer as KI
from sglang_dsv41.kernels import indexer_tables as IT
from triton_checks import run_kernel_cases_in_interpreter

KERNEL_HERE = FE.INTERPRETED or torch.cuda.is_available()
DEVICE = "cuda" if torch.cuda.is_available() and not FE.INTERPRETED else "cpu"


def _check_table(rows: int, context: int, seq: list[int], ratio: int, width: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    table = torch.randint(2, 1 << 20, (rows, context), generator=g, dtype=torch.int32).to(DEVICE)
    req_rows = torch.randperm(rows, generator=g)[: len(seq)].to(DEVICE)
    seq_lens = torch.tensor(seq, device=DEVICE)
    got = IT.entry_index_table(table, req_rows, seq_lens // ratio, ratio, width)
    assert torch.equal(got, EI._entry_index_table_torch(table, req_rows, seq_lens // ratio, ratio, width))
    assert torch.equal(EI.entry_index_table(table, req_rows, seq_lens // ratio, ratio, width), got)   # dispatches


def _check_tiles(extend: list[int], block_t: int, shuffle: bool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    token_req = torch.repeat_interleave(torch.arange(len(extend)), torch.tensor(extend))
    if shuffle:
        token_req = token_req[torch.randperm(token_req.numel(), generator=g)]
    token_req = token_req.to(DEVICE)
    got = IT.query_tiles(token_req, len(extend), block_t, grouped=not shuffle)
    want = KI._query_tiles_torch(token_req, len(extend), block_t)
    for a, b in zip(got, want):
        assert a.dtype == torch.int64 and torch.equal(a, b)


if KERNEL_HERE:

    def test_kernel_case_entry_index_table() -> None:
        _check_table(6, 300, [300, 17, 1, 64], 2, 150, 0)
        _check_table(5, 2000, [1999, 600, 0], 1, 1500, 1)                # width past one program
        _check_table(3, 64, [64, 40], 2, 40, 2)                          # positions past the table: clamped

    def test_kernel_case_unfilled_entry_table_writes_the_entries_only(monkeypatch) -> None:
        """`fill=False`: the entries j < n_entries[r] as filled, every later column left as allocated
        (the allocation is made to hold −7 here), whether a program writes one block or loops over several."""
        g = torch.Generator().manual_seed(9)
        table = torch.randint(2, 1 << 20, (4, 1200), generator=g, dtype=torch.int32).to(DEVICE)
        req_rows = torch.tensor([3, 0, 2], device=DEVICE)
        n_entries = torch.tensor([1100, 5, 0], device=DEVICE)
        filled = IT.entry_index_table(table, req_rows, n_entries, 1, 1100)
        entry = torch.arange(1100, device=DEVICE)[None, :] < n_entries[:, None]
        empty = torch.empty
        for programs in (1, 16):                  # one program looping over a row's blocks; one a block
            monkeypatch.setattr(IT, "UNFILLED_PROGRAMS", programs)
            monkeypatch.setattr(torch, "empty", lambda *a, **k: empty(*a, **k).fill_(-7))
            got = EI.entry_index_table(table, req_rows, n_entries, 1, 1100, fill=False)
            monkeypatch.undo()
            assert torch.equal(got[entry], filled[entry])
            assert bool((got[~entry] == -7).all()) and int((~entry).sum()) > 1000

    def test_kernel_case_query_tiles() -> None:
        _check_tiles([1] * 7, 1, False, 0)                                # decode
        _check_tiles([1] * 9, 4, False, 1)
        _check_tiles([5, 0, 1, 33, 2, 0, 17], 4, False, 2)
        _check_tiles([5, 0, 1, 33, 2, 0, 17], 8, True, 3)                # any order: torch's argsort
        _check_tiles([300, 1, 250, 900], 16, False, 4)                    # counting past one histogram step
        _check_tiles([1] * 1100 + [3, 0, 2], 1, False, 5)                 # owners past one search step, R ≥ 1024


# ---- the interpreter child and the main-process checks -------------------------------------------

if not FE.INTERPRETED:

    def test_kernel_cases_in_triton_interpreter() -> None:
        """Run this file's kernel cases in a child pytest with TRITON_INTERPRET=1 (CPU)."""
        run_kernel_cases_in_interpreter(__file__, min_passed=3, exact=True)

    @pytest.mark.parametrize("name,consts", [
        ("_query_tiles_kernel", {"BLOCK_N": 1024, "BLOCK_R": 256, "LOG2_R": 8, "BLOCK_I": 1024, "GROUPED": True}),
        ("_entry_table_kernel", {"BLOCK": 512, "FILL": False}),
    ])
    def test_kernels_compile_for_hopper(name: str, consts: dict) -> None:
        """sm_90 builds (no GPU)."""
        from triton_checks import compile_for_sm90
        kernel = getattr(IT, name)
        sig = {n: "constexpr" if n in consts else ("*i32" if n == "table_ptr" else "*i64") if n.endswith("_ptr")
               else "i32" for n in kernel.arg_names}
        compile_for_sm90(kernel, sig, consts, {"num_warps": 4})

    def test_bad_shapes_raise() -> None:
        with pytest.raises(ValueError, match="ratio"):
            IT.entry_index_table(torch.zeros(2, 8, dtype=torch.int32), torch.zeros(2), torch.zeros(3), 0, 4)
        with pytest.raises(ValueError, match="requests"):
            IT.query_tiles(torch.zeros(4, dtype=torch.int64), 0, 4)


@pytest.mark.gpu
def test_gpu_flash_shapes() -> None:
    _check_table(300, 8192, [8192 - i for i in range(256)], 2, 4096, 5)
    _check_tiles([1] * 256, 1, False, 6)
    _check_tiles([8192], 4, False, 7)
    _check_tiles([4000, 3000, 1192], 4, False, 8)

"""`kernels/swa_window.py`: a batch's SWA windows as SWA slots in one launch.

What is pinned:
* kernel cases (interpreter child on CPU; compiled on CUDA): the window slots and the tokens' own SWA rows ==
  `attention.swa_window_torch` exactly — an extend batch of two requests at their own `req_to_token` rows,
  windows reaching before position 0 (−1), full slots whose SWA slot was freed (0), an int32 map, a window
  that is not a power of two, and a static decode layout with a padding request (row 0, slot 0);
* main process: bad shapes raise; the kernels build for sm_90 (no GPU);
* GPU (`gpu`): a Flash decode batch (256 requests, window 128).
"""
from __future__ import annotations

import pytest
import torch

from sglang_dsv41.kernels import fused_elementwise as FE
from sglang_dsv41.kernels.swa_window import swa_window
from sglang_dsv41.runtime.attention import swa_window_torch
from sglang_dsv41.runtime.batch import make_layout, static_decode_layout
from triton_checks import run_kernel_cases_in_interpreter

KERNEL_HERE = FE.INTERPRETED or torch.cuda.is_available()
DEVICE = "cuda" if torch.cuda.is_available() and not FE.INTERPRETED else "cpu"


class _Caches:
    """The two `RuntimeCaches` methods the torch path reads, over a random full → SWA map (0 = freed)."""

    def __init__(self, slots: int, seed: int, dtype: torch.dtype) -> None:
        g = torch.Generator().manual_seed(seed)
        self.swa_slot_of = torch.randint(1, 5000, (slots,), generator=g).to(dtype)
        self.swa_slot_of[torch.rand(slots, generator=g) < 0.1] = 0
        self.swa_slot_of = self.swa_slot_of.to(DEVICE)

    def swa_slots(self, full):
        mapped = self.swa_slot_of[full.clamp(min=0)].to(torch.int64)
        return torch.where(full >= 0, mapped, -1)

    def swa_rows(self, full):
        return self.swa_slot_of[full].to(torch.int64)


def _check(layout, caches, window: int) -> None:
    got = swa_window(layout.positions, layout.token_req, layout.req_rows, layout.req_to_token, caches.swa_slot_of,
                     layout.out_slots, window)
    want = swa_window_torch(layout, caches, window)
    for a, b in zip(got, want):
        assert a.dtype == torch.int64 and torch.equal(a, b)
    assert (got[0] == -1).any() and (got[0] == 0).any()


if KERNEL_HERE:

    def test_kernel_case_equals_the_torch_path() -> None:
        table = torch.zeros(4, 256, dtype=torch.int32)
        table[3] = 64 + torch.arange(256, dtype=torch.int32)
        table[1] = 320 + torch.arange(256, dtype=torch.int32)
        prefix, extend, rows = torch.tensor([3, 40]), torch.tensor([6, 2]), torch.tensor([3, 1])
        pos = torch.cat([torch.arange(3, 9), torch.arange(40, 42)])
        out = torch.cat([table[3, 3:9], table[1, 40:42]]).long()
        layout = make_layout(*(x.to(DEVICE) for x in (rows, prefix, extend, pos, out, table)))
        for window, dtype, seed in ((8, torch.int64, 0), (11, torch.int32, 1)):
            _check(layout, _Caches(600, seed, dtype), window)
        decode = static_decode_layout(*(x.to(DEVICE) for x in (torch.tensor([3, 1, 0]), torch.tensor([200, 5, 1]),
                                                               torch.tensor([199, 4, 0]),
                                                               torch.tensor([int(table[3, 199]), int(table[1, 4]), 0]),
                                                               table)))
        _check(decode, _Caches(600, 2, torch.int32), 128)


# ---- the interpreter child and the main-process checks -------------------------------------------

if not FE.INTERPRETED:

    def test_kernel_cases_in_triton_interpreter() -> None:
        """Run this file's kernel cases in a child pytest with TRITON_INTERPRET=1 (CPU)."""
        run_kernel_cases_in_interpreter(__file__, min_passed=1, exact=True)

    def test_kernel_compiles_for_hopper() -> None:
        """sm_90 build (no GPU)."""
        from sglang_dsv41.kernels import swa_window as SW
        from triton_checks import compile_for_sm90
        sig = {n: "constexpr" if n == "BLOCK_W" else ("*i32" if n in ("table_ptr", "map_ptr") else "*i64")
               if n.endswith("_ptr") else "i32" for n in SW._swa_window_kernel.arg_names}
        compile_for_sm90(SW._swa_window_kernel, sig, {"BLOCK_W": 128}, {"num_warps": 4})

    def test_bad_shapes_raise() -> None:
        i64 = torch.zeros(3, dtype=torch.int64)
        with pytest.raises(ValueError, match="window"):
            swa_window(i64, i64, i64, torch.zeros(2, 8, dtype=torch.int32), i64, i64, 0)
        with pytest.raises(ValueError, match="token_req"):
            swa_window(i64, i64[:2], i64, torch.zeros(2, 8, dtype=torch.int32), i64, i64, 4)


@pytest.mark.gpu
def test_gpu_flash_decode_batch() -> None:
    table = torch.zeros(300, 8192, dtype=torch.int32)
    table[1:257] = (128 + torch.arange(256 * 8192, dtype=torch.int32)).view(256, 8192)
    rows = torch.arange(1, 257)
    pos = torch.randint(0, 8192, (256,), generator=torch.Generator().manual_seed(3))
    pos[:4] = torch.tensor([0, 5, 127, 128])
    layout = static_decode_layout(*(x.to(DEVICE) for x in (rows, pos + 1, pos, table[rows, pos].long(), table)))
    _check(layout, _Caches(128 + 256 * 8192, 4, torch.int32), 128)

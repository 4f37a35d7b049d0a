"""`kernels/engram_rows.py`: a batch's Engram row ids from the history ring, and the ring advanced, in two launches.

What is pinned:
* kernel cases (interpreter child on CPU; compiled on CUDA), on hash constants whose products wrap
  int64 (negative hashes) and an extend batch of a fresh request, requests with 1 and 2 ids of
  history, one whose chunk starts past its ring's reach, a decode request and (static) padding
  requests —
  - rows == `EngramHasher.row_ids` of the ring's history (pad where none), with and without an image
    id (multimodal pad ids, blocking from the first image id on);
  - the ring after `advance_ring` == `EngramHistoryRing.advance(history_tail(...))`, every request
    written, or with `live_only` none of the padding ones;
* main process: bad shapes raise; the kernels build for sm_90 (no GPU);
* GPU (`gpu`): a Flash-sized decode batch (256 requests, 2 layers of 24 columns).
"""
from __future__ import annotations

import pytest
import torch

from sglang_dsv41.engram_hash import MULTIMODAL_PAD_ID_BASE, EngramHasher, EngramLayerHash
from sglang_dsv41.kernels import engram_rows as ER
from sglang_dsv41.kernels import fused_elementwise as FE
from sglang_dsv41.runtime.engram_history import NO_TOKEN, EngramHistoryRing, history_tail
from padded_batches import padded_batch
from triton_checks import run_kernel_cases_in_interpreter

KERNEL_HERE = FE.INTERPRETED or torch.cuda.is_available()
DEVICE = "cuda" if torch.cuda.is_available() and not FE.INTERPRETED else "cpu"
VOCAB, M = 300, 4


def _hasher(layers: int, heads: int, image: int | None, seed: int) -> EngramHasher:
    g = torch.Generator().manual_seed(seed)
    C = (M - 1) * heads
    hash_layers = [EngramLayerHash(layer_id=i, primes=torch.randint(50, 999, (C,), generator=g),
                                   offsets=torch.randint(0, 10_000, (C,), generator=g),
                                   multipliers=torch.randint(1 << 40, 1 << 62, (M,), generator=g))
                   for i in range(layers)]
    return EngramHasher(torch.randint(0, 200, (VOCAB,), generator=g), hash_layers, max_ngram=M, n_heads=heads,
                        pad_token_id=2, image_token_id=image).to(DEVICE)


def _case(prefix: list[int], extend: list[int], rows: list[int], padding: int, image: int | None, seed: int):
    """(ids, positions, token_req, starts, prefix, ext, req_rows, out_slots, ring) on DEVICE; the ring's rows
    hold K ids ending at each request's prefix (random ids, some multimodal); padding requests at row 0."""
    g = torch.Generator().manual_seed(seed)
    pb = padded_batch(prefix, extend, rows, padding)
    ids = torch.randint(3, VOCAB, (int(pb.extend.sum()),), generator=g)
    if image is not None:
        ids[torch.rand(ids.shape, generator=g) < 0.15] = image
        ids[torch.rand(ids.shape, generator=g) < 0.1] = MULTIMODAL_PAD_ID_BASE + 7
    ring = EngramHistoryRing.allocate(int(pb.rows.max()) + 1, M - 1, "cpu")
    for r, p in zip(pb.rows.tolist(), pb.prefix.tolist()):
        if r and p:
            held = torch.randint(3, VOCAB, (M - 1,), generator=g)
            held[: max(0, M - 1 - p)] = NO_TOKEN
            ring.ids[r] = held.to(torch.int32)
            ring.end[r] = p
    d = lambda t: t.to(DEVICE)  # noqa: E731
    return (d(ids), d(pb.positions), d(pb.token_req), d(pb.starts), d(pb.prefix), d(pb.extend), d(pb.rows),
            d(pb.out_slots), EngramHistoryRing(d(ring.ids), d(ring.end)))


def _check(hasher: EngramHasher, case, live_only: bool) -> None:
    ids, pos, token_req, starts, prefix, ext, rows, out, ring = case
    history = ring.read(rows, prefix, check=False)
    want = hasher.row_ids(ids, pos, torch.where(history >= 0, history, hasher.pad_token_id), ext, validate=False)
    consts = [torch.stack([getattr(layer, k) for layer in hasher.layers]) for k in ("multipliers", "primes", "offsets")]
    got = ER.engram_ring_rows(ids, pos, token_req, starts, prefix, rows, ring.ids, hasher.token_map, *consts,
                              heads=hasher.n_heads, pad_id=hasher.pad_token_id, image_id=hasher.image_token_id)
    assert got.shape == (len(hasher.layers), *want[0].shape)
    for layer, rows_want in enumerate(want):
        assert torch.equal(got[layer], rows_want), layer
    expect = EngramHistoryRing(ring.ids.clone(), ring.end.clone())
    live = ((out >= 2)[(starts + ext - 1).clamp(min=0)] & (ext > 0)) if live_only else None
    expect.advance(rows, prefix + ext, history_tail(history, ids, starts, prefix, ext), live=live)
    ER.advance_ring(ids, starts, ext, prefix, rows, out, ring.ids, ring.end, live_only=live_only)
    assert torch.equal(ring.ids, expect.ids) and torch.equal(ring.end, expect.end)


if KERNEL_HERE:

    def test_kernel_case_extend_and_decode_rows_and_ring() -> None:
        # fresh 0 (5 ids), 1 id of history (prefix 1), 2 (prefix 2), prefix 9 with a 2-id chunk, decode at 40
        case = _case([0, 1, 2, 9, 40], [5, 3, 1, 2, 1], [1, 3, 5, 2, 6], 0, None, 0)
        _check(_hasher(2, 4, None, 0), case, live_only=False)

    def test_kernel_case_image_ids_and_padding_requests() -> None:
        case = _case([0, 7, 30], [6, 4, 1], [4, 1, 2], 3, 250, 1)
        _check(_hasher(1, 3, 250, 1), case, live_only=True)              # 3 heads: not a power of two


# ---- the interpreter child and the main-process checks -------------------------------------------

if not FE.INTERPRETED:

    def test_kernel_cases_in_triton_interpreter() -> None:
        """Run this file's kernel cases in a child pytest with TRITON_INTERPRET=1 (CPU)."""
        run_kernel_cases_in_interpreter(__file__, min_passed=2, exact=True)

    @pytest.mark.parametrize("name,consts", [
        ("_engram_rows_kernel", {"K": 3, "M": 4, "HEADS": 8, "BLOCK_H": 8, "L": 2, "BLOCK_L": 2, "HAS_IMAGE": True,
                                 "BLOCK_T": 32}),
        ("_advance_ring_kernel", {"K": 3, "BLOCK_K": 4, "LIVE_ONLY": True}),
    ])
    def test_kernels_compile_for_hopper(name: str, consts: dict) -> None:
        """sm_90 builds (no GPU): the interpreter accepts globals and forms a compiled build refuses."""
        from triton_checks import compile_for_sm90
        kernel = getattr(ER, name)
        sig = {n: "constexpr" if n in consts else ("*i32" if n == "ring_ptr" else "*i64") if n.endswith("_ptr")
               else "i64" if n in ("PAD", "IMAGE") else "i32" for n in kernel.arg_names}
        compile_for_sm90(kernel, sig, consts, {"num_warps": 4})

    def test_bad_shapes_raise() -> None:
        i64 = torch.zeros(3, dtype=torch.int64)
        consts = (torch.ones(1, M, dtype=torch.int64), torch.ones(1, 6, dtype=torch.int64),
                  torch.zeros(1, 6, dtype=torch.int64))
        with pytest.raises(ValueError, match="int32"):
            ER.engram_ring_rows(i64, i64, i64, i64, i64, i64, torch.zeros(2, M - 1, dtype=torch.int64), i64, *consts,
                                heads=2, pad_id=0, image_id=None)
        with pytest.raises(ValueError, match="columns"):
            ER.engram_ring_rows(i64, i64, i64, i64, i64, i64, torch.zeros(2, M - 1, dtype=torch.int32), i64, *consts,
                                heads=3, pad_id=0, image_id=None)
        with pytest.raises(ValueError, match="end int64"):
            ER.advance_ring(i64, i64, i64, i64, i64, i64, torch.zeros(2, M - 1, dtype=torch.int32),
                            torch.zeros(3, dtype=torch.int64), live_only=True)


@pytest.mark.gpu
def test_gpu_flash_decode_batch() -> None:
    rows = list(range(1, 257))
    case = _case([8000 + i for i in rows], [1] * 256, rows, 0, 250, 5)
    _check(_hasher(2, 8, 250, 5), case, live_only=True)

"""`kernels/pair_state.py`: a ratio-2 kv source's pair latents and pending-pair ring in two launches.

What is pinned:
* kernel cases (interpreter child on CPU; compiled on CUDA): on an extend batch whose requests start at
  odd positions (their first pair from the ring), at even ones, at 0, plus a decode request, a
  CUDA-graph padding token and a zero-length request —
  - latents == RMSNorm(bf16(`pair_pool` with float64 exp)) through the `rms_norm` kernel, bit for bit,
    with pair score differences from 0 to −250, equal scores and a NaN score;
  - entry indices and RoPE positions == the torch formulas of `runtime/attention._write_compressed`;
  - the ring after `store_pending_pairs` == `RuntimeCaches.store_pending_pairs`' (pending even ends
    stored, odd ends emptied, padding and zero-length requests untouched);
  - `exp_nonpositive` == float64 exp rounded to fp32 on [−87, 0] and at 0 / below −104 / NaN;
* main process: bad shapes raise; sm_90 PTX has no approximate / fused fp32 instruction and no float64;
* GPU (`gpu`): the same checks on a Flash-sized decode batch (256 requests, D = 512).
"""
from __future__ import annotations

import re
import types

import pytest
import torch

from sglang_dsv41.kernels import fused_elementwise as FE
from sglang_dsv41.kernels import pair_state as PS
from sglang_dsv41.numerics.rounding import pair_pool
from sglang_dsv41.runtime.cache import RuntimeCaches
from padded_batches import padded_batch
from triton_checks import compile_for_sm90, run_kernel_cases_in_interpreter

KERNEL_HERE = FE.INTERPRETED or torch.cuda.is_available()
DEVICE = "cuda" if torch.cuda.is_available() and not FE.INTERPRETED else "cpu"
EPS = 1e-20


def _batch(prefix: list[int], extend: list[int], rows: list[int], padding: int, D: int, ring: int, seed: int):
    """Tensors of one batch (int64, on DEVICE): requests at `rows` with `prefix` / `extend`, then `padding`
    CUDA-graph padding requests (row 0, position 0, slot 0); a, s with pair differences down to −250."""
    g = torch.Generator().manual_seed(seed)
    pb = padded_batch(prefix, extend, rows, padding, row_stride=4096)
    N = int(pb.extend.sum())
    a = torch.randn(N, D, generator=g) * 3
    s = torch.randn(N, D, generator=g) * 4
    s[:, :8] = torch.tensor([0.0, -1e-3, -30.0, -87.0, -90.0, -103.0, -150.0, -250.0])
    s[1::2, :8] = 0.0                                  # paired with a shifted copy: differences down to −250
    s[:, 8] = 1.5                                      # equal scores: σ = ½
    s[min(3, N - 1), 9] = float("nan")
    ring_rows = int(pb.rows.max()) + 1
    kv = torch.randn(ring_rows, ring, D, generator=g)
    score = torch.randn(ring_rows, ring, D, generator=g)
    held = torch.randint(0, 50, (ring_rows, ring), generator=g)
    w = torch.rand(D, generator=g) + 0.5
    d = lambda t: t.to(DEVICE)  # noqa: E731
    return types.SimpleNamespace(
        prefix=d(pb.prefix), extend=d(pb.extend), starts=d(pb.starts), rows=d(pb.rows), token_req=d(pb.token_req),
        pos=d(pb.positions), out=d(pb.out_slots), a=d(a), s=d(s), kv=d(kv), score=d(score), held=d(held), w=d(w),
        ring=ring)


def _expected_latents(b) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    in_batch = (b.pos > b.prefix[b.token_req])[:, None]
    prev = (torch.arange(b.pos.shape[0], device=b.pos.device) - 1).clamp(min=0)
    first = (b.pos - 1).clamp(min=0)
    slot = torch.div(first, 2, rounding_mode="floor") % b.ring
    row = b.rows[b.token_req]
    a1 = torch.where(in_batch, b.a[prev], b.kv[row, slot])
    s1 = torch.where(in_batch, b.s[prev], b.score[row, slot])
    pooled = pair_pool(torch.stack((a1, b.a), 1), torch.stack((s1, b.s), 1), torch.float64)
    latents = FE.rms_norm(FE.round_bf16(pooled), b.w, EPS)
    entries = torch.where(((b.pos % 2) == 1) & (b.out >= 2), b.out // 2, -1)
    return latents, entries, first


def _expected_ring(b) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`RuntimeCaches.store_pending_pairs` on copies of the ring (its torch code, called unbound)."""
    caches = types.SimpleNamespace(pair_ring_slots=b.ring, pair_kv={0: b.kv.clone()}, pair_score={0: b.score.clone()},
                                   pair_position={0: b.held.clone()})
    caches.pair_slot = lambda p: RuntimeCaches.pair_slot(caches, p)
    last = b.starts + b.extend - 1
    live = (b.out >= 2)[last] & (b.extend > 0)
    pending = ((b.pos[last] % 2) == 0) & live
    RuntimeCaches.store_pending_pairs(caches, 0, b.rows, b.pos[last], pending, live, b.a[last], b.s[last])
    return caches.pair_kv[0], caches.pair_score[0], caches.pair_position[0]


def _check(b) -> None:
    want_lat, want_entries, want_first = _expected_latents(b)
    want_ring = _expected_ring(b)
    lat, entries, first = PS.pair_latents(b.a, b.s, b.pos, b.token_req, b.prefix, b.rows, b.out, b.kv, b.score, b.w,
                                          EPS)
    assert torch.equal(entries, want_entries) and torch.equal(first, want_first)
    nan = want_lat.isnan()
    assert torch.equal(lat.isnan(), nan) and torch.equal(lat[~nan], want_lat[~nan])
    kv, score, held = b.kv.clone(), b.score.clone(), b.held.clone()
    PS.store_pending_pairs(b.a, b.s, b.pos, b.out, b.starts, b.extend, b.rows, kv, score, held)
    for got, want in zip((kv, score, held), want_ring):
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
    assert not torch.equal(held, b.held)                   # the case writes the ring


if KERNEL_HERE:

    def test_kernel_case_extend_batch_equals_the_torch_path() -> None:
        # request 0 starts at odd 5 (its first pair from the ring), 1 at 0, 2 at even 8, 3 decodes at odd 13,
        # 4 decodes at even 20, 5 has no tokens; then two padding requests
        b = _batch([5, 0, 8, 13, 20, 7], [4, 3, 2, 1, 1, 0], [3, 1, 6, 2, 5, 4], 2, 40, 4, 0)
        _check(b)

    def test_kernel_case_the_ring_wraps_inside_one_chunk() -> None:
        # 9 tokens from odd 3 with a 2-slot ring: the last token's slot is the first token's ring read
        _check(_batch([3], [9], [1], 0, 24, 2, 1))

    def test_kernel_case_exp_nonpositive_is_float64_exp_rounded() -> None:
        import triton
        import triton.language as tl

        @triton.jit
        def _exp(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
            i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            tl.store(y_ptr + i, PS.exp_nonpositive(tl.load(x_ptr + i, mask=i < n, other=0.0)), mask=i < n)

        g = torch.Generator().manual_seed(4)
        x = torch.cat((-torch.rand(20000, generator=g) * 87, torch.tensor([0.0, -0.0, -104.0, -200.0, -1e30,
                                                                            float("nan")])))
        y = torch.empty(x.shape, device=DEVICE)
        _exp[(triton.cdiv(x.numel(), 1024),)](x.to(DEVICE), y, x.numel(), BLOCK=1024)
        want = x.double().exp().float()
        assert torch.equal(y.cpu().isnan(), want.isnan())
        assert torch.equal(y.cpu()[~want.isnan()], want[~want.isnan()])


# ---- the interpreter child and the main-process checks -------------------------------------------

if not FE.INTERPRETED:

    def test_kernel_cases_in_triton_interpreter() -> None:
        """Run this file's kernel cases in a child pytest with TRITON_INTERPRET=1 (CPU)."""
        run_kernel_cases_in_interpreter(__file__, min_passed=3, exact=True)

    def test_bad_shapes_raise() -> None:
        a, ring, idx = torch.zeros(3, 8), torch.zeros(2, 2, 8), torch.zeros(3, dtype=torch.long)
        with pytest.raises(ValueError, match="one shape"):
            PS.pair_latents(a, a[:, :4], idx, idx, idx, idx, idx, ring, ring, torch.ones(8), EPS)
        with pytest.raises(ValueError, match="power of two"):
            PS.pair_latents(a, a, idx, idx, idx, idx, idx, torch.zeros(2, 3, 8), torch.zeros(2, 3, 8), torch.ones(8),
                            EPS)
        with pytest.raises(ValueError, match="norm weight"):
            PS.pair_latents(a, a, idx, idx, idx, idx, idx, ring, ring, torch.ones(4), EPS)
        with pytest.raises(ValueError, match="int64"):
            PS.store_pending_pairs(a, a, idx, idx, idx, idx, idx, ring, ring, torch.zeros(2, 2, dtype=torch.int32))

    @pytest.mark.parametrize("name", ["_pair_latents_kernel", "_store_pending_kernel"])
    def test_kernels_compile_for_hopper_exactly(name: str) -> None:
        """sm_90 PTX: no approximate fp32 division / exp, no fp32 FMA, no float64 instruction."""
        kernel = getattr(PS, name)
        ints = {"pos_ptr", "token_req_ptr", "prefix_ptr", "rows_ptr", "out_ptr", "entry_ptr", "rope_pos_ptr",
                "starts_ptr", "ext_ptr", "ring_pos_ptr"}
        consts = {"EPS_HI": 1e-20, "EPS_LO": -5.6e-28, "BLOCK_D": 512, "LOG2_D": 9} \
            if name == "_pair_latents_kernel" else {"BLOCK_D": 512}
        sig = {n: "constexpr" if n in consts else "*i64" if n in ints else "*fp32" if n.endswith("_ptr") else "i32"
               for n in kernel.arg_names}
        compiled, _ = compile_for_sm90(kernel, sig, consts, {"num_warps": 4, "enable_fp_fusion": False})
        ptx = compiled.asm["ptx"]
        bad = re.findall(r"\b(div\.full\.f32|div\.approx\.\w+|ex2\.approx\.\w+|rcp\.approx\.ftz\.f32|fma\.rn\.f32)",
                         ptx)
        assert not bad, sorted(set(bad))
        assert not re.findall(r"\.f64\b", ptx)


@pytest.mark.gpu
def test_gpu_flash_decode_batch() -> None:
    rows = list(range(1, 257))
    b = _batch([8191 - (i % 2) for i in rows], [1] * 256, rows, 0, 512, 2, 5)
    _check(b)

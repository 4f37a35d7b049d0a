"""`sglang_dsv41.kernels.sparse_attention` against the float64 oracle (spec §3.4.5).

CPU tests run the Triton kernels under Triton's interpreter. `TRITON_INTERPRET` is read when a
`@triton.jit` function is *defined* — including Triton's own standard library (`tl.sum`,
`tl.cdiv`, …) when `triton` is first imported — and interpreted and compiled jit functions cannot
call each other. So one process cannot hold both, and setting the variable after some other test
module imported triton does nothing. Hence `test_interpreter_cases` re-runs this file's CPU
tests in one child pytest process with `TRITON_INTERPRET=1` set from its start (they are skipped,
with that reason, in the parent); if this process already holds interpreted kernels (the session
started under `TRITON_INTERPRET=1`) they run in-process instead and the compiled-only tests skip.
GPU tests run in the parent, compiled.

Bounds. The oracle `attend_with_sink` is the exact value rounded once to BF16 (RNE). The kernel's
fp32 result is within ~2^-17·max|k| of the exact value (P split into two BF16 parts; measured
≤ 2^-18 in the interpreter), so its BF16 output is at most one BF16 ulp of the output scale from
the oracle (scale = the largest |o| of the same query and head; element-wise ulps are not a
bound: a near-zero output's ulp is below the fp32 error) — on the GPU (RNE; the bound is not
loosened there) and in the interpreter (which truncates fp32→bf16, spec §12). The fp32 output
(`out=` fp32) is compared with the unrounded float64 value: ≤ 2^-14·max|k|.
"""
from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch
import triton
import triton.language as tl

from sglang_dsv41.kernels import sparse_attention as sa
from sglang_dsv41.kernels.packed_rows import load_latent_pair_tiles
from sglang_dsv41.reference.attention import attend_with_sink, swa_key_positions
from sglang_dsv41.runtime.batch import make_layout

import child_runs
from packed_rows_codec import packed_rows_case
from triton_checks import compile_for_sm90

BF16 = torch.bfloat16
INTERPRETED = sa._is_interpreted()   # kernels defined under TRITON_INTERPRET=1 in this process
interpreter = pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 child process of "
                                                         "test_interpreter_cases")


INTERPRETER_ARGV = child_runs.interpreter_argv(__file__, "-m", "not gpu", "-k",
                                               "not test_interpreter_cases and not test_compiled_kernels_refuse_cpu_tensors"
                                               " and not test_compiles_for_hopper_without_spills")


@pytest.mark.skipif(INTERPRETED, reason="this process is the interpreter child")
@pytest.mark.child_run(*INTERPRETER_ARGV)
def test_interpreter_cases():
    """This file's CPU tests under Triton's interpreter, in one child pytest process (which may
    have run ahead on a spare core: `child_runs`)."""
    child_runs.assert_all_passed(INTERPRETER_ARGV)


# ---- oracle helpers -------------------------------------------------------------------------

def gather_keys(swa_cache, swa_slots, comp_cache, comp_slots):
    """Dense [N, W+K, D] fp32 keys + valid mask, exactly what the torch runtime passes the oracle."""
    parts, valids = [], []
    for cache, slots in ((swa_cache, swa_slots), (comp_cache, comp_slots)):
        if cache is None:
            continue
        valid = slots >= 0
        rows = cache.float()[slots.clamp(min=0).long()]
        parts.append(torch.where(valid[..., None], rows, 0.0))
        valids.append(valid)
    return torch.cat(parts, dim=1), torch.cat(valids, dim=1)


def exact_attention(q, keys, valid, sink, scale):
    """The unrounded float64 value of the §3.4.5 formula (attend_with_sink before its BF16 rounding)."""
    qd, kd = q.double(), keys.double()
    logits = torch.einsum("thd,tsd->ths", qd, kd) * scale
    logits = torch.where(valid[:, None, :], logits, -math.inf)
    sink_d = sink.double()[None, :].expand(q.shape[0], -1)
    m = torch.maximum(logits.amax(dim=2), sink_d)
    p = torch.exp(logits - m[..., None])
    return torch.einsum("ths,tsd->thd", p, kd) / (p.sum(dim=2) + torch.exp(sink_d - m))[..., None]


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """One BF16 ulp at |x| (8 significant bits): 2^(⌊log2|x|⌋ − 7); tiny floor for zeros."""
    ax = x.abs().double().clamp(min=2.0 ** -120)
    return torch.exp2(torch.floor(torch.log2(ax)) - 7)


def assert_within_one_bf16_ulp(out: torch.Tensor, ref: torch.Tensor) -> None:
    """|out − ref| ≤ one BF16 ulp of the output scale, the scale being max_d |ref[t, h, d]| (the
    largest output of the same query and head): both are roundings of values ≲2^-16·max|k| apart."""
    o, r = out.double(), ref.double()
    assert torch.isfinite(o).all()
    bound = bf16_ulp(r.abs().amax(dim=-1, keepdim=True))
    excess = (o - r).abs() - bound
    assert float(excess.max()) <= 0.0, f"max |o−ref| exceeds one BF16 ulp of the row scale by {float(excess.max()):.3g}"


def check_against_oracle(mod, q, swa_cache, swa_slots, comp_cache, comp_slots, sink, scale, config=None):
    """BF16 output ≤ 1 ulp from attend_with_sink; fp32 output ≤ 2^-14·max|k| from the exact value."""
    out = mod.sparse_sink_attention(q, swa_cache, swa_slots, comp_cache, comp_slots, sink, scale, config=config)
    assert out.dtype == BF16 and out.shape == q.shape
    keys, valid = gather_keys(swa_cache, swa_slots, comp_cache, comp_slots)
    ref = attend_with_sink(q.float(), keys, sink, valid)
    assert_within_one_bf16_ulp(out, ref)
    out32 = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    mod.sparse_sink_attention(q, swa_cache, swa_slots, comp_cache, comp_slots, sink, scale, out=out32,
                              config=config)
    exact = exact_attention(q, keys, valid, sink, scale)
    k_max = float(keys.abs().max()) if keys.numel() else 1.0
    err = float((out32.double() - exact).abs().max())
    assert err <= 2.0 ** -14 * k_max, f"fp32 output error {err:.3g} > 2^-14·{k_max:.3g}"
    return out, out32


def random_case(n, heads, dim, window, topk, slots, seed, hole_frac=0.25, device="cpu", slot_dtype=torch.int64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, heads, dim, generator=g).to(BF16)
    swa_cache = torch.randn(slots, dim, generator=g).to(BF16)
    comp_cache = torch.randn(slots, dim, generator=g).to(BF16)
    swa_slots = torch.randint(0, slots, (n, window), generator=g)
    comp_slots = torch.randint(0, slots, (n, topk), generator=g)
    swa_slots[torch.rand(n, window, generator=g) < hole_frac] = -1
    comp_slots[torch.rand(n, topk, generator=g) < hole_frac] = -1
    sink = torch.randn(heads, generator=g)
    to = dict(device=device)
    return (q.to(**to), swa_cache.to(**to), swa_slots.to(slot_dtype).to(**to), comp_cache.to(**to),
            comp_slots.to(slot_dtype).to(**to), sink.to(**to))


TINY = dict(heads=4, dim=96, window=8, topk=4)          # tiny preset attention shape
FLASH_SMALL = dict(heads=8, dim=512, window=16, topk=8)  # Flash head_dim, fewer heads/keys


# ---- interpreter tests ----------------------------------------------------------------------

@interpreter
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tiny_random_matches_oracle(seed):
    q, swa, ss, comp, cs, sink = random_case(n=7, slots=50, seed=seed, **TINY)
    check_against_oracle(sa, q, swa, ss, comp, cs, sink, TINY["dim"] ** -0.5)


@interpreter
def test_flash_like_small_matches_oracle():
    q, swa, ss, comp, cs, sink = random_case(n=5, slots=80, seed=11, **FLASH_SMALL)
    check_against_oracle(sa, q, swa, ss, comp, cs, sink, FLASH_SMALL["dim"] ** -0.5)


@interpreter
def test_flash_shape_decode_query_planned_splits():
    """One decode query at the full Flash shape (D 512, H 64, W 128, K 512) with the config planned
    for an H200 (132 SMs): two head blocks of 32, 20 key tiles in 5 splits, then the merge."""
    q, swa, ss, comp, cs, sink = random_case(n=1, slots=1500, seed=15, heads=64, dim=512, window=128, topk=512,
                                             hole_frac=0.1, slot_dtype=torch.int32)
    cfg = sa.plan_config(1, 64, 512, 128, 512, sm_count=132)
    assert (cfg.block_h, cfg.block_n, cfg.num_splits) == (32, 32, 5)
    check_against_oracle(sa, q, swa, ss, comp, cs, sink, 512 ** -0.5, config=cfg)


@interpreter
def test_swa_only_layer_and_int32_slots():
    q, swa, ss, _, _, sink = random_case(n=6, slots=40, seed=3, slot_dtype=torch.int32, **TINY)
    out, _ = check_against_oracle(sa, q, swa, ss, None, None, sink, TINY["dim"] ** -0.5)
    out64 = sa.sparse_sink_attention(q, swa, ss.long(), None, None, sink, TINY["dim"] ** -0.5)
    assert torch.equal(out, out64)


@interpreter
def test_all_invalid_compressed_part_equals_swa_only():
    q, swa, ss, comp, cs, sink = random_case(n=6, slots=40, seed=4, **TINY)
    cs = torch.full_like(cs, -1)
    scale = TINY["dim"] ** -0.5
    with_comp, _ = check_against_oracle(sa, q, swa, ss, comp, cs, sink, scale)
    without = sa.sparse_sink_attention(q, swa, ss, None, None, sink, scale)
    assert torch.equal(with_comp, without)


@interpreter
def test_window_start_of_sequence_runtime_layout():
    """Slots built the way `runtime.attention` addresses the pool (req_to_token, positions): a
    fresh request (window shorter than W at its start) packed with a request that has a prefix."""
    W, K, H, D = 8, 4, 4, 96
    g = torch.Generator().manual_seed(5)
    num_slots, max_ctx = 64, 32
    pages = torch.randperm(num_slots // 2 - 1, generator=g) + 1   # pages of 2 slots; page 0 = padding
    req_to_token = torch.zeros(3, max_ctx, dtype=torch.int32)
    req_to_token[1, :20] = (2 * pages[:10, None] + torch.arange(2)).reshape(-1).int()    # paged, like SGLang
    req_to_token[2, :12] = (2 * pages[10:16, None] + torch.arange(2)).reshape(-1).int()
    prefix, extend = torch.tensor([0, 9]), torch.tensor([6, 3])   # request 1 starts at 0
    positions = torch.cat([torch.arange(0, 6), torch.arange(9, 12)])
    out_slots = torch.cat([req_to_token[1, :6], req_to_token[2, 9:12]]).long()
    layout = make_layout(torch.tensor([1, 2]), prefix, extend, positions, out_slots, req_to_token)
    window = swa_key_positions(layout.positions, W)
    valid = window >= 0
    swa_slots = torch.where(valid, layout.slots_at(layout.token_req[:, None].expand_as(window),
                                                   window.clamp(min=0)), -1)
    assert int((swa_slots[0] >= 0).sum()) == 1          # position 0 sees only itself
    selection = torch.full((layout.num_tokens, K), -1, dtype=torch.int64)   # ratio 1: ≤ p+1 entries
    for t, p in enumerate(layout.positions.tolist()):
        picks = torch.randperm(p + 1, generator=g)[:K]
        selection[t, :picks.numel()] = picks.sort().values
    c_valid = selection >= 0
    comp_slots = torch.where(c_valid, layout.slots_at(layout.token_req[:, None].expand_as(selection),
                                                      selection.clamp(min=0)), -1)
    swa = torch.randn(num_slots, D, generator=g).to(BF16)
    comp = torch.randn(num_slots, D, generator=g).to(BF16)
    q = torch.randn(layout.num_tokens, H, D, generator=g).to(BF16)
    sink = torch.randn(H, generator=g)
    check_against_oracle(sa, q, swa, swa_slots, comp, comp_slots, sink, D ** -0.5)


@interpreter
def test_minus_inf_sink_is_plain_softmax():
    q, swa, ss, comp, cs, _ = random_case(n=6, slots=40, seed=6, **TINY)
    ss[:, -1] = torch.arange(6)                          # every query keeps at least one key
    sink = torch.full((TINY["heads"],), -math.inf)
    scale = TINY["dim"] ** -0.5
    out, out32 = check_against_oracle(sa, q, swa, ss, comp, cs, sink, scale)
    keys, valid = gather_keys(swa, ss, comp, cs)
    logits = torch.einsum("thd,tsd->ths", q.double(), keys.double()) * scale
    probs = torch.softmax(logits.masked_fill(~valid[:, None, :], -math.inf), dim=2)
    plain = torch.einsum("ths,tsd->thd", probs, keys.double())
    assert float((out32.double() - plain).abs().max()) <= 2.0 ** -14 * float(keys.abs().max())


@interpreter
def test_sink_only_query_outputs_zero_and_large_sink_suppresses():
    q, swa, ss, comp, cs, sink = random_case(n=4, slots=40, seed=7, **TINY)
    ss[1], cs[1] = -1, -1                                # query 1 has no key: o = 0/e^{sink} = 0
    out, _ = check_against_oracle(sa, q, swa, ss, comp, cs, sink, TINY["dim"] ** -0.5)
    assert torch.equal(out[1].float(), torch.zeros_like(out[1].float()))
    big = torch.full_like(sink, 60.0)                    # e^60 dwarfs every key term
    out_big, _ = check_against_oracle(sa, q, swa, ss, comp, cs, big, TINY["dim"] ** -0.5)
    assert float(out_big.float().abs().max()) < 1e-20


@interpreter
@pytest.mark.parametrize("splits", [2, 3, 5])      # 5: one tile per split, `plan_decode_config`'s floor
def test_split_kv_matches_unsplit(splits):
    shape = dict(heads=4, dim=96, window=40, topk=24)    # 3 + 2 tiles of 16 keys
    q, swa, ss, comp, cs, sink = random_case(n=5, slots=90, seed=8, **shape)
    ss[2, :32] = -1                                      # an all-invalid split for query 2
    sink[1] = -math.inf
    base = sa.SparseAttentionConfig(block_h=16, block_d=128, block_n=16, num_splits=1, num_warps=4, num_stages=2)
    split = sa.SparseAttentionConfig(block_h=16, block_d=128, block_n=16, num_splits=splits, num_warps=4,
                                     num_stages=2)
    scale = shape["dim"] ** -0.5
    _, unsplit32 = check_against_oracle(sa, q, swa, ss, comp, cs, sink, scale, config=base)
    _, split32 = check_against_oracle(sa, q, swa, ss, comp, cs, sink, scale, config=split)
    assert float((split32 - unsplit32).abs().max()) <= 2.0 ** -18 * float(swa.float().abs().max())


@interpreter
def test_planned_split_path_flash_like():
    q, swa, ss, comp, cs, sink = random_case(n=2, slots=120, seed=9, heads=8, dim=512, window=48, topk=32)
    cfg = sa.plan_config(2, 8, 512, 48, 32, sm_count=132)
    assert cfg.num_splits > 1 and cfg.block_d == 512 and cfg.block_n == 32
    check_against_oracle(sa, q, swa, ss, comp, cs, sink, 512 ** -0.5, config=cfg)


@interpreter
def test_strided_views_match_contiguous():
    """SGLang's k_buffer[layer] is [slots, 1, D]: the runtime passes `buf[:, 0, :]`; q may be a slice."""
    q, swa, ss, comp, cs, sink = random_case(n=5, slots=40, seed=10, **TINY)
    scale = TINY["dim"] ** -0.5
    want = sa.sparse_sink_attention(q, swa, ss, comp, cs, sink, scale)
    padded = torch.zeros(40, TINY["dim"] + 32, dtype=BF16)
    padded[:, :TINY["dim"]] = swa
    wide_q = torch.zeros(5, TINY["heads"] * 2, TINY["dim"], dtype=BF16)
    wide_q[:, ::2] = q
    got = sa.sparse_sink_attention(wide_q[:, ::2], padded[:, :TINY["dim"]], ss, comp.view(40, 1, -1)[:, 0, :],
                                   cs, sink, scale)
    assert torch.equal(got, want)


@interpreter
def test_empty_batch():
    q = torch.empty(0, 4, 96, dtype=BF16)
    out = sa.sparse_sink_attention(q, torch.zeros(3, 96, dtype=BF16), torch.empty(0, 8, dtype=torch.int64),
                                   None, None, torch.zeros(4), 0.1)
    assert out.shape == (0, 4, 96)


@interpreter
def test_empty_softmax_is_nan_or_raises_when_validated():
    q, swa, ss, comp, cs, _ = random_case(n=3, slots=40, seed=12, **TINY)
    ss[0], cs[0] = -1, -1
    sink = torch.full((TINY["heads"],), -math.inf)
    out = sa.sparse_sink_attention(q, swa, ss, comp, cs, sink, 0.1)
    assert torch.isnan(out[0].float()).all() and torch.isfinite(out[1:].float()).all()
    with pytest.raises(ValueError, match="empty softmax"):
        sa.sparse_sink_attention(q, swa, ss, comp, cs, sink, 0.1, validate=True)


@interpreter
def test_input_errors():
    q, swa, ss, comp, cs, sink = random_case(n=3, slots=40, seed=13, **TINY)
    f = sa.sparse_sink_attention
    with pytest.raises(ValueError, match="q must be"):
        f(q.float(), swa, ss, comp, cs, sink, 0.1)
    with pytest.raises(ValueError, match="both be given"):
        f(q, swa, ss, comp, None, sink, 0.1)
    with pytest.raises(ValueError, match="swa_cache must be"):
        f(q, swa.float(), ss, comp, cs, sink, 0.1)
    with pytest.raises(ValueError, match="comp_slots must be"):
        f(q, swa, ss, comp, cs[:2], sink, 0.1)
    with pytest.raises(ValueError, match="sink must be"):
        f(q, swa, ss, comp, cs, sink[:2], 0.1)
    with pytest.raises(ValueError, match="scale"):
        f(q, swa, ss, comp, cs, sink, float("nan"))
    bad = ss.clone()
    bad[0, 0] = 40
    with pytest.raises(ValueError, match="outside"):
        f(q, swa, bad, comp, cs, sink, 0.1, validate=True)
    with pytest.raises(ValueError, match="block_d"):
        f(q, swa, ss, comp, cs, sink, 0.1,
          config=sa.SparseAttentionConfig(block_h=16, block_d=64, block_n=16, num_splits=1, num_warps=4,
                                          num_stages=2))
    with pytest.raises(ValueError, match="power of two"):
        sa.SparseAttentionConfig(block_h=12, block_d=128, block_n=16, num_splits=1, num_warps=4, num_stages=2)


# ---- packed FP4 compressed entries (contracts §1, §2, §5) ----------------------------------

TINY_RATIOS, FLASH_RATIOS = (2, 2, 1), (2, 2, 2, 1)     # kv-source ratios in kv_source_layer_ids order


def packed_case(n, heads, dim, index_dim, window, topk, num_rows, ratios, source, seed, hole_frac=0.25,
                pad_columns=0, device="cpu", slot_dtype=torch.int64):
    """(q, swa_cache, swa_slots, PackedSource, entries, bf16 cache of the decoded latents, sink):
    latent rows hold every source's columns (garbage outside `source`), entries −1 at `hole_frac`."""
    pr = packed_rows_case(num_rows, dim, index_dim, ratios, source, seed, "latent", pad_columns=pad_columns)
    q, swa, ss, _, _, sink = random_case(n, heads, dim, window, topk, num_rows, seed + 1000, hole_frac=hole_frac,
                                         slot_dtype=slot_dtype)
    g = torch.Generator().manual_seed(seed + 2000)
    n_entries = pr["latent_cache"].shape[0]
    entries = torch.randint(0, n_entries, (n, topk), generator=g)
    entries[torch.rand(n, topk, generator=g) < hole_frac] = -1
    to = dict(device=device)
    src = sa.PackedSource(pr["rows"].to(**to), pr["offset"], pr["share"], pr["ratio"], dim, index_dim, "latent")
    return (q.to(**to), swa.to(**to), ss.to(**to), src, entries.to(slot_dtype).to(**to),
            pr["latent_cache"].to(**to), sink.to(**to))


def _bf16_ulps_of_output_scale(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got − want| in BF16 ulps of the output scale (max |want| of each query and head)."""
    scale = want.float().abs().amax(dim=-1, keepdim=True).clamp(min=2.0 ** -126)
    ulp = 2.0 ** (torch.floor(torch.log2(scale)) - 7)
    return float(((got.float() - want.float()).abs() / ulp).max())


def assert_packed_equals_bf16_path(mod, q, swa, ss, src, entries, cache, sink, scale, config=None):
    """Packed-entry output vs BF16-cache output on the same decoded values, bf16 and fp32 outputs.

    Interpreter: bit for bit (same arithmetic). Compiled (H200, 2026-11-30): the two variants are
    different binaries (the packed one decodes in registers and spills), whose fp32 softmax /
    accumulation may contract and order differently — measured not bit-identical, so the GPU
    contract is the runtime's: each within one BF16 ulp of the output scale of the exact value,
    hence within two of each other (the decoded values themselves are exact)."""
    packed = mod.sparse_sink_attention(q, swa, ss, src, entries, sink, scale, config=config, validate=True)
    plain = mod.sparse_sink_attention(q, swa, ss, cache, entries, sink, scale, config=config, validate=True)
    out32 = [torch.empty(q.shape, dtype=torch.float32, device=q.device) for _ in range(2)]
    mod.sparse_sink_attention(q, swa, ss, src, entries, sink, scale, config=config, out=out32[0])
    mod.sparse_sink_attention(q, swa, ss, cache, entries, sink, scale, config=config, out=out32[1])
    if sa._is_interpreted():
        assert torch.equal(packed.view(torch.int16), plain.view(torch.int16))
        assert torch.equal(out32[0].view(torch.int32), out32[1].view(torch.int32))
    else:
        ulps = max(_bf16_ulps_of_output_scale(packed, plain), _bf16_ulps_of_output_scale(out32[0], out32[1]))
        print(f"packed vs BF16 path: max {ulps:.3g} BF16 ulps of the output scale")
        assert ulps <= 2.0
    assert bool((entries >= 0).any()) and torch.isfinite(out32[0]).all()
    return packed


@interpreter
@pytest.mark.parametrize("source,pad", [(0, 0), (1, 24), (2, 0)], ids=["ratio2_first", "ratio2_strided", "ratio1"])
def test_packed_latents_bit_identical_to_bf16_path_tiny(source, pad):
    case = packed_case(n=6, heads=4, dim=96, index_dim=64, window=8, topk=8, num_rows=60, ratios=TINY_RATIOS,
                       source=source, seed=20 + source, pad_columns=pad)
    out = assert_packed_equals_bf16_path(sa, *case, 96 ** -0.5)
    q, swa, ss, src, entries, cache, sink = case
    assert src.rows.stride(0) == src.rows.shape[1] + pad
    if source == 2:
        check_against_oracle(sa, q, swa, ss, cache, entries, sink, 96 ** -0.5)   # the decoded values attend
    assert not torch.equal(out, sa.sparse_sink_attention(q, swa, ss, None, None, sink, 96 ** -0.5))


@interpreter
@pytest.mark.parametrize("source", [1, 3], ids=["ratio2", "ratio1"])
def test_packed_latents_bit_identical_flash_dims_split(source):
    """Flash head_dim 512 / index_head_dim 128 in the Flash 4-source latent row (720 B), split key tiles."""
    case = packed_case(n=3, heads=8, dim=512, index_dim=128, window=16, topk=24, num_rows=64, ratios=FLASH_RATIOS,
                       source=source, seed=30 + source, slot_dtype=torch.int32)
    assert case[3].rows.shape[1] == 720 and case[3].entry_bytes == 288
    cfg = sa.SparseAttentionConfig(block_h=16, block_d=512, block_n=16, num_splits=2, num_warps=4, num_stages=2)
    assert_packed_equals_bf16_path(sa, *case, 512 ** -0.5, config=cfg)


@interpreter
def test_packed_input_errors():
    q, swa, ss, src, entries, cache, sink = packed_case(n=3, heads=4, dim=96, index_dim=64, window=8, topk=4,
                                                        num_rows=40, ratios=TINY_RATIOS, source=0, seed=40)
    f = sa.sparse_sink_attention
    bad = entries.clone()
    bad[0, 0] = src.num_entries                                   # 20 entries of ratio 2 in 40 rows
    with pytest.raises(ValueError, match="outside −1..19"):
        f(q, swa, ss, src, bad, sink, 0.1, validate=True)
    with pytest.raises(ValueError, match="head_dim 96"):
        f(q[..., :64].contiguous(), swa[:, :64].contiguous(), ss, src, entries, sink, 0.1)
    assert (src.rows.shape[1], src.share, src.entry_bytes) == (108, 27, 54)   # tiny latent rows: 27 + 27 + 54
    with pytest.raises(ValueError, match="share"):
        sa.PackedSource(src.rows, 0, 28, 2, 96, 64, "latent")
    with pytest.raises(ValueError, match="do not fit"):
        sa.PackedSource(src.rows, 90, 27, 2, 96, 64, "latent")
    with pytest.raises(ValueError, match="uint8"):
        sa.PackedSource(src.rows.float(), 0, 27, 2, 96, 64, "latent")
    with pytest.raises(ValueError, match="multiple of 16"):
        sa.PackedSource(src.rows, 0, 27, 2, 88, 64, "latent")
    with pytest.raises(ValueError, match="part 'entry'"):        # one merged latent + key row is no format
        sa.PackedSource(src.rows, 0, 27, 2, 96, 64, "entry")
    keys = sa.PackedSource(src.rows, 0, 17, 2, 96, 64, "key")   # index-key rows are not attention's
    with pytest.raises(ValueError, match="reads the latent part"):
        f(q, swa, ss, keys, entries, sink, 0.1)


@triton.jit
def _decode_pairs_kernel(rows_ptr, entries_ptr, even_ptr, odd_ptr, n, row_stride, offset, ratio, D,
                         SHARE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr):
    """Test harness: packed_rows.load_latent_pair_tiles on entries[0..n) → even/odd [n, D/2] fp32."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_p = tl.arange(0, BLOCK_P)
    e = tl.load(entries_ptr + offs_n, mask=offs_n < n, other=-1).to(tl.int64)
    even, odd = load_latent_pair_tiles(rows_ptr, e * ratio * row_stride, e >= 0, D, row_stride, offset, SHARE,
                                       BLOCK_P, False)
    out = offs_n[:, None] * (D // 2) + offs_p[None, :]
    mask = (offs_n < n)[:, None] & (offs_p < D // 2)[None, :]
    tl.store(even_ptr + out, even.to(tl.float32), mask=mask)
    tl.store(odd_ptr + out, odd.to(tl.float32), mask=mask)


@interpreter
@pytest.mark.parametrize("dim,index_dim,ratios,source", [(96, 64, TINY_RATIOS, 0), (96, 64, TINY_RATIOS, 2),
                                                         (512, 128, FLASH_RATIOS, 1)],
                         ids=["tiny_ratio2", "tiny_ratio1", "flash_ratio2"])
def test_latent_pair_tiles_decode_even_and_odd_dims(dim, index_dim, ratios, source):
    """The parity-split decode: column i of `even` / `odd` is dim 2i / 2i+1 of the decoded latent
    (low / high nibble of byte i, scale group i // 8), entries −1 (holes, tail) decode to +0, a
    non-power-of-two D (96: 48 of 64 pair columns) is masked; entries straddle rows at ratio 2."""
    pr = packed_rows_case(40, dim, index_dim, ratios, source, seed=60 + source, part="latent")
    n_entries = pr["latent_cache"].shape[0]
    entries = torch.randperm(n_entries, generator=torch.Generator().manual_seed(61))[:12]
    entries[[1, 5]] = -1
    want = torch.where((entries >= 0)[:, None], pr["latent_cache"].float()[entries.clamp(min=0)], 0.0)
    even = torch.full((12, dim // 2), 7.0)
    odd = torch.full((12, dim // 2), 7.0)
    rows = pr["rows"]
    _decode_pairs_kernel[(1,)](rows, entries, even, odd, 12, rows.stride(0), pr["offset"], pr["ratio"], dim,
                               SHARE=pr["share"], BLOCK_N=16, BLOCK_P=triton.next_power_of_2(dim // 2))
    assert torch.equal(even, want[:, 0::2]) and torch.equal(odd, want[:, 1::2])
    assert bool((want[entries >= 0] != 0).any())
    assert torch.equal(even[1], torch.zeros(dim // 2)) and torch.equal(odd[5], torch.zeros(dim // 2))


def test_compiled_latent_decode_formula_is_exact():
    """The GPU branch of `load_latent_pair_tiles` (COMPILED) in torch terms: nibble s|e1e0m moved to
    bits 7|4..2 of a float8_e4m3fn byte is e2m1 × 2^-6, so e4m3(nibble bits) × (e4m3(scale) × 64) in
    BF16 equals the E2M1 × E4M3 value (contracts §1) for every payload byte and every scale byte
    (0x7F / 0xFF: NaN either way) — exact, both nibbles."""
    import packed_rows_codec as codec

    byte = torch.arange(256, dtype=torch.int32)
    low = (((byte << 2) & 0x1C) | ((byte << 4) & 0x80)).to(torch.uint8).view(torch.float8_e4m3fn)
    high = (((byte >> 2) & 0x1C) | (byte & 0x80)).to(torch.uint8).view(torch.float8_e4m3fn)
    scale = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    scale64 = scale.to(BF16) * 64.0
    got_low = low.to(BF16)[:, None] * scale64[None, :]
    got_high = high.to(BF16)[:, None] * scale64[None, :]
    mag = codec.E2M1_MAGNITUDES
    e2m1 = lambda c: torch.where((c & 8) != 0, -mag[c & 7], mag[c & 7])
    exact_low = e2m1(byte & 15).double()[:, None] * scale.double()[None, :]
    exact_high = e2m1(byte >> 4).double()[:, None] * scale.double()[None, :]
    for got, exact in ((got_low, exact_low), (got_high, exact_high)):
        nan = torch.isnan(exact)
        assert torch.equal(torch.isnan(got.double()), nan) and bool(nan[:, 0x7F].all() and nan[:, 0xFF].all())
        assert torch.equal(got.double()[~nan], exact[~nan])
    assert torch.equal(torch.signbit(got_low[8, 0x38:0x39].float()), torch.tensor([True]))   # −0 code keeps its sign


@interpreter
def test_parity_split_input_errors():
    """D must be even (dims are split by parity) and a BF16 cache must allow its int32 pair view."""
    q, swa, ss, comp, cs, sink = random_case(n=2, slots=40, seed=62, **TINY)
    f = sa.sparse_sink_attention
    with pytest.raises(ValueError, match="must be even"):
        f(q[..., :95].contiguous(), swa[:, :95].contiguous(), ss, None, None, sink, 0.1)
    shifted = torch.zeros(40 * 96 + 1, dtype=BF16)[1:].view(40, 96)
    shifted.copy_(swa)
    with pytest.raises(ValueError, match="swa_cache needs an even"):
        f(q, shifted, ss, comp, cs, sink, 0.1)
    with pytest.raises(ValueError, match="≥ 32"):
        sa.SparseAttentionConfig(block_h=16, block_d=16, block_n=16, num_splits=1, num_warps=4, num_stages=2)


def test_test_codec_equals_runtime_kv_layout():
    """The tests' own encoder/row writer (tests/packed_rows_codec.py) produces the same bytes and
    column layout as the production codec `runtime/kv_layout.py` (helper A), tiny and Flash."""
    from sglang_dsv41.presets import flash_config_dict, tiny_config_dict
    from sglang_dsv41.config import DeepseekV41Config
    from sglang_dsv41.runtime import kv_layout
    import packed_rows_codec as codec

    g = torch.Generator().manual_seed(50)
    for cfg_dict in (tiny_config_dict(True), flash_config_dict()):
        text = DeepseekV41Config.from_dict(cfg_dict).text
        layout = kv_layout.CompressedRowLayout.from_config(text)
        D, Dk = text.head_dim, text.index_head_dim
        ratios = tuple(text.compress_ratios[i] for i in text.kv_source_layer_ids)
        assert [(c.latent.offset, c.latent.share, c.ratio) for c in layout.sources] == \
            codec.part_layout(codec.latent_part_bytes(D), ratios)
        assert [(c.key.offset, c.key.share, c.ratio) for c in layout.sources] == \
            codec.part_layout(codec.key_part_bytes(Dk), ratios)
        assert layout.entry_bytes == codec.entry_bytes(D, Dk)
        n = 40
        lat = torch.randn(n, D, generator=g) * 2.0 ** torch.randint(-14, 12, (n, 1), generator=g)
        key = torch.randn(n, Dk, generator=g) * 2.0 ** torch.randint(-40, 40, (n, 1), generator=g)
        lat[0], key[0] = 0.0, 0.0                                   # all-zero groups
        lat[1, :16], key[1, :32] = -1e-30, -1e-30                  # −0 codes, smallest scales
        ours_bytes = torch.cat([codec.encode_latent(lat), codec.encode_index_key(key)], dim=1)
        theirs = kv_layout.encode_entries(layout, lat, key)
        assert torch.equal(ours_bytes, theirs)
        split = codec.latent_part_bytes(D)
        for source in layout.sources:
            entries = torch.randperm(n + 2, generator=g)[:n // source.ratio]
            lat_a = torch.zeros(2 * n + 4, layout.latent_row_stride, dtype=torch.uint8)
            key_a = torch.zeros(2 * n + 4, layout.key_row_stride, dtype=torch.uint8)
            lat_b, key_b = lat_a.clone(), key_a.clone()
            kv_layout.write_source_entries(lat_a, key_a, source, entries, theirs[:entries.numel()])
            for rows, src, part in ((lat_b, source.latent, ours_bytes[:, :split]),
                                    (key_b, source.key, ours_bytes[:, split:])):
                codec.write_entries(rows, entries, part[:entries.numel()], src.offset, src.share, src.ratio)
            assert torch.equal(lat_a, lat_b) and torch.equal(key_a, key_b)


@pytest.mark.skipif(INTERPRETED, reason="needs the compiled kernels")
def test_compiled_kernels_refuse_cpu_tensors():
    assert not sa._is_interpreted()
    q, swa, ss, comp, cs, sink = random_case(n=2, slots=40, seed=14, **TINY)
    with pytest.raises(ValueError, match="need a CUDA device"):
        sa.sparse_sink_attention(q, swa, ss, comp, cs, sink, 0.1)


def test_plan_config_shapes():
    flash = sa.plan_config(2048, 64, 512, 128, 512, sm_count=132)
    assert (flash.block_d, flash.block_h, flash.block_n, flash.num_warps, flash.num_splits) == (512, 32, 32, 8, 1)
    one = sa.plan_config(1, 64, 512, 128, 512, sm_count=132)
    assert one.num_splits == 5            # 20 tiles, ≥ ⌈2·64/32⌉ = 4 tiles per split
    assert sa.plan_config(16, 64, 512, 128, 512, sm_count=132).num_splits == 4     # ⌊132/32⌋
    assert sa.plan_config(64, 64, 512, 128, 512, sm_count=132).num_splits == 1     # one wave already
    dec = [sa.plan_decode_config(n, 64, 512, 128, 512, sm_count=132) for n in (1, 8, 16, 17, 2048)]
    assert [c.num_splits for c in dec] == [20, 7, 5, 1, 1]   # 20 tiles: ⌈132/4⌉ → 20, ⌈132/16⌉ = 9 → 7, 5 → 5
    assert [c.block_h for c in dec] == [16, 32, 32, 32, 32]   # DECODE_SMALL_BLOCK_H at one query
    assert all((c.block_n, c.block_d) == (32, 512) for c in dec)
    assert sa.plan_decode_config(1, 64, 512, 128, 512, sm_count=132, block_h=16).num_splits == 20
    assert sa.plan_decode_config(8, 64, 512, 128, 512, sm_count=132, block_h=16).num_splits == 5   # ⌈132/32⌉ = 5
    tiny = sa.plan_config(5, 4, 96, 8, 4, sm_count=132)
    assert (tiny.block_d, tiny.block_h, tiny.block_n, tiny.num_warps) == (128, 16, 16, 4)
    prefill = sa.plan_prefill_config(8192, 64, 512, 128, 512)       # the measured class: the workspace's config
    assert (prefill.block_d, prefill.block_h, prefill.block_n, prefill.num_warps, prefill.num_stages,
            prefill.num_splits) == (512, 16, 32, 4, 2, 1)
    assert sa.plan_prefill_config(512, 32, 512, 128, 512) == prefill                 # 32 heads: the same class
    for shape in ((8192, 16, 512, 128, 512), (2048, 64, 256, 128, 512), (37, 4, 96, 8, 4)):   # other classes
        assert sa.plan_prefill_config(*shape) == dataclasses.replace(sa.plan_config(*shape, sm_count=1), num_splits=1)
    with pytest.raises(ValueError, match="head_dim"):
        sa.plan_config(1, 4, 2048, 8, 4, sm_count=1)
    assert sa.bytes_read_per_query(64, 512, 128, 512, 640) == 64 * 512 * 2 + 640 * 4 + 640 * 1024 + 256
    assert sa.bytes_read_per_query(64, 512, 128, 512, 640, valid_comp_keys=512, packed_comp=True) == \
        64 * 512 * 2 + 640 * 4 + 128 * 1024 + 512 * 288 + 256          # 288 B per packed latent entry
    with pytest.raises(ValueError, match="valid_comp_keys"):
        sa.bytes_read_per_query(64, 512, 128, 512, 10, valid_comp_keys=11)


# ---- ahead-of-time compilation for Hopper (no GPU needed: Triton's bundled ptxas) -----------

def _hopper_binary(kernel, constexprs: dict, num_warps: int, num_stages: int):
    """Compile `kernel` for sm_90 with BF16 q/out, BF16 cache rows as int32 pair views (uint8
    packed rows when COMP_PACKED), int32 slots; returns (compiled, resource line)."""
    pointer_types = {"q_ptr": "*bf16", "swa_ptr": "*i32", "comp_ptr": "*u8" if constexprs.get("COMP_PACKED") else
                     "*i32", "swa_slots_ptr": "*i32", "comp_slots_ptr": "*i32", "sink_ptr": "*fp32",
                     "out_ptr": "*bf16", "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32"}
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = pointer_types[name]
        else:
            signature[name] = "fp32" if name == "qk_scale_log2" else "i32"
    return compile_for_sm90(kernel, signature, constexprs, {"num_warps": num_warps, "num_stages": num_stages})


@pytest.mark.skipif(INTERPRETED, reason="needs the compiled kernels")
@pytest.mark.parametrize("case,packed", [("flash_decode_split", False), ("flash_extend", False), ("tiny", False),
                                         ("flash_decode_split", True), ("flash_prefill_workspace", False)],
                         ids=["flash_decode_split", "flash_extend", "tiny", "flash_decode_split_packed",
                              "flash_prefill_workspace"])
def test_compiles_for_hopper_without_spills(case, packed):
    """The planned configs compile for sm_90 with BF16 tensor-core dots and shared memory within
    Hopper's 227 KiB per block — with BF16 compressed rows (no register spills: STACK/LOCAL 0) and
    with packed FP4 entries decoded in the kernel (parity-split decode pinned to the load layout:
    measured 48 B/thread of stack at the runtime's one-split Flash plan, 168 B with the 5 planned
    splits tested here, bounded at 256 B so a regression shows —
    the per-dim decode it replaced spilled 950 B; the per-byte join/reshape decode gave wrong
    values on the H200)."""
    n, h, d, w, k = {"flash_decode_split": (1, 64, 512, 128, 512), "flash_extend": (2048, 64, 512, 128, 512),
                     "tiny": (5, 4, 96, 8, 4), "flash_prefill_workspace": (8192, 64, 512, 128, 512)}[case]
    cfg = (sa.plan_prefill_config(n, h, d, w, k) if case == "flash_prefill_workspace" else
           sa.plan_config(n, h, d, w, k, sm_count=132))
    consts = dict(BLOCK_H=cfg.block_h, BLOCK_D=cfg.block_d, BLOCK_N=cfg.block_n, HAS_COMP=True,
                  COMP_PACKED=packed, COMP_SHARE=144 if packed else 1, NUM_SPLITS=cfg.num_splits, DOT_FP32=False)
    compiled, usage = _hopper_binary(sa._sparse_sink_attn_kernel, consts, cfg.num_warps, cfg.num_stages)
    stack = int(re.search(r"STACK:(\d+) ", usage).group(1))
    assert stack <= (256 if packed else 0) and "LOCAL:0 " in usage, usage
    assert compiled.metadata.shared <= 227 * 1024
    ptx = compiled.asm["ptx"]
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in ptx or "wgmma" in ptx
    if cfg.num_splits > 1:
        merge_h, merge_d = sa.merge_tile(n, h, cfg.block_d, 132)
        merge_consts = dict(BLOCK_H=merge_h, BLOCK_D=merge_d, NUM_SPLITS=cfg.num_splits)
        _, merge_usage = _hopper_binary(sa._merge_splits_kernel, merge_consts, 4, 1)
        assert "STACK:0 " in merge_usage and "LOCAL:0 " in merge_usage, merge_usage


def test_merge_tile_fills_the_multiprocessors_within_bounds():
    """The merge tile shrinks from MERGE_ELEMS_PER_PROGRAM until the grid has ≥ 2·SMs programs (or the
    floor), never wider than MERGE_MAX_BLOCK_D columns, both sides powers of two."""
    assert sa.merge_tile(1, 64, 512, 132) == (1, 128)           # floor: 256 programs
    assert sa.merge_tile(8, 64, 512, 132) == (4, 128)           # 8·64·512 / 1024 = 256 < 264 → 512: 512 programs
    assert sa.merge_tile(256, 64, 512, 132) == (16, 128)        # already ≥ 2·SMs at 2048
    assert sa.merge_tile(5, 4, 128, 1) == (8, 128)             # 2,560 elements: 1,024 per program
    for n in (1, 2, 8, 16, 64):
        bh, bd = sa.merge_tile(n, 64, 512, 132)
        assert bh & (bh - 1) == 0 and bd & (bd - 1) == 0 and bd <= sa.MERGE_MAX_BLOCK_D
        assert sa.MERGE_MIN_ELEMS_PER_PROGRAM <= bh * bd <= sa.MERGE_ELEMS_PER_PROGRAM


# ---- GPU tests (compiled kernels; run on the GPU machine) -----------------------------------

def _gpu_module():
    assert not sa._is_interpreted(), "GPU tests need the compiled kernels (unset TRITON_INTERPRET)"
    return sa


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 64, 2048])
def test_gpu_flash_shape_matches_oracle(n):
    """Flash shape (D 512, H 64, W 128, K 512): BF16 output ≤ 1 BF16 ulp element-wise from the
    float64 oracle; fp32 output ≤ 2^-14·max|k| from the exact value. Covers split-KV (n=1, 64)."""
    mod = _gpu_module()
    q, swa, ss, comp, cs, sink = random_case(n=n, slots=max(4096, 2 * n), seed=100 + n, heads=64, dim=512,
                                             window=128, topk=512, hole_frac=0.1, device="cuda",
                                             slot_dtype=torch.int32)
    ss[0, :100] = -1                                     # a query near its sequence start
    check_against_oracle(mod, q, swa, ss, comp, cs, sink, 512 ** -0.5)


@pytest.mark.gpu
@pytest.mark.parametrize("n,block_h", [(1, 32), (8, 32), (1, 16)])
def test_gpu_decode_plan_flash_matches_oracle_and_packed(n, block_h):
    """`plan_decode_config` (SGLANG_DSV41_ATTN_SPLITS=decode) at the Flash shape: the oracle bound
    on BF16 rows, and the packed FP4 entries give the BF16 path's bits under the same plan."""
    mod = _gpu_module()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cfg = mod.plan_decode_config(n, 64, 512, 128, 512, sm_count=sms, block_h=block_h)
    assert cfg.num_splits > 1
    q, swa, ss, comp, cs, sink = random_case(n=n, slots=4096, seed=700 + n, heads=64, dim=512, window=128, topk=512,
                                             hole_frac=0.1, device="cuda", slot_dtype=torch.int32)
    ss[0, :100] = -1
    check_against_oracle(mod, q, swa, ss, comp, cs, sink, 512 ** -0.5, config=cfg)
    case = packed_case(n=n, heads=64, dim=512, index_dim=128, window=128, topk=512, num_rows=8192,
                       ratios=FLASH_RATIOS, source=1, seed=710 + n, hole_frac=0.1, device="cuda", slot_dtype=torch.int32)
    assert_packed_equals_bf16_path(mod, *case, 512 ** -0.5, config=cfg)


@pytest.mark.gpu
def test_gpu_prefill_plan_flash_matches_oracle():
    """`plan_prefill_config` (the BF16 prefill workspace's launch: 16 heads, 4 warps at the Flash
    shape) on BF16 compressed rows: the oracle bound; whether its output equals the one-split
    `plan_config` launch's bit for bit is printed (measured equal at 8,192 queries, session 13)."""
    mod = _gpu_module()
    n = 2048
    cfg = mod.plan_prefill_config(n, 64, 512, 128, 512)
    assert (cfg.block_h, cfg.num_warps, cfg.num_splits) == (16, 4, 1)
    args = random_case(n=n, slots=8192, seed=800, heads=64, dim=512, window=128, topk=512, hole_frac=0.1,
                       device="cuda", slot_dtype=torch.int32)
    out, _ = check_against_oracle(mod, *args, 512 ** -0.5, config=cfg)
    plan = dataclasses.replace(mod.plan_config(n, 64, 512, 128, 512, sm_count=1), num_splits=1)
    same = mod.sparse_sink_attention(*args, 512 ** -0.5, config=plan)
    print(f"plan_prefill_config vs plan_config at n = {n}: {float((out == same).float().mean()):.4%} of elements equal")


@pytest.mark.gpu
def test_gpu_tiny_shape_matches_oracle():
    mod = _gpu_module()
    q, swa, ss, comp, cs, sink = random_case(n=37, slots=200, seed=200, device="cuda", **TINY)
    check_against_oracle(mod, q, swa, ss, comp, cs, sink, TINY["dim"] ** -0.5)


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_matches_eager():
    """Decode at the Flash shape with split-KV scratch allocated inside a captured CUDA graph:
    replay on new inputs (copied into the captured buffers) equals an eager call bit for bit."""
    mod = _gpu_module()
    args = random_case(n=8, slots=4096, seed=300, heads=64, dim=512, window=128, topk=512, device="cuda",
                       slot_dtype=torch.int32)
    fresh = random_case(n=8, slots=4096, seed=301, heads=64, dim=512, window=128, topk=512, device="cuda",
                        slot_dtype=torch.int32)
    scale = 512 ** -0.5
    assert mod.plan_config(8, 64, 512, 128, 512, torch.cuda.get_device_properties(0).multi_processor_count
                           ).num_splits > 1
    mod.sparse_sink_attention(*args, scale)              # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = mod.sparse_sink_attention(*args, scale)
    for dst, src in zip(args, fresh):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, mod.sparse_sink_attention(*fresh, scale))


@pytest.mark.gpu
@pytest.mark.parametrize("source", [1, 3], ids=["ratio2", "ratio1"])
@pytest.mark.parametrize("n", [1, 64, 2048])
def test_gpu_packed_flash_within_two_bf16_ulps_of_bf16_path(n, source):
    """Flash shape (D 512, Dk 128, H 64, W 128, top-512) in the 720-byte Flash latent row, planned
    config (split-KV at n = 1): packed FP4 entries give the BF16-cache path's bits (bf16 and fp32 out)."""
    mod = _gpu_module()
    case = packed_case(n=n, heads=64, dim=512, index_dim=128, window=128, topk=512, num_rows=8192,
                       ratios=FLASH_RATIOS, source=source, seed=400 + n + source, hole_frac=0.1, device="cuda",
                       slot_dtype=torch.int32)
    assert case[3].rows.shape[1] == 720
    assert_packed_equals_bf16_path(mod, *case, 512 ** -0.5)


@pytest.mark.gpu
@pytest.mark.parametrize("source", [0, 2], ids=["ratio2", "ratio1"])
def test_gpu_packed_tiny_within_two_bf16_ulps_of_bf16_path(source):
    mod = _gpu_module()
    case = packed_case(n=37, heads=4, dim=96, index_dim=64, window=8, topk=4, num_rows=200, ratios=TINY_RATIOS,
                       source=source, seed=500 + source, device="cuda")
    assert_packed_equals_bf16_path(mod, *case, 96 ** -0.5)

"""`sglang_dsv41.kernels.key_gather.gather_key_rows`: the decode queries' keys as one BF16 tensor and
FlashMLA indices into it (the input of the flashmla decode opt-in, `runtime/attention_flashmla.py`).

CPU cases run the kernel under Triton's interpreter in one child process (`test_interpreter_cases`,
as in tests/test_kernels_sparse_attention.py). What is pinned: every indexed row holds exactly the
key the Triton attention kernel reads for that column (the SWA row by slot, the decoded latent of
the packed entry, bit for bit), zero-padded to `out_dim`; −1 exactly where a query has no key and
in the padding columns; the width rounded up to the multiple. On the H200: the same at the Flash
shape, compiled.
"""
from __future__ import annotations

import pytest
import torch

from sglang_dsv41.kernels import key_gather as KG
from sglang_dsv41.kernels.packed_rows import PackedSource

import child_runs
from packed_rows_codec import packed_rows_case

INTERPRETED = KG.INTERPRETED
interpreter = pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 child process of "
                                                         "test_interpreter_cases")
INTERPRETER_ARGV = child_runs.interpreter_argv(__file__, "-m", "not gpu", "-k",
                                               "not test_interpreter_cases and not test_compiles_for_hopper")


@pytest.mark.skipif(INTERPRETED, reason="this process is the interpreter child")
@pytest.mark.child_run(*INTERPRETER_ARGV)
def test_interpreter_cases():
    """This file's CPU cases under Triton's interpreter, in one child pytest process."""
    child_runs.assert_all_passed(INTERPRETER_ARGV)


def _case(n, dim, window, topk, num_rows=64, ratios=(2, 2, 1), source=1, seed=0, hole=0.25, device="cpu"):
    pr = packed_rows_case(num_rows, dim, 64, ratios, source, seed, "latent")
    g = torch.Generator().manual_seed(seed + 1)
    swa = torch.randn(num_rows, dim, generator=g).to(torch.bfloat16)
    swa_slots = torch.randint(0, num_rows, (n, window), generator=g)
    swa_slots[torch.rand(n, window, generator=g) < hole] = -1
    entries = torch.randint(0, pr["latent_cache"].shape[0], (n, topk), generator=g)
    entries[torch.rand(n, topk, generator=g) < hole] = -1
    src = PackedSource(pr["rows"].to(device), pr["offset"], pr["share"], pr["ratio"], dim, 64, "latent")
    return swa.to(device), swa_slots.to(device), src, entries.to(device), pr["latent_cache"].to(device)


def _expected(swa, swa_slots, entries, latents, out_dim, multiple):
    """kv rows and indices from torch indexing (module docstring)."""
    N, W = swa_slots.shape
    K = 0 if entries is None else entries.shape[1]
    T = -(-(W + K) // multiple) * multiple
    D = swa.shape[1]
    rows = torch.zeros(N, T, out_dim, dtype=torch.bfloat16, device=swa.device)
    valid = torch.zeros(N, T, dtype=torch.bool, device=swa.device)
    rows[:, :W, :D] = torch.where((swa_slots >= 0)[..., None], swa[swa_slots.clamp(min=0)], 0)
    valid[:, :W] = swa_slots >= 0
    if K:
        rows[:, W:W + K, :D] = torch.where((entries >= 0)[..., None], latents[entries.clamp(min=0)], 0)
        valid[:, W:W + K] = entries >= 0
    flat = torch.arange(N * T, device=swa.device).view(N, T)
    return rows.view(N * T, 1, out_dim), torch.where(valid, flat, -1).to(torch.int32)[:, None, :]


def _check(got, want):
    (kv, idx), (kv_want, idx_want) = got, want
    assert torch.equal(idx, idx_want)
    live = idx.view(-1) >= 0
    assert torch.equal(kv.view(torch.int16)[live], kv_want.view(torch.int16)[live])   # bit for bit
    assert not bool(kv[~live].float().abs().sum())                                       # zeros elsewhere


@interpreter
@pytest.mark.parametrize("n,dim,window,topk,out_dim,multiple,ratios,source", [
    (3, 96, 8, 4, 128, 1, (2, 2, 1), 1),          # tiny widths, no padding of the width
    (2, 96, 8, 4, 512, 128, (2, 2, 1), 2),        # padded to the kernel's 512 dims and 128 columns
    (2, 64, 5, 0, 64, 16, (2,), 0),               # no compressed keys in the list
    (4, 64, 16, 16, 64, 64, (1, 2), 0),           # ratio-1 source
])
def test_gather_matches_torch_indexing(n, dim, window, topk, out_dim, multiple, ratios, source):
    swa, swa_slots, src, entries, latents = _case(n, dim, window, topk, ratios=ratios, source=source, seed=n + dim)
    ents = entries if topk else None
    got = KG.gather_key_rows(swa, swa_slots, src if topk else None, ents, out_dim, multiple)
    _check(got, _expected(swa, swa_slots, ents, latents, out_dim, multiple))


@interpreter
def test_int32_slot_lists_and_all_holes():
    swa, swa_slots, src, entries, latents = _case(2, 64, 4, 4, ratios=(2,), source=0, hole=1.0)
    got = KG.gather_key_rows(swa, swa_slots.int(), src, entries.int(), 64)
    assert bool((got[1] == -1).all())
    _check(got, _expected(swa, swa_slots, entries, latents, 64, 1))


@interpreter
@pytest.mark.parametrize("heads,dim", [(4, 96), (64, 512)])
def test_flashmla_decode_within_the_bound_of_the_triton_math(heads, dim):
    """`attention_flashmla.decode_attend` through the test emulation of `flash_mla_sparse_fwd`
    (tests/test_runtime_attention_flashmla.py) against the Triton kernel's math (`attend_with_sink`,
    float64, over the same SWA rows and decoded latents) within `flashmla_bound`, padded plan
    (4 × 96) and native (64 × 512); q from a different query is outside it."""
    from sglang_dsv41.numerics.geometry import softmax_scale
    from sglang_dsv41.runtime import attention_flashmla as FM
    from sglang_dsv41.runtime import attention_ops_torch
    from test_runtime_attention_flashmla import HOPPER, emulate_sparse_fwd

    n = 3
    swa, swa_slots, src, entries, latents = _case(n, dim, 8, 16, ratios=(2, 2, 1), source=1, seed=heads)
    g = torch.Generator().manual_seed(heads + 5)
    q = torch.randn(n, heads, dim, generator=g).to(torch.bfloat16)
    sink = torch.randn(heads, generator=g)
    plan = FM.plan_flashmla(heads, dim, HOPPER)
    got = FM.decode_attend(emulate_sparse_fwd, plan, q, sink, swa, swa_slots, src, entries, softmax_scale(dim)).float()
    sk, sv = attention_ops_torch.gather_rows(swa, swa_slots)
    ck, cv = attention_ops_torch.gather_rows(latents, entries)
    keys, valid = torch.cat((sk, ck), 1), torch.cat((sv, cv), 1)
    want = attention_ops_torch.attend_with_sink(q.float(), keys, sink, valid)
    key_max = torch.where(valid[..., None], keys.float().abs(), 0.0).amax((1, 2))
    bound = FM.flashmla_bound(key_max[:, None, None], want.abs().amax(-1, keepdim=True))
    assert got.shape == (n, heads, dim)
    assert bool(((got - want).abs() <= bound).all()), float(((got - want).abs() - bound).max())
    wrong = FM.decode_attend(emulate_sparse_fwd, plan, q.roll(1, 0), sink, swa, swa_slots, src, entries,
                             softmax_scale(dim)).float()
    assert not bool(((wrong - want).abs() <= bound).all())


@interpreter
@pytest.mark.parametrize("dim,splits", [(96, "one"), (64, "decode")])
def test_gather_decode_choice_is_the_packed_path_bit_for_bit(dim, splits):
    """SGLANG_DSV41_ATTN_DECODE=gather: `KernelAttentionOps.attend` on the packed rows, with the entries
    decoded first (`gather_latent_rows`: a [N·K, D] view, row stride 2·(a power of two)), returns the
    bits of the default `triton` choice, which decodes them in the attention loop."""
    from sglang_dsv41.kernels import indexer, sparse_attention
    from sglang_dsv41.runtime import attention_ops
    from packed_rows_codec import kernel_source_as_runtime_rows

    n, heads = 3, 4
    swa, swa_slots, src, entries, latents = _case(n, dim, 8, 16, ratios=(2, 2, 1), source=1, seed=dim)
    rows, slots = KG.gather_latent_rows(src, entries)
    assert rows.shape == (n * 16, dim) and rows.stride(0) == 2 * (1 << ((dim // 2 - 1).bit_length()))
    assert torch.equal(slots, torch.where(entries >= 0, torch.arange(n * 16).view(n, 16), -1).int())
    g = torch.Generator().manual_seed(dim)
    q = torch.randn(n, heads, dim, generator=g).to(torch.bfloat16)
    sink = torch.randn(heads, generator=g)
    packed = kernel_source_as_runtime_rows(src)
    outs = {c: attention_ops.KernelAttentionOps(sparse_attention, indexer, splits=splits, decode=c).attend(
        q, sink, swa, swa_slots, packed, entries) for c in ("triton", "gather")}
    assert torch.equal(outs["gather"], outs["triton"])


def test_refuses_bad_shapes():
    swa = torch.zeros(4, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="power of two"):
        KG.gather_key_rows(swa, torch.zeros(1, 2, dtype=torch.long), None, None, 96)
    with pytest.raises(ValueError, match="BF16"):
        KG.gather_key_rows(swa.float(), torch.zeros(1, 2, dtype=torch.long), None, None, 64)


@pytest.mark.gpu
def test_gpu_gather_at_the_flash_shape():
    """Compiled: 64 queries × (128 SWA + 512 packed entries of 512 dims, ratio 2) into 640 rows each."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    swa, swa_slots, src, entries, latents = _case(64, 512, 128, 512, num_rows=4096, ratios=(2, 2, 2, 1), source=1,
                                                  device="cuda")
    got = KG.gather_key_rows(swa, swa_slots, src, entries, 512, 128)
    _check(got, _expected(swa, swa_slots, entries, latents, 512, 128))


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 64])
def test_gpu_flashmla_decode_matches_the_triton_kernel(n):
    """The real `flash_mla_sparse_fwd` over the gathered keys against `sparse_sink_attention` on the
    packed rows (the serving default's decode) at the Flash shape: within `flashmla_bound`."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from sglang_dsv41.kernels import sparse_attention as SA
    from sglang_dsv41.numerics.geometry import softmax_scale
    from sglang_dsv41.runtime import attention_flashmla as FM
    dev = torch.device("cuda")
    plan = FM.plan_flashmla(64, 512, torch.cuda.get_device_capability(dev))
    assert plan.mode == "native", plan
    swa, swa_slots, src, entries, latents = _case(n, 512, 128, 512, num_rows=4096, ratios=(2, 2, 2, 1), source=1,
                                                  seed=n, device="cuda")
    g = torch.Generator(device=dev).manual_seed(n)
    q = (torch.randn(n, 64, 512, generator=g, device=dev) * 0.5).to(torch.bfloat16)
    sink = torch.randn(64, generator=g, device=dev)
    scale = softmax_scale(512)
    want = SA.sparse_sink_attention(q, swa, swa_slots, src, entries, sink, scale).float()
    got = FM.decode_attend(FM.load_kernel(), plan, q, sink, swa, swa_slots, src, entries, scale).float()
    kv, idx = KG.gather_key_rows(swa, swa_slots, src, entries, 512, FM.TOPK_BLOCK)
    i = idx[:, 0].long()
    key_max = torch.where(i >= 0, kv[:, 0].float().abs().amax(1)[i.clamp(min=0)], 0.0).amax(1)
    bound = FM.flashmla_bound(key_max[:, None, None], want.abs().amax(-1, keepdim=True))
    err = (got - want).abs()
    print(f"\nflashmla decode vs triton, N={n}: max |Δ|/bound {float((err / bound).max()):.3f}")
    assert bool(torch.isfinite(got).all()) and bool((err <= bound).all()), float((err / bound).max())


@pytest.mark.skipif(INTERPRETED, reason="compiles the kernel for sm_90 (not the interpreter's)")
@pytest.mark.parametrize("has_comp", [True, False])
def test_compiles_for_hopper_without_spills(has_comp):
    """The Flash-shape kernel (512 dims, share 144) builds for sm_90 with Triton's ptxas, without
    register spills and with the FP8 conversions of the compiled decode."""
    from triton_checks import compile_for_sm90
    kernel = KG._gather_keys_kernel
    consts = dict(HAS_COMP=has_comp, COMP_SHARE=144, OUT_P=256, BLOCK_N=KG.BLOCK_N, COMPILED=True)
    ptrs = dict(swa_ptr="*i32", swa_slots_ptr="*i64", comp_ptr="*u8", comp_slots_ptr="*i64", kv_ptr="*i32",
                idx_ptr="*i32")
    sig = {n: "constexpr" if n in consts else ptrs.get(n, "i32") for n in kernel.arg_names}
    compiled, usage = compile_for_sm90(kernel, sig, consts, {"num_warps": 4})
    assert "STACK:0 " in usage + " " and "LOCAL:0 " in usage + " ", usage
    if has_comp:
        assert "e4m3" in compiled.asm["ptx"]


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 8, 64])
def test_gpu_gather_decode_matches_the_packed_kernel(n):
    """`gather_latent_rows` + the BF16-row kernel against the packed kernel, same decode plan, Flash
    shape: within 2 BF16 ulps of the output scale (two binaries; session 21's sweep saw equal bits)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from sglang_dsv41.kernels import sparse_attention as SA
    from sglang_dsv41.numerics.geometry import softmax_scale
    swa, swa_slots, src, entries, _ = _case(n, 512, 128, 512, num_rows=4096, ratios=(2, 2, 2, 1), source=1, seed=n,
                                            device="cuda")
    g = torch.Generator(device="cuda").manual_seed(n)
    q = (torch.randn(n, 64, 512, generator=g, device="cuda") * 0.5).to(torch.bfloat16)
    sink = torch.randn(64, generator=g, device="cuda")
    plan = SA.plan_decode_config(n, 64, 512, 128, 512, sm_count=SA.device_sm_count(q.device))
    want = SA.sparse_sink_attention(q, swa, swa_slots, src, entries, sink, softmax_scale(512), config=plan).float()
    rows, slots = KG.gather_latent_rows(src, entries)
    got = SA.sparse_sink_attention(q, swa, swa_slots, rows, slots, sink, softmax_scale(512), config=plan).float()
    ulp = torch.exp2(torch.floor(torch.log2(want.abs().amax(-1, keepdim=True).clamp(min=2.0 ** -126))) - 7)
    print(f"\ngather vs packed, N={n}: equal fraction {float((got == want).float().mean()):.4f}")
    assert bool(((got - want).abs() <= 2 * ulp).all())

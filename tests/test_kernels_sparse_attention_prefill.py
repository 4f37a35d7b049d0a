"""`sglang_dsv41.kernels.sparse_attention_prefill` against the float64 oracle (spec §3.4.5).

The kernel computes `sparse_attention.sparse_sink_attention`'s function for BF16 rows with its
products transposed; it is held to the same bounds (`test_kernels_sparse_attention`: BF16 output
≤ 1 BF16 ulp of the output scale from the oracle, fp32 output ≤ 2^-14·max|k| from the exact value).
CPU tests run under Triton's interpreter in one child process (as in that file); the sm_90 build
is checked without a GPU; GPU tests run compiled.
"""
from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from sglang_dsv41.kernels import sparse_attention_prefill as sap

import child_runs
from test_kernels_sparse_attention import (FLASH_SMALL, TINY, assert_within_one_bf16_ulp, attend_with_sink,
                                          check_against_oracle, exact_attention, gather_keys, random_case)
from triton_checks import compile_for_sm90, no_spills

INTERPRETED = not isinstance(sap._prefill_attn_kernel, __import__("triton").runtime.jit.JITFunction)
interpreter = pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 child process of "
                                                         "test_interpreter_cases")
INTERPRETER_ARGV = child_runs.interpreter_argv(__file__, "-m", "not gpu", "-k",
                                               "not test_interpreter_cases and not test_compiled"
                                               " and not test_hopper_build")


@pytest.mark.skipif(INTERPRETED, reason="this process is the interpreter child")
@pytest.mark.child_run(*INTERPRETER_ARGV)
def test_interpreter_cases():
    """This file's CPU tests under Triton's interpreter, in one child pytest process."""
    child_runs.assert_all_passed(INTERPRETER_ARGV)


class Wide:
    """`check_against_oracle`'s module argument: its `sparse_sink_attention` is this kernel under `config`."""

    def __init__(self, config: sap.PrefillAttentionConfig | None = None) -> None:
        self.config = config

    def sparse_sink_attention(self, q, swa, swa_slots, comp, comp_slots, sink, scale, *, out=None, config=None):
        assert config is None
        return sap.prefill_sink_attention(q, swa, swa_slots, comp, comp_slots, sink, scale, out=out,
                                          config=self.config)


SMALL = [sap.PrefillAttentionConfig(block_h=16, num_warps=4, num_stages=2),
         sap.PrefillAttentionConfig(block_h=32, num_warps=8, num_stages=3)]
#: key-tile splits (flash-decoding) over the 2 + 2 tiles below: 3 asked gives 2 splits of 2 tiles, 32 gives 4 of one
SPLITS = [sap.PrefillAttentionConfig(block_h=16, num_warps=4, num_stages=2, num_splits=3),
          sap.PrefillAttentionConfig(block_h=16, num_warps=4, num_stages=2, num_splits=32)]
#: the heads layout (`sparse_attention_prefill_heads`): the split over duplicated rows, and as two products
HEADS = [sap.PrefillAttentionConfig(block_h=16, num_warps=4, num_stages=2, layout="heads"),
         sap.PrefillAttentionConfig(block_h=32, num_warps=8, num_stages=2, layout="heads", pv="split2"),
         sap.PrefillAttentionConfig(block_h=16, num_warps=4, num_stages=5, layout="heads", tile_keys=16)]


# ---- interpreter tests ----------------------------------------------------------------------

@interpreter
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("config", [None, *SMALL], ids=["plan", "h16_w4", "h32_w8_s3"])
def test_tiny_random_matches_oracle(seed, config):
    """Tiny heads (4 of a 16- or 32-head block) and D = 96 (two halves of 48 in 64-column tiles): masking."""
    q, swa, ss, comp, cs, sink = random_case(n=7, slots=50, seed=seed, **TINY)
    check_against_oracle(Wide(config), q, swa, ss, comp, cs, sink, TINY["dim"] ** -0.5)


@interpreter
@pytest.mark.parametrize("config", [None, SMALL[1]], ids=["plan", "h32_w8_s3"])
def test_flash_like_small_matches_oracle(config):
    q, swa, ss, comp, cs, sink = random_case(n=3, slots=80, seed=11, **FLASH_SMALL)
    check_against_oracle(Wide(config), q, swa, ss, comp, cs, sink, FLASH_SMALL["dim"] ** -0.5)


@interpreter
def test_two_head_blocks_and_more_keys_than_a_tile():
    """20 heads in blocks of 16 (the second one masked) and 70 + 90 keys (two tiles per list)."""
    q, swa, ss, comp, cs, sink = random_case(n=3, slots=300, seed=5, heads=20, dim=32, window=70, topk=90)
    check_against_oracle(Wide(), q, swa, ss, comp, cs, sink, 32 ** -0.5)


@interpreter
@pytest.mark.parametrize("config", [None, SPLITS[1]], ids=["plan", "splits32"])
def test_mixed_slot_dtypes_match_oracle(config):
    """The runtime's slot tensors — int64 SWA windows beside int32 workspace / gathered rows — within the
    same bounds, one split and key splits."""
    q, swa, ss, comp, cs, sink = random_case(n=3, slots=300, seed=7, heads=20, dim=32, window=70, topk=90)
    check_against_oracle(Wide(config), q, swa, ss.long(), comp, cs.to(torch.int32), sink, 32 ** -0.5)


class LaunchRecorder:
    """Stands in for a Triton kernel: `kernel[grid](*args, **kwargs)` records the launch's arguments."""

    def __init__(self) -> None:
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append(args)


@pytest.mark.parametrize("layout", ["keys", "heads"])
@pytest.mark.parametrize("swa_dtype,comp_dtype", [(torch.int64, torch.int32), (torch.int32, torch.int64)])
def test_kernels_get_one_slot_integer_type(monkeypatch, layout, swa_dtype, comp_dtype):
    """Both layouts read the two key lists in one loop, which selects between the two slot pointers: the
    host hands them over as one integer type, the compressed list's (two types do not compile for the GPU:
    session 45's GPU run). Checked on the launch's arguments, with the kernels stood in for."""
    from sglang_dsv41.kernels import sparse_attention_prefill_heads as sah
    recorder = LaunchRecorder()
    monkeypatch.setattr(sap, "_prefill_attn_kernel", recorder)
    monkeypatch.setattr(sah, "_prefill_attn_heads_kernel", recorder)
    q, swa, ss, comp, cs, sink = random_case(n=3, slots=300, seed=7, heads=20, dim=32, window=70, topk=90)
    config = sap.PrefillAttentionConfig(block_h=16, num_warps=4, num_stages=2, layout=layout)
    sap.prefill_sink_attention(q, swa, ss.to(swa_dtype), comp, cs.to(comp_dtype), sink, 32 ** -0.5, config=config)
    (args,) = recorder.launches
    slot_dtypes = {a.dtype for a in args if isinstance(a, torch.Tensor) and not a.is_floating_point()}
    assert slot_dtypes == {comp_dtype}


@interpreter
@pytest.mark.parametrize("config", SPLITS, ids=["splits3", "splits32"])
def test_key_splits_match_oracle(config):
    """Split-KV: 20 heads (a masked second block), 70 + 90 keys (two tiles a list), a −∞ sink on one
    head, a query with one valid key (splits holding no valid key) — merged within the same bounds."""
    q, swa, ss, comp, cs, sink = random_case(n=3, slots=300, seed=6, heads=20, dim=32, window=70, topk=90)
    sink[3] = float("-inf")
    ss[1, :] = -1
    ss[1, 5] = 11
    cs[1, :] = -1
    check_against_oracle(Wide(config), q, swa, ss, comp, cs, sink, 32 ** -0.5)


@interpreter
@pytest.mark.parametrize("config", HEADS, ids=["heads", "heads_split2", "heads_k16_s5"])
@pytest.mark.parametrize("case", ["tiny", "flash_like", "two_blocks", "sinks", "mixed_slot_dtypes"])
def test_heads_layout_matches_oracle(config, case):
    """The heads layout within the same bounds: tiny heads and D = 96 (masking), a Flash-like shape, 20
    heads in blocks of 16 with 70 + 90 keys (several tiles a list, a partial duplicated tile), a −∞ sink, a
    query whose only valid key is compressed, a query with one SWA key, SWA and compressed slots of two integer
    types (the runtime passes int64 windows and int32 workspace rows: GPU run of session 45)."""
    shape = dict(tiny=TINY, flash_like=FLASH_SMALL, two_blocks=dict(heads=20, dim=32, window=70, topk=90),
                 sinks=dict(heads=20, dim=32, window=70, topk=90), mixed_slot_dtypes=TINY)[case]
    q, swa, ss, comp, cs, sink = random_case(n=3, slots=300, seed=31, **shape)
    if case == "mixed_slot_dtypes":       # the runtime's: int64 SWA slots, int32 workspace rows
        cs = cs.to(torch.int32)
    if case == "sinks":
        sink[3] = float("-inf")
        ss[1, :] = -1
        cs[1, :] = -1
        cs[1, 40] = 9
        ss[2, :] = -1
        ss[2, 69] = 4
    check_against_oracle(Wide(config), q, swa, ss, comp, cs, sink, shape["dim"] ** -0.5)


@interpreter
def test_swa_only_and_minus_inf_sink():
    """No compressed list (a ratio-0 layer), a −∞ sink (plain softmax), a query with one valid key."""
    q, swa, ss, _, _, sink = random_case(n=4, slots=40, seed=3, **TINY)
    sink[1] = float("-inf")
    ss[2, :] = -1
    ss[2, 0] = 7
    check_against_oracle(Wide(), q, swa, ss, None, None, sink, TINY["dim"] ** -0.5)


def check_fp16_pv(config, q, swa, ss, comp, cs, sink, scale):
    """`pv="fp16"`: BF16 output ≤ 1 BF16 ulp of the output scale from the oracle (the serving bound); fp32
    output ≤ 2⁻¹²·max|k| from the exact value (P rounded to FP16: 2⁻¹¹ relative a term, against the split's
    2⁻¹⁴ bound), also from FP16 q and rows (the same values here; compiled, the products may sum in
    another order)."""
    out = sap.prefill_sink_attention(q, swa, ss, comp, cs, sink, scale, config=config)
    keys, valid = gather_keys(swa, ss, comp, cs)
    assert_within_one_bf16_ulp(out, attend_with_sink(q.float(), keys, sink, valid))
    exact = exact_attention(q, keys, valid, sink, scale)
    half = (q.half(), swa.half(), ss, None if comp is None else comp.half(), cs)
    for inputs in ((q, swa, ss, comp, cs), half):
        out32 = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        sap.prefill_sink_attention(*inputs, sink, scale, out=out32, config=config)
        err = float((out32.double() - exact).abs().max())
        assert err <= 2.0 ** -12 * float(keys.abs().max()), inputs[0].dtype


FP16_PV = sap.PrefillAttentionConfig(block_h=16, num_warps=4, num_stages=2, pv="fp16")


@interpreter
@pytest.mark.parametrize("case", ["tiny", "flash_like", "sinks"])
def test_fp16_pv_within_the_serving_bound(case):
    """P·V in one FP16 product: a dominant sink (+30: every P below FP16's normal range were it folded
    first, hence added last), a −∞ sink, a query with one valid key and no SWA key."""
    shape = dict(tiny=TINY, flash_like=FLASH_SMALL, sinks=dict(heads=20, dim=32, window=70, topk=90))[case]
    q, swa, ss, comp, cs, sink = random_case(n=3, slots=300, seed=21, **shape)
    if case == "sinks":
        sink[0], sink[3] = 30.0, float("-inf")
        ss[1, :] = -1
        cs[1, :] = -1
        cs[1, 7] = 5
    check_fp16_pv(FP16_PV, q, swa, ss, comp, cs, sink, shape["dim"] ** -0.5)


def test_fp16_rows_need_the_fp16_mode():
    q, swa, ss, comp, cs, sink = random_case(n=2, slots=20, seed=4, **TINY)
    with pytest.raises(ValueError, match="float16|bfloat16"):
        sap.prefill_sink_attention(q.half(), swa.half(), ss, comp.half(), cs, sink, 0.1)
    with pytest.raises(ValueError, match="pv"):
        sap.PrefillAttentionConfig(block_h=16, num_warps=4, num_stages=2, pv="fp8")


@pytest.mark.parametrize("bad", [dict(layout="rows"), dict(layout="heads", num_splits=2),
                                 dict(layout="heads", pv="fp16"), dict(pv="split2"), dict(tile_keys=16),
                                 dict(layout="heads", tile_keys=8)])
def test_layout_rules(bad):
    """The heads layout takes one split and no FP16 P; `split2` (two products) and `tile_keys` (16 or 32) are
    the heads layout's only."""
    with pytest.raises(ValueError, match="layout|split|tile_keys"):
        sap.PrefillAttentionConfig(block_h=16, num_warps=4, num_stages=2, **bad)


@interpreter
def test_empty_batch_and_input_errors():
    q, swa, ss, comp, cs, sink = random_case(n=2, slots=20, seed=4, **TINY)
    assert sap.prefill_sink_attention(q[:0], swa, ss[:0], comp, cs[:0], sink, 0.1).shape == (0, 4, 96)
    with pytest.raises(ValueError, match="q must be"):
        sap.prefill_sink_attention(q.float(), swa, ss, comp, cs, sink, 0.1)
    with pytest.raises(ValueError, match="BF16 rows"):
        sap.prefill_sink_attention(q, swa, ss, object(), cs, sink, 0.1)


def test_plan_and_config_rules():
    """Every head of a query in one program up to 64, 8 warps, 2 stages; the decode plan splits the 10
    Flash key tiles over the multiprocessors without a second wave (132: a split a tile up to 13 queries,
    two from 44 to 66, one from 67);
    bad configs raise."""
    assert sap.plan(64, 512) == sap.PrefillAttentionConfig(block_h=64, num_warps=8, num_stages=2)
    assert sap.plan(4, 96).block_h == 16 and sap.plan(128, 512).block_h == 64
    splits = {n: sap.plan_decode(n, 64, 512, 128, 512, 132).num_splits for n in (1, 8, 13, 16, 64, 66, 67, 256)}
    assert splits == {1: 10, 8: 10, 13: 10, 16: 8, 64: 2, 66: 2, 67: 1, 256: 1}
    assert sap.plan_decode(8, 64, 512, 128, 512, 132).block_h == 64
    for bad in (dict(block_h=24), dict(num_stages=0), dict(num_warps=2), dict(num_splits=0), dict(num_splits=33)):
        with pytest.raises(ValueError):
            sap.PrefillAttentionConfig(**(dict(block_h=64, num_warps=8, num_stages=2) | bad))


# ---- the sm_90 build (no GPU: Triton's bundled ptxas) ------------------------------------------

#: spills of the planned Flash build (96 B of stack a thread with Triton 3.6 since the two key lists are one
#: loop; 616 B with a loop each, 1,168 B for `sparse_attention`'s kernel at 64 heads): a ceiling that shows a
#: regression
FLASH_STACK_CEILING = 128


@pytest.mark.skipif(INTERPRETED, reason="needs the compiled kernels")
@pytest.mark.parametrize("splits", [1, 10], ids=["prefill", "decode_splits"])
def test_hopper_build_of_the_flash_plan(splits):
    """The planned Flash launch (64 heads, D 512, 8 warps; one split, and the 10 of a small decode
    batch) builds for sm_90 with `wgmma` products, the key rows copied asynchronously (cp.async) into
    shared memory within Hopper's 227 KiB a block, and at most FLASH_STACK_CEILING bytes of spills."""
    k = sap._prefill_attn_kernel
    cfg = sap.plan(64, 512)
    consts = dict(BLOCK_H=cfg.block_h, BLOCK_P=256, BLOCK_N=sap.BLOCK_N, HAS_COMP=True, NUM_SPLITS=splits,
                  DOT_FP32=False, PV_MODE=cfg.PV_MODES[cfg.pv])
    pointers = {"q_ptr": "*bf16", "swa_ptr": "*bf16", "comp_ptr": "*bf16", "swa_slots_ptr": "*i32",
                "comp_slots_ptr": "*i32", "sink_ptr": "*fp32", "out_ptr": "*bf16",
                "part_acc_ptr": "*fp32" if splits > 1 else "*bf16", "part_ml_ptr": "*fp32" if splits > 1 else "*bf16"}
    signature = {n: "constexpr" if n in consts else pointers.get(n, "fp32" if n == "qk_scale_log2" else "i32")
                 for n in k.arg_names}
    # the launcher specialises 16-divisible integers and 16-byte aligned pointers (every Flash argument)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(k.arg_names)
             if signature[n] not in ("constexpr", "fp32") and n != "tiles_per_split"}
    compiled, usage = compile_for_sm90(k, signature, consts, {"num_warps": cfg.num_warps,
                                                              "num_stages": cfg.num_stages}, attrs)
    ptx = compiled.asm["ptx"]
    assert "wgmma.mma_async" in ptx and "cp.async" in ptx
    assert compiled.metadata.shared <= 227 * 1024
    assert int(re.search(r"STACK:(\d+)", usage).group(1)) <= FLASH_STACK_CEILING, usage


@pytest.mark.skipif(INTERPRETED, reason="needs the compiled kernels")
@pytest.mark.parametrize("pv,keys,stages", [("split", 32, 2), ("bf16", 64, 2), ("split", 16, 5)])
def test_hopper_build_of_the_heads_layout(pv, keys, stages):
    """The heads layout at the Flash shape (64 heads, D 512, 8 warps) builds for sm_90 with `wgmma`
    products and cp.async copies within 227 KiB, and — the reason for its duplicated rows — with no
    spills (P·V as two products spills ≈ 600 B a thread). At 16 keys and 5 stages the key loop's wait
    leaves copies in flight (the next tiles' gathers overlap this tile's products); at 2 stages none."""
    from sglang_dsv41.kernels import sparse_attention_prefill_heads as sah
    k = sah._prefill_attn_heads_kernel
    cfg = dataclasses.replace(sap.plan(64, 512), layout="heads", pv=pv, num_stages=stages)
    consts = dict(BLOCK_H=cfg.block_h, BLOCK_P=256, KEYS=keys, HAS_COMP=True, DOT_FP32=False,
                  PV_MODE=cfg.PV_MODES[pv])
    pointers = {"q_ptr": "*bf16", "swa_ptr": "*bf16", "comp_ptr": "*bf16", "swa_slots_ptr": "*i32",
                "comp_slots_ptr": "*i32", "sink_ptr": "*fp32", "out_ptr": "*bf16"}
    signature = {n: "constexpr" if n in consts else pointers.get(n, "fp32" if n == "qk_scale_log2" else "i32")
                 for n in k.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(k.arg_names)
             if signature[n] not in ("constexpr", "fp32")}
    compiled, usage = compile_for_sm90(k, signature, consts, {"num_warps": cfg.num_warps,
                                                              "num_stages": cfg.num_stages}, attrs)
    ptx = compiled.asm["ptx"]
    assert "wgmma.mma_async" in ptx and "cp.async" in ptx
    assert compiled.metadata.shared <= 227 * 1024
    assert no_spills(usage), usage
    loop = compiled.asm["ttgir"].split("scf.for", 1)[1]
    first_wait = int(re.search(r"ttg\.async_wait .*?\{num = (\d+)", loop).group(1))
    assert (first_wait > 0) == (stages >= 5), first_wait


# ---- GPU tests ------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("swa_dtype", [torch.int32, torch.int64], ids=["int32", "int64_windows"])
@pytest.mark.parametrize("n", [1, 2048])
def test_gpu_flash_shape_matches_oracle(n, swa_dtype):
    """Flash shape (D 512, H 64, W 128, K 512) under `plan`, the SWA windows int32 or — as the runtime
    passes them — int64 beside int32 rows: the oracle bounds; the fraction of outputs equal to
    `plan_prefill_config`'s launch of `sparse_sink_attention` is printed."""
    from sglang_dsv41.kernels import sparse_attention as sa
    args = list(random_case(n=n, slots=max(4096, 2 * n), seed=900 + n, heads=64, dim=512, window=128, topk=512,
                            hole_frac=0.1, device="cuda", slot_dtype=torch.int32))
    args[2][0, :100] = -1
    args[2] = args[2].to(swa_dtype)
    out, _ = check_against_oracle(Wide(), *args, 512 ** -0.5)
    same = sa.sparse_sink_attention(*args, 512 ** -0.5, config=sa.plan_prefill_config(n, 64, 512, 128, 512))
    print(f"wide vs plan_prefill_config at n = {n}: {float((out == same).float().mean()):.4%} of elements equal")


@pytest.mark.gpu
@pytest.mark.parametrize("over", [dict(), dict(pv="split2"), dict(tile_keys=16, num_stages=5),
                                  dict(tile_keys=16, num_stages=7)], ids=["split", "split2", "k16_s5", "k16_s7"])
def test_gpu_flash_shape_heads_layout_matches_oracle(over):
    """The heads layout under `plan` at the Flash shape, 2,048 queries, SWA holes and a query with no SWA
    key: the oracle bounds; the fraction of outputs equal to the keys layout's is printed."""
    args = list(random_case(n=2048, slots=4096, seed=930, heads=64, dim=512, window=128, topk=512, hole_frac=0.1,
                            device="cuda", slot_dtype=torch.int32))
    args[2][0, :] = -1
    args[2] = args[2].long()              # the runtime's int64 windows beside int32 workspace rows
    out, _ = check_against_oracle(Wide(dataclasses.replace(sap.plan(64, 512), layout="heads", **over)), *args,
                                  512 ** -0.5)
    keys = sap.prefill_sink_attention(*args, 512 ** -0.5)
    print(f"heads ({over}) vs keys layout: {float((out == keys).float().mean()):.4%} of elements equal")


@pytest.mark.gpu
@pytest.mark.parametrize("config", HEADS, ids=["heads", "heads_split2", "heads_k16_s5"])
def test_gpu_tiny_shape_heads_layout_matches_oracle(config):
    q, swa, ss, comp, cs, sink = random_case(n=37, slots=200, seed=202, device="cuda", **TINY)
    check_against_oracle(Wide(config), q, swa, ss, comp, cs, sink, TINY["dim"] ** -0.5)


@pytest.mark.gpu
def test_gpu_flash_shape_fp16_pv_within_the_serving_bound():
    """`pv="fp16"` under `plan` at the Flash shape, 512 queries: `check_fp16_pv`'s bounds."""
    args = random_case(n=512, slots=4096, seed=907, heads=64, dim=512, window=128, topk=512, hole_frac=0.1,
                       device="cuda", slot_dtype=torch.int32)
    check_fp16_pv(dataclasses.replace(sap.plan(64, 512), pv="fp16"), *args, 512 ** -0.5)


@pytest.mark.gpu
@pytest.mark.parametrize("config", SMALL, ids=["h16_w4", "h32_w8_s3"])
def test_gpu_tiny_shape_matches_oracle(config):
    q, swa, ss, comp, cs, sink = random_case(n=37, slots=200, seed=201, device="cuda", **TINY)
    check_against_oracle(Wide(config), q, swa, ss, comp, cs, sink, TINY["dim"] ** -0.5)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 8, 64])
def test_gpu_flash_decode_splits_match_oracle(n):
    """Flash decode shapes under `plan_decode` (10 / 10 / 2 key splits on 132 multiprocessors; what the
    device has), SWA holes and a query whose SWA list is empty: the oracle bounds after the merge."""
    from sglang_dsv41.kernels import sparse_attention as sa
    args = list(random_case(n=n, slots=4096, seed=950 + n, heads=64, dim=512, window=128, topk=512,
                            hole_frac=0.05, device="cuda", slot_dtype=torch.int32))
    args[2][0, :] = -1
    args[2] = args[2].long()              # the runtime's int64 windows beside int32 gathered rows
    cfg = sap.plan_decode(n, 64, 512, 128, 512, sa.device_sm_count(torch.device("cuda")))
    assert cfg.num_splits > 1
    check_against_oracle(Wide(cfg), *args, 512 ** -0.5)

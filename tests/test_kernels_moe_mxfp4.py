"""MXFP4 routed experts on Hopper (`sglang_dsv41.kernels.moe_mxfp4`, spec §2.3, §3.6, §3.8).

CPU: the load-time conversion is checked exhaustively (every E2M1 code in both nibbles, every
finite UE8M0 byte, padding, gate/up interleave) by decoding the swizzled tensors back and
comparing with `codecs.dequantize_mxfp4`; the routing plan against its definition (and the fused
one-launch order of decode sizes equal to the stable sort, in a TRITON_INTERPRET child); the Triton
device code we own (BF16 rounding, the SwiGLU epilogue, the weighted combine) under Triton's
interpreter, bit for bit against the reference formulas.
GPU (`gpu` marker, Hopper): `routed_experts_mxfp4` against `reference.moe.routed_expert` and the
reference's finalize, tiny and Flash shapes. Bound (both GEMMs accumulate in fp32, the reference
in fp64): per element |Δ| ≤ ulp(ref) + 1.5·Σ_j w_j·ulp(E_j) (`mx.routed_error_bound`, derivation
there) and at most 2 % of the outputs (at least 2) differ. The former bound, max |Δ| ≤ 2⁻⁶·RMS(row),
was mis-derived: one flip of the final BF16 rounding at |ref| ∈ [16, 32) is 0.125/RMS ≈ 0.0164 at
the Flash shape (H200: 0.0163, 0.0167). CPU: an emulation of the kernel's numerics with truncating
fp32 chunk accumulation (Hopper-like) checks that the bound holds and that the old one does not.
"""
from __future__ import annotations

import importlib.util
import inspect
import math
import os
import sys
from types import SimpleNamespace

import pytest
import torch
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from sglang_dsv41.checkpoint.codecs import E2M1_VALUES, dequantize_mxfp4
from sglang_dsv41.kernels import moe_mxfp4 as mx
from sglang_dsv41.numerics.rounding import slot_sum_fp32
from sglang_dsv41.reference.moe import clamped_swiglu, routed_expert
from sglang_dsv41.reference.ops import bf16

LIMIT, SCALE = 10.0, 1.5


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def random_experts(E: int, H: int, I: int, seed: int, *, exp1: int | None = None, exp2: int | None = None,
                   scale_bytes: tuple[int, int] | None = None) -> dict[str, torch.Tensor]:
    """Stacked packed experts. Scale bytes: uniform in `scale_bytes`, or around 2^exp so that
    g/u have a standard deviation near 5 (clamp exercised) and expert outputs stay O(1)."""
    g = torch.Generator().manual_seed(seed)
    rms_code = math.sqrt(sum(v * v for v in E2M1_VALUES) / 16)
    e1 = exp1 if exp1 is not None else round(math.log2(5.0 / (math.sqrt(H) * rms_code)))
    e2 = exp2 if exp2 is not None else round(math.log2(1.0 / (math.sqrt(I) * rms_code * 4.0)))

    def sc(shape, e):
        if scale_bytes is not None:
            return torch.randint(scale_bytes[0], scale_bytes[1] + 1, shape, generator=g, dtype=torch.uint8)
        return (127 + e + torch.randint(-1, 2, shape, generator=g)).to(torch.uint8)

    byte = lambda *s: torch.randint(0, 256, s, generator=g, dtype=torch.uint8)
    return {"w1": byte(E, I, H // 2), "w1_scale": sc((E, I, H // 32), e1),
            "w3": byte(E, I, H // 2), "w3_scale": sc((E, I, H // 32), e1),
            "w2": byte(E, H, I // 2), "w2_scale": sc((E, H, I // 32), e2)}


def prepare(raw: dict[str, torch.Tensor], device=None) -> mx.PreparedMxfp4Experts:
    return mx.prepare_mxfp4_stacked(raw["w1"], raw["w1_scale"], raw["w3"], raw["w3_scale"],
                                    raw["w2"], raw["w2_scale"], device=device)


def assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


# ---------------------------------------------------------------------------------------------
# load-time conversion (CPU, exhaustive)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("E,H,I", [(3, 64, 32), (2, 256, 128), (2, 288, 96), (1, 512, 384)])
def test_prepared_layout_decodes_to_the_checkpoint_values(E: int, H: int, I: int) -> None:
    raw = random_experts(E, H, I, seed=E * H + I, scale_bytes=(1, 254))
    for name in ("w1_scale", "w3_scale", "w2_scale"):    # every finite UE8M0 byte at least once
        flat = raw[name].view(-1)
        flat[: min(254, flat.numel())] = torch.arange(1, 255, dtype=torch.uint8)[: flat.numel()]
    for name in ("w1", "w3", "w2"):                      # every code in the low and the high nibble
        raw[name].view(-1)[:16] = torch.arange(16, dtype=torch.uint8) * 17
    p = prepare(raw)
    Hp, Ip = p.hidden_padded, p.intermediate_padded
    assert (p.hidden, p.intermediate, p.n_experts) == (H, I, E)
    assert Hp % mx.HIDDEN_ALIGN == 0 and Ip % mx.INTERMEDIATE_ALIGN == 0 and Hp - H < 256 and Ip - I < 128
    assert p.w13.shape == [E, Hp, 2 * Ip] and p.w2.shape == [E, Ip, Hp]
    dense = mx.dequantize_prepared(p)
    for e in range(E):
        assert_same(dense["w1"][e], dequantize_mxfp4(raw["w1"][e], raw["w1_scale"][e]))
        assert_same(dense["w3"][e], dequantize_mxfp4(raw["w3"][e], raw["w3_scale"][e]))
        assert_same(dense["w2"][e], dequantize_mxfp4(raw["w2"][e], raw["w2_scale"][e]))
    padded = mx.dequantize_prepared(p, crop=False)
    assert padded["w1"].shape == (E, Ip, Hp) and padded["w2"].shape == (E, Hp, Ip)
    for name in ("w1", "w3", "w2"):
        t = padded[name].clone()
        rows, cols = (I, H) if name != "w2" else (H, I)
        t[:, :rows, :cols] = 0
        assert not t.any(), f"{name}: padding is not zero"


def test_scale_byte_zero_is_decoded_as_zero() -> None:
    """Documented deviation: the kernel builds the scale as the BF16 with bits byte<<7, so byte 0
    gives 0, not 2^−127 (|values| ≤ 6·2^−127: no visible effect on any output)."""
    raw = random_experts(1, 256, 128, seed=5, scale_bytes=(120, 130))
    raw["w1_scale"][0, 3, 2] = 0
    dense = mx.dequantize_prepared(prepare(raw))["w1"][0]
    exact = dequantize_mxfp4(raw["w1"][0], raw["w1_scale"][0])
    group = slice(64, 96)
    assert not dense[3, group].any()
    assert exact[3, group].abs().max() <= 6 * 2.0 ** -127
    exact[3, group] = 0
    assert_same(dense, exact)


def test_prepare_rejects_bad_input() -> None:
    raw = random_experts(2, 256, 128, seed=1)
    bad = dict(raw, w2_scale=raw["w2_scale"].clone())
    bad["w2_scale"][1, 7, 0] = 255
    with pytest.raises(ValueError, match="255"):
        prepare(bad)
    with pytest.raises(ValueError, match="w3"):
        prepare(dict(raw, w3=raw["w3"][:, :-1]))
    with pytest.raises(ValueError, match="multiples of 32"):
        prepare(random_experts(1, 80, 32, seed=2))


def test_prepare_from_checkpoint_names(tiny_checkpoint) -> None:
    """The synthetic tiny checkpoint's stored experts (U8 values, F8_E8M0 scales), a subset in a
    chosen order; dense values equal the codec's decode of the same stored tensors."""
    from sglang_dsv41.checkpoint.reader import CheckpointReader

    with CheckpointReader(tiny_checkpoint) as reader:
        names = [n for n in reader.names() if n.startswith("layers.1.ffn.experts.")]
        stored = {n: reader.get(n) for n in names}
    n_experts = len(names) // 6
    order = [n_experts - 1, 0, 2]
    p = mx.prepare_mxfp4_experts(stored, "layers.1.", n_experts, experts=order)
    dense = mx.dequantize_prepared(p)
    for i, e in enumerate(order):
        for w in ("w1", "w2", "w3"):
            pre = f"layers.1.ffn.experts.{e}.{w}"
            assert_same(dense[w][i], dequantize_mxfp4(stored[pre + ".weight"], stored[pre + ".scale"]))
    with pytest.raises(KeyError, match="experts.0.w2.scale"):
        mx.prepare_mxfp4_experts({k: v for k, v in stored.items() if k != "layers.1.ffn.experts.0.w2.scale"},
                                 "layers.1.", n_experts)
    with pytest.raises(ValueError, match="subset"):
        mx.prepare_mxfp4_experts(stored, "layers.1.", n_experts, experts=[n_experts])


# ---------------------------------------------------------------------------------------------
# routing plan (CPU)
# ---------------------------------------------------------------------------------------------
def test_routing_plan_groups_slots_by_expert() -> None:
    g = torch.Generator().manual_seed(3)
    T, k, E = 37, 4, 9
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    ids[5] = torch.tensor([0, 1, 2, 3])
    ids[6] = torch.tensor([0, 1, 2, 3])
    plan = mx.make_routing_plan(ids, E)
    flat = ids.reshape(-1)
    slots = plan.sorted_slots.long()
    assert sorted(slots.tolist()) == list(range(T * k))
    assert torch.equal(plan.slot_rows.long()[slots], torch.arange(T * k))
    expected = sorted(range(T * k), key=lambda s: (int(flat[s]), s))     # stable grouping
    assert slots.tolist() == expected
    assert torch.equal(plan.expert_counts, torch.bincount(flat, minlength=E).int())
    offs = plan.ragged.slice_offs.long()
    assert torch.equal(offs, torch.cat([torch.zeros(1, dtype=torch.long), plan.expert_counts.long().cumsum(0)]))
    for e in range(E):
        assert (flat[slots[offs[e]:offs[e + 1]]] == e).all()
    rd, gi = plan.routing_data(), plan.gather()
    assert (rd.n_expts_tot, rd.n_expts_act) == (E, k) and gi.src_indx is plan.sorted_slots
    with pytest.raises(RuntimeError, match="topk_ids outside"):
        mx.make_routing_plan(torch.tensor([[0, E]]), E)
    unchecked = mx.make_routing_plan(ids, E, check_ids=False)          # the runtime's call: same plan
    assert torch.equal(unchecked.sorted_slots, plan.sorted_slots) and torch.equal(unchecked.slot_rows, plan.slot_rows)
    with pytest.raises(ValueError, match="integer"):
        mx.make_routing_plan(ids.float(), E)


@pytest.mark.parametrize("check_ids", [True, False])
def test_expert_outputs_pass_check_ids_to_the_routing_plan(check_ids: bool, monkeypatch) -> None:
    """`routed_expert_outputs(check_ids=False)` (the runtime's call: router ids are in range) builds its
    plan without the device-side range assertion (one launch fewer per MoE layer); the default checks."""
    seen = []

    class Planned(Exception):
        pass

    def plan(*args, **kwargs):
        seen.append(kwargs.get("check_ids", True))
        raise Planned

    experts = SimpleNamespace(n_experts=4)
    monkeypatch.setattr(mx, "_check_call", lambda *a: None)
    monkeypatch.setattr(mx, "make_routing_plan", plan)
    with pytest.raises(Planned):
        mx.routed_expert_outputs(torch.zeros(1, 64, dtype=torch.bfloat16), torch.zeros(1, 2, dtype=torch.int64),
                                 experts, swiglu_limit=10.0, check_ids=check_ids)
    with pytest.raises(Planned):
        mx.routed_experts_mxfp4(torch.zeros(1, 64, dtype=torch.bfloat16), torch.zeros(1, 2, dtype=torch.int64),
                                torch.ones(1, 2), experts, swiglu_limit=10.0, routed_scale=1.0, check_ids=check_ids)
    assert seen == [check_ids, check_ids]


def test_decode_flags_parse_and_scope_restores_the_constraints() -> None:
    from triton_kernels.matmul_ogs_details import opt_flags
    assert mx.parse_decode_flags(" block_k=256, num_stages=4 ") == {"block_k": 256, "num_stages": 4}
    assert mx.parse_decode_flags("") == {}
    assert mx.parse_decode_flags("split_k=2,block_k=256") == {"split_k": 2, "block_k": 256}
    for bad in ("is_persistent=1", "block_k=0", "block_k=x", "block_n=128", "split_k=9"):
        with pytest.raises(ValueError, match="SGLANG_DSV41_MOE_DECODE_FLAGS"):
            mx.parse_decode_flags(bad)
    seen = []
    with pytest.raises(RuntimeError, match="inside"):
        mx.with_decode_flags({"block_k": 64}, lambda: seen.append(dict(opt_flags._opt_flags_constraints))
                             or (_ for _ in ()).throw(RuntimeError("inside")))
    assert seen == [{"block_k": 64}] and opt_flags._opt_flags_constraints == {}


def _opt_flag_arguments(can_use_split_k: bool) -> dict:
    """Arguments of `triton_kernels.matmul_ogs.make_opt_flags` for a call that reaches its split-K check."""
    from triton_kernels import matmul_ogs as ogs

    args = dict.fromkeys(inspect.signature(ogs.make_opt_flags).parameters)
    args.update(precision_config=SimpleNamespace(enforce_bitwise_invariance=False), can_use_persistent_tma=False,
                can_use_split_k=can_use_split_k)
    return args


def test_split_k_flag_lifts_the_mx_refusal_for_the_scoped_call_only(monkeypatch) -> None:
    """triton_kernels refuses a split-K constraint when `matmul_ogs` says can_use_split_k=False (MX weights);
    inside `decode_flags_scope` with split_k > 1 its `make_opt_flags` is asked with True, and the module's
    function is restored afterwards (also after an error). Fails when the target moves."""
    from triton_kernels import matmul_ogs as ogs
    from triton_kernels.matmul_ogs_details import opt_flags
    from sglang_dsv41.kernels import moe_mxfp4_flags as flags

    assert "can_use_split_k = " in inspect.getsource(ogs.matmul_ogs) and "make_opt_flags(" in inspect.getsource(
        ogs.matmul_ogs)                                          # the refusal and the call the scope redirects
    opt_flags.update_opt_flags_constraints({"split_k": 2})
    try:
        with pytest.raises(opt_flags.InapplicableConstraint, match="split_k"):
            ogs.make_opt_flags(**_opt_flag_arguments(can_use_split_k=False))
    finally:
        opt_flags.reset_opt_flags_constraints()
    asked = []
    real = ogs.make_opt_flags

    def recorder(*args, can_use_split_k, **kwargs):
        asked.append((can_use_split_k, dict(opt_flags._opt_flags_constraints)))

    monkeypatch.setattr(ogs, "make_opt_flags", recorder)
    for scoped, want in (({"split_k": 2}, True), ({"block_k": 256}, False), ({"split_k": 1}, False)):
        with mx.decode_flags_scope(scoped):
            ogs.make_opt_flags(**_opt_flag_arguments(can_use_split_k=False))
        assert asked.pop() == (want, scoped) and ogs.make_opt_flags is recorder
    with pytest.raises(RuntimeError, match="inside"):
        mx.with_decode_flags({"split_k": 4}, lambda: (_ for _ in ()).throw(RuntimeError("inside")))
    assert ogs.make_opt_flags is recorder and opt_flags._opt_flags_constraints == {}
    monkeypatch.setattr(ogs, "make_opt_flags", lambda x: x)                 # the parameter is gone: loud
    with pytest.raises(RuntimeError, match="can_use_split_k"):
        with flags.mx_split_k_allowed():
            pass
    assert real is not recorder


def test_prefill_flags_apply_above_the_decode_tokens(monkeypatch) -> None:
    """SGLANG_DSV41_MOE_PREFILL_FLAGS: the constraints of calls of more than DECODE_FLAG_MAX_TOKENS
    tokens (decode's flags up to there); a bad value raises naming the prefill variable."""
    monkeypatch.setenv(mx.PREFILL_FLAGS_ENV, "block_m=64,num_stages=3")
    monkeypatch.setenv(mx.DECODE_FLAGS_ENV, "block_k=256")
    mx.prefill_flags.cache_clear()
    mx.decode_flags.cache_clear()
    try:
        assert mx.launch_flags(mx.DECODE_FLAG_MAX_TOKENS) == {"block_k": 256}
        assert mx.launch_flags(mx.DECODE_FLAG_MAX_TOKENS + 1) == {"block_m": 64, "num_stages": 3}
        monkeypatch.setenv(mx.PREFILL_FLAGS_ENV, "block_m=big")
        mx.prefill_flags.cache_clear()
        with pytest.raises(ValueError, match=mx.PREFILL_FLAGS_ENV):
            mx.launch_flags(8192)
    finally:
        monkeypatch.delenv(mx.PREFILL_FLAGS_ENV)
        monkeypatch.delenv(mx.DECODE_FLAGS_ENV)
        mx.prefill_flags.cache_clear()
        mx.decode_flags.cache_clear()
    assert mx.launch_flags(8192) == {} == mx.launch_flags(1)


def test_gemm1_kernel_name_says_matmul_ogs() -> None:
    """triton_kernels names GEMM1 `<matmul_ogs repr>_<the fused activation's repr>`: ours is a plain
    name (Triton's default, the dotted full name, left only `clamped_swiglu_tile` in profiles)."""
    import collections

    from triton_kernels.matmul_ogs import specializations
    kernel = specializations.get(activation=mx.clamped_swiglu_activation(10.0).specs)._matmul_ogs
    proxy = collections.namedtuple("P", ["constants", "signature"])(
        dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, SPLIT_K=1, stride_y_n=1, stride_x_k=1),
        dict({n: "i32" for n in kernel.arg_names}, Y="*bf16", X="*bf16", W="*u8"))
    name = kernel.repr(proxy)
    assert name.startswith("_matmul_ogs") and name.endswith("_128x256x128x1_" + mx.GEMM1_ACTIVATION_NAME), name
    assert "." not in name


def test_routed_call_checks_device_and_shapes() -> None:
    p = prepare(random_experts(2, 256, 128, seed=4))
    x = torch.zeros(3, 256, dtype=torch.bfloat16)
    ids, w = torch.zeros(3, 2, dtype=torch.long), torch.full((3, 2), 0.5)
    with pytest.raises(ValueError, match="bf16"):
        mx.routed_experts_mxfp4(x.float(), ids, w, p, swiglu_limit=LIMIT, routed_scale=SCALE)
    with pytest.raises(RuntimeError, match="Hopper"):
        mx.routed_experts_mxfp4(x, ids, w, p, swiglu_limit=LIMIT, routed_scale=SCALE)
    with pytest.raises(ValueError, match="fp32"):
        mx.clamped_swiglu_activation(0.1)


# ---------------------------------------------------------------------------------------------
# Triton device code under the interpreter (CPU)
# ---------------------------------------------------------------------------------------------
INTERPRETED = isinstance(mx._combine_kernel, InterpretedFunction)   # this file's child run (TRITON_INTERPRET=1)


def _plan_parts(plan) -> tuple:
    return (plan.sorted_slots, plan.slot_rows, plan.expert_counts, plan.ragged.slice_offs,
            plan.ragged.block_offs_data, plan.ragged.block_schedule_data)


if INTERPRETED:      # kernels with reductions need the interpreter from the start: a child pytest

    @pytest.mark.parametrize("T,k,E,absent", [(1, 6, 384, False), (16, 6, 384, False), (16, 6, 384, True),
                                              (37, 4, 9, True), (85, 6, 12, False), (128, 4, 3, True)])
    def test_kernel_case_fused_routing_order_equals_the_stable_sort(T: int, k: int, E: int, absent: bool) -> None:
        """`_routing_order_kernel` (one launch, decode sizes) gives the stable sort's plan exactly: the
        same permutation, rows, counts and tile schedule — with repeated experts, absent (−1) slots,
        int64 and int32 ids, up to FUSED_ORDER_MAX_SLOTS slots (T·k = 512 at 128 × 4)."""
        g = torch.Generator().manual_seed(T * k + E)
        ids = torch.randint(-1 if absent else 0, E, (T, k), generator=g)
        ids[0] = ids[0, 0]                                   # one token with k copies of one expert: ties
        for dtype in (torch.int64, torch.int32):
            want = mx.make_routing_plan(ids.to(dtype), E, allow_absent=absent, fused=False)
            got = mx.make_routing_plan(ids.to(dtype), E, allow_absent=absent, fused=True)
            for a, b in zip(_plan_parts(got), _plan_parts(want)):
                assert a.dtype == b.dtype and torch.equal(a, b)
        key = ids.view(-1) % (E + 1)                         # −1 → E: after every expert
        assert got.sorted_slots.tolist() == sorted(range(T * k), key=lambda s: (int(key[s]), s))

    def test_kernel_case_fused_routing_order_checks_ids() -> None:
        """The fused order flags ids out of range (as the torch path does) and refuses too many slots."""
        for ids, absent in (([[0, 9]], False), ([[-1, 2]], False), ([[-2, 2]], True), ([[2**32 + 3, 2]], False)):
            with pytest.raises(RuntimeError, match="topk_ids outside"):
                mx.make_routing_plan(torch.tensor(ids), 9, allow_absent=absent, fused=True)
        with pytest.raises(ValueError, match="fused routing order takes"):
            mx.make_routing_plan(torch.zeros(129, 4, dtype=torch.long), 9, fused=True)
else:

    def test_kernel_cases_in_triton_interpreter() -> None:
        """Run this file's kernel cases in a child pytest with TRITON_INTERPRET=1 (CPU)."""
        from triton_checks import run_kernel_cases_in_interpreter
        run_kernel_cases_in_interpreter(__file__, min_passed=7, exact=True)

    @pytest.mark.parametrize("sp,warps,absent", [(16, 4, False), (128, 4, False), (512, 8, True)])
    def test_fused_routing_order_compiles_for_sm90_without_spills(sp: int, warps: int, absent: bool) -> None:
        from triton_checks import compile_for_sm90, no_spills
        from sglang_dsv41.kernels import moe_routing_plan as rp
        kern = rp._routing_order_kernel
        first_log2, sizes = rp._block_sizes_log2()
        consts = dict(ALLOW_ABSENT=absent, SP=sp, CHUNK=32, BINS=32, PAD=rp._FUSED_ORDER_PAD_KEY, EP=512, SIZES=sizes,
                      FIRST_LOG2=first_log2)
        sig = {n: "constexpr" if n in consts else "i32" for n in kern.arg_names}
        sig.update(Ids="*i64", Order="*i32", Rows="*i32", Counts="*i32", Valid="*i1", Offs="*i32", Schedule="*i32")
        _, usage = compile_for_sm90(kern, sig, consts, {"num_warps": warps})
        assert no_spills(usage), usage

    def test_routing_plan_is_the_torch_order_off_cuda() -> None:
        """Off CUDA (and above FUSED_ORDER_MAX_SLOTS) the plan is torch's stable sort; `fused` needs
        the kernel (CUDA or the interpreter)."""
        assert mx.make_routing_plan(torch.zeros(2, 2, dtype=torch.long), 3).sorted_slots.tolist() == [0, 1, 2, 3]

@pytest.fixture(scope="module")
def interpreted():
    """A second copy of the module whose @triton.jit functions are Triton-interpreter functions
    (TRITON_INTERPRET is read when a function is decorated). The canonical module is untouched."""
    import sglang_dsv41.kernels as pkg
    from sglang_dsv41.kernels import double_fp32
    name = "sglang_dsv41.kernels._moe_mxfp4_interpreted"
    df_name = "sglang_dsv41.kernels.double_fp32"
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        df_spec = importlib.util.spec_from_file_location(df_name, double_fp32.__file__)
        df_mod = importlib.util.module_from_spec(df_spec)
        df_spec.loader.exec_module(df_mod)                  # interpreted device functions for the copy
        sys.modules[df_name], pkg.double_fp32 = df_mod, df_mod
        spec = importlib.util.spec_from_file_location(name, mx.__file__)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        assert isinstance(mod._combine_kernel, InterpretedFunction)
        sys.modules[df_name], pkg.double_fp32 = double_fp32, double_fp32
        yield mod
    finally:
        sys.modules[df_name], pkg.double_fp32 = double_fp32, double_fp32
        sys.modules.pop(name, None)
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old


_DEVICE_FN = {}  # the interpreted module's device functions, for the probe kernels below


def _round_probe(X, O, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(O + i, _DEVICE_FN["round"](tl.load(X + i)))


def _swiglu_probe(A, O, limit, M: tl.constexpr, N2: tl.constexpr):
    r = tl.arange(0, M)[:, None]
    acc = tl.load(A + r * N2 + tl.arange(0, N2)[None, :])
    tl.store(O + r * (N2 // 2) + tl.arange(0, N2 // 2)[None, :], _DEVICE_FN["swiglu"](acc, limit))


def test_round_to_bf16_is_round_to_nearest_even(interpreted) -> None:
    _DEVICE_FN["round"] = interpreted.round_to_bf16
    g = torch.Generator().manual_seed(6)
    bits = torch.randint(-2**31, 2**31 - 1, (8192,), generator=g, dtype=torch.int64).to(torch.int32)
    bits[:4096] = (bits[:4096] & ~0xFFFF) | 0x8000            # exact ties
    bits[4096:4200] = (bits[4096:4200] & ~0xFFFF) | 0x7FFF    # just below a tie
    x = bits.view(torch.float32).clone()
    x[-6:] = torch.tensor([float("inf"), -float("inf"), 3.4028235e38, -3.4028235e38, 1e-40, float("nan")])
    out = torch.empty_like(x)
    InterpretedFunction(_round_probe)[(1,)](x, out, N=x.numel())
    want = x.to(torch.bfloat16).float()
    nan = want.isnan()
    assert torch.equal(out.isnan(), nan)
    assert torch.equal(out[~nan].view(torch.int32), want[~nan].view(torch.int32))


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # exp(1e6): silu → −0
def test_clamped_swiglu_epilogue_matches_reference(interpreted) -> None:
    _DEVICE_FN["swiglu"] = interpreted.clamped_swiglu_tile
    g = torch.Generator().manual_seed(7)
    M, n = 32, 128
    acc = torch.randn(M, 2 * n, generator=g) * 6
    ties = (torch.randn(64, generator=g) * 4).to(torch.bfloat16).float().view(torch.int32) + 0x8000
    acc.view(-1)[:64] = ties.view(torch.float32)                      # g and u exactly between BF16s
    acc[1, 0:8] = torch.tensor([10.0, 10.03, 9.99, 1e6, -1e6, -10.04, -120.0, 0.0])  # gates at/over L
    acc[2, 1:16:2] = torch.tensor([10.0, 10.03, -10.0, -10.03, 1e6, -1e6, 0.0, -0.0])  # ups at/over ±L
    acc[3, 0], acc[3, 3] = float("nan"), float("nan")
    out = torch.empty(M, n)
    InterpretedFunction(_swiglu_probe)[(1,)](acc, out, LIMIT, M=M, N2=2 * n)
    ref = clamped_swiglu(acc[:, 0::2], acc[:, 1::2], LIMIT)
    assert torch.equal(out.isnan(), ref.isnan()) and out.isnan().sum() == 2
    fin = ~ref.isnan()
    assert_same(out, bf16(out))                                          # h is BF16-valued
    diff = out[fin] != ref[fin]
    # fp32 silu·u vs the reference's fp64: may land on the other side of a BF16 rounding boundary
    assert diff.float().mean() <= 0.005
    ulp = torch.ldexp(torch.ones_like(ref[fin]), torch.frexp(ref[fin].abs())[1] - 8)
    assert ((out[fin] - ref[fin]).abs() <= ulp).all()


@pytest.mark.parametrize("T,k,H", [(1, 6, 64), (5, 3, 1100), (9, 2, 2048)])
def test_combine_is_the_reference_finalize(interpreted, T: int, k: int, H: int) -> None:
    g = torch.Generator().manual_seed(T * 100 + k)
    E = 11
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    plan = mx.make_routing_plan(ids, E)
    y_rows = (torch.randn(T * k, H + 64, generator=g) * 4).to(torch.bfloat16)   # padded columns ignored
    w = torch.rand(T, k, generator=g)
    w = (w / w.sum(-1, keepdim=True)).float()
    out = interpreted.combine_routed(y_rows, plan, w, SCALE, H)
    per_slot = y_rows.double()[plan.slot_rows.long()].view(T, k, -1)[..., :H]
    # the kernel's definition bf16(fp32(s·R)), R the fp32 slot-order sum (the runtime passes
    # w' = fp32(w·s) and s = 1: reference.moe.moe_sublayer's finalize), fed the same per-slot outputs
    want = bf16(slot_sum_fp32(w, per_slot) * SCALE).to(torch.bfloat16)
    assert out.dtype == torch.bfloat16 and torch.equal(out, want)
    with pytest.raises(ValueError, match="fp32"):
        interpreted.combine_routed(y_rows, plan, w.double(), SCALE, H)
    with pytest.raises(ValueError, match="routed_scale"):
        interpreted.combine_routed(y_rows, plan, w, 0.1, H)
    # with the shared expert's output: the MoE finalize bf16(S + bf16(R)) in the same launch, as fp32
    shared = bf16(torch.randn(T, H, generator=g) * 3)
    shared[0, :4] = torch.tensor([float("inf"), -0.0, 3.3895314e38, float("nan")])
    both = interpreted.combine_routed(y_rows, plan, w, SCALE, H, shared=shared)
    want = bf16(shared + out.float())
    assert both.dtype == torch.float32 and torch.equal(both.isnan(), want.isnan())
    assert torch.equal(both.nan_to_num(), want.nan_to_num())
    with pytest.raises(ValueError, match="shared must be"):
        interpreted.combine_routed(y_rows, plan, w, SCALE, H, shared=shared[:, :-1])


# ---------------------------------------------------------------------------------------------
# GPU (Hopper): the full routed call against reference.moe
# ---------------------------------------------------------------------------------------------
def dequantized_expert(raw: dict[str, torch.Tensor], e: int) -> dict[str, torch.Tensor]:
    """{w1, w2, w3} of expert e, codec-dequantised (fp32, CPU)."""
    return {n: dequantize_mxfp4(raw[n][e], raw[n + "_scale"][e]) for n in ("w1", "w2", "w3")}


def reference_routed(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, raw: dict[str, torch.Tensor],
                     deq_of: dict[int, dict[str, torch.Tensor]] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """reference.moe: routed_expert per (token, slot) with codec-dequantised weights (`deq_of[e]`
    when given, else dequantised here), then the sublayer's finalize bf16(R), R = the fp32
    slot-order sum of fp32(1.5·w_k)·E_k — on x's device. Returns (output [T, H],
    per-slot expert outputs [T, k, H] fp64)."""
    T, k = ids.shape
    dev = x.device
    per_slot = torch.zeros(T, k, x.shape[1], dtype=torch.float64, device=dev)
    for e in torch.unique(ids).tolist():
        rows, slot = torch.nonzero(ids == e, as_tuple=True)
        deq = {n: v.to(dev) for n, v in (deq_of[e] if deq_of is not None else dequantized_expert(raw, e)).items()}
        per_slot[rows, slot] = routed_expert(x[rows].float(), deq["w1"], deq["w2"], deq["w3"], LIMIT).double()
    return bf16(slot_sum_fp32(w * SCALE, per_slot)), per_slot


def assert_within_bound(out: torch.Tensor, ref: torch.Tensor, per_slot: torch.Tensor, w: torch.Tensor) -> None:
    """|out − ref| ≤ ulp(ref) + 1.5·Σ_j w_j·ulp(E_j) everywhere (one flip of each per-slot BF16
    expert output plus one of the final rounding; `mx.routed_error_bound`), ≤ 2 % differ."""
    o, r = out.float(), ref.float()
    assert torch.isfinite(o).all()
    bound = mx.routed_error_bound(r, per_slot, w, SCALE)
    ratio = ((o - r).abs() / bound).max().item()
    rms = r.pow(2).mean(dim=-1, keepdim=True).sqrt().clamp(min=1e-30)
    n_diff = int((o != r).sum())
    assert ratio <= 1.0, f"max |Δ|/bound = {ratio:.4g} (max |Δ|/RMS(row) = {((o - r).abs() / rms).max().item():.4g})"
    assert n_diff <= max(2, int(mx.ROUTED_DIFF_FRACTION_BOUND * r.numel())), f"{n_diff} of {r.numel()} outputs differ"


def _routing(T: int, k: int, E: int, seed: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=g) + 0.05
    return ids.to(device), (w / w.sum(-1, keepdim=True)).float().to(device)


def _truncating_fp32_matmul(a: torch.Tensor, weight: torch.Tensor, chunk: int = 16) -> torch.Tensor:
    """a·weightᵀ the way a Hopper BF16 MMA accumulates (a model): each `chunk`-product partial
    sum exact, added to an fp32 accumulator and truncated toward zero (not rounded to nearest)."""
    acc = torch.zeros(a.shape[0], weight.shape[0], dtype=torch.float64)
    K = a.shape[1]
    pad = -K % chunk                                   # zero columns add nothing
    a64 = torch.nn.functional.pad(a.double(), (0, pad)).view(a.shape[0], -1, chunk)
    w64 = torch.nn.functional.pad(weight.double(), (0, pad)).view(weight.shape[0], -1, chunk)
    partials = torch.einsum("rck,nck->crn", a64, w64)  # every chunk's exact partial sum, one product
    for c in range(partials.shape[0]):
        exact = acc + partials[c]
        f = exact.float()
        acc = (f.view(torch.int32) - (f.double().abs() > exact.abs()).int()).view(torch.float32).double()
    return acc.float()


def test_bound_holds_for_an_emulation_of_the_kernel_at_flash_shape() -> None:
    """The GPU test's Flash inputs (T = 5), the kernel's numerics emulated on CPU (truncating fp32
    accumulation, fp32 epilogue g/(1+e^−g)·u, BF16 g/u/h/E, fp64 combine): within
    `routed_error_bound` and ≤ 2 % differing — while max |Δ| > 2⁻⁶·RMS(row), the former,
    mis-derived bound (one final-rounding flip at |ref| ∈ [16, 32); the H200 measured 0.0163)."""
    E, H, I, k, T = 12, 5120, 2304, 6, 5
    raw = random_experts(E, H, I, seed=E + H + T)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(T)).to(torch.bfloat16).float()
    ids, w = _routing(T, k, E, seed=T + 1, device="cpu")
    emulated = torch.zeros(T, k, H, dtype=torch.float64)
    deq_of = {e: dequantized_expert(raw, e) for e in torch.unique(ids).tolist()}   # shared with the reference
    for e, deq in deq_of.items():
        rows, slot = torch.nonzero(ids == e, as_tuple=True)
        gate = bf16(_truncating_fp32_matmul(x[rows], deq["w1"])).clamp(max=LIMIT)
        up = bf16(_truncating_fp32_matmul(x[rows], deq["w3"])).clamp(min=-LIMIT, max=LIMIT)
        h = bf16(gate / (1.0 + torch.exp(-gate)) * up)
        emulated[rows, slot] = bf16(_truncating_fp32_matmul(h, deq["w2"])).double()
    out = bf16((SCALE * (w.double().unsqueeze(-1) * emulated).sum(dim=1)).float())
    ref, per_slot = reference_routed(x, ids, w, raw, deq_of)
    assert not torch.equal(out, ref)
    assert_within_bound(out, ref, per_slot, w)
    rms = ref.pow(2).mean(dim=-1, keepdim=True).sqrt()
    assert ((out - ref).abs() / rms).max().item() > 2.0 ** -6


def test_bf16_ulp() -> None:
    v = torch.tensor([1.0, 1.5, -2.0, 19.125, 0.0, 2.0 ** -130, 3e38])
    want = torch.tensor([2.0 ** -7, 2.0 ** -7, 2.0 ** -6, 0.125, 2.0 ** -133, 2.0 ** -133, 2.0 ** 120])
    assert torch.equal(mx.bf16_ulp(v), want)
    r = torch.tensor([[19.125, 0.5]])
    b = mx.routed_error_bound(r, torch.tensor([[[3.0, -40.0], [0.25, 1.0]]]), torch.tensor([[0.5, 0.5]]), 1.5)
    chains = 4 * 3 * 2.0 ** -24 * 1.5                                   # 4(k + 1)·2⁻²⁴·s, k = 2
    assert torch.equal(b, torch.tensor([[0.125 + 0.75 * (2.0 ** -6 + 2.0 ** -9) + chains * (0.5 * 3 + 0.5 * 0.25),
                                         2.0 ** -8 + 0.75 * (0.25 + 2.0 ** -7) + chains * (0.5 * 40 + 0.5 * 1)]]))


def _hopper() -> torch.device:
    """The CUDA device, or a skip: the MXFP4 W4A16 path is Hopper-only."""
    dev = torch.device("cuda")
    if torch.cuda.get_device_capability(dev)[0] != 9:
        pytest.skip("the MXFP4 W4A16 path is Hopper-only")
    return dev


def _flash_batch(T: int, seed: int, dev: torch.device):
    """12 experts at Flash widths (H 5,120, I 2,304, top-6) and T routed BF16 tokens: raw, prepared,
    x, ids, weights (seeds seed, seed + 1, seed + 2)."""
    E, H, I, k = 12, 5120, 2304, 6
    raw = random_experts(E, H, I, seed=seed)
    p = prepare(raw, device=dev)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(seed + 1)).to(torch.bfloat16).to(dev)
    ids, w = _routing(T, k, E, seed=seed + 2, device=dev)
    return raw, p, x, ids, w


@pytest.mark.gpu
@pytest.mark.parametrize("E,H,I,k", [(8, 64, 32, 2), (16, 256, 128, 4), (12, 5120, 2304, 6)])
@pytest.mark.parametrize("T", [1, 5, 64])
def test_routed_experts_match_reference_on_gpu(E: int, H: int, I: int, k: int, T: int) -> None:
    dev = _hopper()
    raw = random_experts(E, H, I, seed=E + H + T)
    p = prepare(raw, device=dev)
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).to(dev)
    ids, w = _routing(T, k, E, seed=T + 1, device=dev)
    out = mx.routed_experts_mxfp4(x, ids, w, p, swiglu_limit=LIMIT, routed_scale=SCALE)
    assert out.shape == (T, H) and out.dtype == torch.bfloat16
    assert_within_bound(out, *reference_routed(x, ids, w, raw), w)


@pytest.mark.gpu
@pytest.mark.parametrize("flags,T", [("block_k=256", 1), ("block_k=64", 1), ("num_stages=5", 1),
                                     ("block_m=16,num_stages=4", 1), ("split_k=2", 1), ("split_k=4", 1),
                                     ("split_k=2", 8), ("split_k=2,block_k=256", 1)])
def test_routed_experts_with_decode_flags_on_gpu(flags: str, T: int) -> None:
    """SGLANG_DSV41_MOE_DECODE_FLAGS candidates (benchmarks/kernel_variants.py MOE_FLAG_SETS) at the
    Flash shape, T = 1 (split-K also at 8): the same bound as the default launch."""
    dev = _hopper()
    raw, p, x, ids, w = _flash_batch(T, 77, dev)
    out = mx.with_decode_flags(mx.parse_decode_flags(flags),
                               lambda: mx.routed_experts_mxfp4(x, ids, w, p, swiglu_limit=LIMIT, routed_scale=SCALE))
    assert_within_bound(out, *reference_routed(x, ids, w, raw), w)


@pytest.mark.gpu
@pytest.mark.parametrize("flags", ["block_m=64", "block_m=64,num_stages=3"])
def test_routed_experts_with_prefill_flags_on_gpu(flags: str, monkeypatch) -> None:
    """SGLANG_DSV41_MOE_PREFILL_FLAGS candidates (benchmarks/prefill_profile.py's `new_moe_*`) at the
    Flash shape, T = 256 (128 rows an expert: triton_kernels' own block_m is 128), set through the
    variable as the runtime reads it: the same bound as the default launch."""
    dev = _hopper()
    T = 256
    raw, p, x, ids, w = _flash_batch(T, 81, dev)
    monkeypatch.setenv(mx.PREFILL_FLAGS_ENV, flags)
    mx.prefill_flags.cache_clear()
    try:
        assert mx.launch_flags(T) == mx.parse_decode_flags(flags)
        out = mx.routed_experts_mxfp4(x, ids, w, p, swiglu_limit=LIMIT, routed_scale=SCALE)
    finally:
        monkeypatch.delenv(mx.PREFILL_FLAGS_ENV)
        mx.prefill_flags.cache_clear()
    default = mx.routed_experts_mxfp4(x, ids, w, p, swiglu_limit=LIMIT, routed_scale=SCALE)
    print(f"prefill flags {flags}: equal to the default launch: {torch.equal(out, default)}")
    assert_within_bound(out, *reference_routed(x, ids, w, raw), w)


@pytest.mark.gpu
def test_routed_experts_from_tiny_checkpoint_on_gpu(tiny_checkpoint) -> None:
    from sglang_dsv41.checkpoint.reader import CheckpointReader

    dev = _hopper()
    with CheckpointReader(tiny_checkpoint) as reader:
        stored = {n: reader.get(n) for n in reader.names() if n.startswith("layers.2.ffn.experts.")}
    E = len(stored) // 6
    p = mx.prepare_mxfp4_experts(stored, "layers.2.", E, device=dev)
    raw = {w: torch.stack([stored[f"layers.2.ffn.experts.{e}.{w}.weight"].view(torch.uint8) for e in range(E)])
           for w in ("w1", "w2", "w3")}
    raw |= {w + "_scale": torch.stack([stored[f"layers.2.ffn.experts.{e}.{w}.scale"].view(torch.uint8)
                                       for e in range(E)]) for w in ("w1", "w2", "w3")}
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, p.hidden, generator=g).to(torch.bfloat16).to(dev)
    ids, w = _routing(7, 2, E, seed=1, device=dev)
    out = mx.routed_experts_mxfp4(x, ids, w, p, swiglu_limit=LIMIT, routed_scale=SCALE)
    assert_within_bound(out, *reference_routed(x, ids, w, raw), w)


@pytest.mark.gpu
@pytest.mark.parametrize("T,k,E", [(1, 6, 384), (16, 6, 384), (85, 6, 384)])
def test_routing_plan_fused_order_equals_the_sort_on_gpu(T: int, k: int, E: int) -> None:
    """On CUDA at ≤ FUSED_ORDER_MAX_SLOTS slots the plan's order is the fused kernel's (the default):
    every part of the plan bit-equal to the one from torch's stable sort (with and without absent
    slots), so the GEMMs see the same rows in the same order."""
    g = torch.Generator().manual_seed(T)
    for absent in (False, True):
        ids = torch.randint(-1 if absent else 0, E, (T, k), generator=g).cuda()
        got = mx.make_routing_plan(ids, E, allow_absent=absent)
        want = mx.make_routing_plan(ids, E, allow_absent=absent, fused=False)
        for a, b in zip(_plan_parts(got), _plan_parts(want)):
            assert torch.equal(a, b)


@pytest.mark.gpu
def test_routing_plan_tile_schedule_on_gpu() -> None:
    from triton_kernels.tensor import make_ragged_tensor_metadata_torch

    ids, _ = _routing(300, 6, 384, seed=9, device="cuda")
    plan = mx.make_routing_plan(ids, 384)
    ref = make_ragged_tensor_metadata_torch(plan.expert_counts, 300 * 6)
    assert torch.equal(plan.ragged.slice_offs, ref.slice_offs)
    assert torch.equal(plan.ragged.block_offs_data, ref.block_offs_data)
    assert torch.equal(plan.ragged.block_schedule_data, ref.block_schedule_data)

"""`runtime/stacked_linear.py`: the attention's `wq_a | wkv` and the shared expert's `w1 | w3` as one FP8 product each.

What is pinned:
* main process: the stack holds the members' E4M3 rows and tile scales in column order, the members'
  parameters become views of its rows; a restack reuses the stack's storage and copies a member
  whose scales were replaced (a reload) back into it; fp32 (dequantised) members are not stacked and
  a stale stack is dropped; the dense-weight cache registers the stack once whatever the dict order
  and resolves each member as a tile-row view of it; `Attention.refresh` / `MoE.refresh` build the stacks;
  the shared expert's column-parallel members stack, members of different kinds do not; a model streamed
  in the CUDA form (E4M3 kept) has both stacks in every layer, keeps them out of its checkpoint-named
  `weights`, and a reload of `wkv` lands in the same stack storage with the new values;
* kernel cases (interpreter child on CPU; compiled on CUDA): `project_q_lora_kv` on `TritonBackend`
  gives the same bits with the stack (one FP8 launch, one `rms_norm_pair` launch) as without it (two
  products, two norms), and the stacked path issues two launches where the members issue four; the shared
  expert with the stacked `w1 | w3` gives the members' bits with one launch fewer.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from fp8_cases import KERNEL_HERE, fp8_weight
from sglang_dsv41.checkpoint.names import tensor_inventory
from sglang_dsv41.kernels import fused_elementwise as FE
from sglang_dsv41.runtime.attention_math import project_q_lora_kv
from sglang_dsv41.runtime.dense_weights import DenseWeightCache, Fp8Weight
from sglang_dsv41.runtime.parallel_linear import linear_values, parallel_fp8_linear
from sglang_dsv41.runtime.stacked_linear import SHARED_STACKED, STACKED, stack_attention_inputs, stack_shared_expert
from sglang_dsv41.runtime.tensor_parallel import SINGLE
from triton_checks import run_kernel_cases_in_interpreter

DEVICE = "cuda" if torch.cuda.is_available() and not FE.INTERPRETED else "cpu"
E4M3 = torch.float8_e4m3fn


def _config():
    from reference_weights import tiny_config
    return tiny_config(vision=False)


def attention_inputs(seed: int = 0, kept: bool = True, device: str = DEVICE) -> tuple[dict, str, object]:
    """(w, prefix, text config): layer 1's `wq_a` / `wkv` as the runtime's FP8 layers holding random E4M3
    tiles (`kept`) or their fp32 values, with random norms."""
    cfg = _config()
    t, prefix = cfg.text, "layers.1.attn."
    g = torch.Generator().manual_seed(seed)
    specs = {s.name: s for s in tensor_inventory(cfg, vision=False, dspark=False)}
    w: dict = {}
    for m in ("wq_a", "wkv"):
        spec = specs[f"{prefix}{m}.weight"]
        values, scales = fp8_weight(*spec.shape, g, device=device)
        layer = parallel_fp8_linear(spec, SINGLE.plan(t), keep_fp8=kept)
        if kept:
            layer.set_values(values, scales)
        else:
            from fp8_cases import dequantised
            layer.set_values(dequantised(values, scales))
        w[prefix + m] = layer
    for norm, n in (("q_norm", t.q_lora_rank), ("kv_norm", t.head_dim)):
        w[f"{prefix}{norm}.weight"] = (torch.rand(n, generator=g) + 0.5).to(torch.bfloat16).float().to(device)
    return w, prefix, t


def shared_expert_layers(seed: int = 0, device: str = DEVICE) -> tuple[dict, str, object]:
    """(w, prefix, text config): layer 1's shared expert as the runtime's FP8 layers holding random E4M3 tiles."""
    cfg = _config()
    t, prefix = cfg.text, "layers.1.ffn."
    g = torch.Generator().manual_seed(seed)
    specs = {s.name: s for s in tensor_inventory(cfg, vision=False, dspark=False)}
    w: dict = {}
    for m in ("w1", "w2", "w3"):
        spec = specs[f"{prefix}shared_experts.{m}.weight"]
        layer = parallel_fp8_linear(spec, SINGLE.plan(t), keep_fp8=True)
        layer.set_values(*fp8_weight(*spec.shape, g, device=device))
        w[f"{prefix}shared_experts.{m}"] = layer
    return w, prefix, t


def test_stack_holds_the_members_rows_and_the_members_become_views() -> None:
    w, p, t = attention_inputs()
    a, b = w[p + "wq_a"], w[p + "wkv"]
    before = [(m.weight.data.clone(), m.scale.data.clone()) for m in (a, b)]
    stack = stack_attention_inputs(w, p)
    assert w[p + STACKED] is stack and stack.stacked_rows == (t.q_lora_rank, t.head_dim)
    assert stack.weight.dtype == E4M3 and stack.weight.shape == (t.q_lora_rank + t.head_dim, t.hidden_size)
    want_values = torch.cat([v for v, _ in before])
    assert torch.equal(stack.weight.view(torch.uint8), want_values.view(torch.uint8))
    assert torch.equal(stack.scale, torch.cat([s for _, s in before]))
    n = t.q_lora_rank
    assert a.weight.data_ptr() == stack.weight.data_ptr()
    assert b.weight.data_ptr() == stack.weight[n:].data_ptr() and b.scale.data_ptr() == stack.scale[n // 32:].data_ptr()


def test_restack_reuses_the_storage_and_takes_a_reloaded_member() -> None:
    w, p, _ = attention_inputs()
    stack = stack_attention_inputs(w, p)
    address = stack.weight.data_ptr()
    b = w[p + "wkv"]
    fresh = b.scale.data * 2                      # a reload replaced wkv's scales (new storage)
    b.scale.data = fresh
    again = stack_attention_inputs(w, p, previous=stack)
    assert again is stack and again.weight.data_ptr() == address
    n = w[p + "wq_a"].weight.shape[0]
    assert torch.equal(again.scale[n // 32:], fresh) and b.scale.data_ptr() == again.scale[n // 32:].data_ptr()


def test_dequantised_members_are_not_stacked_and_a_stale_stack_is_dropped() -> None:
    w, p, _ = attention_inputs(kept=False)
    w[p + STACKED] = object()
    assert stack_attention_inputs(w, p) is None and p + STACKED not in w


@pytest.mark.parametrize("stack_first", [False, True])
def test_the_cache_registers_the_stack_once_and_members_resolve_as_its_rows(stack_first: bool) -> None:
    w, p, t = attention_inputs()
    stack = stack_attention_inputs(w, p)
    values = linear_values(w)
    if stack_first:
        values = {k: values[k] for k in sorted(values, key=lambda k: STACKED not in k)}
    cache = DenseWeightCache.from_weights(values)
    assert cache.fp8_elements == stack.weight.numel()
    for m, row0 in (("wq_a", 0), ("wkv", t.q_lora_rank)):
        found = cache.lookup(w[p + m].weight)
        assert isinstance(found, Fp8Weight) and found.values.data_ptr() == stack.weight[row0:].data_ptr()
        assert found.scales.data_ptr() == stack.scale[row0 // 32:].data_ptr()


def test_attention_refresh_builds_the_stack() -> None:
    from sglang_dsv41.runtime.layers import Attention
    w, p, t = attention_inputs()
    role = next(r for r in t.layer_roles() if r.layer == 1)
    attn = Attention(w, t, role)
    attn.refresh()
    stack = attn.tensors[p + STACKED]
    attn.refresh()
    assert attn.tensors[p + STACKED] is stack


@contextlib.contextmanager
def counted_launches():
    """The list of Triton launches (`JITFunction.run`, the interpreter's `InterpretedFunction.run`) while open."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    launches: list[str] = []
    saved = {cls: cls.run for cls in (JITFunction, InterpretedFunction)}

    def counting(inner):
        def run(self, *args, **kwargs):
            launches.append(getattr(self, "__name__", "?"))
            return inner(self, *args, **kwargs)
        return run
    for cls, inner in saved.items():
        cls.run = counting(inner)
    try:
        yield launches
    finally:
        for cls, inner in saved.items():
            cls.run = inner


def test_the_shared_expert_stacks_and_mixed_kinds_do_not() -> None:
    from sglang_dsv41.runtime.layers import MoE
    from sglang_dsv41.runtime.parallel_linear import ColumnParallelFp8
    w, p, t = shared_expert_layers()
    assert isinstance(w[p + "shared_experts.w1"], ColumnParallelFp8)
    moe = MoE(w, t, 1)
    moe.refresh()
    stack = moe.tensors[p + SHARED_STACKED]
    n = w[p + "shared_experts.w1"].weight.shape[0]
    assert stack.stacked_rows == (n, n) and w[p + "shared_experts.w3"].weight.data_ptr() == stack.weight[n:].data_ptr()
    mixed, pa, _ = attention_inputs()
    mixed[p + "shared_experts.w1"], mixed[p + "shared_experts.w3"] = w[p + "shared_experts.w1"], mixed[pa + "wq_a"]
    assert stack_shared_expert(mixed, p) is None and p + SHARED_STACKED not in mixed


def test_a_streamed_model_stacks_every_layer_and_a_reload_lands_in_the_stack(tiny_checkpoint) -> None:
    from sglang_dsv41.checkpoint.reader import CheckpointReader
    from sglang_dsv41.config import DeepseekV41Config
    from sglang_dsv41.engram_hash import EngramHasher, _load_fast_tokenizer, compressed_token_map
    from sglang_dsv41.runtime.backend import ExactTorchBackend
    from sglang_dsv41.runtime.forward import TorchForward, fp32_default_dtype

    cfg = DeepseekV41Config.from_file(tiny_checkpoint)
    hasher = EngramHasher.from_config(cfg, compressed_token_map(_load_fast_tokenizer(tiny_checkpoint))[0])
    with fp32_default_dtype(), CheckpointReader(tiny_checkpoint) as reader:
        stored = {n: reader.get(n) for n in reader.names()}
        # the CUDA form on CPU: inspected, never run (a fixed backend skips the CPU backends' E4M3 check)
        model = TorchForward.for_loading(cfg, hasher, experts_mxfp4=False, dense_fp8=True, backend=ExactTorchBackend())
        model.load_weights(stored.items())
        layers = range(cfg.text.num_hidden_layers)
        stacks = [model.layers[i].attn.tensors[f"layers.{i}.attn.{STACKED}"] for i in layers]
        assert all(model.layers[i].ffn.tensors.get(f"layers.{i}.ffn.{SHARED_STACKED}") is not None for i in layers)
        assert not any(STACKED in k or SHARED_STACKED in k for k in model.weights)
        address = stacks[1].weight.data_ptr()
        name = "layers.1.attn.wkv"
        values = (stored[name + ".weight"].view(torch.uint8) ^ 1).view(E4M3)      # new bytes (compared as bytes)
        model.load_weights([(name + ".weight", values), (name + ".scale", stored[name + ".scale"])])
    again = model.layers[1].attn.tensors[f"layers.1.attn.{STACKED}"]
    n = cfg.text.q_lora_rank
    assert again is stacks[1] and again.weight.data_ptr() == address
    assert torch.equal(again.weight[n:].view(torch.uint8), values.view(torch.uint8))
    assert model.weights[name + ".weight"].data_ptr() == again.weight[n:].data_ptr()


if KERNEL_HERE:

    def test_kernel_case_stacked_shared_expert_gives_the_members_bits() -> None:
        from sglang_dsv41.runtime.triton_backend import TritonBackend
        from sglang_dsv41.runtime.dense_ops import BlockedBf16Gemm
        from sglang_dsv41.runtime.moe_ops import shared_expert

        w, p, t = shared_expert_layers(seed=5)
        g = torch.Generator().manual_seed(6)
        x = (torch.randn(4, t.hidden_size, generator=g) * 2).to(torch.bfloat16).to(DEVICE)
        sh = [w[f"{p}shared_experts.{m}"] for m in ("w1", "w2", "w3")]

        def run(w13) -> tuple[torch.Tensor, int]:
            be = TritonBackend(BlockedBf16Gemm(DenseWeightCache.from_weights(linear_values(w))), device_types=(DEVICE,))
            with counted_launches() as launches:
                out = shared_expert(be, x, *sh, t.swiglu_limit, True, w13)
            return out, len(launches)

        alone, members_launches = run(None)
        stack = stack_shared_expert(w, p)
        stacked, stacked_launches = run(stack)
        assert torch.equal(stacked, alone) and stacked_launches == members_launches - 1

    def test_kernel_case_quantised_handoff_keeps_the_shared_expert_bits(monkeypatch) -> None:
        """`w8a8_fold` at ≤ 16 rows: the stacked SwiGLU writes w2's x quantised and w2 multiplies it as
        loaded (`quantised_handoff`) — the bits and the launch count of the hand-off off, on the model's TP-1
        path (`TensorParallel.shared_expert`) and on `moe_ops.shared_expert`."""
        from sglang_dsv41.kernels import fp8_w8a8 as W
        from sglang_dsv41.runtime.triton_backend import TritonBackend
        from sglang_dsv41.runtime.dense_ops import BlockedBf16Gemm
        from sglang_dsv41.runtime.moe_ops import shared_expert
        from sglang_dsv41.runtime.tensor_parallel import SINGLE

        w, p, t = shared_expert_layers(seed=7)
        x = (torch.randn(3, t.hidden_size, generator=torch.Generator().manual_seed(8)) * 2).to(torch.bfloat16)
        x = x.to(DEVICE)
        sh = [w[f"{p}shared_experts.{m}"] for m in ("w1", "w2", "w3")]
        stack = stack_shared_expert(w, p)
        be = TritonBackend(BlockedBf16Gemm(DenseWeightCache.from_weights(linear_values(w))), device_types=(DEVICE,),
                           fp8_gemm="w8a8_fold")
        flags: list[bool] = []
        real = W.fp8_w8a8_linear
        monkeypatch.setattr(W, "fp8_w8a8_linear", lambda *a, **kw: flags.append(kw["x_quantised"]) or real(*a, **kw))

        def both() -> tuple[torch.Tensor, torch.Tensor, int]:
            with counted_launches() as launches:
                tp_out, partial = SINGLE.shared_expert(*sh, x, be, True, t.swiglu_limit, stack)
                out = shared_expert(be, x, *sh, t.swiglu_limit, True, stack)
            assert not partial
            return tp_out, out, len(launches)

        on = both()
        assert flags == [False, True] * 2, flags
        monkeypatch.setattr(be, "quantised_handoff", lambda rows: False)
        off = both()
        assert flags[4:] == [False] * 4 and torch.equal(on[0], off[0]) and torch.equal(on[1], off[1])
        assert torch.equal(on[0], on[1]) and on[2] == off[2]

    def test_kernel_case_stacked_projection_gives_the_members_bits() -> None:
        from sglang_dsv41.runtime.triton_backend import TritonBackend
        from sglang_dsv41.runtime.dense_ops import BlockedBf16Gemm

        w, p, t = attention_inputs(seed=3)
        g = torch.Generator().manual_seed(4)
        x = (torch.randn(5, t.hidden_size, generator=g) * 2).to(torch.bfloat16).to(DEVICE)

        def project(weights: dict) -> tuple[tuple[torch.Tensor, torch.Tensor], int]:
            be = TritonBackend(BlockedBf16Gemm(DenseWeightCache.from_weights(linear_values(weights))),
                               device_types=(DEVICE,))
            with counted_launches() as launches:
                out = project_q_lora_kv(be, t, weights, p, x, True)
            return out, len(launches)

        (q_alone, kv_alone), members_launches = project(w)
        stack_attention_inputs(w, p)
        (q_stacked, kv_stacked), stacked_launches = project(w)
        assert torch.equal(q_stacked, q_alone) and torch.equal(kv_stacked, kv_alone)
        assert q_stacked.dtype == kv_stacked.dtype == torch.float32
        assert stacked_launches == members_launches - 2, (stacked_launches, members_launches)


if not FE.INTERPRETED:

    def test_kernel_cases_in_triton_interpreter() -> None:
        """Run this file's kernel cases in a child pytest with TRITON_INTERPRET=1 (CPU)."""
        run_kernel_cases_in_interpreter(__file__, min_passed=3, exact=True)

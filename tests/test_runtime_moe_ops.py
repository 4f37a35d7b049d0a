"""`runtime.moe_ops` and `runtime.weights` (spec §2.3–§2.4, §3.6, §3.8).

CPU: `moe_sublayer` is bit-identical to `reference.moe.moe_sublayer` at TP1 (text and vision
routing); split over two expert shards in one process (reduce = sum of the two float64 partials)
it is bit-identical too; the runtime weights equal the reference loader's, except that with
`experts_mxfp4=True` the routed experts are never dequantised (the codec's MXFP4 decoder is
made to raise) and come back as uint8 kernel-layout tensors that decode to the checkpoint values;
devices without an implementation raise.
GPU (`gpu` marker, Hopper): the CUDA path against the reference on the same device within
`moe_error_bound` (per element) and ≤ 2 % differing outputs — every layer of the tiny
checkpoint (TP1 and a two-shard split) and a Flash-shaped layer (H 5120, I 2304, top-6) with
random MXFP4 experts; after loading, the experts occupy their packed bytes only.
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from reference_weights import random_reference_weights, tiny_config

from sglang_dsv41.checkpoint import loader
from sglang_dsv41.checkpoint.codecs import dequantize_mxfp4, quantize_fp8_block, dequantize_fp8_block
from sglang_dsv41.checkpoint.reader import CheckpointReader
from sglang_dsv41.config import DeepseekV41Config
from sglang_dsv41.presets import flash_config_dict
from sglang_dsv41.reference import moe as ref_moe
from sglang_dsv41.numerics.rounding import fp32_scalar
from sglang_dsv41.reference.ops import bf16
from sglang_dsv41.runtime import moe_ops
from sglang_dsv41.runtime.backend import ExactTorchBackend
from sglang_dsv41.runtime.weights import is_routed_expert_tensor, runtime_weights

from runtime_values import logical, with_linear_layers


def _x(T: int, H: int, seed: int, device="cpu") -> torch.Tensor:
    return bf16(torch.randn(T, H, generator=torch.Generator().manual_seed(seed))).to(device)


@pytest.fixture(scope="module")
def tiny():
    cfg = tiny_config()
    return cfg, random_reference_weights(cfg, seed=3)


@pytest.fixture(scope="module")
def tiny_stored(tiny_checkpoint):
    with CheckpointReader(tiny_checkpoint) as reader:
        stored = {n: reader.get(n) for n in reader.names()}
    return DeepseekV41Config.from_file(tiny_checkpoint), stored


def moe_sublayer(t, w, p, x, *, image_rows, act_quant, experts=None, reduce=None):
    """The model's MoE implementation for x's device (`moe_for`) on the exact torch primitives
    (router and shared expert as the runtime's linear layers over `w`'s tensors)."""
    return moe_ops.moe_for(x.device)(ExactTorchBackend(), t, with_linear_layers(w, t), p, x, image_rows, act_quant,
                                     experts, reduce)


# ---------------------------------------------------------------------------------------------
# CPU: the reference path
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("vision", [False, True])
def test_cpu_tp1_is_bit_identical_to_the_reference(tiny, vision: bool) -> None:
    cfg, w = tiny
    t = cfg.text
    x = _x(37, t.hidden_size, seed=1)
    image_rows = (torch.arange(37) % 3 == 0) if vision else None
    for layer in (0, t.num_hidden_layers - 1):
        p = f"layers.{layer}."
        got = moe_sublayer(t, w, p, x, image_rows=image_rows, act_quant=True)
        want = ref_moe.moe_sublayer(t, w, p, x, image_rows=image_rows, act_quant=True)
        assert torch.equal(got, want)


def test_cpu_expert_split_with_reduce_is_bit_identical(tiny) -> None:
    cfg, w = tiny
    t = cfg.text
    E, p = t.n_routed_experts, "layers.1."
    x = _x(29, t.hidden_size, seed=2)
    shard_a, shard_b = list(range(0, E, 2)), list(range(1, E, 2))
    partials = {}

    def capture(name):
        def keep(partial: torch.Tensor) -> torch.Tensor:
            assert partial.dtype == torch.float64 and partial.shape == (x.shape[0], t.num_experts_per_tok, x.shape[1])
            partials[name] = partial.clone()
            return partial
        return keep

    for name, shard in (("a", shard_a), ("b", shard_b)):
        moe_sublayer(t, w, p, x, image_rows=None, act_quant=True, experts=shard, reduce=capture(name))
    want = ref_moe.moe_sublayer(t, w, p, x, image_rows=None, act_quant=True)
    got_a = moe_sublayer(t, w, p, x, image_rows=None, act_quant=True, experts=shard_a,
                                 reduce=lambda part: part + partials["b"])
    got_b = moe_sublayer(t, w, p, x, image_rows=None, act_quant=True, experts=shard_b,
                                 reduce=lambda part: partials["a"] + part)
    assert torch.equal(got_a, want) and torch.equal(got_b, want)
    # each shard alone is only part of the routed sum: the split is not vacuous
    alone = moe_sublayer(t, w, p, x, image_rows=None, act_quant=True, experts=shard_a)
    assert not torch.equal(alone, want)
    assert partials["a"].abs().sum() > 0 and partials["b"].abs().sum() > 0
    # a shard's weights suffice (other experts' tensors absent)
    own = {k: v for k, v in w.items() if not any(f"experts.{e}." in k for e in shard_b)}
    assert torch.equal(moe_sublayer(t, own, p, x, image_rows=None, act_quant=True, experts=shard_a,
                                            reduce=lambda part: part + partials["b"]), want)


def test_cpu_rejects_bad_calls(tiny) -> None:
    cfg, w = tiny
    t = cfg.text
    x = _x(3, t.hidden_size, seed=3)
    with pytest.raises(ValueError, match="distinct"):
        moe_sublayer(t, w, "layers.0.", x, image_rows=None, act_quant=True, experts=[0, 0])
    with pytest.raises(ValueError, match="distinct"):
        moe_sublayer(t, w, "layers.0.", x, image_rows=None, act_quant=True, experts=[t.n_routed_experts])
    no_experts = {k: v for k, v in w.items() if not is_routed_expert_tensor(k)}
    with pytest.raises(KeyError, match="dequantised"):
        moe_sublayer(t, no_experts, "layers.0.", x, image_rows=None, act_quant=True)
    with pytest.raises(RuntimeError, match="no MoE implementation"):
        moe_ops.moe_for(torch.device("meta"))


def test_routing_plan_with_absent_slots() -> None:
    from sglang_dsv41.kernels.moe_mxfp4 import make_routing_plan

    ids = torch.tensor([[2, -1, 0], [-1, 2, 1], [0, -1, -1]])
    plan = make_routing_plan(ids, 3, allow_absent=True)
    assert plan.expert_counts.tolist() == [2, 1, 2]
    flat = ids.reshape(-1)
    grouped = flat[plan.sorted_slots.long()].tolist()
    assert grouped == [0, 0, 1, 2, 2, -1, -1, -1, -1]            # absent slots last, in slot order
    assert torch.equal(plan.sorted_slots[plan.slot_rows.long()], torch.arange(9, dtype=torch.int32))
    with pytest.raises(RuntimeError):
        make_routing_plan(ids, 3)                                  # −1 only with allow_absent


# ---------------------------------------------------------------------------------------------
# CPU: runtime weights
# ---------------------------------------------------------------------------------------------
def test_routed_expert_name_filter() -> None:
    assert is_routed_expert_tensor("layers.3.ffn.experts.17.w2.weight")
    assert is_routed_expert_tensor("layers.0.ffn.experts.0.w1.scale")
    assert is_routed_expert_tensor("mtp.0.ffn.experts.5.w3.weight")
    for name in ("layers.3.ffn.shared_experts.w1.weight", "layers.3.ffn.gate.weight",
                 "layers.3.ffn.experts.1.w4.weight", "layers.3.attn.wq_a.weight"):
        assert not is_routed_expert_tensor(name)


def test_dequantised_weights_equal_the_reference_loader(tiny_stored) -> None:
    cfg, stored = tiny_stored
    got = runtime_weights(stored, cfg, torch.device("cpu"), experts_mxfp4=False)
    want = loader.load_reference_weights_from_tensors(stored, cfg, vision=False, dspark=False)
    assert got.keys() == want.keys()
    assert all(torch.equal(logical(got[k]), want[k]) and logical(got[k]).dtype == torch.float32 for k in want)


def test_mxfp4_weights_are_never_dequantised(tiny_stored, monkeypatch) -> None:
    cfg, stored = tiny_stored
    E = cfg.text.n_routed_experts

    def forbidden(*_a, **_k):
        raise AssertionError("routed experts must not be dequantised on the MXFP4 path")

    monkeypatch.setattr(loader, "dequantize_mxfp4", forbidden)
    held = [E - 1, 0, 2]
    w = runtime_weights(stored, cfg, torch.device("cpu"), experts_mxfp4=True, expert_ids=held)
    assert not any(is_routed_expert_tensor(k) or ".ffn.experts." in k and k.endswith(".weight") for k in w)
    from sglang_dsv41.kernels.moe_mxfp4 import dequantize_prepared

    for layer in range(cfg.text.num_hidden_layers):
        p = f"layers.{layer}."
        routed = w[moe_ops.routed_experts_key(p)]
        assert isinstance(routed, moe_ops.RoutedExpertsMxfp4) and routed.expert_ids == tuple(held)
        assert routed.local_index.tolist() == [held.index(e) if e in held else -1 for e in range(E)]
        pr = routed.prepared
        for tk in (pr.w13, pr.w13_scale, pr.w2, pr.w2_scale):
            assert tk.storage.data.dtype == torch.uint8
        dense = dequantize_prepared(pr)
        for i, e in enumerate(held):
            for name in ("w1", "w2", "w3"):
                q = f"{p}ffn.experts.{e}.{name}"
                assert torch.equal(dense[name][i], dequantize_mxfp4(stored[q + ".weight"], stored[q + ".scale"]))
    # the non-expert tensors are the reference loader's values
    monkeypatch.undo()
    ref = loader.load_reference_weights_from_tensors(stored, cfg, vision=False, dspark=False)
    dense_keys = {k for k in ref if not is_routed_expert_tensor(k)}
    assert dense_keys == {k for k in w if not isinstance(w[k], moe_ops.RoutedExpertsMxfp4)}
    assert all(torch.equal(logical(w[k]), ref[k]) for k in dense_keys)


def test_runtime_weights_check_the_checkpoint(tiny_stored) -> None:
    cfg, stored = tiny_stored
    broken = {k: v for k, v in stored.items() if k != "layers.0.ffn.experts.1.w2.scale"}
    with pytest.raises(loader.CheckpointFormatError, match="experts.1.w2.scale"):
        runtime_weights(broken, cfg, torch.device("cpu"), experts_mxfp4=True)
    with pytest.raises(ValueError, match="expert_ids"):
        runtime_weights(stored, cfg, torch.device("cpu"), experts_mxfp4=True, expert_ids=[cfg.text.n_routed_experts])


# ---------------------------------------------------------------------------------------------
# GPU (Hopper)
# ---------------------------------------------------------------------------------------------
def _hopper() -> torch.device:
    dev = torch.device("cuda")
    if torch.cuda.get_device_capability(dev)[0] != 9:
        pytest.skip("the MXFP4 W4A16 path is Hopper-only")
    return dev


def _reference_parts(t, w_ref, p: str, x: torch.Tensor):
    """Reference y, its routed term and per-slot expert outputs, on x's device."""
    routing = ref_moe.route(x, w_ref[p + "ffn.gate.weight"], w_ref[p + "ffn.gate.bias"], t.num_experts_per_tok)
    T, k = routing.experts.shape
    per_slot = torch.zeros(T, k, x.shape[1], dtype=torch.float64, device=x.device)
    for e in torch.unique(routing.experts).tolist():
        rows, slot = torch.nonzero(routing.experts == e, as_tuple=True)
        q = f"{p}ffn.experts.{e}."
        per_slot[rows, slot] = ref_moe.routed_expert(x[rows], w_ref[q + "w1.weight"], w_ref[q + "w2.weight"],
                                                     w_ref[q + "w3.weight"], t.swiglu_limit).double()
    scaled = routing.weights * fp32_scalar(t.routed_scaling_factor)       # fp32(w·s), as the reference
    routed = bf16((scaled.double().unsqueeze(-1) * per_slot).sum(1).float())
    y = ref_moe.moe_sublayer(t, w_ref, p, x, image_rows=None, act_quant=True)
    bound = moe_ops.moe_error_bound(y, routed, per_slot, routing.weights, t.routed_scaling_factor)
    return y, bound


def _assert_within(out: torch.Tensor, y: torch.Tensor, bound: torch.Tensor) -> None:
    from sglang_dsv41.kernels.moe_mxfp4 import ROUTED_DIFF_FRACTION_BOUND

    assert out.shape == y.shape and bool(torch.isfinite(out).all())
    diff = (out - y).abs()
    assert bool((diff <= bound).all()), f"max |Δ|/bound = {(diff / bound).max().item():.3f}"
    differ = int((out != y).sum())
    assert differ <= max(2, math.ceil(ROUTED_DIFF_FRACTION_BOUND * out.numel())), f"{differ} of {out.numel()} differ"


@pytest.mark.gpu
def test_cuda_matches_reference_on_tiny_checkpoint(tiny_stored) -> None:
    dev = _hopper()
    cfg, stored = tiny_stored
    t, E = cfg.text, cfg.text.n_routed_experts
    # dense weights dequantised (dense_fp8=False): this test calls the MoE sublayer outside the dense
    # backend, so the shared expert and router take the exact product (no E4M3 weights)
    w = runtime_weights(stored, cfg, dev, experts_mxfp4=True, dense_fp8=False)
    w_ref = runtime_weights(stored, cfg, dev, experts_mxfp4=False, dense_fp8=False)
    shard_a, shard_b = list(range(E // 2)), list(range(E // 2, E))
    w_a = runtime_weights(stored, cfg, dev, experts_mxfp4=True, expert_ids=shard_a, dense_fp8=False)
    w_b = runtime_weights(stored, cfg, dev, experts_mxfp4=True, expert_ids=shard_b, dense_fp8=False)
    for T in (1, 9, 64):
        x = _x(T, t.hidden_size, seed=T, device=dev)
        for layer in range(t.num_hidden_layers):
            p = f"layers.{layer}."
            y, bound = _reference_parts(t, w_ref, p, x)
            _assert_within(moe_sublayer(t, w, p, x, image_rows=None, act_quant=True), y, bound)
            part_b = {}
            moe_sublayer(t, w_b, p, x, image_rows=None, act_quant=True, experts=shard_b,
                                 reduce=lambda q: part_b.setdefault("p", q.clone()))
            split = moe_sublayer(t, w_a, p, x, image_rows=None, act_quant=True, experts=shard_a,
                                         reduce=lambda q: q + part_b["p"])
            _assert_within(split, y, bound)


def _flash_moe_layer(dev: torch.device, n_experts: int, seed: int):
    """A Flash-shaped MoE layer (H 5120, I 2304, top-6, `n_experts` routed experts): stored
    random MXFP4 experts + the reference's fp32 tensors of the rest; scale bytes give g/u a std near 6.5 (clamp at 10 exercised), expert outputs O(1)."""
    t = dataclasses.replace(DeepseekV41Config.from_dict(flash_config_dict()).text, n_routed_experts=n_experts)
    H, I = t.hidden_size, t.moe_intermediate_size
    g = torch.Generator().manual_seed(seed)
    p = "layers.3.ffn."
    stored = {}
    for e in range(n_experts):
        for name, (rows, cols, exp) in {"w1": (I, H, -5), "w3": (I, H, -5), "w2": (H, I, -9)}.items():
            stored[f"{p}experts.{e}.{name}.weight"] = torch.randint(0, 256, (rows, cols // 2), generator=g,
                                                                    dtype=torch.uint8)
            stored[f"{p}experts.{e}.{name}.scale"] = (127 + exp + torch.randint(-1, 2, (rows, cols // 32),
                                                                                generator=g)).to(torch.uint8)
    dense = {p + "gate.weight": bf16(torch.randn(n_experts, H, generator=g) / math.sqrt(H)),
             p + "gate.bias": 0.3 * torch.randn(n_experts, generator=g)}
    for name, shape in {"w1": (I, H), "w3": (I, H), "w2": (H, I)}.items():
        dense[f"{p}shared_experts.{name}.weight"] = dequantize_fp8_block(
            *quantize_fp8_block(torch.randn(*shape, generator=g) / math.sqrt(shape[1])))
    return t, stored, {k: v.to(dev) for k, v in dense.items()}


@pytest.mark.gpu
def test_cuda_matches_reference_at_flash_shape() -> None:
    from sglang_dsv41.runtime.weights import prepare_layer_experts

    dev = _hopper()
    E = 24
    t, stored, dense = _flash_moe_layer(dev, E, seed=0)
    stored_dev = {k: v.to(dev) for k, v in stored.items()}
    stored_bytes = sum(v.numel() for v in stored_dev.values())
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(dev)
    routed = prepare_layer_experts(stored_dev, "layers.3.", E, dev)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated(dev) - before
    # the prepared experts hold the packed bytes only (exactly 1.0× at Flash dims, checked on CPU;
    # slack for the caching allocator's rounding) — fp32 weights would be ≥ 7.5× the stored bytes
    assert held <= 1.05 * stored_bytes + (16 << 20), (held, stored_bytes)
    pr = routed.prepared
    assert all(tk.storage.data.dtype == torch.uint8 for tk in (pr.w13, pr.w13_scale, pr.w2, pr.w2_scale))
    del stored_dev
    w = dict(dense, **{moe_ops.routed_experts_key("layers.3."): routed})
    w_ref = dict(dense)
    for k, v in stored.items():
        if k.endswith(".weight"):
            w_ref[k] = dequantize_mxfp4(v, stored[k[:-len("weight")] + "scale"]).to(dev)
    for T in (1, 5, 64):
        x = _x(T, t.hidden_size, seed=100 + T, device=dev)
        y, bound = _reference_parts(t, w_ref, "layers.3.", x)
        _assert_within(moe_sublayer(t, w, "layers.3.", x, image_rows=None, act_quant=True), y, bound)


def test_sqrt_softplus_cpu_fp32_keeps_the_where_chain() -> None:
    """On CPU (fp32 acc too) the scores are the `where` chain's: exp / log1p below the threshold, z above."""
    z = torch.linspace(-30, 30, 4001, dtype=torch.float32)
    chain = torch.where(z > moe_ops.SOFTPLUS_THRESHOLD, z, torch.log1p(torch.exp(z.clamp(max=moe_ops.SOFTPLUS_THRESHOLD))))
    assert torch.equal(moe_ops.sqrt_softplus(z, torch.float32), torch.sqrt(chain))


@pytest.mark.gpu
def test_cuda_sqrt_softplus_one_kernel_equals_the_where_chain() -> None:
    """CUDA fp32: `F.softplus` (one kernel) gives the `where` chain's bits, threshold included."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (run with -m gpu on the GPU machine)")
    g = torch.Generator(device="cuda").manual_seed(3)
    z = torch.cat((torch.randn(1 << 20, generator=g, device="cuda") * 8,
                   torch.tensor([20.0, 20.000002, 19.999998, -88.0, -104.0, 0.0], device="cuda")))
    t = moe_ops.SOFTPLUS_THRESHOLD
    chain = torch.sqrt(torch.where(z > t, z, torch.log1p(torch.exp(z.clamp(max=t)))))
    assert torch.equal(moe_ops.sqrt_softplus(z, torch.float32), chain)

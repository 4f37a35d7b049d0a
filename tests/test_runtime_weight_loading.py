"""Streaming weight loading into parameters (`runtime/quant_methods.py`, `runtime/weight_modules.py`;
issue 13 item 1).

* every stored tensor of the tiny checkpoint (text model) maps onto a parameter of the model,
  and every parameter is the target of at least one stored tensor: none missing, none extra;
  the stacked expert parameters are covered exactly, expert by expert;
* `TorchForward.for_loading` + `load_weights` gives the old loading path's values
  (`runtime_weights` / `load_shard_weights`) bit for bit: CPU form, CUDA form (E4M3 kept, MXFP4
  prepared; built on CPU) and each TP-2 shard; and the same logits;
* the runtime values are the parameters themselves or views of them (no second copy), and the
  parameters hold exactly the bytes the inventory predicts for the CPU form;
* reload (`update_weights_from_disk`'s path) replaces the values, a partial reload (an FP8
  weight without its scale, one expert of a layer) raises, bad / unknown / missing tensors raise one error naming them;
* SGLang's dummy load (its `initialize_dummy_weights`, then `post_load_weights`) gives a model
  whose forward is finite.
"""
from __future__ import annotations

import pytest
import torch

from runtime_scenarios import one_shot_logits, prompt
from tp_harness import stored_tensors
from sglang_dsv41.checkpoint.names import Kind, stored_inventory, tensor_inventory
from sglang_dsv41.checkpoint.reader import CheckpointFormatError
from sglang_dsv41.config import DeepseekV41Config
from sglang_dsv41.engram_hash import EngramHasher, _load_fast_tokenizer, compressed_token_map
from sglang_dsv41.runtime.backend import ExactTorchBackend
from sglang_dsv41.runtime.forward import TorchForward, fp32_default_dtype
from sglang_dsv41.runtime.moe_ops import RoutedExpertsMxfp4
from sglang_dsv41.runtime.tensor_parallel import ShardPlan, TensorParallel, load_shard_weights
from sglang_dsv41.runtime.weight_modules import parameter_target
from sglang_dsv41.runtime.weights import runtime_weights

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    cfg = DeepseekV41Config.from_file(tiny_checkpoint)
    token_map, _ = compressed_token_map(_load_fast_tokenizer(tiny_checkpoint))
    return cfg, stored_tensors(tiny_checkpoint), EngramHasher.from_config(cfg, token_map)


def streamed(tiny, *, tp: TensorParallel = TensorParallel(), cuda_form: bool = False, deterministic=True):
    cfg, stored, hasher = tiny
    with fp32_default_dtype():
        # the CUDA form on CPU: compared, never run (a fixed backend skips the CPU backends' E4M3 check)
        model = TorchForward.for_loading(cfg, hasher, tp=tp, experts_mxfp4=cuda_form, dense_fp8=cuda_form,
                                         deterministic=deterministic, backend=ExactTorchBackend() if cuda_form else None)
        model.load_weights(stored.items())
    return model


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def assert_same_values(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name, w in want.items():
        g = got[name]
        if isinstance(w, torch.Tensor):
            assert g.dtype == w.dtype and g.shape == w.shape and torch.equal(_bytes(g), _bytes(w)), name
        elif isinstance(w, RoutedExpertsMxfp4):
            assert g.expert_ids == w.expert_ids and torch.equal(g.local_index, w.local_index), name
            for field in ("w13", "w13_scale", "w2", "w2_scale"):
                assert torch.equal(getattr(g.prepared, field).storage.data, getattr(w.prepared, field).storage.data)
        else:                                                        # stored Engram table
            assert torch.equal(_bytes(g.values), _bytes(w.values)), name
            assert torch.equal(_bytes(g.scales), _bytes(w.scales)), name


def test_checkpoint_names_map_one_to_one_onto_parameters(tiny) -> None:
    cfg, stored, _ = tiny
    model = streamed(tiny)
    params = dict(model.named_parameters())
    wanted = stored_inventory(cfg, vision=False, dspark=False)
    assert set(wanted) <= set(stored)
    targets: dict[str, list[tuple]] = {}
    for name in wanted:
        target, extra = parameter_target(name)
        assert target in params, f"{name} → {target}: no such parameter"
        targets.setdefault(target, []).append(extra)
    assert set(targets) == set(params), sorted(set(params) - set(targets))[:5]
    E = cfg.text.n_routed_experts
    for target, extras in targets.items():
        if ".ffn.experts." in target:                               # stacked: each (shard, expert) once
            shards = ("w2",) if ".w2_" in target else ("w1", "w3")
            assert sorted(extras) == sorted((s, e) for s in shards for e in range(E)), target
        else:
            assert extras == [()], target
    assert all(not p.requires_grad and hasattr(p, "weight_loader") for p in params.values())
    layer0 = {n for n, _ in model.layers[0].named_parameters()}
    assert {"attn.wq_a.weight", "attn.wq_a.scale", "ffn.experts.w13_weight", "ffn.experts.w2_scale",
            "hc_attn.fn"} <= layer0
    # every linear, the embedding and the head are SGLang's layer classes with our quant methods
    from sglang.srt.layers import linear, vocab_parallel_embedding as vocab

    attn = model.layers[0].attn
    kinds = {"wq_a": linear.ReplicatedLinear, "wkv": linear.ReplicatedLinear, "wq_b": linear.ReplicatedLinear,
             "wo_a": linear.ReplicatedLinear, "wo_b": linear.RowParallelLinear}
    for name, cls in kinds.items():
        assert isinstance(getattr(attn, name), (cls, linear.ColumnParallelLinear)), name
        assert type(getattr(attn, name).quant_method).__name__ == "Fp8TileParallelMethod", name
    assert isinstance(model.layers[0].ffn.gate, linear.ReplicatedLinear)
    assert type(model.layers[0].ffn.gate.quant_method).__name__ == "Bf16ReplicatedMethod"
    assert isinstance(model.embed, vocab.VocabParallelEmbedding) and isinstance(model.head, vocab.ParallelLMHead)


def test_streaming_equals_the_old_loading_path_cpu_form(tiny) -> None:
    cfg, stored, _ = tiny
    model = streamed(tiny)
    assert_same_values(model.weights, runtime_weights(stored, cfg, CPU, experts_mxfp4=False))


def test_streaming_equals_the_old_loading_path_cuda_form(tiny) -> None:
    cfg, stored, _ = tiny
    model = streamed(tiny, cuda_form=True)
    want = runtime_weights(stored, cfg, CPU, experts_mxfp4=True, dense_fp8=True)
    assert any(isinstance(t, torch.Tensor) and t.dtype == torch.float8_e4m3fn for t in want.values())
    assert_same_values(model.weights, want)
    experts = model.layers[0].ffn.experts
    assert all(p.numel() == 0 for p in experts.parameters())         # kernel layout replaced the stored bytes


@pytest.mark.parametrize("rank", [0, 1])
def test_streaming_tp2_shard_equals_the_shard_loader(tiny, rank, monkeypatch) -> None:
    cfg, stored, _ = tiny
    plan = ShardPlan.for_config(cfg.text, rank, 2)
    tp = TensorParallel()
    monkeypatch.setattr(tp, "plan", lambda text: plan)                   # the shard, without a process group
    model = streamed(tiny, tp=tp)
    assert_same_values(model.weights, load_shard_weights(stored, cfg, plan))
    held = model.layers[0].ffn.experts.expert_ids
    assert held == list(plan.experts) and len(held) < cfg.text.n_routed_experts


def test_streamed_model_gives_the_old_models_logits(tiny) -> None:
    cfg, stored, hasher = tiny
    old = TorchForward(cfg, runtime_weights(stored, cfg, CPU, experts_mxfp4=False), hasher, deterministic=False)
    new = streamed(tiny, deterministic=False)
    tokens = prompt(7, 19)
    assert torch.equal(one_shot_logits(new, CPU, tokens), one_shot_logits(old, CPU, tokens))


def test_runtime_values_are_the_parameters_no_second_copy(tiny) -> None:
    model = streamed(tiny)
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    for name, value in model.weights.items():
        tensors = [value] if isinstance(value, torch.Tensor) else [value.values, value.scales]
        assert all(t.untyped_storage().data_ptr() in storages for t in tensors), name


def test_reload_replaces_values_and_partial_fp8_reload_raises(tiny) -> None:
    cfg, stored, _ = tiny
    model = streamed(tiny)
    norm = model.weights["norm.weight"]
    model.load_weights([("norm.weight", stored["norm.weight"] * 2)])                  # a subset is a reload
    assert torch.equal(model.weights["norm.weight"], (stored["norm.weight"] * 2).float().bfloat16().float())
    assert model.weights["norm.weight"] is norm                                        # same parameter
    model.load_weights(stored.items())
    assert_same_values(model.weights, runtime_weights(stored, cfg, CPU, experts_mxfp4=False))
    kept = streamed(tiny, cuda_form=True)
    with pytest.raises(RuntimeError, match="wq_a.*reloaded in part"):
        kept.load_weights([("layers.0.attn.wq_a.weight", stored["layers.0.attn.wq_a.weight"])])
    one_expert = [(n, t) for n, t in stored.items() if n.startswith("layers.1.ffn.experts.0.")]
    assert len(one_expert) == 6
    for form in (model, streamed(tiny, cuda_form=True)):
        with pytest.raises(RuntimeError, match="routed experts.*reloaded in part"):
            form.load_weights(one_expert)
    layer1 = [(n, t) for n, t in stored.items() if n.startswith("layers.1.ffn.experts.")]
    model.load_weights(layer1)                       # every expert of the layer: accepted, and repairs it
    assert_same_values(model.weights, runtime_weights(stored, cfg, CPU, experts_mxfp4=False))


def test_bad_unknown_and_missing_tensors_raise_one_error(tiny) -> None:
    cfg, stored, hasher = tiny
    with fp32_default_dtype():
        model = TorchForward.for_loading(cfg, hasher, experts_mxfp4=False, dense_fp8=False)
    broken = dict(stored)
    del broken["layers.1.ffn.experts.0.w2.scale"]
    broken["layers.0.attn.wkv.weight"] = broken["layers.0.attn.wkv.weight"][:-1]
    broken["layers.0.mystery.weight"] = torch.zeros(2)
    with pytest.raises(CheckpointFormatError) as err:
        model.load_weights(broken.items())
    for what in ("experts.0.w2.scale", "layers.0.attn.wkv.weight: shape", "mystery"):
        assert what in str(err.value)
    with pytest.raises(RuntimeError, match="forward before the weights were loaded"):
        one_shot_logits(model, CPU, [1, 2])


def test_sglang_dummy_load_gives_a_finite_forward(tiny) -> None:
    from sglang.srt.model_loader.weight_utils import initialize_dummy_weights

    cfg, _, hasher = tiny
    with fp32_default_dtype():
        model = TorchForward.for_loading(cfg, hasher, experts_mxfp4=False, dense_fp8=False, deterministic=False)
        initialize_dummy_weights(model)
        model.post_load_weights()
    logits = one_shot_logits(model, CPU, prompt(3, 9))
    assert torch.isfinite(logits).all()


def expected_cpu_bytes(cfg: DeepseekV41Config) -> int:
    """Bytes a TP-1 CPU model holds, from the inventory: fp32 values of dense / plain tensors and
    experts, the stored scale bytes next to them, Engram tables as stored."""
    total = 0
    for spec in tensor_inventory(cfg, vision=False, dspark=False):
        stored = spec.stored()
        if spec.kind is Kind.ENGRAM:
            total += sum(s.nbytes for s in stored)
        else:
            total += 4 * spec.numel + sum(s.nbytes for s in stored[1:])       # + scale bytes (FP8, FP4)
    return total


def test_parameters_hold_exactly_the_expected_bytes(tiny) -> None:
    model = streamed(tiny)
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    assert held == expected_cpu_bytes(tiny[0])
    assert sum(b.numel() for b in model.buffers()) == 0

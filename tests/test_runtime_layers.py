"""The runtime model as `nn.Module`s that own their parameters (`runtime/layers.py`, issue 13 item 2).

* every runtime weight of the tiny checkpoint is a parameter under its checkpoint name
  (hyper-connections: `hc_attn.fn` for `hc_attn_fn`) or, for the stacked routed experts, a view
  of one (same storage, no copy; `weight_modules.parameter_target`);
* a weight no layer owns raises;
* the decoder layer's forward fits on one screen and runs Engram → hc → attention → hc → MoE → hc;
* the model picks its implementations once, at construction (backend, attention, mHC, MoE);
* every linear computes through its own quantisation method: in one forward each linear layer's
  `apply` runs, and no backend product ever receives a linear's weight outside that apply.
"""
from __future__ import annotations

import inspect

import pytest
import torch

from runtime_scenarios import one_shot_logits, prompt, runtime_engine
from sglang_dsv41.runtime import parallel_linear, vocab_parallel
from sglang_dsv41.runtime.backend import ExactTorchBackend
from sglang_dsv41.runtime.forward import TorchForward
from sglang_dsv41.runtime.layers import DeepseekV41DecoderLayer
from sglang_dsv41.runtime.mhc_ops import TorchMhc
from sglang_dsv41.runtime.weight_modules import parameter_target

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def engine(tiny_checkpoint) -> TorchForward:
    return runtime_engine(tiny_checkpoint, CPU)


def test_every_weight_is_a_parameter_under_its_name(engine) -> None:
    params = dict(engine.named_parameters())
    storages = {p.untyped_storage().data_ptr() for p in params.values()}
    for name, value in engine.weights.items():
        target, extra = parameter_target(name)
        if not extra and isinstance(value, torch.Tensor):            # not a stacked expert view
            assert params[target] is value, name
        tensors = [value] if isinstance(value, torch.Tensor) else [value.values, value.scales]
        assert all(t.untyped_storage().data_ptr() in storages for t in tensors), name   # no copy
    assert all(not p.requires_grad for p in params.values())
    layer0 = {n for n, _ in engine.layers[0].named_parameters()}
    assert {"attn.wq_a.weight", "attn_norm.weight", "ffn.gate.weight", "hc_attn.fn"} <= layer0


def test_a_weight_no_layer_owns_raises(engine) -> None:
    weights = dict(engine.weights)
    weights["layers.0.mystery.weight"] = torch.zeros(2)
    with pytest.raises(ValueError, match="no layer owns.*mystery"):
        TorchForward(engine.cfg, weights, engine.hasher)


def test_decoder_layer_forward_fits_on_one_screen() -> None:
    source = inspect.getsource(DeepseekV41DecoderLayer.forward).splitlines()
    assert len(source) <= 20, len(source)
    body = "\n".join(source)
    order = [body.index(s) for s in ("self.engram(", "fork(self.hc_attn,", "self.attn(", "fork(self.hc_ffn,",
                                     "self.ffn(")]
    assert order == sorted(order)


def test_implementations_are_chosen_at_construction(engine) -> None:
    assert isinstance(engine.backend, ExactTorchBackend) and isinstance(engine.mhc, TorchMhc)
    assert len(engine.layers) == engine.text.num_hidden_layers


def test_every_linear_computes_through_its_quantisation_method(engine, monkeypatch) -> None:
    """Spy on the methods' `apply` (FP8 tile, BF16, vocab head) and on the backend's products:
    one prefill applies every linear layer of the model, and a product that receives a linear's
    weight while that layer's `apply` is not running (a weight read by name) fails the test."""
    linears = {id(m): n for n, m in engine.named_modules() if parallel_linear.is_parallel_linear(m)}
    linears[id(engine.head)] = "head"
    weight_of = {id(m.weight): id(m) for m in engine.modules() if id(m) in linears}
    applied: dict[int, int] = {}
    running: list[int] = []
    bypassed: list[str] = []

    def spy(cls):
        inner = cls.apply

        def apply(self, layer, x, *args, **kwargs):
            applied[id(layer)] = applied.get(id(layer), 0) + 1
            running.append(id(layer.weight))
            try:
                return inner(self, layer, x, *args, **kwargs)
            finally:
                running.pop()
        monkeypatch.setattr(cls, "apply", apply)

    for cls in (parallel_linear.Fp8TileParallelMethod, parallel_linear.Bf16ReplicatedMethod,
                vocab_parallel.Bf16VocabMethod):
        spy(cls)
    be = engine.backend
    for name in ("linear_fp8", "linear_fp8_partial", "linear_bf16", "linear_bf16_grouped", "matmul", "matmul_acc"):
        def product(x, weight, *args, _inner=getattr(be, name), _name=name, **kwargs):
            if id(weight) in weight_of and (not running or running[-1] != id(weight)):
                bypassed.append(f"{_name} on {linears[weight_of[id(weight)]]}")
            return _inner(x, weight, *args, **kwargs)
        monkeypatch.setattr(be, name, product)
    one_shot_logits(engine, CPU, prompt(11, 9))
    assert not bypassed, bypassed[:8]
    missing = sorted(n for i, n in linears.items() if not applied.get(i))
    assert not missing, f"{len(missing)} of {len(linears)} linears never applied, e.g. {missing[:6]}"
    assert len(linears) > 10 * len(engine.layers)


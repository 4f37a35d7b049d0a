"""`--load-format dummy` weights (issue 21 item 3; `runtime/dummy_weights.py`,
`runtime/routing_spread.py`), on CPU at tiny widths:

* every stored tensor of the inventory (vision and DSpark included) comes out in its stored dtype
  and shape, and decodes (FP8 tiles, MXFP4, Engram rows) to finite values of the synth scale;
* the same seed gives the same bytes, another seed other bytes;
* the dummy router spreads top-k over the experts like uniform routing, and the metric reports a
  collapsed router as collapsed;
* a model loaded from them gives a finite forward; the DSpark draft fills itself on
  `post_load_weights` under a dummy load and refuses otherwise.
The served path (`python -m sglang.launch_server --load-format dummy`) is checked by
`test_runtime_weights_server.py::test_dummy_load_format_serves`.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from runtime_scenarios import one_shot_logits, prompt
from sglang_dsv41.checkpoint.loader import check_stored, logical_tensor
from sglang_dsv41.checkpoint.names import Kind, tensor_inventory
from sglang_dsv41.config import DeepseekV41Config
from sglang_dsv41.engram_hash import EngramHasher, _load_fast_tokenizer, compressed_token_map
from sglang_dsv41.runtime.dummy_weights import dummy_stored_tensors, meta_stored_tensors
from sglang_dsv41.runtime.forward import TorchForward, fp32_default_dtype
from sglang_dsv41.runtime.routing_spread import distinct_experts, dummy_router_spread, route_topk, uniform_distinct

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def cfg(tiny_checkpoint) -> DeepseekV41Config:
    return DeepseekV41Config.from_file(tiny_checkpoint)


@pytest.fixture(scope="module")
def stored(cfg) -> dict[str, torch.Tensor]:
    return dict(dummy_stored_tensors(cfg, CPU, seed=3, specs=tensor_inventory(cfg, vision=True, dspark=True)))


def test_every_stored_tensor_in_its_format_and_finite(cfg, stored) -> None:
    check_stored(stored, cfg, vision=True, dspark=True, meta=lambda n: (stored[n].dtype, tuple(stored[n].shape)))
    kinds = set()
    for spec in tensor_inventory(cfg, vision=True, dspark=True):
        value = logical_tensor(spec, stored.__getitem__).float()
        assert torch.isfinite(value).all(), spec.name
        assert value.abs().max() > 0, spec.name
        if spec.kind in (Kind.FP8, Kind.FP4) and len(spec.shape) == 2 and "gate" not in spec.name:
            rms = float(value.pow(2).mean().sqrt()) * spec.shape[1] ** 0.5      # ≈ gain (1 or 1/64, 1/4)
            assert 2 ** -8 < rms < 4, (spec.name, rms)
        kinds.add(spec.kind)
    assert {Kind.FP8, Kind.FP4, Kind.ENGRAM, Kind.BF16, Kind.FP32} <= kinds


def test_seeded(cfg, stored) -> None:
    specs = tensor_inventory(cfg, vision=False, dspark=False)[:6]
    again = dict(dummy_stored_tensors(cfg, CPU, seed=3, specs=specs))
    other = dict(dummy_stored_tensors(cfg, CPU, seed=4, specs=specs))
    for name, t in again.items():
        assert torch.equal(t.view(torch.uint8) if t.element_size() == 1 else t, stored[name].view(torch.uint8)
                           if t.element_size() == 1 else stored[name]), name
    assert any(not torch.equal(a.float(), other[n].float()) for n, a in again.items())


def test_meta_tensors_carry_the_inventory(cfg) -> None:
    specs = tensor_inventory(cfg, vision=False, dspark=False)
    meta = dict(meta_stored_tensors(specs))
    assert all(t.device.type == "meta" for t in meta.values())
    check_stored(meta, cfg, vision=False, dspark=False, meta=lambda n: (meta[n].dtype, tuple(meta[n].shape)))


def test_dummy_router_spreads_like_uniform_routing(cfg) -> None:
    res = dummy_router_spread(cfg, CPU, batches=(1, 4, 8), draws=8)
    t = cfg.text
    for row in res["per_batch"]:
        assert row["uniform_expectation"] == pytest.approx(uniform_distinct(row["tokens"], t.n_routed_experts,
                                                                            t.num_experts_per_tok))
        assert row["ratio"] > 0.85, row
    collapsed = route_topk(torch.randn(16, t.hidden_size), torch.zeros(t.n_routed_experts, t.hidden_size),
                           torch.zeros(t.n_routed_experts), t.num_experts_per_tok)
    assert distinct_experts(collapsed) == t.num_experts_per_tok
    assert distinct_experts(torch.tensor([[0, -1], [0, 3]])) == 2


def test_model_from_dummy_weights_gives_a_finite_forward(tiny_checkpoint, cfg) -> None:
    token_map, _ = compressed_token_map(_load_fast_tokenizer(tiny_checkpoint))
    with fp32_default_dtype():
        model = TorchForward.for_loading(cfg, EngramHasher.from_config(cfg, token_map), experts_mxfp4=False,
                                         dense_fp8=False, deterministic=False)
        model.load_weights(dummy_stored_tensors(cfg, CPU, seed=0))
    logits = one_shot_logits(model, CPU, prompt(3, 9))
    assert torch.isfinite(logits).all() and logits.std() > 0.1


def test_dspark_draft_fills_itself_under_a_dummy_load(tiny_checkpoint, monkeypatch) -> None:
    from sglang_dsv41 import plugin
    from sglang_dsv41.runtime import dspark_model
    from sglang_dsv41.runtime.hf_config import DeepseekV41HFConfig

    plugin.register_config()
    hf = DeepseekV41HFConfig.from_pretrained(str(tiny_checkpoint))
    monkeypatch.setattr(dspark_model, "dummy_seed", lambda: 0)
    monkeypatch.setattr("sglang_dsv41.runtime.model.deterministic_inference", lambda: False)
    monkeypatch.setattr(dspark_model, "dummy_load_requested", lambda draft: False)
    with pytest.raises(RuntimeError, match="outside --load-format dummy"):
        dspark_model.DeepseekV41ForCausalLMDSpark(hf).post_load_weights()
    monkeypatch.setattr(dspark_model, "dummy_load_requested", lambda draft: draft)
    model = dspark_model.DeepseekV41ForCausalLMDSpark(hf)
    model.post_load_weights()
    assert model.draft is not None


def test_config_only_directory(tmp_path) -> None:
    from sglang_dsv41.checkpoint.synth import cli

    assert cli(["--preset", "tiny", "--config-only", "--out", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "special_tokens_map.json", "tokenizer.json",
                                                          "tokenizer_config.json"]
    assert DeepseekV41Config.from_file(tmp_path).text.num_hidden_layers == 8
    assert cli(["--preset", "tiny", "--config-only", "--out", str(tmp_path)]) == 1          # no silent overwrite
    assert cli(["--preset", "tiny", "--config-only", "--layers", "4", "--out", str(tmp_path), "--overwrite"]) == 1


def test_dummy_seed_is_the_same_in_every_launch(monkeypatch) -> None:
    """Two servers (a restart reading L3 KV, PD prefill and decode) must draw the same weights:
    SGLang's `--random-seed`, random per launch when unset, must not move the dummy seed."""
    from sglang.srt import server_args as sa

    from sglang_dsv41.runtime import dummy_weights as dw

    monkeypatch.delenv(dw.DUMMY_SEED_ENV, raising=False)
    seen = set()
    for launch_seed in (12345, 987654):
        monkeypatch.setattr(sa, "get_global_server_args", lambda s=launch_seed: SimpleNamespace(random_seed=s))
        seen.add(dw.dummy_seed())
    assert seen == {dw.DUMMY_SEED}
    monkeypatch.setenv(dw.DUMMY_SEED_ENV, " 7 ")
    assert dw.dummy_seed() == 7
    monkeypatch.setenv(dw.DUMMY_SEED_ENV, "seven")
    with pytest.raises(ValueError, match="SGLANG_DSV41_DUMMY_SEED"):
        dw.dummy_seed()

"""DSpark's SGLang side on CPU (docs/dspark.md): bundle detection and draft config through SGLang
0.5.17's own functions, the two DSpark hooks (their targets are pinned by tests/test_hooks.py),
the start-up refusals, and the target's capture of the DSpark layers' attention input.
"""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from sglang_dsv41 import hooks, plugin


@pytest.fixture(scope="module")
def registered():
    plugin.register()
    return hooks.specs_for(("runtime",))


@pytest.fixture(scope="module")
def hf(registered, tiny_checkpoint: Path):
    from sglang.srt.configs.model_config import ModelConfig

    return ModelConfig(str(tiny_checkpoint)).hf_config


def test_bundle_detection_and_draft_config_read_our_config(hf, tiny_checkpoint):
    """SGLang's own parsers find the bundled draft and read γ, mask id, capture layers, Markov rank."""
    from sglang.srt.speculative.dspark_components.dspark_config import (
        checkpoint_bundles_dspark_draft,
        parse_dspark_draft_config,
        resolve_runtime_config,
    )

    text = hf.parsed().text
    assert checkpoint_bundles_dspark_draft(hf)
    parsed = parse_dspark_draft_config(draft_hf_config=hf)
    assert parsed.gamma == text.dspark_block_size == 5
    assert parsed.mask_token_id == text.dspark_noise_token_id
    assert parsed.target_layer_ids == list(text.dspark_target_layer_ids)
    assert parsed.markov_rank == text.dspark_markov_rank
    rc = resolve_runtime_config(draft_hf_config=hf, speculative_num_draft_tokens=None, target_vocab_size=text.vocab_size)
    assert (rc.gamma, rc.verify_num_draft_tokens, rc.mask_token_id) == (5, 6, text.dspark_noise_token_id)
    # the raw config.json is unchanged (the fields stay inside text_config)
    assert "dspark_block_size" not in hf.dsv41_config_json and "dspark_block_size" in hf.dsv41_config_json["text_config"]


def test_checkpoint_without_dspark_exposes_no_bundle(registered, tiny_checkpoint, tmp_path):
    import json
    import shutil

    from sglang.srt.speculative.dspark_components.dspark_config import checkpoint_bundles_dspark_draft

    from sglang_dsv41.runtime.hf_config import DeepseekV41HFConfig

    raw = json.loads((tiny_checkpoint / "config.json").read_text())
    t = raw["text_config"]
    t["num_nextn_predict_layers"] = 0
    t["compress_ratios"] = t["compress_ratios"][: t["num_hidden_layers"]]
    t["dspark_target_layer_ids"] = []
    (tmp_path / "config.json").write_text(json.dumps(raw))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (tiny_checkpoint / name).exists():
            shutil.copy(tiny_checkpoint / name, tmp_path / name)
    cfg = DeepseekV41HFConfig.from_pretrained(str(tmp_path))
    assert not checkpoint_bundles_dspark_draft(cfg)


@pytest.mark.parametrize("algo", ["DSPARK", None])
def test_draft_model_config_picks_our_draft_class(registered, tiny_checkpoint, algo):
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.utils import get_model_architecture

    from sglang_dsv41.runtime.dspark_model import DRAFT_ARCHITECTURE, DeepseekV41ForCausalLMDSpark

    draft = ModelConfig(str(tiny_checkpoint), is_draft_model=True, speculative_algorithm=algo)
    assert draft.hf_config.architectures == [DRAFT_ARCHITECTURE]
    cls, _ = get_model_architecture(draft)
    assert cls is DeepseekV41ForCausalLMDSpark
    target = ModelConfig(str(tiny_checkpoint), speculative_algorithm=algo)
    assert target.hf_config.architectures == ["DeepseekV41ForCausalLM"]        # the target is untouched


def test_draft_model_config_refuses_other_algorithms(registered, tiny_checkpoint):
    from sglang.srt.configs.model_config import ModelConfig

    with pytest.raises(ValueError, match="only speculative method"):
        ModelConfig(str(tiny_checkpoint), is_draft_model=True, speculative_algorithm="EAGLE")


def _server_args(hf, backend):
    return SimpleNamespace(model_path="/nonexistent/v41", speculative_draft_attention_backend=backend,
                           get_model_config=lambda: SimpleNamespace(hf_config=hf),
                           get_attention_backends=lambda: ("flashinfer", "flashinfer"))


def test_draft_attention_backend_hook(registered, hf):
    from sglang.srt.speculative import draft_worker_common as dwc

    resolve = dwc._resolve_draft_attention_backend_fallback
    assert resolve(draft_server_args=_server_args(hf, "dsv41"), algo_label="DSPARK") == "dsv41"
    assert resolve(draft_server_args=_server_args(hf, "torch_native"), algo_label="DSPARK") == "torch_native"
    with pytest.raises(ValueError, match="draft attention backend 'flashinfer'"):
        resolve(draft_server_args=_server_args(hf, None), algo_label="DSPARK")
    other = SimpleNamespace(architectures=["LlamaForCausalLM"])
    # another model keeps SGLang's fallback (torch_native is not in its list → flashinfer)
    assert resolve(draft_server_args=_server_args(other, "torch_native"), algo_label="DSPARK") == "flashinfer"


def test_dspark_refusals(hf):
    from sglang_dsv41.overrides import refusals, speculative_refusals

    text = hf.parsed().text
    cpu = speculative_refusals("DSPARK", text, "cpu")
    assert len(cpu) == 1 and "CUDA-only" in cpu[0] and "_handle_dspark" in cpu[0]
    assert speculative_refusals("DSPARK", text, "cuda") == []
    assert "only speculative method" in speculative_refusals("EAGLE", text, "cuda")[0]
    assert speculative_refusals(None, text, "cpu") == []
    assert any("--speculative-algorithm DSPARK on cpu" in m for m in refusals({"speculative_algorithm": "DSPARK"},
                                                                              text, "cpu"))


def test_pool_builder_gives_the_draft_worker_its_draft_pool(registered, tiny_checkpoint):
    """SGLang's draft worker builds its pool through our hook (the draft's ModelConfig, renamed
    architecture): a `DeepseekV41DSparkPool` over the target's full slots, which the draft model
    finds its context store in (tests/test_runtime_dspark_pool.py checks the buffers)."""
    from sglang.srt.configs.model_config import ModelConfig

    from sglang_dsv41.runtime.dspark_model import dspark_context_of
    from sglang_dsv41.runtime.dspark_pool import DeepseekV41DSparkPool
    from sglang_dsv41.runtime.sglang_pool import build_token_to_kv_pool_hook

    draft = ModelConfig(str(tiny_checkpoint), is_draft_model=True, speculative_algorithm="DSPARK")
    args = SimpleNamespace(speculative_algorithm="DSPARK", speculative_num_draft_tokens=6)
    kvc = SimpleNamespace(model_config=draft, is_hybrid_swa=True, is_draft_worker=True, server_args=args,
                          kv_cache_dtype=torch.bfloat16, pool_page_size=2, device="cpu")
    sizes = SimpleNamespace(full_max_total_num_tokens=64, swa_max_total_num_tokens=32)
    pool = build_token_to_kv_pool_hook(lambda *a, **k: pytest.fail("SGLang's own pool built"), kvc, sizes=sizes,
                                       is_dsa_model=False, is_dsv4_model=False, req_to_token_pool=None)
    assert isinstance(pool, DeepseekV41DSparkPool) and pool.size == 64
    assert dspark_context_of(pool) is pool.dspark_context and pool.dspark_context.rows == 66
    hicache = SimpleNamespace(**{**vars(kvc), "server_args": SimpleNamespace(**vars(args),
                                                                             enable_hierarchical_cache=True)})
    with pytest.raises(RuntimeError, match="--enable-hierarchical-cache with --speculative-algorithm DSPARK"):
        build_token_to_kv_pool_hook(lambda *a, **k: None, hicache, sizes=sizes, req_to_token_pool=None)
    for draft_worker in (True, False):                        # the draft's pool and the target's
        refused = SimpleNamespace(**{**vars(kvc), "is_draft_worker": draft_worker,
                                     "server_args": SimpleNamespace(**vars(args), enable_hierarchical_cache=True)})
        with pytest.raises(RuntimeError, match="--enable-hierarchical-cache with --speculative-algorithm DSPARK"):
            build_token_to_kv_pool_hook(lambda *a, **k: None, refused, sizes=sizes, req_to_token_pool=None)
    # PD + DSpark: refused on CPU only (tests/test_runtime_pd.py checks both devices)
    pd = SimpleNamespace(**{**vars(kvc), "server_args": SimpleNamespace(**vars(args), disaggregation_mode="decode")})
    with pytest.raises(RuntimeError, match="--disaggregation-mode with --speculative-algorithm DSPARK on cpu"):
        build_token_to_kv_pool_hook(lambda *a, **k: None, pd, sizes=sizes, req_to_token_pool=None)


# ---- target side: capture of the DSpark layers' attention input ------------------------------

def test_target_captures_stream_mean_layer_inputs_like_the_reference(tiny_checkpoint):
    from runtime_scenarios import Slots, allocate_caches, prompt, run_batch, runtime_engine

    from sglang_dsv41.reference.model import ReferenceModel

    engine = runtime_engine(tiny_checkpoint, torch.device("cpu"))
    ids = prompt(7, 21)
    layers = engine.text.dspark_target_layer_ids
    engine.set_capture_layers(layers)
    slots = Slots(torch.device("cpu"), rows=2, max_context=len(ids))
    run_batch(engine, allocate_caches(engine, slots), slots, [(1, 0, ids)])
    captured = torch.stack(engine.captured, dim=1)                       # [T, n, H]
    reference = ReferenceModel.from_checkpoint(tiny_checkpoint)
    state = reference.new_request()
    reference.prefill(state, ids, capture=True)
    assert torch.equal(captured, state.dspark_features)
    with pytest.raises(ValueError, match="distinct layer ids"):
        engine.set_capture_layers([0, 99])
    engine.set_capture_layers(())
    run_batch(engine, allocate_caches(engine, slots), slots, [(1, 0, ids)])
    assert engine.captured is None


def test_target_model_set_dspark_layers_to_capture_checks_the_ids(registered, tiny_checkpoint):
    from sglang.srt.configs.model_config import ModelConfig

    from sglang_dsv41.runtime.model import DeepseekV41ForCausalLM

    hf = ModelConfig(str(tiny_checkpoint)).hf_config
    model = DeepseekV41ForCausalLM.__new__(DeepseekV41ForCausalLM)
    torch.nn.Module.__init__(model)
    model.cfg, model.torch_forward = hf.parsed(), None
    ids = list(model.cfg.text.dspark_target_layer_ids)
    model.set_dspark_layers_to_capture(ids)
    assert model.dspark_capture_layers == tuple(ids)
    with pytest.raises(ValueError, match="dspark_target_layer_ids"):
        model.set_dspark_layers_to_capture(ids[::-1])


def test_model_classes_refuse_a_config_the_plugin_did_not_make() -> None:
    """Target and draft classes parse SGLang's HF config through `hf_config.parsed_config`; a
    foreign config class is refused naming the likely cause."""
    from types import SimpleNamespace

    from sglang_dsv41.runtime.dspark_model import DeepseekV41ForCausalLMDSpark
    from sglang_dsv41.runtime.model import DeepseekV41ForCausalLM

    for cls in (DeepseekV41ForCausalLM, DeepseekV41ForCausalLMDSpark):
        with pytest.raises(TypeError, match="is the sglang-dsv41 plugin loaded"):
            cls(SimpleNamespace(model_type="llama"))

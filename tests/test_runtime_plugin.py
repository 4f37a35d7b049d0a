"""The SGLang plugin: entry point, version guard, loud failure, and that a V4.1 checkpoint can only
be served by our class (runtime.md §B; issue 3 item 1)."""
from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from sglang_dsv41 import plugin

ROOT = Path(__file__).resolve().parents[1]


def test_entry_point_is_declared_and_installed() -> None:
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    assert declared["sglang.srt.plugins"] == {"dsv41": "sglang_dsv41.plugin:register"}
    installed = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="sglang.srt.plugins")}
    assert installed.get("dsv41") == "sglang_dsv41.plugin:register"


def test_version_guard_names_both_versions() -> None:
    with pytest.raises(plugin.PluginLoadError) as e:
        plugin.check_sglang_version("0.5.23")
    assert "0.5.17" in e.value.message and "0.5.23" in e.value.message
    assert isinstance(e.value, SystemExit)        # SGLang's loader catches Exception, not SystemExit
    plugin.check_sglang_version("0.5.17")         # the supported version passes


def test_register_refuses_other_sglang_before_touching_it(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    monkeypatch.setattr(plugin, "installed_sglang_version", lambda: "0.5.18")
    monkeypatch.setattr(plugin, "register_config", lambda: calls.append("config"))
    with pytest.raises(plugin.PluginLoadError, match=r"0\.5\.17.*0\.5\.18"):
        plugin.register()
    assert calls == []


def test_registration_failure_stops_the_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plugin, "installed_sglang_version", lambda: plugin.SUPPORTED_SGLANG_VERSION)
    monkeypatch.setattr(plugin, "register_config", lambda: None)

    def broken() -> None:
        raise ImportError("no module named sglang.srt.models.registry")

    monkeypatch.setattr(plugin, "register_model", broken)
    with pytest.raises(plugin.PluginLoadError, match="ImportError"):
        plugin.register()


def test_v41_checkpoint_resolves_to_our_class_and_no_v4_path(tiny_checkpoint: Path) -> None:
    """In-process, what SGLang's scheduler does after loading plugins: ModelConfig + architecture."""
    from sglang.srt.configs.model_config import AttentionArch, ModelConfig, is_deepseek_dsa, is_deepseek_v4
    from sglang.srt.model_loader.utils import get_model_architecture
    from sglang.srt.models.registry import ModelRegistry

    from sglang_dsv41.runtime.model import DeepseekV41ForCausalLM

    plugin.register()
    plugin.register()                                          # idempotent
    mc = ModelConfig(str(tiny_checkpoint))
    cls, arch = get_model_architecture(mc)
    assert cls is DeepseekV41ForCausalLM and arch == "DeepseekV41ForCausalLM"
    assert mc.hf_config.architectures == ["DeepseekV41ForCausalLM"]
    assert mc.hf_config.model_type == "deepseek_v41"
    # none of the V4 / DSA / MLA / FP8 paths engage for our architecture; a checkpoint with a
    # vision_config is multimodal through our registration (runtime/mm_processor.py, docs/vision.md)
    assert not is_deepseek_v4(mc.hf_config) and not is_deepseek_dsa(mc.hf_config)
    assert mc.attention_arch == AttentionArch.MHA
    assert mc.is_multimodal and mc.is_multimodal_chunked_prefill_supported and mc.quantization is None
    # the model as it is: 8 decoder layers, each sliding-window attention over one KV head of 96
    # (K = V); SGLang takes its hybrid-SWA path, and our pool (runtime/kv_pool.py) holds the rows
    assert mc.is_hybrid_swa and not mc.is_hybrid_swa_compress and not mc.is_deepseek_v4_arch
    assert mc.num_hidden_layers == 8 and mc.full_attention_layer_ids == []
    assert mc.swa_attention_layer_ids == list(range(8))
    assert (mc.get_num_kv_heads(1), mc.head_dim, mc.v_head_dim) == (1, 96, 96)
    assert (mc.get_swa_num_kv_heads(1), mc.swa_head_dim, mc.swa_v_head_dim) == (1, 96, 96)
    assert mc.sliding_window_size == 8
    assert mc.context_len == 4096
    # V4's own class is untouched: we add an architecture, we do not replace V4
    assert ModelRegistry.models["DeepseekV4ForCausalLM"] is not DeepseekV41ForCausalLM


def test_hf_config_exposes_a_generic_decoder_and_validates(tiny_checkpoint: Path, tmp_path: Path) -> None:
    import json

    from sglang_dsv41.config import ConfigError, DeepseekV41Config
    from sglang_dsv41.runtime.hf_config import DeepseekV41HFConfig

    raw = json.loads((tiny_checkpoint / "config.json").read_text())
    cfg = DeepseekV41HFConfig.from_dict(raw)
    assert cfg.parsed() == DeepseekV41Config.from_dict(raw)
    assert cfg.dsv41_config_json == raw                         # untouched original
    assert (cfg.num_key_value_heads, cfg.head_dim) == (1, 96)
    assert cfg.is_hybrid_swa and cfg.hybrid_layer_pattern == [1] * 8
    assert (cfg.num_hidden_layers, cfg.sliding_window) == (8, 8)
    for hidden in ("text_config", "vision_config", "quantization_config", "v_head_dim", "swa_head_dim",
                   "swa_v_head_dim", "swa_num_key_value_heads",
                   "rope_scaling", "index_topk", "kv_lora_rank", "num_nextn_predict_layers"):
        assert not hasattr(cfg, hidden), hidden
    again = DeepseekV41HFConfig.from_dict(cfg.to_dict())       # SGLang deep-copies / re-creates configs
    assert again.parsed() == cfg.parsed() and again.architectures == ["DeepseekV41ForCausalLM"]
    bad = json.loads(json.dumps(raw))
    bad["text_config"]["compress_ratios"][1] = 4                # a V4 ratio in a V4.1 config
    with pytest.raises(ConfigError, match="compress_ratios"):
        DeepseekV41HFConfig.from_dict(bad)


@pytest.mark.slow
def test_stock_sglang_refuses_a_v41_checkpoint(tiny_checkpoint: Path) -> None:
    """Without our plugin (SGLang's allow-list excludes it) the checkpoint is refused — neither
    served by the V4 model nor by SGLang's Transformers fallback."""
    script = textwrap.dedent(f"""
        from sglang.srt.plugins import load_plugins
        load_plugins()
        from sglang.srt.models.registry import ModelRegistry
        assert "DeepseekV41ForCausalLM" not in ModelRegistry.models
        from sglang.srt.configs.model_config import ModelConfig
        try:
            ModelConfig({str(tiny_checkpoint)!r})
        except ValueError as e:
            print("REFUSED:", str(e).splitlines()[0])
        else:
            print("SERVED")
    """)
    env = dict(os.environ, SGLANG_PLUGINS="only-a-plugin-that-does-not-exist")
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "REFUSED:" in run.stdout and "deepseek_v41" in run.stdout, run.stdout


def test_runtime_hooks_leave_other_models_alone() -> None:
    """The Engram-history hook acts on the V4.1 architecture only (the pool hooks' dispatch:
    tests/test_runtime_sglang_pool.py)."""
    from types import SimpleNamespace

    from sglang_dsv41.runtime.sglang_hooks import attach_engram_history_hook

    fb = SimpleNamespace(forward_mode=SimpleNamespace(name="EXTEND"))
    batch = SimpleNamespace(reqs=[SimpleNamespace(origin_input_ids=[1, 2], output_ids=[])])
    other_model = SimpleNamespace(stage_engram_history=None)       # would raise if called
    assert attach_engram_history_hook(fb, None, batch, SimpleNamespace(model=other_model)) is fb


@pytest.mark.slow
def test_sglang_plugin_loader_cannot_swallow_the_version_error() -> None:
    """Through SGLang's own `load_plugins()` (which logs and continues on `Exception`), a wrong
    SGLang version stops the process with our message."""
    script = textwrap.dedent("""
        import sglang_dsv41.plugin as p
        p.installed_sglang_version = lambda: "0.6.0"
        from sglang.srt.plugins import load_plugins
        load_plugins()
        print("SURVIVED")
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert run.returncode != 0 and "SURVIVED" not in run.stdout
    assert "supports SGLang 0.5.17 only, but SGLang 0.6.0 is installed" in run.stderr

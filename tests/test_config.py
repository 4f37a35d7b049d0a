"""Config parsing, validation errors, and the roles table (spec §1)."""
from __future__ import annotations

import copy
import re
import json

import pytest

from sglang_dsv41.config import ConfigError, DeepseekV41Config, yarn_ramp_bounds
from sglang_dsv41.presets import flash_config_dict, slice_config_dict, tiny_config_dict


def flash() -> DeepseekV41Config:
    return DeepseekV41Config.from_dict(flash_config_dict())


# Spec §1.3, written out by hand: layer → (ratio, rope, kv_source, computes_latents,
# runs_indexer, candidate_source, candidate_consumer, selection_from, engram, dspark_capture)
def _flash_expected_row(i: int) -> tuple:
    if i < 2:
        return (0, "A", None, False, False, False, False, None, i == 1, False)
    if i < 20:
        src = 2 if i < 8 else 8 if i < 14 else 14
        own = i in (2, 8, 14)
        return (2, "B", src, own, own, False, False, src, i == 14, False)
    consumers = (24, 28, 32, 36)
    sel = 20 if i < 24 else max(c for c in consumers if c <= i)
    return (1, "B", 20, i == 20, i == 20 or i in consumers, i == 20, i in consumers, sel, False, i >= 37)


def test_flash_roles_table_matches_spec_1_3() -> None:
    roles = flash().text.layer_roles()
    assert len(roles) == 40
    for r in roles:
        got = (r.ratio, r.rope, r.kv_source, r.computes_latents, r.runs_indexer, r.candidate_source,
               r.candidate_consumer, r.selection_from, r.engram, r.dspark_capture)
        assert got == _flash_expected_row(r.layer), f"layer {r.layer}"
        assert r.decoder == (r.layer >= 20)


def test_tiny_roles_match_spec_7() -> None:
    roles = DeepseekV41Config.from_dict(tiny_config_dict(500)).text.layer_roles()
    assert [r.ratio for r in roles] == [0, 2, 2, 2, 1, 1, 1, 1]
    assert [r.kv_source for r in roles] == [None, 1, 1, 3, 4, 4, 4, 4]
    assert [r.selection_from for r in roles] == [None, 1, 1, 3, 4, 4, 6, 6]
    assert [r.layer for r in roles if r.candidate_consumer] == [6]
    assert [r.layer for r in roles if r.candidate_source] == [4]
    assert [r.layer for r in roles if r.engram] == [1, 3]
    assert [r.layer for r in roles if r.dspark_capture] == [5, 6, 7]
    assert [r.layer for r in roles if r.decoder] == [4, 5, 6, 7]


def test_flash_yarn_ramp_bounds_are_15_25() -> None:
    t = flash().text
    rs = t.rope_scaling
    assert rs is not None
    assert yarn_ramp_bounds(t.qk_rope_head_dim, t.compress_rope_theta, rs.original_max_position_embeddings,
                            rs.beta_fast, rs.beta_slow) == (15, 25)


def test_flash_derived_sizes() -> None:
    c = flash()
    t = c.text
    assert (t.qk_nope_head_dim, t.heads_per_group, t.hc_dim, t.engram_num_columns) == (448, 8, 24, 24)
    assert c.has_vision and c.vision is not None and c.vision.head_dim == 64
    assert c.image_token_id == 129264 and c.eos_ids == (1,)


def test_slice_config_is_valid_and_keeps_the_roles_it_promises() -> None:
    d = slice_config_dict(layers=25)
    d["text_config"]["engram_num_embeddings"] = [1000, 1000]  # filled by synth in practice
    roles = DeepseekV41Config.from_dict(d).text.layer_roles()
    assert any(r.engram for r in roles) and any(r.candidate_consumer for r in roles)
    assert {r.ratio for r in roles} == {0, 1, 2}


def test_from_file_reads_a_directory(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(tiny_config_dict(321)))
    assert DeepseekV41Config.from_file(tmp_path).text.engram_compressed_vocab_size == 321
    with pytest.raises(ConfigError, match="no config.json"):
        DeepseekV41Config.from_file(tmp_path / "missing")


def _mutated(path: str, value) -> dict:
    d = copy.deepcopy(flash_config_dict())
    node = d
    keys = path.split(".")
    for k in keys[:-1]:
        node = node[k]
    if value is KeyError:
        del node[keys[-1]]
    else:
        node[keys[-1]] = value
    return d


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        ("architectures", ["DeepseekV4ForCausalLM"], "V4 checkpoint is not a V4.1"),
        ("model_type", "deepseek_v4", "model_type"),
        ("text_config.hidden_size", KeyError, "missing required field 'hidden_size'"),
        ("text_config.num_key_value_heads", 2, "single-KV-head"),
        ("text_config.compress_ratios", [0, 0] + [4] * 18 + [1] * 20 + [0, 0, 0], "only ratios 0, 1, 2"),
        ("text_config.compress_ratios", [0] * 10, "compress_ratios has 10 entries"),
        ("text_config.kv_source_layer_ids", [0, 8, 14, 20], "kv source layer 0 has compress ratio 0"),
        ("text_config.kv_source_layer_ids", [8, 14, 20], "layer 2 (ratio 2) has no kv source"),
        ("text_config.index_source_layer_ids", [8, 14, 20, 24], "layer 2 (ratio 2) has no indexer"),
        ("text_config.index_source_layer_ids", [2, 14, 20, 24, 28, 32, 36], "kv source layer 8 must be in index_source"),
        ("text_config.candidate_source_layer_id", 21, "must be a kv source"),
        ("text_config.engram_num_embeddings", [1], "engram_num_embeddings has 1 entries"),
        ("text_config.engram_layer_ids", [1, 30], "decoder half"),
        ("text_config.dspark_target_layer_ids", [38, 39], "for 3 DSpark stages"),
        ("text_config.num_hash_layers", 3, "hash-routed"),
        ("text_config.engram_compressed_vocab_size", None, "must be an integer"),
        ("quantization_config.weight_block_size", [128, 128], "weight_block_size must be [32, 32]"),
        ("quantization_config", KeyError, "missing 'quantization_config'"),
        ("image_token_id", 200000, "outside vocab_size"),
        ("text_config.num_attention_heads", 60, "not divisible by o_groups"),
    ],
)
def test_illegal_configs_fail_with_a_message_naming_the_field(path: str, value, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        DeepseekV41Config.from_dict(_mutated(path, value))


def test_text_only_checkpoint_has_no_vision() -> None:
    c = DeepseekV41Config.from_dict(_mutated("vision_config", KeyError))
    assert c.vision is None and not c.has_vision


def test_eos_list_is_accepted() -> None:
    assert DeepseekV41Config.from_dict(_mutated("eos_token_id", [1, 2])).eos_ids == (1, 2)

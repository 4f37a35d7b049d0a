"""Deployment configs: every shipped config validates; illegal combinations are rejected with
a message that names the problem (sglang_dsv41/deploy/schema.py)."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest

from sglang_dsv41.deploy.schema import (
    DeployConfigError, DeploymentConfig, EngramSpec, Validation, apply_override, config_from_dict, load_config,
)

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))

BASE = {
    "name": "x", "description": "d", "validated_on": "unvalidated",
    "hardware": {"gpu": "H200", "gpus": 4}, "parallel": {"tp": 4},
}


def test_the_card_targets_are_all_there() -> None:
    names = {p.stem for p in CONFIGS}
    required = {"h200-tp4", "h200-tp8", "b200-tp2", "b300-tp2", "gb200-tp2", "gb300-tp2", "b200-dep8", "b300-dep8",
                "gb200-dep4", "gb300-dep4", "mi355x-tp2", "mi355x-tp4", "mi325x-tp4", "tiny-h200-tp1",
                "tiny-h200-tp2", "tiny-cpu"}
    assert required <= names, sorted(required - names)
    loaded = [load_config(p) for p in CONFIGS]
    assert any(c.pd is not None for c in loaded)
    assert any(c.features.text_only for c in loaded)
    assert any(c.speculative.enabled for c in loaded)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_validates_and_records_validation(path: Path) -> None:
    c = load_config(path)
    assert c.name == path.stem
    if isinstance(c.validated_on, Validation):
        anchor = c.validated_on.log.split("#", 1)
        doc = (ROOT / anchor[0]).read_text()
        assert len(anchor) == 1 or anchor[1].replace("-", " ").lower() in doc.lower().replace("-", " ")
    else:
        assert c.validated_on == "unvalidated"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_engram_host_only_where_the_card_offloads(path: Path) -> None:
    c = load_config(path)
    if c.name in ("h200-tp4", "mi355x-tp2", "mi325x-tp4") or c.name.endswith("-tp2") and not c.name.startswith("tiny"):
        assert c.engram.placement == "host"
    if c.name in ("mi355x-tp4", "h200-tp8") or "-dep" in c.name:
        assert c.engram.placement == "device"


def test_host_layout_is_per_rank_and_shared_is_refused_naming_why() -> None:
    """This runtime implements the per_rank host table only (spec runtime.md §A.7): the default,
    what every shipped host config says, and the one a host placement accepts."""
    assert EngramSpec().host_layout == "per_rank"
    host = [c for c in map(load_config, CONFIGS) if c.engram.placement == "host"]
    assert host and all(c.engram.host_layout == "per_rank" for c in host)
    assert config_from_dict(_with(engram__placement="host")).engram.host_layout == "per_rank"
    with pytest.raises(DeployConfigError) as e:
        config_from_dict(_with(engram__placement="host", engram__host_layout="shared"), "test")
    text = str(e.value)
    assert "(config): engram.host_layout 'shared' with engram.placement host" in text
    assert "implements per_rank only" in text and "one memfd mapping for the whole TP group" in text
    assert "not implemented" in text and "set engram.host_layout: per_rank" in text


def _with(**changes: object) -> dict:
    d = copy.deepcopy(BASE)
    for key, value in changes.items():
        apply_override(d, f"{key.replace('__', '.')}={value}")
    return d


ILLEGAL = [
    ({"features__text_only": "true", "features__encoder_data_parallel": "true"}, "mutually exclusive"),
    ({"speculative__algorithm": "EAGLE", "speculative__block_size": "5"}, "DSpark is the only speculative method"),
    ({"speculative__algorithm": "dspark"}, "speculative.block_size must be given"),
    ({"parallel__tp": "3"}, "must equal hardware.gpus"),
    ({"parallel__dp_attention": "3"}, "does not divide parallel.tp"),
    ({"parallel__ep": "2"}, "must be 1 or equal parallel.tp"),
    ({"hardware__gpus": "16", "parallel__tp": "16"}, "exceeds the 8 GPUs"),
    ({"features__kv_layout": "v41"}, "v41 needs SM100/SM103 or gfx950"),
    ({"hardware__gpu": "MI355X", "features__bounded_replay__decoder": "true"}, "must be off on ROCm"),
    ({"features__bounded_replay__encoder": "true"}, "needs serving.max_running_requests"),
    ({"features__bounded_replay__decoder": "true", "cuda_graph__prefill": "full"}, "breakable or disabled"),
    ({"serving__moe_a2a_backend": "deepep", "parallel__ep": "4"}, "vision path refuses MoE all-to-all"),
    ({"serving__moe_a2a_backend": "megamoe", "parallel__ep": "4"}, "requires serving.chunked_prefill_size"),
    ({"serving__moe_a2a_backend": "megamoe", "parallel__ep": "4", "serving__chunked_prefill_size": "8192"},
     "above MegaMoE's 1024"),
    ({"serving__moe_a2a_backend": "megamoe"}, "needs expert parallelism"),
    ({"hardware__gpu": "CPU", "hardware__gpus": "0", "parallel__tp": "1", "engram__placement": "host"},
     "on CPU the tables are already in host memory"),
    ({"engram__placement": "host", "engram__host_layout": "shared"},
     "engram.host_layout 'shared' with engram.placement host: this runtime implements per_rank only"),
    ({"hardware__gpu": "CPU", "hardware__gpus": "0", "parallel__tp": "1", "cuda_graph__decode": "full"},
     "CUDA graphs need a GPU"),
    ({"hardware__gpu": "TPU"}, "unknown GPU kind"),
    ({"serving__mem_fraction_static": "1.5"}, "less than 1"),
    ({"serving__no_such_key": "1"}, "Extra inputs are not permitted"),
    ({"features__text_only": "true", "features__max_images_per_request": "2"},
     "features.max_images_per_request 2 with features.text_only: a text-only server refuses every image"),
    ({"features__max_images_per_request": "0"}, "greater than or equal to 1"),
    ({"serving__extra_args": '["--limit-mm-data-per-request", "{\\"image\\": 2}"]'},
     "--limit-mm-data-per-request in extra_args: set features.max_images_per_request: N instead"),
    ({"serving__extra_args": '["--language-model-only"]'},
     "--language-model-only in extra_args: set features.text_only: true instead"),
    ({"model__tiny_seed": "0", "model__architecture": "tiny", "model__path": "/ckpt"}, "two checkpoint sources"),
    ({"model__tiny_seed": "0"}, "set model.architecture: tiny"),
]


@pytest.mark.parametrize("changes, message", ILLEGAL, ids=[m for _, m in ILLEGAL])
def test_illegal_combination_is_rejected_with_its_message(changes: dict, message: str) -> None:
    with pytest.raises(DeployConfigError) as e:
        config_from_dict(_with(**changes), "test")
    assert message in str(e.value)


def test_pd_rules() -> None:
    pd = {"prefill": {"port": 30000, "bootstrap_port": 8998}, "decode": {"port": 30001, "base_gpu_id": 4}}
    ok = dict(BASE, pd=pd)
    assert config_from_dict(ok).is_pd
    bad = copy.deepcopy(ok)
    bad["pd"]["decode"]["base_gpu_id"] = 2
    with pytest.raises(DeployConfigError, match="share GPUs"):
        config_from_dict(bad)
    bad = copy.deepcopy(ok)
    del bad["pd"]["prefill"]["bootstrap_port"]
    with pytest.raises(DeployConfigError, match="bootstrap_port is required"):
        config_from_dict(bad)
    bad = copy.deepcopy(ok)
    bad["features"] = {"bounded_replay": {"encoder": True}}
    bad["serving"] = {"max_running_requests": 8, "chunked_prefill_size": 4096}
    with pytest.raises(DeployConfigError, match="rejected with PD"):
        config_from_dict(bad)


def test_a_legal_base_config_passes_and_validation_record_is_checked() -> None:
    assert isinstance(config_from_dict(copy.deepcopy(BASE)), DeploymentConfig)
    rec = dict(BASE, validated_on={"date": "2026-12-01", "hardware": "1 × H200", "log": "notes.txt"})
    with pytest.raises(DeployConfigError, match="docs/validation.md"):
        config_from_dict(rec)


def test_override_rejects_malformed_assignment() -> None:
    with pytest.raises(DeployConfigError, match="KEY=VALUE"):
        apply_override({}, "serving.port")


def test_tiny_tp_configs_use_the_cached_tiny_tp8_checkpoint() -> None:
    for name in ("tiny-h200-tp4", "tiny-h200-tp8"):
        c = load_config(ROOT / "configs" / f"{name}.yaml")
        assert c.model.tiny_seed == 0 and c.model.architecture == "tiny-tp8" and not c.features.text_only
        assert c.validated_on == "unvalidated"


def test_architecture_names_a_known_preset() -> None:
    with pytest.raises(DeployConfigError, match="model.architecture"):
        config_from_dict(_with(model__tiny_seed="0", model__architecture="tiny-tp16"), "test")
    assert config_from_dict(_with(model__tiny_seed="0", model__architecture="tiny-tp8"), "test").model.architecture \
        == "tiny-tp8"


def test_tiny_configs_use_the_cached_tiny_checkpoint() -> None:
    for name in ("tiny-cpu", "tiny-h200-tp1", "tiny-h200-tp2"):
        c = load_config(ROOT / "configs" / f"{name}.yaml")
        # images served on CPU (tests/test_vision_server.py) and on the H200 (tests/test_vision_gpu.py)
        assert c.model.tiny_seed == 0 and c.model.architecture == "tiny" and not c.features.text_only
    dspark = load_config(ROOT / "configs" / "tiny-h200-tp1-dspark.yaml")
    assert dspark.features.text_only          # DSpark drafting over image spans is not built (docs/vision.md)


@pytest.mark.parametrize("command", ["launch", "plan", "doctor"])
def test_a_missing_or_unreadable_config_is_one_line_not_a_traceback(command, tmp_path, capsys) -> None:
    """Issue 20: `launch --config` with a missing file printed a Python traceback."""
    from sglang_dsv41 import cli

    for path, needle in ((tmp_path / "nope.yaml", "no deployment config at"),
                         (tmp_path, "cannot read the deployment config")):
        assert cli.main([command, "--config", str(path)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"sglang-dsv41 {command}: {needle}") and "(--config)" in err
        assert len(err.splitlines()) == 1 and "Traceback" not in err


def test_image_limit_is_emitted_parsed_and_checked_against_the_context() -> None:
    """features.max_images_per_request → SGLang's --limit-mm-data-per-request '{"image": N}' (its
    own check answers 'Image count M exceeds limit N'); N images that cannot fit the context at the
    per-image token cap are refused with the numbers, and so is a cap on a checkpoint without a tower."""
    import json

    from sglang_dsv41.config import DeepseekV41Config
    from sglang_dsv41.deploy.command import build_launch
    from sglang_dsv41.deploy.memory import check_against_checkpoint
    from sglang_dsv41.deploy.vision_config import image_span_tokens
    from sglang_dsv41.presets import flash_config_dict

    dc = config_from_dict(_with(features__max_images_per_request="4", serving__context_length="8192"))
    args = build_launch(dc, frozenset()).commands[0].args
    i = args.index("--limit-mm-data-per-request")
    assert json.loads(args[i + 1]) == {"image": 4}
    flash = DeepseekV41Config.from_dict(flash_config_dict())
    assert image_span_tokens(flash.vision) == 32 * 33 + 2
    assert check_against_checkpoint(dc, flash) == []
    eight = config_from_dict(_with(features__max_images_per_request="8", serving__context_length="8192"))
    (problem,) = check_against_checkpoint(eight, flash)
    assert "8 image(s) at the 1024-token cap need at least 8,216 prompt tokens, above the 8,192-token context" in problem
    no_tower = flash_config_dict()
    no_tower.pop("vision_config")
    (problem,) = check_against_checkpoint(dc, DeepseekV41Config.from_dict(no_tower))
    assert "features.max_images_per_request: the checkpoint has no vision tower" in problem

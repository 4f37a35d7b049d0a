"""verify / reader / loader against deliberately broken copies of the tiny checkpoint."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from sglang_dsv41.checkpoint.loader import (
    fp32_tensor_is_bf16_norm,
    load_reference_weights,
    load_reference_weights_from_tensors,
)
from sglang_dsv41.checkpoint.reader import CheckpointFormatError, CheckpointReader
from sglang_dsv41.checkpoint.synth import make_checkpoint, random_tensors
from sglang_dsv41.checkpoint.verify import cli as verify_cli
from sglang_dsv41.checkpoint.verify import verify_checkpoint
from sglang_dsv41.config import DeepseekV41Config

INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("tiny", tmp_path_factory.mktemp("tiny") / "ckpt", seed=5, progress=False)


@pytest.fixture
def copy(tiny: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny, tmp_path / "broken"))


def _shard_of(ckpt: Path, name: str) -> Path:
    return ckpt / json.loads((ckpt / INDEX).read_text())["weight_map"][name]


def _rewrite(ckpt: Path, name: str, value: torch.Tensor | None, *, keep_index: bool = True) -> None:
    """Replace (or drop, value=None) one tensor in its shard; optionally drop it from the index."""
    shard = _shard_of(ckpt, name)
    tensors = load_file(str(shard))
    if value is None:
        del tensors[name]
    else:
        tensors[name] = value
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index = json.loads((ckpt / INDEX).read_text())
    if not keep_index:
        del index["weight_map"][name]
    index["metadata"]["total_size"] = sum(
        sum(t.numel() * t.element_size() for t in load_file(str(ckpt / f)).values())
        for f in sorted(set(index["weight_map"].values())))
    (ckpt / INDEX).write_text(json.dumps(index, indent=2))


def _problems(ckpt: Path) -> str:
    report = verify_checkpoint(ckpt, progress=False)
    assert not report.ok
    assert "problem" in report.format()
    return "\n".join(report.problems)


# ---------------------------------------------------------------------------------- verify
def test_verify_missing_tensor(copy: Path):
    _rewrite(copy, "layers.3.attn.wkv.weight", None, keep_index=False)
    text = _problems(copy)
    assert "layers.3.attn.wkv.weight: missing" in text
    assert verify_cli([str(copy), "--quiet"]) == 1


def test_verify_index_lists_absent_tensor(copy: Path):
    _rewrite(copy, "layers.0.ffn.gate.bias", None, keep_index=True)
    assert "layers.0.ffn.gate.bias: listed in" in _problems(copy)


def test_verify_wrong_shape(copy: Path):
    _rewrite(copy, "layers.2.attn.wq_b.scale", torch.full((3, 1), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu))
    text = _problems(copy)
    assert "layers.2.attn.wq_b.scale: shape [3, 1]" in text


def test_verify_wrong_dtype(copy: Path):
    w = load_file(str(_shard_of(copy, "layers.1.attn.wq_a.weight")))["layers.1.attn.wq_a.weight"]
    _rewrite(copy, "layers.1.attn.wq_a.weight", w.to(torch.bfloat16))
    assert "layers.1.attn.wq_a.weight: dtype BF16 where F8_E4M3 is expected" in _problems(copy)


def test_verify_unexpected_tensor_and_total_size(copy: Path):
    shard = _shard_of(copy, "norm.weight")
    tensors = load_file(str(shard))
    tensors["layers.0.attn.bogus"] = torch.zeros(4)
    save_file(tensors, str(shard))
    text = _problems(copy)
    assert "layers.0.attn.bogus: stored in" in text and "not listed" in text
    assert "layers.0.attn.bogus: unexpected tensor" in text
    assert "total_size" in text


def test_verify_nan_scale_byte(copy: Path):
    name = "layers.0.ffn.experts.1.w2.scale"
    s = load_file(str(_shard_of(copy, name)))[name].view(torch.uint8).clone()
    s[0, 0] = 255
    _rewrite(copy, name, s.view(torch.float8_e8m0fnu))
    assert f"{name}: 1 scale byte(s) are 255 (NaN)" in _problems(copy)
    skipped = verify_checkpoint(copy, progress=False, value_scan_max_bytes=1000)
    assert skipped.ok and "skipped" in skipped.value_scan  # headers alone cannot see NaN bytes


def test_verify_missing_shard_file_and_bad_config(copy: Path):
    _shard_of(copy, "embed.weight").unlink()
    text = _problems(copy)
    assert "do not exist" in text and "model-00001" in text
    (copy / "config.json").write_text("{}")
    assert "config.json" in _problems(copy)


def test_verify_truncated_shard(copy: Path):
    shard = _shard_of(copy, "head.weight")
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    assert "truncated" in _problems(copy)


def test_verify_accepts_int8_and_f4_packed_experts(copy: Path):
    """Packed FP4 stored as I8 or F4 (SGLang accepts U8/I8/F4) verifies and loads identically."""
    ref = load_reference_weights(copy)
    for name, to in (("layers.0.ffn.experts.0.w1.weight", torch.int8),
                     ("layers.4.ffn.experts.2.w3.weight", torch.float4_e2m1fn_x2)):
        packed = load_file(str(_shard_of(copy, name)))[name]
        _rewrite(copy, name, packed.view(to))
    report = verify_checkpoint(copy, progress=False)
    assert report.ok, report.format()
    with CheckpointReader(copy) as r:
        assert r.dtype("layers.4.ffn.experts.2.w3.weight") == "F4"
        assert r.shape("layers.4.ffn.experts.2.w3.weight") == (32, 64)  # F4 headers count elements
        assert r.get("layers.4.ffn.experts.2.w3.weight").shape == (32, 32)
    got = load_reference_weights(copy)
    assert all(torch.equal(got[k], ref[k]) for k in ref)


# ---------------------------------------------------------------------------------- reader
def test_reader_headers_iteration_and_errors(tiny: Path, copy: Path):
    with CheckpointReader(tiny) as r:
        assert len(r) == len(r.names()) and "embed.weight" in r
        assert r.dtype("layers.1.engram.embed.scale") == "F8_E8M0"
        assert r.shape("layers.1.engram.embed.weight") == (434, 32)
        streamed = dict(iter(r))
        assert set(streamed) == set(r.names())
        with pytest.raises(KeyError, match="not in the checkpoint"):
            r.get("nope")
    _rewrite(copy, "layers.0.ffn.gate.bias", None, keep_index=True)
    with CheckpointReader(copy) as r:
        with pytest.raises(CheckpointFormatError, match="does not contain it"):
            r.get("layers.0.ffn.gate.bias")
    _shard_of(copy, "embed.weight").unlink()
    with pytest.raises(CheckpointFormatError, match="do not exist"):
        CheckpointReader(copy)
    with pytest.raises(CheckpointFormatError, match="neither"):
        CheckpointReader(copy.parent)


def test_reader_single_file(tiny: Path, tmp_path: Path):
    cfg = DeepseekV41Config.from_file(tiny)
    single = tmp_path / "single"
    single.mkdir()
    shutil.copy(tiny / "config.json", single / "config.json")
    save_file(dict(random_tensors(cfg, 5)), str(single / "model.safetensors"))
    assert verify_checkpoint(single, progress=False).ok
    a, b = load_reference_weights(single), load_reference_weights(tiny)
    assert all(torch.equal(a[k], b[k]) for k in b)
    assert CheckpointReader(single / "model.safetensors").names() == CheckpointReader(single).names()


# ---------------------------------------------------------------------------------- loader
def test_loader_precision_rules(tiny: Path):
    cfg = DeepseekV41Config.from_file(tiny)
    stored = dict(random_tensors(cfg, 5))
    w = load_reference_weights(tiny, cfg)

    def is_bf16(t: torch.Tensor) -> bool:
        return torch.equal(t, t.to(torch.bfloat16).to(torch.float32))

    # RMSNorm weights: stored FP32, loaded as BF16 values
    for name in ("norm.weight", "layers.0.attn_norm.weight", "layers.1.attn.q_norm.weight",
                 "layers.1.attn.compressor.norm.weight", "layers.1.attn.indexer.k_norm.weight",
                 "mtp.0.main_norm.weight", "mtp.2.norm.weight", "mtp.1.ffn_norm.weight"):
        assert stored[name].dtype == torch.float32 and not is_bf16(stored[name]), name
        assert torch.equal(w[name], stored[name].to(torch.bfloat16).float()), name
    # kept FP32, bit-exact
    for name in ("layers.0.hc_attn_fn", "layers.0.hc_ffn_base", "layers.0.hc_attn_scale", "layers.2.attn.attn_sink",
                 "layers.2.ffn.gate.bias", "layers.2.ffn.gate.bias_vl", "vision.blocks.0.norm1.weight",
                 "vision.norm.weight", "mtp.2.confidence_head.proj.weight"):
        assert torch.equal(w[name], stored[name]), name
    # wo_a: dequantised then BF16; (its FP8·2^k values happen to be BF16-exact, so compare decode)
    from sglang_dsv41.checkpoint.codecs import dequantize_fp8_block

    wo_a = dequantize_fp8_block(stored["layers.0.attn.wo_a.weight"], stored["layers.0.attn.wo_a.scale"])
    assert torch.equal(w["layers.0.attn.wo_a.weight"], wo_a.to(torch.bfloat16).float())
    # Engram tables decode to BF16 values; BF16 tensors unchanged
    assert is_bf16(w["layers.1.engram.embed.weight"])
    assert torch.equal(w["embed.weight"], stored["embed.weight"].float())
    assert not any(k.endswith(".scale") for k in w)
    # dtype of the returned tensors
    wb = load_reference_weights(tiny, cfg, dtype=torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in wb.values())


def test_loader_rounds_fp32_stored_bf16_tensors_and_bf16_stored_norms():
    """The stored width of plain tensors is unconfirmed (spec §10): both directions are accepted
    and give the same values as the canonical storage."""
    from sglang_dsv41.presets import tiny_config_dict

    cfg = DeepseekV41Config.from_dict(tiny_config_dict(500))
    stored = dict(random_tensors(cfg, 1))
    ref = load_reference_weights_from_tensors(stored, cfg)
    alt = dict(stored)
    alt["embed.weight"] = stored["embed.weight"].float() + 1e-4  # F32 copy, off BF16 grid
    alt["layers.0.attn_norm.weight"] = stored["layers.0.attn_norm.weight"].to(torch.bfloat16)
    got = load_reference_weights_from_tensors(alt, cfg)
    assert torch.equal(got["embed.weight"], alt["embed.weight"].to(torch.bfloat16).float())
    assert torch.equal(got["layers.0.attn_norm.weight"], ref["layers.0.attn_norm.weight"])


def test_loader_errors_name_the_tensors():
    from sglang_dsv41.presets import tiny_config_dict

    cfg = DeepseekV41Config.from_dict(tiny_config_dict(500))
    stored = dict(random_tensors(cfg, 2))
    broken = dict(stored)
    del broken["layers.5.attn.wo_b.scale"]
    broken["layers.0.extra"] = torch.zeros(1)
    broken["layers.2.attn.wq_a.weight"] = broken["layers.2.attn.wq_a.weight"][:, :32]
    broken["layers.3.attn.wkv.weight"] = broken["layers.3.attn.wkv.weight"].float()
    with pytest.raises(CheckpointFormatError) as e:
        load_reference_weights_from_tensors(broken, cfg)
    msg = str(e.value)
    for needle in ("missing 1 tensor(s): layers.5.attn.wo_b.scale", "layers.0.extra",
                   "layers.2.attn.wq_a.weight: shape [32, 32]", "layers.3.attn.wkv.weight: dtype torch.float32"):
        assert needle in msg, needle


def test_loader_vision_and_dspark_switches():
    from sglang_dsv41.presets import tiny_config_dict

    cfg = DeepseekV41Config.from_dict(tiny_config_dict(500))
    stored = dict(random_tensors(cfg, 3))
    w = load_reference_weights_from_tensors(stored, cfg, vision=False, dspark=False)
    assert not any(k.startswith(("vision.", "aligner.", "image_", "mtp.")) for k in w)
    text_only = {k: v for k, v in stored.items() if not k.startswith(("vision.", "aligner.", "image_", "mtp."))}
    w2 = load_reference_weights_from_tensors(text_only, cfg, vision=False, dspark=False)
    assert w2.keys() == w.keys()
    with pytest.raises(CheckpointFormatError, match="missing"):
        load_reference_weights_from_tensors(text_only, cfg)


def test_fp32_precision_rule_is_total():
    with pytest.raises(CheckpointFormatError, match="no load-time precision rule"):
        fp32_tensor_is_bf16_norm("layers.0.something_new")
    assert fp32_tensor_is_bf16_norm("layers.0.ffn_norm.weight")
    assert not fp32_tensor_is_bf16_norm("vision.blocks.3.norm2.weight")

"""Seeded random reference weights for tests (the contract's `Mapping[str, Tensor]`).

Built from `checkpoint.names.tensor_inventory(cfg)`: every tensor a real checkpoint has, with
its logical shape, holding values the loader would produce (spec §2.3–§2.4) — FP8 weights are
round-tripped through 32×32 E4M3 tiles, routed experts through MXFP4, Engram tables through
E4M3 rows then BF16, norms and BF16 tensors BF16-rounded, `hc_*`/sinks/biases fp32. Scales are
chosen so activations stay O(1) through the tiny model (weights ~ 1/sqrt(fan_in)).

Tests that need a real checkpoint use `checkpoint.synth` + `checkpoint.loader` instead; this
helper exists so model tests need neither the tokenizer nor the file format.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from sglang_dsv41.checkpoint.codecs import (
    dequantize_engram_rows,
    dequantize_fp8_block,
    dequantize_mxfp4,
    quantize_engram_rows,
    quantize_fp8_block,
    quantize_mxfp4,
)
from sglang_dsv41.checkpoint.names import Kind, TensorSpec, tensor_inventory
from sglang_dsv41.config import DeepseekV41Config
from sglang_dsv41.presets import tiny_config_dict

#: compressed vocabulary used by random-weight tests (no tokenizer): one class per token id.
TINY_TEST_COMPRESSED_VOCAB = 1024


def tiny_config(compressed_vocab: int = TINY_TEST_COMPRESSED_VOCAB, *, vision: bool = True) -> DeepseekV41Config:
    """Spec §7's tiny config (optionally without `vision_config`)."""
    d = tiny_config_dict(compressed_vocab)
    if not vision:
        d.pop("vision_config")
    return DeepseekV41Config.from_dict(d)


def _value(spec: TensorSpec, g: torch.Generator) -> Tensor:
    name, shape = spec.name, spec.shape
    last = name.rsplit(".", 1)[-1]
    randn = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    if "hc_" in name and name.endswith("_fn"):
        return randn(*shape) / math.sqrt(shape[1])
    if "hc_" in name and name.endswith("_base"):
        return 0.5 * randn(*shape)
    if "hc_" in name and name.endswith("_scale"):
        return 0.5 + 0.5 * torch.rand(*shape, generator=g)
    if name.endswith("attn_sink"):
        return 0.5 * randn(*shape)
    if name.endswith("gate.bias") or name.endswith("gate.bias_vl"):
        return 0.3 * randn(*shape)
    if name.endswith(("norm.weight", "norm1.weight", "norm2.weight")) or last in ("q_weight", "k_weight"):
        return 1.0 + 0.1 * randn(*shape)
    if name in ("embed.weight", "image_start", "image_end", "image_newline") or name.endswith("markov_head.embed.weight"):
        return randn(*shape)
    if name.endswith(".bias"):
        return 0.05 * randn(*shape)
    if spec.kind is Kind.ENGRAM:
        return randn(*shape)
    if len(shape) == 2:
        return randn(*shape) / math.sqrt(shape[1])
    raise ValueError(f"reference_weights: no value rule for {name} {shape}")


def _as_loaded(spec: TensorSpec, w: Tensor) -> Tensor:
    """What the loader hands the reference for a tensor of this kind (fp32 values)."""
    if spec.kind is Kind.FP8:
        return dequantize_fp8_block(*quantize_fp8_block(w))
    if spec.kind is Kind.FP4:
        return dequantize_mxfp4(*quantize_mxfp4(w))
    if spec.kind is Kind.ENGRAM:
        return dequantize_engram_rows(*quantize_engram_rows(w)).float()
    if spec.kind is Kind.BF16:
        return w.to(torch.bfloat16).float()
    # FP32 in the checkpoint: norms are held in BF16 by the model (spec §2.4 item 4), the
    # rest (hc_*, attn_sink, gate biases, ViT norms, confidence head) stay fp32.
    bf16_norm = (spec.name.endswith("norm.weight") and not spec.name.startswith("vision."))
    return w.to(torch.bfloat16).float() if bf16_norm else w.float()


def random_reference_weights(cfg: DeepseekV41Config, seed: int = 0, *, vision: bool = True,
                             dspark: bool = True) -> dict[str, Tensor]:
    """name → fp32 tensor for every tensor of `tensor_inventory(cfg)`, deterministic in `seed`."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, Tensor] = {}
    for spec in tensor_inventory(cfg, vision=vision, dspark=dspark):
        out[spec.name] = _as_loaded(spec, _value(spec, g))
    return out

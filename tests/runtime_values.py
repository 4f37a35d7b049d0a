"""Equality of runtime weight values for tests: tensors bit for bit, stored Engram tables by their
stored bytes (`runtime.engram_table.StoredEngramTable`)."""
from __future__ import annotations

import torch

from sglang_dsv41.runtime.engram_table import StoredEngramTable


def same_value(a: object, b: object) -> bool:
    if isinstance(a, StoredEngramTable) or isinstance(b, StoredEngramTable):
        return isinstance(a, StoredEngramTable) and a.equal(b)
    return torch.equal(a, b)


def logical(value: object) -> torch.Tensor:
    """The fp32 logical tensor of a runtime value (a stored Engram table dequantised whole)."""
    return value.dequantized() if isinstance(value, StoredEngramTable) else value


def with_linear_layers(weights: dict, cfg) -> dict:
    """`weights` (name → value; the reference's fp32, or E4M3 + scales) plus the model's linears
    as the runtime's SGLang layers over the same tensors, under their prefixes
    (`layers.0.attn.wq_a`): the runtime math applies those through their quantisation methods,
    the reference reads the tensors. `cfg`: a DeepseekV41Config or its TextConfig."""
    from types import SimpleNamespace

    from sglang_dsv41.config import TextConfig
    from sglang_dsv41.runtime.parallel_linear import is_parallel_linear, with_parallel_linears
    from sglang_dsv41.runtime.tensor_parallel import SINGLE

    if isinstance(cfg, TextConfig):
        cfg = SimpleNamespace(text=cfg, vision=None)
    layers = with_parallel_linears(weights, cfg, SINGLE.plan(cfg.text), dspark=True)
    return {**weights, **{k: v for k, v in layers.items() if is_parallel_linear(v)}}

"""Dequantised reference weights with the load-time numerics of spec `model.md` §2.3–§2.4.

`load_reference_weights(path, cfg)` → {DeepSeek-native logical name → tensor} for every entry of
`names.tensor_inventory(cfg, vision=..., dspark=...)`; this is what the pure-PyTorch reference
model consumes (e.g. `layers.3.attn.wq_a.weight`, no `.scale` companions).

Value rules (values are fixed first, then cast to the requested `dtype`):

| logical tensor                                  | value                                         |
|-------------------------------------------------|-----------------------------------------------|
| FP8 (32×32 tiles)                               | exact fp32 dequantisation                     |
| `attn.wo_a.weight` (FP8)                        | dequantised, then rounded to BF16 (§2.4.1)    |
| FP4 routed experts                              | exact fp32 MXFP4 dequantisation               |
| Engram tables                                   | fp32 product rounded once to BF16 (§2.3)      |
| BF16 kind                                       | BF16 values (an F32-stored copy is rounded)   |
| text-model RMSNorm weights (attn/ffn/q/kv norm, | rounded to BF16 (§2.4.4)                      |
| compressor/indexer k norm, model norm, DSpark)  |                                               |
| `hc_*`, `attn_sink`, `gate.bias(_vl)`, ViT      | kept FP32                                     |
| norms, DSpark confidence head                   |                                               |

Plain tensors may be stored as BF16, F16 or F32 (the released width is unconfirmed, spec §10);
scales as F8_E8M0 or U8; packed FP4 as U8, I8 or F4. Anything else — a missing tensor, an
unexpected one, a wrong dtype or shape — raises `CheckpointFormatError` listing every offender.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable, Mapping

import torch
from torch import Tensor

from ..config import DeepseekV41Config
from .codecs import dequantize_engram_rows, dequantize_fp8_block, dequantize_mxfp4
from .names import Kind, StoredTensor, TensorSpec, stored_inventory, tensor_inventory
from .reader import CheckpointFormatError, CheckpointReader

#: torch dtypes accepted for each stored safetensors dtype of the inventory.
ACCEPTED_TORCH_DTYPES: dict[str, tuple[torch.dtype, ...]] = {
    "BF16": (torch.bfloat16, torch.float16, torch.float32),
    "F32": (torch.float32, torch.bfloat16, torch.float16),
    "F8_E4M3": (torch.float8_e4m3fn,),
    "F8_E8M0": (torch.float8_e8m0fnu, torch.uint8),
    "U8": tuple(d for d in (torch.uint8, torch.int8, getattr(torch, "float4_e2m1fn_x2", None)) if d is not None),
}
#: safetensors header dtypes accepted for each stored dtype of the inventory (reader path).
ACCEPTED_FILE_DTYPES: dict[str, tuple[str, ...]] = {
    "BF16": ("BF16", "F16", "F32"),
    "F32": ("F32", "BF16", "F16"),
    "F8_E4M3": ("F8_E4M3",),
    "F8_E8M0": ("F8_E8M0", "U8"),
    "U8": ("U8", "I8", "F4"),
}

# FP32-kind tensors whose value the runtime keeps in FP32 (spec §2.4.4) …
_KEEP_FP32_SUFFIXES = ("attn_sink", "gate.bias", "gate.bias_vl", "confidence_head.proj.weight")
# … and the text-model RMSNorm weights it holds as BF16 parameters.
_BF16_NORM_SUFFIXES = ("attn_norm.weight", "ffn_norm.weight", "attn.q_norm.weight", "attn.kv_norm.weight",
                       "compressor.norm.weight", "indexer.k_norm.weight", "main_norm.weight", "norm.weight")


def fp32_tensor_is_bf16_norm(name: str) -> bool:
    """True for a text-model RMSNorm weight (rounded to BF16), False for a kept-FP32 tensor.

    Raises for an FP32-kind name that neither rule covers, so inventory changes cannot slip
    through with the wrong numerics.
    """
    last = name.rsplit(".", 1)[-1]
    if name.startswith("vision.") or last.startswith("hc_") or name.endswith(_KEEP_FP32_SUFFIXES):
        return False
    if name.endswith(_BF16_NORM_SUFFIXES):
        return True
    raise CheckpointFormatError(f"no load-time precision rule for FP32 tensor {name!r} (spec §2.4)")


def _round_bf16(x: Tensor) -> Tensor:
    return x.to(torch.bfloat16).to(torch.float32)


def logical_tensor(spec: TensorSpec, get: Callable[[str], Tensor]) -> Tensor:
    """The float32 value of one logical tensor after the load-time rules of the module table."""
    if spec.kind is Kind.FP8:
        value = dequantize_fp8_block(get(spec.name), get(spec.scale_name))  # type: ignore[arg-type]
        return _round_bf16(value) if spec.name.endswith("attn.wo_a.weight") else value
    if spec.kind is Kind.FP4:
        return dequantize_mxfp4(get(spec.name), get(spec.scale_name))  # type: ignore[arg-type]
    if spec.kind is Kind.ENGRAM:
        return dequantize_engram_rows(get(spec.name), get(spec.scale_name)).to(torch.float32)  # type: ignore[arg-type]
    raw = get(spec.name).to(torch.float32)
    if spec.kind is Kind.BF16:
        return _round_bf16(raw)
    return _round_bf16(raw) if fp32_tensor_is_bf16_norm(spec.name) else raw


def _list(names: Iterable[str], limit: int = 12) -> str:
    items = sorted(names)
    more = f" … (+{len(items) - limit} more)" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def check_stored(present: Iterable[str], cfg: DeepseekV41Config, *, vision: bool, dspark: bool,
                 meta: Callable[[str], tuple[str | torch.dtype, tuple[int, ...]]]) -> None:
    """Raise one `CheckpointFormatError` naming every missing, unexpected, mis-typed or mis-shaped
    stored tensor. `meta(name)` gives (dtype, shape) as a safetensors string (header shape) or
    as a torch dtype (tensor shape)."""
    present = set(present)
    wanted = stored_inventory(cfg, vision=vision, dspark=dspark)
    known = stored_inventory(cfg, vision=True, dspark=True)
    problems: list[str] = []
    missing = set(wanted) - present
    if missing:
        problems.append(f"missing {len(missing)} tensor(s): {_list(missing)}")
    extra = present - set(known)
    if extra:
        problems.append(f"unexpected {len(extra)} tensor(s) not in the inventory for this config: {_list(extra)}")
    for name in sorted(set(wanted) & present):
        problem = stored_problem(wanted[name], *meta(name))
        if problem:
            problems.append(problem)
    if problems:
        raise CheckpointFormatError("checkpoint does not match its config:\n  " + "\n  ".join(problems))


def stored_problem(want: StoredTensor, dtype: str | torch.dtype, shape: tuple[int, ...]) -> str | None:
    """Why a stored tensor's (dtype, shape) does not fit the inventory entry, or None."""
    shape = tuple(shape)
    if isinstance(dtype, str):
        ok = dtype in ACCEPTED_FILE_DTYPES[want.dtype]
        # safetensors records F4 shapes in FP4 elements (two per packed byte)
        expect = want.shape[:-1] + (2 * want.shape[-1],) if dtype == "F4" else want.shape
    else:
        ok = dtype in ACCEPTED_TORCH_DTYPES[want.dtype]
        expect = want.shape
    accepted = ACCEPTED_FILE_DTYPES[want.dtype]
    if not ok:
        return f"{want.name}: dtype {dtype} where {want.dtype} is expected (accepted: {', '.join(accepted)})"
    if shape != expect:
        return f"{want.name}: shape {list(shape)} where {list(expect)} is expected"
    return None


def _assemble(get: Callable[[str], Tensor], cfg: DeepseekV41Config, dtype: torch.dtype, vision: bool,
              dspark: bool) -> dict[str, Tensor]:
    return {spec.name: logical_tensor(spec, get).to(dtype)
            for spec in tensor_inventory(cfg, vision=vision, dspark=dspark)}


def load_reference_weights_from_tensors(stored: Mapping[str, Tensor], cfg: DeepseekV41Config, *,
                                        dtype: torch.dtype = torch.float32, vision: bool = True,
                                        dspark: bool = True) -> dict[str, Tensor]:
    """Like `load_reference_weights`, from in-memory stored tensors (e.g. `synth.random_tensors`)."""
    check_stored(stored.keys(), cfg, vision=vision, dspark=dspark,
                 meta=lambda n: (stored[n].dtype, tuple(stored[n].shape)))
    return _assemble(stored.__getitem__, cfg, dtype, vision, dspark)


def load_reference_weights(path: str | Path, cfg: DeepseekV41Config | None = None, *,
                           dtype: torch.dtype = torch.float32, vision: bool = True,
                           dspark: bool = True) -> dict[str, Tensor]:
    """Every logical tensor of `tensor_inventory(cfg, vision=vision, dspark=dspark)` from the
    checkpoint at `path`, dequantised with the §2.4 rules, as `dtype` tensors.

    `cfg` defaults to the checkpoint's own `config.json`. Shapes and dtypes are checked from the
    headers before any data is read. `vision=False` / `dspark=False` skip those tensors (they
    may still be present in the files).
    """
    if cfg is None:
        cfg = DeepseekV41Config.from_file(path)
    vision = vision and cfg.vision is not None
    with CheckpointReader(path) as reader:
        check_stored(reader.names(), cfg, vision=vision, dspark=dspark,
                     meta=lambda n: (reader.dtype(n), reader.shape(n)))
        return _assemble(reader.get, cfg, dtype, vision, dspark)

"""Runtime weights from the stored checkpoint tensors (spec `model.md` §2.1–§2.4, §3.8).

`runtime_weights(stored, cfg, device, *, experts_mxfp4, expert_ids=None, rows_of, dense_fp8=None,
engram_placement="device")` → {name → value}:

* every stored tensor is checked against the inventory first (`checkpoint.loader.check_stored`:
  one error naming every missing / unexpected / mis-typed / mis-shaped tensor);
* Engram tables (Kind ENGRAM) stay in their stored form — E4M3 rows + UE8M0 row scales, sliced
  to this process's rows — as `engram_table.StoredEngramTable`, whose lookups dequantise the
  gathered rows bit for bit like the reference loader (a dequantised Flash table would not fit);
  `engram_placement="host"` (runtime.md §A.7, per_rank layout): this process's rows are copied
  into mmap host memory instead — pinned and read through UVA on CUDA
  (`engram_host.HostEngramTable`, same lookup bits); on a CPU runtime the same host memory,
  not pinned (device placement is host memory there too: logged once);
* every other logical tensor except the routed experts and the FP8 dense weights kept FP8 is the
  reference loader's §2.4 value
  (`checkpoint.loader.logical_tensor`: FP8 tiles dequantised, BF16 rounding rules, FP32 kept),
  as fp32 on `device` — exactly what `load_reference_weights_from_tensors` gives;
* routed experts (`{prefix}ffn.experts.{e}.w1/w2/w3`, Kind FP4):
  - `experts_mxfp4=False` (CPU reference path): dequantised fp32 like the rest;
  - `experts_mxfp4=True` (CUDA): **never dequantised** — the packed E2M1 bytes and UE8M0 scale
    bytes are converted to the MXFP4 kernel layout on `device` (`kernels.moe_mxfp4`, a lossless
    re-arrangement: transpose, padding, Hopper swizzles) and stored per layer under
    `moe_ops.routed_experts_key(prefix)` as a `RoutedExpertsMxfp4`; no per-expert keys.
* FP8 dense weights (Kind FP8: wq_a, wkv, wq_b, wo_a, wo_b, shared experts, indexer.wq_b,
  engram.wkv), `dense_fp8=True` (default on CUDA): **never dequantised** — the stored E4M3 tensor
  stays under the weight's name and its UE8M0 tile scales, decoded once to fp32 powers of two
  (exact, `codecs.ue8m0_to_float`), under the scale name (`dense_ops.fp8_scale_key`); the dense
  backend multiplies them in place (`runtime/dense_ops.py`, `kernels/fp8_linear.py`). The logical
  value E4M3·scale is unchanged — also for `wo_a`, whose §2.4.1 BF16 rounding is the identity
  when every scale is in 2^-124..2^119 (`fp8_linear.scales_are_bf16_exact`). A weight with a
  scale outside that range is loaded dequantised like the CPU path. `dense_fp8=False` (CPU: the
  exact reference math needs fp32): dequantised fp32 like the rest.
* `expert_ids` (expert parallel): the routed experts this process holds, in order (default all);
  only those are converted / dequantised; `rows_of` / `cols_of` (tensor parallel): the rows /
  columns of sharded tensors this process holds.

`is_routed_expert_tensor(name)` tells a stored routed-expert tensor (weight or scale) from the rest.
"""
from __future__ import annotations

import logging
import re
from typing import Callable, Mapping, Sequence

import torch
from torch import Tensor

from ..checkpoint.codecs import TILE, ue8m0_to_float
from ..checkpoint.loader import check_stored, logical_tensor
from ..checkpoint.names import Kind, TensorSpec, tensor_inventory
from ..config import DeepseekV41Config
from .dense_weights import fp8_scale_key
from .engram_host import EngramPlacement, HostEngramTable
from .engram_table import StoredEngramTable
from .moe_ops import RoutedExpertsMxfp4, routed_experts_key

F32 = torch.float32
logger = logging.getLogger(__name__)
_ROUTED_EXPERT = re.compile(r"^(?P<prefix>(?:layers|mtp)\.\d+\.)ffn\.experts\.(?P<expert>\d+)\.w[123]\.(?:weight|scale)$")


def is_routed_expert_tensor(name: str) -> bool:
    """True for a stored routed-expert tensor: `…ffn.experts.{e}.w1|w2|w3.weight|scale`."""
    return _ROUTED_EXPERT.match(name) is not None


def _expert_of(name: str) -> tuple[str, int]:
    m = _ROUTED_EXPERT.match(name)
    if m is None:
        raise ValueError(f"{name} is not a routed-expert tensor")
    return m["prefix"], int(m["expert"])


def prepare_layer_experts(stored: Mapping[str, Tensor], prefix: str, n_routed_experts: int,
                          device: torch.device, expert_ids: Sequence[int] | None = None) -> RoutedExpertsMxfp4:
    """The stored MXFP4 experts of one layer (`{prefix}ffn.experts.*`, packed U8 + F8_E8M0 scales)
    in the kernel layout on `device`; values are untouched (spec §2.3)."""
    from ..kernels.moe_mxfp4 import prepare_mxfp4_experts

    ids = list(range(n_routed_experts)) if expert_ids is None else [int(e) for e in expert_ids]
    prepared = prepare_mxfp4_experts(stored, prefix, n_routed_experts, experts=ids, device=device)
    return RoutedExpertsMxfp4.build(prepared, ids, n_routed_experts, torch.device(device))


def _aligned(spec: TensorSpec, what: str, r: range, n: int) -> None:
    if r.step != 1 or r.start % TILE or (r.stop % TILE and r.stop != n):
        raise ValueError(f"{spec.name}: {what} {r.start}..{r.stop} of {n} do not follow the {TILE}-wide "
                         "FP8 tiles; this shard cannot keep the weight in its stored form")


def stored_fp8_dense(spec: TensorSpec, get: Callable[[str], Tensor], device: torch.device,
                     rows: range | None = None, cols: range | None = None) -> dict[str, Tensor] | None:
    """An FP8 dense weight as the CUDA dense backend holds it (module doc): {spec.name: E4M3
    [rows, K] contiguous, fp8_scale_key(spec.name): fp32 tile scales of those rows}, on `device`;
    None when its scales are not all BF16-exact (the caller loads it dequantised). `rows`: a
    slice in stored form, which must start on a 32-row tile (and end on one or at the last row)."""
    from ..kernels.fp8_linear import scales_are_bf16_exact

    if spec.kind is not Kind.FP8 or spec.scale_name is None:
        raise ValueError(f"{spec.name}: kind {spec.kind} is not an FP8 dense weight")
    values, scale = get(spec.name), get(spec.scale_name)
    if values.dtype != torch.float8_e4m3fn:
        raise TypeError(f"{spec.name}: FP8 weights must be float8_e4m3fn, got {values.dtype}")
    scales = ue8m0_to_float(scale)
    if rows is not None:
        _aligned(spec, "rows", rows, values.shape[0])
        values = values[rows.start:rows.stop]
        scales = scales[rows.start // TILE: -(-rows.stop // TILE)]
    if cols is not None:
        _aligned(spec, "columns", cols, values.shape[1])
        values = values[:, cols.start:cols.stop]
        scales = scales[:, cols.start // TILE: -(-cols.stop // TILE)]
    if not scales_are_bf16_exact(scales):
        return None
    return {spec.name: values.to(device).contiguous(),
            fp8_scale_key(spec.name): scales.to(device=device, dtype=F32).contiguous()}


def runtime_weights(stored: Mapping[str, Tensor], cfg: DeepseekV41Config, device: torch.device, *,
                    experts_mxfp4: bool, expert_ids: Sequence[int] | None = None,
                    rows_of: Callable[[str], range | None] = lambda name: None,
                    cols_of: Callable[[str], range | None] = lambda name: None,
                    dense_fp8: bool | None = None, engram_placement: EngramPlacement = "device") -> dict[str, object]:
    """Weights for `TorchForward` / `moe_ops` on `device` (module docstring). Text model only
    (vision and DSpark tensors are not loaded; their presence is allowed).

    `rows_of(name)` (tensor parallel, `ShardPlan.rows_of`): the dim-0 rows of a logical tensor
    this process holds (None = all), `cols_of(name)` its dim-1 columns (the row-parallel
    linears, `ShardPlan.cols_of`) — Engram tables and FP8 dense weights kept FP8 are sliced in
    stored form (rows and their scale rows), other tensors after dequantisation.
    `dense_fp8` (None = `device` is CUDA): keep FP8 dense weights in their stored form.
    `engram_placement`: "device" (tables on `device`) or "host" (module docstring)."""
    device = torch.device(device)
    if engram_placement not in ("device", "host"):
        raise ValueError(f"engram_placement must be 'device' or 'host', got {engram_placement!r}")
    if engram_placement == "host" and device.type == "cpu" and cfg.text.engram_layer_ids:
        logger.info("sglang-dsv41: Engram host placement on a CPU runtime: the tables go to mmap host memory "
                    "unpinned, as device placement would keep them in host memory too")
    if dense_fp8 is None:
        dense_fp8 = device.type == "cuda"
    check_stored(stored.keys(), cfg, vision=False, dspark=False,
                 meta=lambda n: (stored[n].dtype, tuple(stored[n].shape)))
    E = cfg.text.n_routed_experts
    held = set(range(E)) if expert_ids is None else {int(e) for e in expert_ids}
    if any(not 0 <= e < E for e in held):
        raise ValueError(f"expert_ids must be ids in 0..{E - 1}")
    out: dict[str, object] = {}
    expert_layers: list[str] = []
    for spec in tensor_inventory(cfg, vision=False, dspark=False):
        if spec.kind is Kind.FP4:
            prefix, expert = _expert_of(spec.name)
            if prefix not in expert_layers:
                expert_layers.append(prefix)
            if experts_mxfp4 or expert not in held:
                continue
        rows, cols = rows_of(spec.name), cols_of(spec.name)
        if dense_fp8 and spec.kind is Kind.FP8:
            kept = stored_fp8_dense(spec, stored.__getitem__, device, rows, cols)
            if kept is not None:
                out.update(kept)
                continue
        if spec.kind is Kind.ENGRAM:                 # stored form, rows dequantised on lookup (engram_table.py)
            r = rows if rows is not None else range(spec.shape[0])
            values, scales = stored[spec.name][r.start:r.stop], stored[spec.scale_name][r.start:r.stop]
            out[spec.name] = HostEngramTable.copy_of(values, scales, device) if engram_placement == "host" else \
                StoredEngramTable(values.to(device).contiguous(), scales.to(device).contiguous())
            continue
        value = logical_tensor(spec, stored.__getitem__)
        if rows is not None:
            value = value[rows.start:rows.stop]
        if cols is not None:
            value = value[:, cols.start:cols.stop]
        out[spec.name] = value.to(device=device, dtype=F32).contiguous()
    if experts_mxfp4:
        order = sorted(held) if expert_ids is None else [int(e) for e in expert_ids]
        for prefix in expert_layers:
            out[routed_experts_key(prefix)] = prepare_layer_experts(stored, prefix, E, device, order)
    return out

"""FP8 linears that read the same input as one product (spec `model.md` §3.4.1, §3.6).

Two stacks (`STACKS`): the attention's `wq_a | wkv` (both multiply the attention input) and the shared
expert's `w1 | w3` (both multiply the MoE input; this rank's columns of each when column-parallel).
When the members hold their E4M3 tiles (the CUDA serving form: `Fp8TileParallelMethod` kept FP8),
`stack_rows` copies their weights and tile scales into consecutive rows of one tensor, makes the
members' parameters views of those rows, and puts a replicated SGLang linear over the whole
(`ReplicatedDsv41`, our FP8 method) under `prefix + key`: one GEMM launch instead of two, whose columns
are the members' in order. The readers take both halves in one launch from the stacked rows
(`attention_math.project_q_lora_kv` → `ComputeBackend.rms_norm_pair`; `TensorParallel.shared_expert` →
`ComputeBackend.clamped_swiglu_halves`).

Invariants:
* a column of the product depends only on x and its own weight row, so the stacked output is each
  member's within the FP8 kernel's stated bound (the kernel may pick its tier / split-K for the
  stacked shape, so the bits can differ from the members' own launches within that bound);
* the members stay usable alone: the dense-weight cache registers the stack before its members
  (`DenseWeightCache.from_weights`: larger first), and a member resolves as a tile-row view of it;
* restacking (each `finish_loading`, e.g. after a reload that replaced a member's scales) reuses the
  stack's storage when its shape is unchanged, so the addresses a captured CUDA graph holds stay valid.
Anything else (fp32 dequantised weights on CPU, members of different kinds or ranks) is left unstacked: no key.
"""
from __future__ import annotations

from typing import MutableMapping

import torch
from torch import nn

from ..checkpoint.codecs import TILE
from ..checkpoint.names import Kind, TensorSpec

E4M3, F32 = torch.float8_e4m3fn, torch.float32
#: the stacked layers' keys under their owner's prefix (`layers.{i}.attn.`, `layers.{i}.ffn.`), and their
#: members in column order
STACKED, MEMBERS = "wqkv_a", ("wq_a", "wkv")
SHARED_STACKED, SHARED_MEMBERS = "shared_experts.w13", ("shared_experts.w1", "shared_experts.w3")


def _stackable(members: list[object]) -> bool:
    """FP8 linears of one kind holding E4M3 tiles with fp32 scales: all replicated, or all column-parallel
    on the same rank; on one device, whole tile rows, one input width."""
    from .parallel_linear import ColumnParallelFp8, ReplicatedDsv41     # (they import the model math: not at import)

    kinds = {type(m) for m in members}
    if kinds == {ColumnParallelFp8}:
        if len({(m.tp_rank, m.tp_size) for m in members}) != 1:
            return False
    elif kinds != {ReplicatedDsv41}:
        return False
    w0 = members[0].weight
    return all(m.weight.dtype == E4M3 and m.scale.dtype == F32 and m.weight.dim() == 2
               and m.weight.shape[0] % TILE == 0 and m.weight.shape[1] == w0.shape[1]
               and m.weight.device == w0.device for m in members)


def _new_stack(name: str, rows: int, cols: int, device: torch.device) -> nn.Module:
    from .parallel_linear import Dsv41Fp8TileConfig, ReplicatedDsv41

    spec = TensorSpec(f"{name}.weight", (rows, cols), Kind.FP8, "dense")
    layer = ReplicatedDsv41(cols, rows, bias=False, params_dtype=F32, quant_config=Dsv41Fp8TileConfig(spec, True),
                            prefix=name)
    layer.set_values(torch.empty(rows, cols, dtype=E4M3, device=device),
                     torch.empty(rows // TILE, -(-cols // TILE), dtype=F32, device=device))
    layer.prebuilt = True
    return layer


def stack_attention_inputs(w: MutableMapping[str, object], prefix: str,
                           previous: nn.Module | None = None) -> nn.Module | None:
    """`stack_rows` of the attention's `wq_a | wkv` under `prefix` (`layers.{i}.attn.`)."""
    return stack_rows(w, prefix, STACKED, MEMBERS, previous)


def stack_shared_expert(w: MutableMapping[str, object], prefix: str,
                        previous: nn.Module | None = None) -> nn.Module | None:
    """`stack_rows` of the shared expert's `w1 | w3` under `prefix` (`layers.{i}.ffn.`)."""
    return stack_rows(w, prefix, SHARED_STACKED, SHARED_MEMBERS, previous)


def stack_rows(w: MutableMapping[str, object], prefix: str, name: str, member_names: tuple[str, ...],
               previous: nn.Module | None = None) -> nn.Module | None:
    """Put the stack of `w[prefix + m]` for m in `member_names` under `w[prefix + name]` and return it
    (module doc); `previous`: the stack of an earlier call, whose storage is reused when the shape still
    fits. Members that cannot be stacked leave `w` without the key; returns None."""
    key = prefix + name
    w.pop(key, None)
    members = [w.get(prefix + m) for m in member_names]
    if not _stackable(members):
        return None
    rows = [m.weight.shape[0] for m in members]
    cols, dev = members[0].weight.shape[1], members[0].weight.device
    stack = previous
    if stack is None or stack.weight_shape != (sum(rows), cols) or stack.weight.device != dev:
        stack = _new_stack(key, sum(rows), cols, dev)
    values, scales = stack.weight.data, stack.scale.data
    r0 = 0
    for m, n in zip(members, rows):
        v, s = values[r0:r0 + n], scales[r0 // TILE:(r0 + n) // TILE]
        if m.weight.data_ptr() != v.data_ptr():
            v.copy_(m.weight.data)
        if m.scale.data_ptr() != s.data_ptr():
            s.copy_(m.scale.data)
        m.weight.data, m.scale.data = v, s
        r0 += n
    stack.stacked_rows = tuple(rows)
    w[key] = stack
    return stack

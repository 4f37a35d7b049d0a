"""The attention's two input projections as one FP8 product (spec `model.md` §3.4.1).

`wq_a` and `wkv` both multiply the attention input x. When both hold their E4M3 tiles (the CUDA
serving form: `Fp8TileParallelMethod` kept FP8, replicated), `stack_attention_inputs` copies their
weights and tile scales into consecutive rows of one tensor, makes the members' parameters views of
those rows, and puts a replicated SGLang linear over the whole (`ReplicatedDsv41`, our FP8 method)
under `prefix + STACKED`: one GEMM launch instead of two, whose columns are `wq_a`'s then `wkv`'s
(`attention_math.project_q_lora_kv`; q_lora and kv are then normalised in one launch,
`ComputeBackend.rms_norm_pair`).

Invariants:
* a column of the product depends only on x and its own weight row, so the stacked output is each
  member's within the FP8 kernel's stated bound (the kernel may pick its tier / split-K for the
  stacked shape, so the bits can differ from the members' own launches within that bound);
* the members stay usable alone: the dense-weight cache registers the stack before its members
  (`DenseWeightCache.from_weights`: larger first), and a member resolves as a tile-row view of it;
* restacking (each `finish_loading`, e.g. after a reload that replaced a member's scales) reuses the
  stack's storage when its shape is unchanged, so the addresses a captured CUDA graph holds stay valid.
Anything else (fp32 dequantised weights on CPU, sharded members) is left unstacked: no `STACKED` key.
"""
from __future__ import annotations

from typing import MutableMapping

import torch
from torch import nn

from ..checkpoint.codecs import TILE
from ..checkpoint.names import Kind, TensorSpec
from .parallel_linear import Dsv41Fp8TileConfig, ReplicatedDsv41

E4M3, F32 = torch.float8_e4m3fn, torch.float32
#: the stacked layer's key under the attention prefix, and its members in column order
STACKED, MEMBERS = "wqkv_a", ("wq_a", "wkv")


def _stackable(members: list[object]) -> bool:
    """Replicated FP8 linears holding E4M3 tiles with fp32 scales, on one device, whole tile rows,
    one input width."""
    if not all(isinstance(m, ReplicatedDsv41) for m in members):
        return False
    w0 = members[0].weight
    return all(m.weight.dtype == E4M3 and m.scale.dtype == F32 and m.weight.dim() == 2
               and m.weight.shape[0] % TILE == 0 and m.weight.shape[1] == w0.shape[1]
               and m.weight.device == w0.device for m in members)


def _new_stack(name: str, rows: int, cols: int, device: torch.device) -> ReplicatedDsv41:
    spec = TensorSpec(f"{name}.weight", (rows, cols), Kind.FP8, "dense")
    layer = ReplicatedDsv41(cols, rows, bias=False, params_dtype=F32, quant_config=Dsv41Fp8TileConfig(spec, True),
                            prefix=name)
    layer.set_values(torch.empty(rows, cols, dtype=E4M3, device=device),
                     torch.empty(rows // TILE, -(-cols // TILE), dtype=F32, device=device))
    layer.prebuilt = True
    return layer


def stack_attention_inputs(w: MutableMapping[str, object], prefix: str,
                           previous: nn.Module | None = None) -> nn.Module | None:
    """Put the stack of `w[prefix + "wq_a"]` and `w[prefix + "wkv"]` under `w[prefix + STACKED]` and
    return it (module doc); `previous`: the stack of an earlier call, whose storage is reused when the
    shape still fits. Members that cannot be stacked leave `w` without the key; returns None."""
    key = prefix + STACKED
    w.pop(key, None)
    members = [w.get(prefix + m) for m in MEMBERS]
    if not _stackable(members):
        return None
    rows = [m.weight.shape[0] for m in members]
    cols, dev = members[0].weight.shape[1], members[0].weight.device
    stack = previous
    if stack is None or stack.weight_shape != (sum(rows), cols) or stack.weight.device != dev:
        stack = _new_stack(prefix + STACKED, sum(rows), cols, dev)
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

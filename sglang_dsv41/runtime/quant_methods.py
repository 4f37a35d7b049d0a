"""Quantisation methods of the runtime's weights: parameters as stored, loaded by `weight_loader`s
(spec `model.md` §2.1–§2.4; issue 13 item 1).

The linears' methods are SGLang `LinearMethodBase`s in `runtime/parallel_linear.py`
(`Fp8TileParallelMethod`, `Bf16ReplicatedMethod`), the embedding / head's in
`runtime/vocab_parallel.py`. Each method follows SGLang's shape (`create_weights` → `weight_loader`s → `process_weights_after_loading`
→ `apply`). Parameters are created in their stored form (this rank's rows), so `named_parameters()`
lists what the checkpoint holds; each loader checks the tensor against the inventory
(`checkpoint.loader.stored_problem`) and copies it in. Processing turns the stored form into the
runtime value *in place of* it (`param.data` is replaced, never duplicated):

| method | parameters (stored form) | after processing |
|---|---|---|
| `Mxfp4ExpertsMethod` | `w13_weight` / `w2_weight` packed E2M1 [E_held, N, K/2], `w13_scale` / `w2_scale` UE8M0 [E_held, N, K/32]; w13 = w1 rows then w3 rows | `prepare`: the kernel layout (`RoutedExpertsMxfp4`), stored bytes released; else dequantised fp32 |

Processing is idempotent: it runs when a loader touched the layer since the last run. A loader
that finds its parameter in processed form puts the stored form back first, so reloading
(`update_weights_from_disk`) works; a layer reloaded in part (a weight without its scale, some
of a layer's experts) raises.
`apply` calls the model's compute backend (`runtime/backend.py`) with the parameters; the model
math reaches a linear only through `apply_linear` (tests/test_runtime_linear_apply.py).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from sglang.srt.layers.quantization.base_config import QuantizationConfig
from torch import Tensor, nn

from ..checkpoint.codecs import TILE, dequantize_mxfp4, packed_fp4_bytes, scale_bytes, ue8m0_to_float
from ..checkpoint.loader import logical_tensor, stored_problem
from ..checkpoint.names import Kind, StoredTensor, TensorSpec
from ..checkpoint.reader import CheckpointFormatError

F32, E4M3, U8 = torch.float32, torch.float8_e4m3fn, torch.uint8
#: UE8M0 byte of 2^0: the scale a created-but-unloaded parameter holds (dummy weights stay finite)
UNIT_SCALE_BYTE = 127


def apply_linear(layer: nn.Module, x: Tensor, backend: object, **kwargs: object) -> Tensor:
    """`layer`'s output for `x` through its quantisation method — the one way the runtime math
    multiplies a linear's weight (`runtime/parallel_linear.py`; kernel choice by rows / mode is
    the method's, through the compute backend). Anything without a method raises."""
    method = getattr(layer, "quant_method", None)
    if method is None or not hasattr(method, "apply"):
        raise TypeError(f"apply_linear: expected a linear layer with a quantisation method, got {type(layer).__name__}"
                        " (the model's linears are SGLang linear layers, runtime/parallel_linear.py)")
    return method.apply(layer, x, backend=backend, **kwargs)


def check_stored(want: StoredTensor, loaded: Tensor) -> None:
    """Raise `CheckpointFormatError` when `loaded` is not what the inventory stores under `want.name`."""
    problem = stored_problem(want, loaded.dtype, tuple(loaded.shape))
    if problem:
        raise CheckpointFormatError(problem)


def new_parameter(data: Tensor, loader: Callable[..., None]) -> nn.Parameter:
    p = nn.Parameter(data, requires_grad=False)
    p.weight_loader = loader
    return p


def restore_stored_form(param: nn.Parameter, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """Give `param` fresh storage of its stored shape and dtype when processing replaced it."""
    if param.dtype != dtype or tuple(param.shape) != tuple(shape):
        param.data = torch.empty(shape, dtype=dtype, device=param.device)


def plain_parameter(spec: TensorSpec, rows: range | None, on_load: Callable[[], None] = lambda: None) -> nn.Parameter:
    """A BF16 / FP32-kind tensor as the fp32 §2.4 value of `rows` (None: all), created on the
    current default device; its loader applies the load-time rules (`logical_tensor`)."""
    if spec.kind not in (Kind.BF16, Kind.FP32):
        raise ValueError(f"{spec.name}: kind {spec.kind} is not a plain tensor")
    r = rows if rows is not None else range(spec.shape[0])
    want = spec.stored()[0]

    def load(param: nn.Parameter, loaded: Tensor) -> None:
        check_stored(want, loaded)
        value = logical_tensor(spec, lambda _: loaded)[r.start:r.stop]
        param.data.copy_(value)
        on_load()

    return new_parameter(torch.empty((len(r),) + tuple(spec.shape[1:]), dtype=F32), load)


def loaded_tile_scales(layer: nn.Module) -> Tensor:
    """fp32 tile scales of an FP8 layer whose E4M3 weight and UE8M0 scale bytes were both loaded;
    a partial reload (one of the two already processed) raises."""
    w, s = layer.weight, layer.scale
    if w.dtype != E4M3 or s.dtype != U8:
        raise RuntimeError(f"{layer.spec.name}: reloaded in part (weight {w.dtype}, scale {s.dtype}); an FP8 "
                           "weight and its scale are loaded together")
    return ue8m0_to_float(s.data)


#: shard id → (stacked parameter, row block) of a routed expert's stored tensors
EXPERT_SHARDS = {"w1": ("w13", 0), "w3": ("w13", 1), "w2": ("w2", 0)}


class Mxfp4ExpertsMethod:
    """The routed experts of one layer held by this rank (`expert_ids`, in order), stacked as
    SGLang's fused MoE stacks them (module table). `prepare`: kernel layout (CUDA)."""

    def __init__(self, prepare: bool) -> None:
        self.prepare = prepare

    def create_weights(self, layer: nn.Module, w1: TensorSpec, w2: TensorSpec, expert_ids: list[int],
                       n_routed_experts: int) -> None:
        (I, H), (H2, I2) = w1.shape, w2.shape
        if (H, I) != (H2, I2) or H % TILE or I % TILE:
            raise ValueError(f"{w1.name}, {w2.name}: expert shapes {w1.shape} / {w2.shape} are not [I, H] / [H, I] "
                             f"with multiples of {TILE}")
        E = len(expert_ids)
        layer.expert_ids, layer.local = list(expert_ids), {e: i for i, e in enumerate(expert_ids)}
        layer.n_routed_experts, layer.hidden, layer.intermediate = n_routed_experts, H, I
        layer.stale, layer.prepared = True, None
        #: parameters given their stored form back by a reload → the (expert, block) slots refilled since
        layer.refilled: dict[str, set[tuple[int, int]]] = {}
        layer.stored_specs = {"w1": w1.stored(), "w3": w1.stored(), "w2": w2.stored()}
        layer.stored_shapes = {"w13_weight": (E, 2 * I, H // 2), "w13_scale": (E, 2 * I, H // TILE),
                               "w2_weight": (E, H, I // 2), "w2_scale": (E, H, I // TILE)}
        for name, shape in layer.stored_shapes.items():
            fill = UNIT_SCALE_BYTE if name.endswith("scale") else 0
            layer.register_parameter(name, new_parameter(torch.full(shape, fill, dtype=U8),
                                                         self._loader(layer, name)))

    def _loader(self, layer: nn.Module, name: str) -> Callable[..., None]:
        is_scale = name.endswith("scale")

        def load(param: nn.Parameter, loaded: Tensor, shard_id: str, expert_id: int) -> None:
            stacked, block = EXPERT_SHARDS[shard_id]
            if not name.startswith(stacked + "_"):
                raise ValueError(f"expert shard {shard_id} does not load into {name}")
            want = layer.stored_specs[shard_id][1 if is_scale else 0]
            check_stored(dataclasses.replace(want, name=f"{want.name} (expert {expert_id} as {name})"), loaded)
            local = layer.local.get(int(expert_id))
            if local is None:
                return                                  # another rank's expert (expert parallel)
            if param.dtype != U8 or tuple(param.shape) != layer.stored_shapes[name]:
                restore_stored_form(param, layer.stored_shapes[name], U8)
                layer.refilled[name] = set()
            raw = scale_bytes(loaded) if is_scale else packed_fp4_bytes(loaded)
            n = raw.shape[0]
            param.data[local, block * n:(block + 1) * n].copy_(raw)
            layer.refilled.get(name, set()).add((local, block))
            layer.stale = True

        return load

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if not layer.stale:
            return
        blocks = {n: len(layer.expert_ids) * (2 if n.startswith("w13") else 1) for n in layer.stored_shapes}
        if any(getattr(layer, n).dtype != U8 or tuple(getattr(layer, n).shape) != s
               for n, s in layer.stored_shapes.items()) or \
                any(len(slots) != blocks[n] for n, slots in layer.refilled.items()):
            raise RuntimeError(f"routed experts {layer.expert_ids[:4]}…: reloaded in part; a reload loads every "
                               "held expert's w1, w2, w3 weights and scales of the layer")
        I = layer.intermediate
        if self.prepare:
            from ..kernels.moe_mxfp4_weights import prepare_mxfp4_stacked
            from .moe_ops import RoutedExpertsMxfp4

            w13, s13 = layer.w13_weight.data, layer.w13_scale.data
            packs = prepare_mxfp4_stacked(w13[:, :I], s13[:, :I], w13[:, I:], s13[:, I:], layer.w2_weight.data,
                                          layer.w2_scale.data, device=w13.device)
            n = len(layer.expert_ids)
            layer.prepared = RoutedExpertsMxfp4.build(packs, layer.expert_ids, layer.n_routed_experts, w13.device)
            for name in layer.stored_shapes:          # the kernel layout replaces the stored bytes
                getattr(layer, name).data = torch.empty((n, 0, 0), dtype=U8, device=w13.device)
        else:
            for w, s in (("w13_weight", "w13_scale"), ("w2_weight", "w2_scale")):
                packed, scale = getattr(layer, w).data, getattr(layer, s).data
                E, N, half = packed.shape
                getattr(layer, w).data = dequantize_mxfp4(packed.reshape(E * N, half),
                                                          scale.reshape(E * N, -1)).reshape(E, N, 2 * half)
        layer.stale, layer.refilled = False, {}

    def runtime_values(self, layer: nn.Module) -> dict[str, object]:
        """What the MoE math reads, relative to the layer: `mxfp4` (prepared) or the per-expert
        fp32 weights `{e}.w1.weight` … as views of the stacked parameters."""
        if self.prepare:
            return {"mxfp4": layer.prepared}
        I, out = layer.intermediate, {}
        for e, i in layer.local.items():
            out[f"{e}.w1.weight"] = layer.w13_weight[i, :I]
            out[f"{e}.w3.weight"] = layer.w13_weight[i, I:]
            out[f"{e}.w2.weight"] = layer.w2_weight[i]
        return out


class PerLayerQuantConfig(QuantizationConfig):
    """Base of the quantisation configs the runtime builds per layer (one tensor spec each), never
    from a checkpoint's quantisation file: subclasses name themselves and hand out the method."""

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict) -> "PerLayerQuantConfig":
        raise NotImplementedError(f"{cls.__name__} is built per layer by the runtime, not from a config file")

"""The model's linears as SGLang's linear layers with quantisation methods of ours (issue 13 item 4).

Every linear of the text model is an SGLang layer, one per checkpoint tensor (so parameter names
stay the checkpoint's; `MergedColumnParallelLinear` would rename them), built with this rank's
`tp_rank` / `tp_size` from the shard plan (`linear_kind`; size 1 where the plan splits nothing):
`wo_b` and the shared expert's `w2` are `RowParallelLinear`s; `wq_b` (by heads), `wo_a` (by
output groups) and the shared expert's `w1` / `w3` `ColumnParallelLinear`s; `wq_a`, `wkv`, the
indexer's `wq_b`, Engram's `wkv` and the BF16 linears (router, compressor, indexer `wk` /
`weights_proj`) `ReplicatedLinear`s. Quantisation config `Dsv41Fp8TileConfig` hands each layer
its method: SGLang's own FP8 method does not fit the checkpoint's format (32×32 UE8M0 tiles, E4M3
activations fake-quantised per 32 with power-of-two scales, CPU math in fp32 / float64; its
block-FP8 kernels are CUDA / AMX only), so `Fp8TileParallelMethod` is a `LinearMethodBase` of
ours (`Bf16ReplicatedMethod` for the BF16 ones):

* `create_weights` (SGLang's signature): `weight` E4M3 [n, k] and `scale` UE8M0 bytes of the
  32×32 tiles covering it, with SGLang's `output_dim` / `input_dim` attributes; their loaders
  check the stored tensor against the inventory, turn scales into bytes, then call the layer's
  own SGLang `weight_loader`, which narrows this rank's rows / columns (`tp_rank`). Shards must
  follow the tiles (the plan guarantees it; anything else raises here).
* `process_weights_after_loading`: E4M3 + fp32 tile scales kept for the CUDA dense backend
  (`keep_fp8` and every scale BF16-exact), else the fp32 §2.4 value (`attn.wo_a`: BF16-rounded);
  idempotent, reloadable.
* `apply(layer, x, bias=None, *, backend, act_quant=True, bf16_out=False, x_quantised=False, quantise_out=False)`:
  the compute backend's FP8 linear (`bf16_out`: the caller takes a BF16 tensor, `runtime/triton_backend.py` BF16_OUT;
  `x_quantised` / `quantise_out` (`wo_a` only): the quantised hand-off, `ComputeBackend.quantised_handoff`) —
  complete BF16 output for a column-parallel layer or at tp_size 1 (the backend picks the kernel
  by rows and its FP8 mode, `backend.FP8_GEMMS`); `wo_a` (built with
  `group_rows` = o_lora_rank) is the grouped BF16-arithmetic product of the groups it holds,
  x [T, groups·K] → [T, groups·r] (`linear_bf16_grouped`: one grouped launch on CUDA; §3.4.6,
  activations never quantised); for a sharded row-parallel layer the partial product in the
  backend's `acc` dtype (`linear_fp8_partial`), which `TensorParallel.row_parallel` all-reduces through SGLang's
  TP group and rounds once: exact on the float64 backend (the split follows the 32-wide
  activation blocks, so every rank's products are the TP-1 products), fp32 sums elsewhere.

SGLang's `forward` is not used: it all-reduces inside, and the model needs the unrounded partial
(one all-reduce with the routed experts' partial, `moe_ops`). The model math calls every linear
through `quant_methods.apply_linear` (the method's `apply` with the model's backend); no weight
is read by name and multiplied elsewhere (tests/test_runtime_linear_apply.py).
"""
from __future__ import annotations

import re
from typing import Mapping

import torch
from sglang.srt.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from sglang.srt.layers.quantization.base_config import LinearMethodBase
from torch import Tensor, nn

from ..checkpoint.codecs import TILE, scale_bytes
from ..checkpoint.loader import logical_tensor
from ..checkpoint.names import Kind, TensorSpec, tensor_inventory
from ..config import DeepseekV41Config
from .backend import ComputeBackend
from .dense_weights import fp8_scale_key, is_dense_linear_name
from .quant_methods import (UNIT_SCALE_BYTE, PerLayerQuantConfig, check_stored, loaded_tile_scales, new_parameter,
                            restore_stored_form)
from .tensor_parallel import ShardPlan

F32, E4M3, U8 = torch.float32, torch.float8_e4m3fn, torch.uint8


def _tiles(r: range) -> range:
    return range(r.start // TILE, -(-r.stop // TILE))


def _check_apply_args(name: str, backend: ComputeBackend | None, bias: Tensor | None) -> None:
    """A linear's `apply` needs the model's compute backend, and the checkpoint's linears have no bias."""
    if backend is None:
        raise TypeError(f"{name}: apply needs the model's compute backend (backend=)")
    if bias is not None:
        raise ValueError(f"{name}: the checkpoint's linears have no bias")


class Fp8TileParallelMethod(LinearMethodBase):
    """FP8 32×32-tile linear as an SGLang linear method (module doc)."""

    def __init__(self, spec: TensorSpec, keep_fp8: bool, group_rows: int | None = None) -> None:
        if spec.kind is not Kind.FP8:
            raise ValueError(f"{spec.name}: kind {spec.kind} is not FP8")
        if group_rows is not None and (group_rows < 1 or spec.shape[0] % group_rows):
            raise ValueError(f"{spec.name}: {spec.shape[0]} rows are not whole groups of {group_rows}")
        self.spec, self.keep_fp8, self.group_rows = spec, keep_fp8, group_rows

    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra) -> None:
        spec, sglang_loader = self.spec, extra["weight_loader"]
        N, K = spec.shape
        if (output_size, input_size) != (N, K):
            raise ValueError(f"{spec.name}: layer {output_size}×{input_size} is not the stored {N}×{K}")
        n, k, rank = sum(output_partition_sizes), input_size_per_partition, getattr(layer, "tp_rank", 0)
        row_parallel = isinstance(layer, RowParallelLinear)
        rows = range(N) if row_parallel else range(rank * n, (rank + 1) * n)
        cols = range(rank * k, (rank + 1) * k) if row_parallel else range(K)
        for what, r, full in (("rows", rows, N), ("columns", cols, K)):
            if r.start % TILE or (r.stop % TILE and r.stop != full):
                raise ValueError(f"{spec.name}: {what} {r.start}..{r.stop} of {full} (tp rank {rank} of "
                                 f"{getattr(layer, 'tp_size', 1)}) do not follow the {TILE}-wide FP8 tiles")
        layer.spec, layer.rows, layer.cols, layer.stale = spec, rows, cols, True
        layer.row_parallel = row_parallel
        layer.weight_shape = (n, k)
        layer.scale_shape = (len(_tiles(rows)), len(_tiles(cols)))
        want_w, want_s = spec.stored()

        def load_weight(param: nn.Parameter, loaded: Tensor) -> None:
            check_stored(want_w, loaded)
            restore_stored_form(param, layer.weight_shape, E4M3)
            sglang_loader(param, loaded)                       # narrows this rank's rows / columns
            layer.stale = True

        def load_scale(param: nn.Parameter, loaded: Tensor) -> None:
            check_stored(want_s, loaded)
            restore_stored_form(param, layer.scale_shape, U8)
            sglang_loader(param, scale_bytes(loaded))
            layer.stale = True

        split = {"input_dim": 1, "output_dim": 0}
        weight = new_parameter(torch.empty(layer.weight_shape, dtype=E4M3), load_weight)
        scale = new_parameter(torch.full(layer.scale_shape, UNIT_SCALE_BYTE, dtype=U8), load_scale)
        for p in (weight, scale):
            for key, value in split.items():
                setattr(p, key, value)
        layer.register_parameter("weight", weight)
        layer.register_parameter("scale", scale)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if not layer.stale:
            return
        scales = loaded_tile_scales(layer)
        from ..kernels.fp8_linear import scales_are_bf16_exact

        if self.keep_fp8 and bool(scales_are_bf16_exact(scales)):
            layer.scale.data = scales.contiguous()
        else:
            n, k = layer.weight_shape
            per = scales.repeat_interleave(TILE, dim=0).repeat_interleave(TILE, dim=1)[:n, :k]
            value = layer.weight.data.to(F32) * per
            if self.spec.name.endswith("attn.wo_a.weight"):       # §2.4: wo_a's value is BF16-rounded
                value = value.to(torch.bfloat16).to(F32)
            layer.weight.data = value.contiguous()
        layer.stale = False

    def set_values(self, layer: nn.Module, weight: Tensor, scale: Tensor | None) -> None:
        """Take over processed runtime values (`runtime/weights.py`'s E4M3 + fp32 scales or fp32
        value of this rank's shard) without a copy."""
        if tuple(weight.shape) != layer.weight_shape:
            raise ValueError(f"{layer.spec.name}: value {tuple(weight.shape)} is not this rank's "
                             f"{layer.weight_shape}")
        if (weight.dtype == E4M3) != (scale is not None):
            raise ValueError(f"{layer.spec.name}: an E4M3 value comes with its fp32 tile scales, an fp32 one without")
        layer.weight.data = weight
        if scale is not None:
            layer.scale.data = scale
        layer.stale = False

    def runtime_values(self, layer: nn.Module) -> dict[str, object]:
        kept = layer.weight.dtype == E4M3
        return {"weight": layer.weight, **({"scale": layer.scale} if kept else {})}

    def apply(self, layer: nn.Module, x: Tensor, bias: Tensor | None = None, *,
              backend: ComputeBackend | None = None, act_quant: bool = True, bf16_out: bool = False,
              x_quantised: bool = False, quantise_out: bool = False) -> Tensor:
        _check_apply_args(layer.spec.name, backend, bias)
        if self.group_rows is not None:                   # wo_a: BF16 activations, one grouped product
            return backend.linear_bf16_grouped(x, layer.weight, layer.weight_shape[0] // self.group_rows,
                                               bf16_out=bf16_out, quantise_out=quantise_out)
        if quantise_out:
            raise ValueError(f"{layer.spec.name}: quantise_out is the grouped wo_a's (its one consumer is wo_b)")
        if layer.row_parallel and getattr(layer, "tp_size", 1) > 1:
            return backend.linear_fp8_partial(x, layer.weight, act_quant)
        return backend.linear_fp8(x, layer.weight, act_quant, bf16_out=bf16_out, x_quantised=x_quantised)


class Bf16ReplicatedMethod(LinearMethodBase):
    """A BF16-kind linear (router, compressor, indexer `wk` / `weights_proj`) as an SGLang linear
    method: `weight` is the fp32 §2.4 value (BF16 values); its loader checks the stored tensor,
    applies the load-time rules and calls the layer's SGLang `weight_loader`. Replicated only."""

    def __init__(self, spec: TensorSpec) -> None:
        if spec.kind not in (Kind.BF16, Kind.FP32):
            raise ValueError(f"{spec.name}: kind {spec.kind} is not a BF16 linear")
        self.spec = spec

    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra) -> None:
        spec, sglang_loader = self.spec, extra["weight_loader"]
        if (sum(output_partition_sizes), input_size_per_partition) != spec.shape:
            raise ValueError(f"{spec.name}: a BF16 linear is replicated; layer "
                             f"{sum(output_partition_sizes)}×{input_size_per_partition} is not the stored {spec.shape}")
        layer.spec, layer.stale = spec, False
        want = spec.stored()[0]

        def load(param: nn.Parameter, loaded: Tensor) -> None:
            check_stored(want, loaded)
            sglang_loader(param, logical_tensor(spec, lambda _: loaded))

        layer.register_parameter("weight", new_parameter(torch.empty(spec.shape, dtype=F32), load))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Nothing to convert: the parameter is loaded in its runtime form."""

    def set_values(self, layer: nn.Module, weight: Tensor, scale: Tensor | None) -> None:
        if tuple(weight.shape) != tuple(self.spec.shape) or weight.dtype != F32 or scale is not None:
            raise ValueError(f"{self.spec.name}: value {tuple(weight.shape)} {weight.dtype} is not its fp32 "
                             f"{tuple(self.spec.shape)} value")
        layer.weight.data = weight

    def runtime_values(self, layer: nn.Module) -> dict[str, object]:
        return {"weight": layer.weight}

    def apply(self, layer: nn.Module, x: Tensor, bias: Tensor | None = None, *,
              backend: ComputeBackend | None = None, out_fp32: bool = False) -> Tensor:
        _check_apply_args(self.spec.name, backend, bias)
        return backend.linear_bf16(x, layer.weight, out_fp32)


class Dsv41Fp8TileConfig(PerLayerQuantConfig):
    """The quantisation config that hands one layer its method: `Fp8TileParallelMethod` for an FP8
    tensor spec, `Bf16ReplicatedMethod` for a BF16 one."""

    def __init__(self, spec: TensorSpec, keep_fp8: bool, group_rows: int | None = None) -> None:
        super().__init__()
        self.spec, self.keep_fp8, self.group_rows = spec, keep_fp8, group_rows

    def get_name(self) -> str:
        return "dsv41_fp8_tile"

    def get_quant_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase:
        if self.spec.kind is Kind.FP8:
            return Fp8TileParallelMethod(self.spec, self.keep_fp8, self.group_rows)
        return Bf16ReplicatedMethod(self.spec)

    def get_scaled_act_names(self) -> list[str]:
        return []


class _ParallelFp8:
    """What the model asks of a weight module (`process`, `runtime_values`, `set_values`)."""

    def process(self) -> None:
        self.quant_method.process_weights_after_loading(self)

    def runtime_values(self) -> dict[str, object]:
        return self.quant_method.runtime_values(self)

    def set_values(self, weight: Tensor, scale: Tensor | None = None) -> None:
        self.quant_method.set_values(self, weight, scale)


class RowParallelFp8(_ParallelFp8, RowParallelLinear):
    """SGLang's `RowParallelLinear` over an FP8 tile weight (module doc)."""


class ColumnParallelFp8(_ParallelFp8, ColumnParallelLinear):
    """SGLang's `ColumnParallelLinear` over an FP8 tile weight (module doc)."""


class ReplicatedDsv41(_ParallelFp8, ReplicatedLinear):
    """SGLang's `ReplicatedLinear` over an FP8 tile or a BF16 weight (module doc)."""


def linear_kind(spec: TensorSpec, plan: ShardPlan) -> str:
    """"row" / "column" (SGLang's Row- / ColumnParallelLinear) or "replicated" for a linear of
    the model: `wo_b`, the shared expert (`plan.parallel_kind`), `wq_b` / `wo_a` column-parallel
    by heads / output groups (`plan.rows_of`), every other linear replicated."""
    kind = plan.parallel_kind(spec.name)
    if kind is not None:
        return kind
    return "replicated" if plan.rows_of(spec.name) is None else "column"


#: BF16 linears of the DSpark stages (their router); the draft's Markov / confidence heads are
#: vocabulary-sized tables and a score row, read by `dspark_heads`
_DSPARK_BF16_LINEAR = re.compile(r"mtp\.\d+\.(attn|ffn)\.")


def is_model_linear(spec: TensorSpec) -> bool:
    """Whether `spec` is one of the model's linears built as an SGLang linear layer: every FP8
    tensor, the BF16 linears of the decoder layers and of the DSpark stages."""
    if spec.kind is Kind.FP8:
        return True
    return spec.kind in (Kind.BF16, Kind.FP32) and is_dense_linear_name(spec.name, len(spec.shape)) and \
        (spec.name.startswith("layers.") or _DSPARK_BF16_LINEAR.match(spec.name) is not None)


def parallel_fp8_linear(spec: TensorSpec, plan: ShardPlan, keep_fp8: bool) -> nn.Module:
    """The SGLang linear layer of `spec` on this rank (`linear_kind`), with our quantisation
    method; tp size 1 where the plan splits none of its rows / columns."""
    if not is_model_linear(spec):
        raise ValueError(f"{spec.name} is not one of the model's linears")
    kind = linear_kind(spec, plan)
    N, K = spec.shape
    group_rows = plan.o_lora_rank if spec.name.endswith("attn.wo_a.weight") else None
    args = dict(bias=False, params_dtype=F32, quant_config=Dsv41Fp8TileConfig(spec, keep_fp8, group_rows),
                prefix=spec.name.rsplit(".", 1)[0])
    if kind == "replicated":
        return ReplicatedDsv41(K, N, **args)
    sharded = (plan.cols_of if kind == "row" else plan.rows_of)(spec.name) is not None
    rank, size = (plan.rank, plan.size) if sharded else (0, 1)
    cls = RowParallelFp8 if kind == "row" else ColumnParallelFp8
    return cls(K, N, tp_rank=rank, tp_size=size, **args)


def is_parallel_linear(module: object) -> bool:
    return isinstance(module, _ParallelFp8)


def with_parallel_linears(weights: Mapping[str, object], cfg: DeepseekV41Config,
                          plan: ShardPlan, dspark: bool = False) -> dict[str, object]:
    """`weights` (name → runtime value, `runtime/weights.py`) with the values of the model's
    linears taken over by their SGLang layers (`weight`, and `scale` when kept E4M3), keyed by
    the layer's prefix (`layers.0.attn.wq_a`): a model built from values runs the same layers as
    one built for loading. Values must be this rank's shard; `dspark`: the DSpark stages' too."""
    out = dict(weights)
    for spec in tensor_inventory(cfg, vision=False, dspark=dspark):
        value = out.get(spec.name)
        if not is_model_linear(spec) or not isinstance(value, Tensor):
            continue
        kept = value.dtype == E4M3
        layer = parallel_fp8_linear(spec, plan, keep_fp8=kept)
        layer.set_values(out.pop(spec.name), out.pop(fp8_scale_key(spec.name)) if kept else None)
        layer.prebuilt = True
        out[spec.name.rsplit(".", 1)[0]] = layer
    return out


def linear_values(weights: Mapping[str, object]) -> dict[str, object]:
    """`weights` with every linear layer replaced by its runtime values under checkpoint names
    (`{prefix}.weight`, and `{prefix}.scale` when kept E4M3): what the dense-weight cache
    registers (`backend_for`) and what name-keyed readers of the weights see."""
    out: dict[str, object] = {}
    for name, value in weights.items():
        if is_parallel_linear(value):
            out.update({f"{name}.{leaf}": v for leaf, v in value.runtime_values().items()})
        else:
            out[name] = value
    return out

"""Vocabulary-parallel embedding and LM head as SGLang's layers (issue 13 item 4; spec §3.1, §3.7).

`VocabParallelEmbedding` / `ParallelLMHead` here are SGLang 0.5.17's classes
(`layers/vocab_parallel_embedding.py`), built with this rank's `tp_rank` / `tp_size` from the
shard plan (through SGLang's own `get_parallel().override`, so a single process can build any
rank's layer; `enable_tp=False` at TP 1). SGLang computes the split — vocabulary padded to 64,
equal blocks, `shard_indices` — and its `weight_loader` narrows the checkpoint tensor to this
rank's rows; the plan's `vocab` must be exactly SGLang's org-vocab range (raises otherwise).

Quantisation method `Bf16VocabMethod` (a `QuantizeMethodBase` of ours): `weight` is the fp32
§2.4 value (BF16 values) of the rows this rank holds — the padding rows of the block are held by
nobody, so `named_parameters()` lists only checkpoint rows; its loader checks the stored tensor
against the inventory, applies the load-time rules, then calls SGLang's loader.

Math is ours, bit-identical to TP 1 (SGLang's `forward` is not used: its masked fill writes +0.0,
which would turn a −0.0 row element into +0.0, and its head is applied by the LogitsProcessor):

* embedding: a rank looks up the ids it holds and writes −0.0 for the others (the additive
  identity of IEEE addition, ±0 included); SGLang's all-reduce then yields each row exactly once;
* head (`logits`): a rank computes the logits of its block on the model's compute backend (each
  column a complete dot product), pads them to the block width, and SGLang's all-gather
  concatenates the blocks in rank order; the padding columns are cut off.
"""
from __future__ import annotations

import contextlib
from typing import Mapping

import torch
import torch.nn.functional as F
from sglang.srt.layers.quantization.base_config import QuantizeMethodBase
from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead as SGLangParallelLMHead
from sglang.srt.layers.vocab_parallel_embedding import VocabParallelEmbedding as SGLangVocabParallelEmbedding
from sglang.srt.runtime_context import get_parallel
from torch import Tensor, nn

from ..checkpoint.loader import logical_tensor
from ..checkpoint.names import Kind, TensorSpec, tensor_inventory
from ..config import DeepseekV41Config
from .backend import ComputeBackend
from .quant_methods import PerLayerQuantConfig, check_stored, new_parameter
from .tensor_parallel import VOCAB_PADDING, ShardPlan, TensorParallel

F32 = torch.float32


class Bf16VocabMethod(QuantizeMethodBase):
    """A BF16-kind vocabulary table held as its fp32 §2.4 value (module doc)."""

    def __init__(self, spec: TensorSpec) -> None:
        if spec.kind is not Kind.BF16:
            raise ValueError(f"{spec.name}: kind {spec.kind} is not a BF16 vocabulary table")
        self.spec = spec

    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra) -> None:
        spec, sglang_loader = self.spec, extra["weight_loader"]
        if (layer.org_vocab_size, input_size) != spec.shape:
            raise ValueError(f"{spec.name}: layer {layer.org_vocab_size}×{input_size} is not the stored "
                             f"{spec.shape[0]}×{spec.shape[1]}")
        held = layer.num_org_embeddings_per_partition
        want = spec.stored()[0]

        def load(param: nn.Parameter, loaded: Tensor) -> None:
            check_stored(want, loaded)
            sglang_loader(param, logical_tensor(spec, lambda _: loaded))    # narrows this rank's rows

        weight = new_parameter(torch.empty((held, input_size_per_partition), dtype=F32), load)
        weight.output_dim, weight.input_dim = 0, 1
        layer.register_parameter("weight", weight)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Nothing to convert: the parameter is loaded in its runtime form."""

    def embedding(self, layer: nn.Module, ids: Tensor) -> Tensor:
        """Rows of the held ids (`ids` local to this rank's block)."""
        return layer.weight[ids]

    def apply(self, layer: nn.Module, x: Tensor, bias: Tensor | None = None, *,
              backend: ComputeBackend | None = None) -> Tensor:
        """fp32 logits of this rank's block (no padding columns) on the model's compute backend."""
        if backend is None:
            raise TypeError(f"{self.spec.name}: apply needs the model's compute backend (backend=)")
        if bias is not None:
            raise ValueError("the DeepSeek-V4.1 LM head has no bias")
        return backend.matmul(x, layer.weight)


class Dsv41VocabConfig(PerLayerQuantConfig):
    """The quantisation config that hands the layer `Bf16VocabMethod` (its tensor spec)."""

    def __init__(self, spec: TensorSpec) -> None:
        super().__init__()
        self.spec = spec

    def get_name(self) -> str:
        return "dsv41_bf16_vocab"

    def get_quant_method(self, layer: nn.Module, prefix: str) -> Bf16VocabMethod:
        return Bf16VocabMethod(self.spec)

    def get_scaled_act_names(self) -> list[str]:
        return []


def _sglang_rank(plan: ShardPlan):
    """SGLang's parallel values forced to the plan's rank (no-op at TP 1: `enable_tp=False`)."""
    if plan.size == 1:
        return contextlib.nullcontext()
    return get_parallel().override(tp_rank=plan.rank, tp_size=plan.size)


class _VocabRows:
    """What the model asks of a vocabulary layer (checked split, loading protocol)."""

    def _check_split(self, plan: ShardPlan) -> None:
        idx = self.shard_indices
        mine = range(idx.org_vocab_start_index, idx.org_vocab_end_index)
        if (mine, self.num_embeddings_per_partition) != (plan.vocab, plan.vocab_per_rank):
            raise ValueError(f"SGLang's vocabulary split gives rank {plan.rank} ids {mine.start}..{mine.stop} "
                             f"(block {self.num_embeddings_per_partition}); the shard plan holds "
                             f"{plan.vocab.start}..{plan.vocab.stop} (block {plan.vocab_per_rank})")
        self.plan, self.vocab, self.per_rank, self.tp = plan, plan.vocab, plan.vocab_per_rank, None

    def attach(self, tp: TensorParallel) -> None:
        """The model's TP group, whose collectives the forward uses (the model built the plan
        from it: `TensorParallel.plan`)."""
        self.tp = tp

    def process(self) -> None:
        self.quant_method.process_weights_after_loading(self)

    def runtime_values(self) -> dict[str, object]:
        return {"weight": self.weight}

    def set_values(self, weight: Tensor) -> None:
        """Take over this rank's rows (the fp32 §2.4 value, `runtime/weights.py`) without a copy."""
        if tuple(weight.shape) != tuple(self.weight.shape) or weight.dtype != F32:
            raise ValueError(f"{self.quant_method.spec.name}: value {tuple(weight.shape)} {weight.dtype} is not "
                             f"this rank's {tuple(self.weight.shape)} fp32 rows")
        self.weight.data = weight


def _layer_args(spec: TensorSpec, plan: ShardPlan) -> dict:
    return dict(params_dtype=F32, quant_config=Dsv41VocabConfig(spec), padding_size=VOCAB_PADDING,
                prefix=spec.name.rsplit(".", 1)[0], enable_tp=plan.size > 1)


class VocabParallelEmbedding(_VocabRows, SGLangVocabParallelEmbedding):
    """SGLang's `VocabParallelEmbedding` over `embed.weight`; `forward(ids)` → the full
    [N, hidden] rows on every rank (module doc)."""

    def __init__(self, spec: TensorSpec, plan: ShardPlan) -> None:
        with _sglang_rank(plan):
            SGLangVocabParallelEmbedding.__init__(self, spec.shape[0], spec.shape[1], **_layer_args(spec, plan))
        self._check_split(plan)

    def forward(self, ids: Tensor) -> Tensor:
        if self.tp.size == 1:
            return self.quant_method.embedding(self, ids)
        held = self.vocab
        local = ids.to(torch.int64) - held.start
        owned = (local >= 0) & (local < len(held))
        if len(held):
            rows = self.quant_method.embedding(self, local.clamp(0, len(held) - 1))
        else:
            rows = self.weight.new_zeros(ids.shape[0], self.weight.shape[1])
        rows = torch.where(owned[:, None], rows, torch.full_like(rows, -0.0))
        return self.tp.all_reduce_sum(rows.contiguous())


class ParallelLMHead(_VocabRows, SGLangParallelLMHead):
    """SGLang's `ParallelLMHead` over `head.weight`; `logits(hidden, backend)` → fp32 logits
    [N, vocab_size] on every rank (the blocks all-gathered; module doc)."""

    def __init__(self, spec: TensorSpec, plan: ShardPlan) -> None:
        with _sglang_rank(plan):
            SGLangParallelLMHead.__init__(self, spec.shape[0], spec.shape[1], **_layer_args(spec, plan))
        self._check_split(plan)

    def logits(self, hidden: Tensor, backend: ComputeBackend) -> Tensor:
        local = self.quant_method.apply(self, hidden, backend=backend)
        if self.tp.size == 1:
            return local
        if local.shape[1] < self.per_rank:
            local = F.pad(local, (0, self.per_rank - local.shape[1]))
        return self.tp.all_gather(local, -1)[:, :self.org_vocab_size]


_LAYERS = {"embed.weight": VocabParallelEmbedding, "head.weight": ParallelLMHead}


def vocab_layer(spec: TensorSpec, plan: ShardPlan) -> nn.Module:
    """The SGLang vocabulary layer of `embed.weight` / `head.weight` on this rank (weights created
    in stored form, loaded by `weight_loader`); the model attaches its TP group."""
    cls = _LAYERS.get(spec.name)
    if cls is None:
        raise ValueError(f"{spec.name} is not the embedding or the LM head")
    return cls(spec, plan)


def with_vocab_layers(weights: Mapping[str, object], cfg: DeepseekV41Config, plan: ShardPlan) -> dict[str, object]:
    """`weights` (name → runtime value, `runtime/weights.py`) with `embed.weight` / `head.weight`
    values (this rank's rows) taken over by their SGLang layers, keyed `embed` / `head`: a model
    built from values runs the same layers as one built for loading."""
    out = dict(weights)
    specs = {s.name: s for s in tensor_inventory(cfg, vision=False, dspark=False) if s.name in _LAYERS}
    for name, spec in specs.items():
        value = out.get(name)
        if isinstance(value, Tensor):
            layer = vocab_layer(spec, plan)
            layer.set_values(out.pop(name))
            layer.prebuilt = True
            out[name.rsplit(".", 1)[0]] = layer
    return out

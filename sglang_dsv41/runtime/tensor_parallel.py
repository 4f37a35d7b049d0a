"""Tensor / expert parallelism of the torch path, bit-identical to TP 1 on the exact backend
(issue 3, issue 13 item 4; spec §3.4, §3.3, §3.6).

The reference evaluates every order-sensitive fp32 formula in float64 and rounds once, so the
shard plan below is chosen such that no rounded value is ever split across ranks: each rank
computes complete values of its share, or exact float64 partial sums of a value rounded once
after the all-reduce; the collectives move values (all-gather), add exact zeros to them
(all-reduce of disjoint supports) or add exact partials. TP size N therefore gives the same bits
as TP 1 on the exact backend.

Shard plan (`ShardPlan.for_config`), rank r of N:

* attention heads, by output groups: rank r owns o_groups r·G/N .. (r+1)·G/N − 1 and their
  heads; it computes q (`wq_b` rows of its heads), attention with its heads' sinks, the inverse
  RoPE and the grouped `wo_a` of its groups (BF16 outputs, each a complete value); `wo_b` is
  row-parallel over exactly those columns (`cols_of`; SGLang's `RowParallelLinear`,
  `runtime/parallel_linear.py`): its partial product in the backend's `acc` is all-reduced and
  rounded once (`row_parallel`). The columns split on 32-wide activation blocks, so each rank's
  products are the TP-1 products: on the exact backend the float64 sum is the TP-1 sum (as for
  the routed partial below), on the fp32 backends within the numerics contract. Needs
  o_groups % N == 0 and num_attention_heads % N == 0;
* shared expert: `w1` / `w3` column-parallel and `w2` row-parallel over equal intermediate blocks
  when each block is whole 32-wide tiles (`shared_expert_block`; else replicated); `w2`'s
  partial shares the routed partial's all-reduce (`shared_expert`, `moe_ops`);
* routed experts (expert parallel): rank r owns a contiguous balanced block of expert ids; the
  router runs replicated, each rank contributes the per-slot expert outputs [T, k, H] of the
  slots of its experts (−0.0 elsewhere; `runtime.moe_ops`' `experts=` / `reduce=` hook), they
  are all-reduced — exact, each slot has one owner — and the reference's finalize (the fp32
  slot-order sum, upstream's) follows (spec §3.6): bit-identical to TP 1 on every backend, for
  k values per hidden element in the collective;
* Engram tables, by rows: rank r holds a contiguous balanced block of each table's rows; the
  looked-up rows are −0.0 where another rank owns them and are all-reduced (exact, as above),
  then the reference's Engram update runs on the gathered rows (spec §3.3.2);
* embedding and LM head, by vocabulary rows as SGLang's `VocabParallelEmbedding` /
  `ParallelLMHead` split them (`vocab_shard`): the embedding looks up its own ids, −0.0 elsewhere,
  and all-reduces (exact); the head computes its block of logits and all-gathers them (values
  moved), so both are bit-identical to TP 1 (`runtime/vocab_parallel.py`);
* everything else is replicated: the KV caches, compressor, indexer (its projections are its
  own weights and `q_lora` is replicated), mHC, `wq_a`, `wkv`, router.

Collectives are SGLang's: the TP `GroupCoordinator`'s `all_reduce` / `all_gather` (custom
all-reduce or pynccl on CUDA, where nothing is float64; gloo's torch.distributed path on CPU,
which sums float64 and fp32), see `TensorParallel.from_sglang`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import re
from dataclasses import dataclass
from typing import Callable, Mapping

import torch
from torch import Tensor

from ..config import DeepseekV41Config, TextConfig
from .weights import runtime_weights

_LAYER = r"layers\.(\d+)\."
_HEAD_ROWS = re.compile(_LAYER + r"attn\.(wq_b\.weight|attn_sink)$")
_GROUP_ROWS = re.compile(_LAYER + r"attn\.wo_a\.weight$")
_EXPERT = re.compile(_LAYER + r"ffn\.experts\.(\d+)\.w[123]\.weight$")
_ENGRAM_TABLE = re.compile(_LAYER + r"engram\.embed\.weight$")
_WO_B = re.compile(_LAYER + r"attn\.wo_b\.weight$")
_SHARED_UP = re.compile(_LAYER + r"ffn\.shared_experts\.w[13]\.weight$")
_SHARED_DOWN = re.compile(_LAYER + r"ffn\.shared_experts\.w2\.weight$")
#: the FP8 tile / activation-quantisation block width a row-parallel split must follow (spec §2.1, §3.8)
SPLIT_ALIGN = 32
_VOCAB_ROWS = ("embed.weight", "head.weight")
#: SGLang's `DEFAULT_VOCAB_PADDING_SIZE`: the vocabulary is padded to a multiple of this before the split
VOCAB_PADDING = 64


class TensorParallelError(ValueError):
    """A tensor-parallel size or rank this model cannot be sharded with."""


def vocab_shard(vocab: int, size: int, rank: int) -> tuple[range, int]:
    """(token ids rank `rank` holds, per-rank width) of a vocabulary of `vocab` ids split as SGLang's
    `VocabParallelEmbedding` / `ParallelLMHead` split it: padded to a multiple of `VOCAB_PADDING`,
    equal blocks of padded / size ids; the ids past `vocab` are padding (held by nobody)."""
    padded = -(-vocab // VOCAB_PADDING) * VOCAB_PADDING
    if padded % size:
        raise TensorParallelError(f"tensor parallel size {size} does not divide the padded vocabulary ({padded})")
    per = padded // size
    return range(min(rank * per, vocab), min((rank + 1) * per, vocab)), per


def shared_expert_block(intermediate: int, size: int, rank: int) -> range | None:
    """Rank `rank`'s block of the shared expert's intermediate columns: equal blocks when each is
    a multiple of `SPLIT_ALIGN` (the row-parallel `w2` then reads whole 32-wide activation blocks
    and FP8 tiles, so its partial sums are exact pieces of the TP-1 sum), else None (replicated;
    e.g. the tiny preset's 32 columns at TP 2)."""
    if size == 1 or intermediate % (size * SPLIT_ALIGN):
        return None
    per = intermediate // size
    return range(rank * per, (rank + 1) * per)


def balanced_block(n: int, size: int, rank: int) -> range:
    """Rank `rank`'s contiguous share of n items split over `size` ranks (the first n % size
    ranks get one extra item)."""
    base, extra = divmod(n, size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


@dataclass(frozen=True)
class ShardPlan:
    """What rank `rank` of `size` holds (module docstring). Ranges are global ids."""

    rank: int
    size: int
    groups: range
    heads: range
    experts: range
    engram_rows: dict[int, range]          # Engram layer id → table rows held
    vocab: range                           # token ids of `embed` / `head` rows held (`vocab_shard`)
    vocab_per_rank: int                    # padded width of every rank's block of logits
    head_dim: int
    o_lora_rank: int
    #: shared-expert intermediate columns held (w1/w3 rows, w2 columns); None = replicated, when
    #: the per-rank block would split a 32-wide FP8 tile / activation block (`shared_expert_block`)
    shared: range | None = None

    @classmethod
    def for_config(cls, text: TextConfig, rank: int, size: int) -> "ShardPlan":
        """The plan of rank `rank`; raises `TensorParallelError` for sizes the model cannot use."""
        if size < 1 or not 0 <= rank < size:
            raise TensorParallelError(f"tensor parallel rank {rank} of size {size} is not a valid rank")
        G, H = text.o_groups, text.num_attention_heads
        if G % size or H % size:
            raise TensorParallelError(
                f"tensor parallel size {size} must divide o_groups ({G}) and num_attention_heads ({H}): "
                f"attention is sharded by whole output groups (bit-identical to TP 1); "
                f"use a divisor of {G}")
        if text.n_routed_experts < size:
            raise TensorParallelError(f"tensor parallel size {size} exceeds the {text.n_routed_experts} "
                                      "routed experts (each rank owns at least one expert)")
        groups = range(rank * G // size, (rank + 1) * G // size)
        hpg = text.heads_per_group
        vocab, per = vocab_shard(text.vocab_size, size, rank)
        return cls(vocab=vocab, vocab_per_rank=per, rank=rank, size=size, groups=groups, heads=range(groups.start * hpg, groups.stop * hpg),
                   experts=balanced_block(text.n_routed_experts, size, rank),
                   engram_rows={layer: balanced_block(rows, size, rank)
                                for layer, rows in zip(text.engram_layer_ids, text.engram_num_embeddings)},
                   head_dim=text.head_dim, o_lora_rank=text.o_lora_rank,
                   shared=shared_expert_block(text.moe_intermediate_size * text.n_shared_experts, size, rank))

    def local_text_config(self, text: TextConfig) -> TextConfig:
        """`text` with this rank's head and group counts (heads_per_group unchanged): the shapes
        the reference's per-head functions see on this rank."""
        return dataclasses.replace(text, num_attention_heads=len(self.heads), o_groups=len(self.groups))

    def holds(self, name: str) -> bool:
        """Whether this rank loads logical tensor `name` at all (routed experts of other ranks: no)."""
        m = _EXPERT.match(name)
        return m is None or int(m.group(2)) in self.experts

    def rows_of(self, name: str) -> range | None:
        """The dim-0 rows of logical tensor `name` this rank holds; None = the whole tensor."""
        if self.size == 1:
            return None
        if name in _VOCAB_ROWS:
            return self.vocab
        if _HEAD_ROWS.match(name):
            per_head = self.head_dim if name.endswith("wq_b.weight") else 1
            return range(self.heads.start * per_head, self.heads.stop * per_head)
        if _GROUP_ROWS.match(name):
            return range(self.groups.start * self.o_lora_rank, self.groups.stop * self.o_lora_rank)
        m = _ENGRAM_TABLE.match(name)
        if m:
            return self.engram_rows[int(m.group(1))]
        if self.shared is not None and _SHARED_UP.match(name):
            return self.shared
        return None

    def cols_of(self, name: str) -> range | None:
        """The dim-1 columns (input features) of logical tensor `name` this rank holds — the
        row-parallel linears: `wo_b` by the output groups of this rank (its own `wo_a` outputs),
        the shared expert's `w2` by `shared`; None = every column."""
        if self.size == 1:
            return None
        if _WO_B.match(name):
            return range(self.groups.start * self.o_lora_rank, self.groups.stop * self.o_lora_rank)
        if self.shared is not None and _SHARED_DOWN.match(name):
            return self.shared
        return None

    def fraction_of(self, name: str, shape: tuple[int, ...]) -> float:
        """The share of logical tensor `name` (of `shape`) this rank holds (the planner's count)."""
        rows, cols = self.rows_of(name), self.cols_of(name)
        return (1.0 if rows is None else len(rows) / shape[0]) * (1.0 if cols is None else len(cols) / shape[1])

    def parallel_kind(self, name: str) -> str | None:
        """"row" / "column" for the linears built as SGLang's Row- / ColumnParallelLinear
        (`runtime/parallel_linear.py`: `wo_b`, the shared expert's w2 and w1/w3), else None."""
        if _WO_B.match(name) or _SHARED_DOWN.match(name):
            return "row"
        return "column" if _SHARED_UP.match(name) else None


def load_shard_weights(stored: Mapping[str, Tensor], cfg: DeepseekV41Config, plan: ShardPlan,
                       device: torch.device | str = "cpu", *, experts_mxfp4: bool = False,
                       engram_placement: str = "device") -> dict[str, object]:
    """This rank's runtime weights on `device`: `runtime.weights.runtime_weights` (every stored
    tensor checked, §2.4 values as fp32, routed experts dequantised or kept MXFP4) restricted to
    the shard — only this rank's experts are converted, Engram tables are sliced in stored form
    (`engram_placement` "device" or "host": per_rank host tables, `runtime/engram_host.py`),
    sharded attention tensors after dequantisation. TP 1 gives exactly `runtime_weights`' result."""
    return runtime_weights(stored, cfg, torch.device(device), experts_mxfp4=experts_mxfp4,
                           expert_ids=list(plan.experts), rows_of=plan.rows_of, cols_of=plan.cols_of,
                           engram_placement=engram_placement)


class TensorParallel:
    """Rank `rank` of a TP group of `size` whose collectives are SGLang's (`comm`: the
    `GroupCoordinator` of `parallel_state.get_tp_group()`, whose `all_reduce` is
    `tensor_model_parallel_all_reduce`: custom all-reduce / pynccl on CUDA, gloo on CPU).
    `size == 1` needs no group and every method is the reference's computation with no
    collective."""

    def __init__(self, rank: int = 0, size: int = 1, comm=None) -> None:
        if size < 1 or not 0 <= rank < size:
            raise TensorParallelError(f"tensor parallel rank {rank} of size {size} is not a valid rank")
        if size > 1 and comm is None:
            raise TensorParallelError(f"tensor parallel size {size} needs SGLang's TP group "
                                      "(parallel_state.initialize_model_parallel; TensorParallel.from_sglang)")
        if size > 1 and (comm.world_size, comm.rank_in_group) != (size, rank):
            raise TensorParallelError(f"SGLang's TP group is rank {comm.rank_in_group} of {comm.world_size}, "
                                      f"asked for rank {rank} of {size}")
        self.rank, self.size, self.comm = rank, size, comm
        self._plans: dict[int, ShardPlan] = {}

    @classmethod
    def from_sglang(cls) -> "TensorParallel":
        """SGLang's TP group (`get_tp_group()`); size 1 when it has one rank."""
        from sglang.srt.distributed.parallel_state import get_tp_group

        tp = get_tp_group()
        if tp.world_size == 1:
            return cls()
        return cls(tp.rank_in_group, tp.world_size, tp)

    def plan(self, text: TextConfig) -> ShardPlan:
        key = id(text)
        if key not in self._plans:
            self._plans[key] = ShardPlan.for_config(text, self.rank, self.size)
        return self._plans[key]

    def describe(self) -> str:
        return "tensor parallel size 1" if self.size == 1 else f"tensor parallel rank {self.rank} of {self.size}"

    # ---- collectives (SGLang's) ---------------------------------------------------------------
    def all_reduce_sum(self, t: Tensor) -> Tensor:
        """Sum over ranks through SGLang's `tensor_model_parallel_all_reduce` path (may return a
        new tensor: use the result). Exact for disjoint supports with −0.0 elsewhere (−0.0 is
        the additive identity of IEEE addition, ±0 included)."""
        return self.comm.all_reduce(t) if self.size > 1 else t

    def all_gather(self, t: Tensor, dim: int = -1) -> Tensor:
        """Rank-ordered concatenation along `dim` (values moved, not combined)."""
        return self.comm.all_gather(t.contiguous(), dim) if self.size > 1 else t

    def all_gather_columns(self, t: Tensor) -> Tensor:
        """[T, c] per rank → [T, size·c], rank-ordered blocks."""
        return self.all_gather(t, 1)

    def barrier(self) -> None:
        if self.size > 1:
            self.comm.barrier()

    def graph_capture(self, stream):
        """SGLang's capture context of the TP group on `stream` (custom all-reduce buffers
        registered, pynccl enabled), as its CUDA-graph runner uses it; a no-op at size 1."""
        if self.size == 1:
            return contextlib.nullcontext()
        from sglang.srt.distributed.parallel_state import GraphCaptureContext

        return self.comm.graph_capture(GraphCaptureContext(stream))

    # ---- row-parallel linears (runtime/parallel_linear.py) -----------------------------------
    def row_parallel(self, layer, x: Tensor, backend, act_quant: bool, x_quantised: bool = False) -> Tensor:
        """BF16 output of row-parallel `layer` (SGLang's `RowParallelLinear` with our method) on
        this rank's input columns `x`: its partial product in the backend's `acc` all-reduced and
        rounded once when the layer is sharded; its complete output at tp size 1 (held as BF16 where
        the backend offers it: `runtime/triton_backend.py` BF16_OUT — its readers, the mHC residual update and
        the MoE finalize, read any dtype). `x_quantised`: x holds its activations quantised already
        (`ComputeBackend.quantised_handoff`)."""
        self._check_layer(layer)
        y = layer.quant_method.apply(layer, x, backend=backend, act_quant=act_quant, bf16_out=layer.tp_size == 1,
                                     x_quantised=x_quantised)
        return backend.linear_fp8_finish(self.all_reduce_sum(y)) if layer.tp_size > 1 else y

    def shared_expert(self, w1, w2, w3, x: Tensor, backend, act_quant: bool, limit: float,
                      w13=None, x_quantised: Tensor | None = None) -> tuple[Tensor, bool]:
        """The shared expert over its parallel layers (column-parallel w1 / w3, row-parallel w2):
        (w2's partial in `acc`, True) when sharded — the caller all-reduces it together with the
        routed partial (`moe_ops`) — else (the BF16 output, False). `w13`: the stack of this rank's
        w1 | w3 columns (`runtime/stacked_linear.py`), one product read by `clamped_swiglu_halves`, which
        writes w2's activations quantised where the backend asks (`quantised_handoff`: the values w2 would
        quantise them to); `x_quantised`: x's values quantised so, which `w13` then reads."""
        for layer in (w1, w2, w3):
            self._check_layer(layer)

        def up(layer, quantised: Tensor | None = None):  # complete BF16 columns, read only by the SwiGLU (BF16_OUT)
            return layer.quant_method.apply(layer, x if quantised is None else quantised, backend=backend,
                                            act_quant=act_quant, bf16_out=True, x_quantised=quantised is not None)

        handoff = w13 is not None and act_quant and backend.quantised_handoff(x.numel() // x.shape[-1])
        h = backend.clamped_swiglu(up(w1), up(w3), limit) if w13 is None else \
            backend.clamped_swiglu_halves(up(w13, x_quantised), limit, quantise_out=handoff)
        return w2.quant_method.apply(w2, h, backend=backend, act_quant=act_quant, bf16_out=w2.tp_size == 1,
                                     x_quantised=handoff), w2.tp_size > 1

    def _check_layer(self, layer) -> None:
        if (layer.tp_rank, layer.tp_size) not in ((0, 1), (self.rank, self.size)):
            raise TensorParallelError(f"{layer.spec.name}: built for tp rank {layer.tp_rank} of {layer.tp_size}, "
                                      f"run at {self.describe()}")

    # ---- Engram (spec §3.3.2) ---------------------------------------------------------------
    def engram_rows(self, cfg: TextConfig, layer: int, row_ids: Tensor, w: Mapping[str, Tensor], *,
                    check: bool = True) -> tuple[Tensor, Tensor]:
        """(table, ids) such that `table[ids]` are the layer's Engram rows of `row_ids`: at TP 1
        the whole table and the ids; sharded, this rank's owned rows looked up, −0.0 elsewhere,
        all-reduced (exact: one rank holds each row) into a [T·columns, d] table indexed
        0..T·columns−1. `check` validates the id range on the host (off in static / CUDA-graph
        forwards, which must not synchronise)."""
        table = w[f"layers.{layer}.engram.embed.weight"]
        total = cfg.engram_num_embeddings[cfg.engram_layer_ids.index(layer)]
        if check and row_ids.numel() and (int(row_ids.min()) < 0 or int(row_ids.max()) >= total):
            raise ValueError(f"Engram row ids outside the table [0, {total}) of layer {layer}")
        if self.size == 1:
            return table, row_ids
        held = self.plan(cfg).engram_rows[layer]
        local = row_ids.to(torch.int64) - held.start
        owned = (local >= 0) & (local < len(held))
        rows = table[local.clamp(0, max(len(held) - 1, 0))] if len(held) else \
            table.new_zeros(*row_ids.shape, table.shape[1])
        rows = torch.where(owned[..., None], rows, torch.full_like(rows, -0.0))
        gathered = self.all_reduce_sum(rows.contiguous()).reshape(-1, table.shape[1])
        return gathered, torch.arange(gathered.shape[0], device=row_ids.device).reshape(row_ids.shape)

    # ---- MoE (spec §3.6) --------------------------------------------------------------------
    def experts_and_reduce(self, cfg: TextConfig) -> tuple[range | None, Callable[[Tensor], Tensor] | None]:
        """(held experts, reduce of the routed partial in `acc`): (None, None) at TP 1; sharded,
        this rank's expert block and the all-reduce over ranks (`moe_ops` module doc)."""
        if self.size == 1:
            return None, None
        return self.plan(cfg).experts, self.all_reduce_sum


SINGLE = TensorParallel()
"""TP size 1: no collectives."""

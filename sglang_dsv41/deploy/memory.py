"""Weight bytes per rank, from the checkpoint's tensor inventory (spec `model.md` §2.2).

Invariants
----------
* Every byte comes from `tensor_inventory(cfg)` and `TensorSpec.stored()`; nothing here knows
  Flash's sizes. The card's table (seed 004, "Memory") is a test expectation, not an input.
* Components follow the card's table, which groups by *storage kind*: MXFP4 tensors (routed +
  DSpark experts), Engram tables, FP8 tensors (attention, dense projections, shared experts,
  Engram projections, DSpark projections), unquantised BF16/FP32 tensors (embedding, head,
  norms, routers, compressor/indexer side projections, vision), and every UE8M0 `.scale`
  tensor as its own row. Each tensor's scale goes where the tensor goes (same rank, same
  placement).
* Sharding follows the layout SGLang gives a DeepSeek-family model (`shard_divisor`):
  routed experts split 1/tp (by experts under EP, by intermediate width under MoE-TP);
  head-split attention projections and the vocab split 1/attn_tp; shared experts 1/moe_tp;
  everything else replicated. Engram rows split over the whole TP group on device, or live in
  pinned host memory (spec `runtime.md` §A.7).
* "Resident" adds the loader's transforms (spec §2.4: `wo_a` is dequantised to BF16 at load);
  "stored" is the checkpoint as written.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from ..checkpoint.names import Kind, TensorSpec, tensor_inventory
from ..config import DeepseekV41Config
from . import vision_config
from .schema import DeploymentConfig

GIB = float(1 << 30)
HUGE_PAGE = 2 << 20  # transparent huge page size the Engram host table asks for (runtime.md §A.7)

# (key, label as the card's table words it)
COMPONENTS: tuple[tuple[str, str], ...] = (
    ("experts", "Routed + DSpark experts (MXFP4)"),
    ("engram", "Engram tables (FP8)"),
    ("fp8_dense", "Attention, dense projections, routers (FP8)"),
    ("unquantised", "Embedding + LM head (BF16), norms (FP32)"),
    ("scales", "UE8M0 block scales"),
)

_ATTN_HEAD_SPLIT = ("attn.wq_b.", "attn.wo_a.", "attn.wo_b.")  # column/row-parallel by heads or groups
_BF16_AT_LOAD = ("attn.wo_a.",)  # spec §2.4 item 1


@dataclass(frozen=True)
class ShardLayout:
    """How one server's ranks split the weights (SGLang's tp / DP-attention / EP)."""

    tp: int = 1
    dp_attention: int = 1
    ep: int = 1

    @property
    def attn_tp(self) -> int:
        return self.tp // self.dp_attention

    @property
    def moe_tp(self) -> int:
        return self.tp // self.ep


def component_of(spec: TensorSpec) -> str:
    """The card's row for the tensor's main payload (its scale always goes to 'scales')."""
    return {Kind.FP4: "experts", Kind.ENGRAM: "engram", Kind.FP8: "fp8_dense"}.get(spec.kind, "unquantised")


def shard_class(spec: TensorSpec) -> str:
    """Which group of ranks splits a tensor: tp | moe_tp | attn_tp | engram | replicated."""
    name = spec.name
    if spec.kind is Kind.ENGRAM:
        return "engram"  # rows over the whole TP group on device, or host memory
    if spec.kind is Kind.FP4:
        return "tp"  # routed experts: experts/ep × intermediate/moe_tp per rank
    if ".shared_experts." in name:
        return "moe_tp"
    if any(k in name for k in _ATTN_HEAD_SPLIT) and ".indexer." not in name:
        return "attn_tp"
    if name in ("embed.weight", "head.weight"):
        return "attn_tp"  # vocab-parallel over the attention TP group
    return "replicated"  # wq_a, wkv, routers, compressor, indexer, Engram projections, norms, vision, DSpark heads


def shard_divisor(spec: TensorSpec, layout: ShardLayout) -> int:
    """Ranks one tensor is split over (1 = replicated)."""
    return _divisor(shard_class(spec), layout)


def _divisor(cls: str, layout: ShardLayout) -> int:
    return {"tp": layout.tp, "engram": layout.tp, "moe_tp": layout.moe_tp, "attn_tp": layout.attn_tp}.get(cls, 1)


@functools.lru_cache(maxsize=32)
def _aggregate(cfg: DeepseekV41Config, vision: bool, dspark: bool) -> tuple[tuple[str, str, bool, int, int, int], ...]:
    """Inventory summed by (component, shard class, dequantised-at-load): (…, numel, main, scale bytes).

    The inventory has ~150k tensors for Flash; summing once per config keeps plans instant.
    """
    sums: dict[tuple[str, str, bool], list[int]] = {}
    for spec in tensor_inventory(cfg, vision=vision, dspark=dspark):
        main, *scales = spec.stored()
        key = (component_of(spec), shard_class(spec),
               spec.kind is Kind.FP8 and any(k in spec.name for k in _BF16_AT_LOAD))
        row = sums.setdefault(key, [0, 0, 0])
        row[0] += spec.numel
        row[1] += main.nbytes
        row[2] += sum(x.nbytes for x in scales)
    return tuple((*k, *v) for k, v in sums.items())


@dataclass
class ComponentBytes:
    key: str
    label: str
    entries: int = 0  # logical elements in the checkpoint (scales: one per byte)
    stored: int = 0  # bytes in the checkpoint
    per_rank: float = 0.0  # bytes on one GPU (stored form)


@dataclass
class WeightPlan:
    components: dict[str, ComponentBytes]
    layout: ShardLayout
    engram_placement: str
    engram_stored: int  # table + its scales, whole checkpoint
    engram_device_per_rank: float
    engram_host_per_server: float
    load_transform_per_rank: float  # extra bytes from load-time dequantisation
    included: dict[str, bool] = field(default_factory=dict)

    @property
    def stored_total(self) -> int:
        return sum(c.stored for c in self.components.values())

    @property
    def stored_per_rank(self) -> float:
        return sum(c.per_rank for c in self.components.values())

    @property
    def resident_per_rank(self) -> float:
        return self.stored_per_rank + self.load_transform_per_rank


def weight_plan(cfg: DeepseekV41Config, layout: ShardLayout, *, vision: bool = True, dspark: bool = True,
                engram_placement: str = "device") -> WeightPlan:
    """Bytes per component for the whole checkpoint and for one rank of `layout`.

    `vision=False` drops the ViT/aligner (text-only: the loader skips them, spec §2.1);
    `dspark=False` drops the `mtp.*` draft (not loaded without speculative decoding).
    """
    if engram_placement not in ("device", "host"):
        raise ValueError(f"engram placement must be 'device' or 'host', got {engram_placement!r}")
    comps = {k: ComponentBytes(k, label) for k, label in COMPONENTS}
    engram_stored = 0
    transform = 0.0
    for comp, cls, bf16_at_load, numel, main, scale in _aggregate(cfg, vision, dspark):
        row = comps[comp]
        row.entries += numel
        row.stored += main
        comps["scales"].entries += scale
        comps["scales"].stored += scale
        if cls == "engram":
            engram_stored += main + scale
            if engram_placement == "host":
                continue
        div = _divisor(cls, layout)
        row.per_rank += main / div
        comps["scales"].per_rank += scale / div
        if bf16_at_load:
            transform += (numel * 2 - main - scale) / div
    on_device = engram_placement == "device"
    return WeightPlan(
        components=comps,
        layout=layout,
        engram_placement=engram_placement,
        engram_stored=engram_stored,
        engram_device_per_rank=engram_stored / layout.tp if on_device else 0.0,
        engram_host_per_server=0.0 if on_device else float(engram_stored),
        load_transform_per_rank=transform,
        included={"vision": vision and cfg.has_vision, "dspark": dspark and cfg.text.num_nextn_predict_layers > 0},
    )


def vram_minimum_gb(stored_bytes: int, headroom: float = 1.2) -> int:
    """The card's `vram_minimum_gb`: checkpoint bytes × headroom, in GB (10^9), rounded up."""
    return math.ceil(stored_bytes * headroom / 1e9)


def layout_of(dc: DeploymentConfig) -> ShardLayout:
    p = dc.parallel
    return ShardLayout(tp=p.tp, dp_attention=p.dp_attention, ep=p.ep)


def check_against_checkpoint(dc: DeploymentConfig, cfg: DeepseekV41Config) -> list[str]:
    """Rules that need the checkpoint's config.json (the schema cannot see it)."""
    t, lay, out = cfg.text, layout_of(dc), []
    spec = dc.speculative
    if spec.enabled:
        if t.num_nextn_predict_layers == 0:
            out.append("speculative decoding needs the DSpark draft, but the checkpoint has "
                       "num_nextn_predict_layers = 0")
        elif spec.block_size != t.dspark_block_size:
            out.append(f"speculative.block_size {spec.block_size} differs from the checkpoint's dspark_block_size "
                       f"{t.dspark_block_size} (the draft is trained for that block)")
    if lay.ep > 1:
        for what, n in (("n_routed_experts", t.n_routed_experts), ("dspark_n_routed_experts", t.dspark_n_routed_experts)):
            if n and n % lay.ep:
                out.append(f"parallel.ep {lay.ep} does not divide the checkpoint's {what} ({n})")
    if lay.moe_tp > 1 and t.moe_intermediate_size % lay.moe_tp:
        out.append(f"MoE tensor parallel {lay.moe_tp} does not divide moe_intermediate_size {t.moe_intermediate_size}")
    if t.num_attention_heads % lay.attn_tp or t.o_groups % lay.attn_tp:
        out.append(f"attention TP {lay.attn_tp} must divide num_attention_heads ({t.num_attention_heads}) and "
                   f"o_groups ({t.o_groups})")
    return out + vision_config.checkpoint_problems(dc, cfg)

"""Weight bytes one GPU rank of THIS project's runtime holds (issue 3; `runtime/weights.py`).

`deploy/memory.py` reproduces the model card's table: the checkpoint as stored, sharded the way
SGLang shards a DeepSeek-family model (vocab-parallel embedding and head, shared experts split by
MoE-TP, wo_a dequantised to BF16). The runtime that serves the plugin holds its weights
differently, and its KV pool gets what is left after *its* weights, so the planner sizes the KV
budget with this module's figure. Rules, each stated where the runtime implements it:

* Loaded tensors: the text model, and with `vision=True` the vision tower (ViT, aligner, span
  markers: `runtime/vision.VisionTower`, every tensor an fp32 parameter replicated on every rank,
  component row "vision"); with `dspark=True` the DSpark draft's `mtp.*` tensors, which SGLang's
  draft worker loads whole on every rank (`runtime/dspark_weights.py`, no TP split; component row
  "dspark": ~14.2B parameters, 7.5 GiB at Flash).
* Sharding (`runtime/tensor_parallel.py ShardPlan`, rank 0 = the largest share: balanced blocks
  give the first ranks the extra row): routed experts in contiguous expert blocks, wq_b / attn_sink
  by heads, wo_a by output groups, wo_b by the columns of those groups (row-parallel), the shared
  expert by intermediate blocks (w1/w3 rows, w2 columns) when each block is whole 32-wide tiles
  (`ShardPlan.shared`, else replicated), Engram tables by rows, embedding and head by vocabulary
  blocks (SGLang's vocab-parallel split); everything else — wq_a, wkv, routers, compressor,
  indexer, norms — replicated.
* Formats at rest on CUDA (`runtime_weights(..., experts_mxfp4=True, dense_fp8=True)`):
  routed experts MXFP4 as stored (E2M1 bytes + UE8M0 scales; the kernel layout's padding is not
  counted); FP8 dense weights as stored E4M3 with their UE8M0 tile scales decoded to fp32
  (4 bytes per 32×32 tile; a weight with a scale outside 2^-124..2^119 would be dequantised —
  data-dependent, not counted); Engram tables as stored; BF16 and FP32 tensors as fp32 values
  (4 bytes per element), plus a BF16 copy (2 bytes per element) of every BF16-stored dense linear
  weight (`dense_ops.is_dense_linear_name`, the predicate the dense backend registers by) made by
  the dense backend (`DenseWeightCache`; FP32-stored weights are not BF16-exact and stay fp32).

The figure is checked against the bytes `runtime_weights` + `DenseWeightCache` actually hold for
the tiny checkpoint at TP 1 and TP 2 (tests/test_deploy_runtime_residency.py).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from ..checkpoint.names import Kind, TensorSpec, tensor_inventory
from ..config import DeepseekV41Config

#: bytes per element of a BF16 / FP32 tensor at rest (fp32 values) and of a dense linear weight's BF16 copy
FP32_AT_REST, BF16_COPY = 4, 2


#: where the runtime can put the Engram tables, and the one host layout it implements (§A.7)
ENGRAM_PLACEMENTS = ("device", "host")
HOST_LAYOUT = "per_rank"


@dataclass
class RuntimeResidency:
    """Bytes rank 0 holds on its GPU, by the card's component rows (`memory.COMPONENTS` keys);
    with host placement also the pinned host bytes every rank maps (per_rank layout)."""

    tp: int
    by_component: dict[str, float] = field(default_factory=dict)
    engram_placement: str = "device"
    #: pinned host bytes of rank r's Engram rows (+ scales), r = 0..tp-1; () on device
    engram_host_by_rank: tuple[float, ...] = ()

    @property
    def per_rank(self) -> float:
        """GPU bytes of rank 0 (the largest share)."""
        return sum(self.by_component.values())

    @property
    def host_layout(self) -> str | None:
        """The host table layout (`HOST_LAYOUT`) with host placement; None on device."""
        return HOST_LAYOUT if self.engram_placement == "host" else None

    @property
    def host_per_rank(self) -> float:
        """Pinned host bytes of the rank with the largest Engram block (rank 0); 0 on device."""
        return max(self.engram_host_by_rank, default=0.0)

    @property
    def host_per_server(self) -> float:
        """Pinned host bytes of all the server's ranks together (one copy of the tables)."""
        return sum(self.engram_host_by_rank)


def tensor_bytes_at_rest(spec: TensorSpec, fraction: float) -> tuple[str, float]:
    """(component row, bytes) of `fraction` of one logical tensor (its rows and, for the
    row-parallel linears, columns held: `ShardPlan.fraction_of`) on a CUDA rank."""
    main, *scales = spec.stored()
    scale_elements = sum(math.prod(s.shape) for s in scales)
    if spec.kind is Kind.FP4:
        return "experts", fraction * (main.nbytes + sum(s.nbytes for s in scales))
    if spec.kind is Kind.ENGRAM:
        return "engram", fraction * (main.nbytes + sum(s.nbytes for s in scales))
    if spec.kind is Kind.FP8:
        return "fp8_dense", fraction * (main.nbytes + 4 * scale_elements)
    from ..runtime.dense_weights import is_dense_linear_name   # imports torch: kept out of `import deploy`

    # a BF16 copy only of BF16-stored weights: an FP32-stored one (the DSpark confidence head) is
    # not BF16-exact, so `DenseWeightCache.add` keeps it fp32
    copy = spec.kind is Kind.BF16 and is_dense_linear_name(spec.name, len(spec.shape))
    per_element = FP32_AT_REST + (BF16_COPY if copy else 0)
    return "unquantised", fraction * spec.numel * per_element


@functools.lru_cache(maxsize=32)
def runtime_residency(cfg: DeepseekV41Config, tp: int, engram_placement: str = "device",
                      vision: bool = False, dspark: bool = False) -> RuntimeResidency:
    """Rank 0's weight bytes at TP `tp` under the runtime's rules (module docstring): with
    `engram_placement="host"` the device figure less the Engram block, which moves to
    `engram_host_by_rank`; with `vision` (and a checkpoint that has a tower) plus the "vision"
    row; with `dspark` (and a checkpoint with DSpark stages) plus the "dspark" row. Raises the runtime's own `TensorParallelError` for a TP size the model cannot be sharded
    to, `ValueError` for an unknown placement."""
    if engram_placement not in ENGRAM_PLACEMENTS:
        raise ValueError(f"engram placement must be one of {ENGRAM_PLACEMENTS}, got {engram_placement!r}")
    on_device = _device_residency(cfg, tp)
    gpu = {k: v for k, v in on_device.by_component.items() if engram_placement == "device" or k != "engram"}
    if vision and cfg.has_vision:
        gpu["vision"] = vision_tower_bytes(cfg)
    if dspark and cfg.text.num_nextn_predict_layers > 0:
        gpu["dspark"] = dspark_draft_bytes(cfg)
    host = engram_host_shards(cfg, tp) if engram_placement == "host" else ()
    return RuntimeResidency(tp=tp, by_component=gpu, engram_placement=engram_placement, engram_host_by_rank=host)


def vision_tower_bytes(cfg: DeepseekV41Config) -> float:
    """Bytes of the vision tower on every rank: each vision tensor as an fp32 parameter."""
    return float(sum(spec.numel * FP32_AT_REST for spec in tensor_inventory(cfg, dspark=False)
                     if spec.group == "vision"))


@functools.lru_cache(maxsize=32)
def dspark_draft_bytes(cfg: DeepseekV41Config) -> float:
    """Bytes of the DSpark draft on every rank: each `mtp.*` tensor whole, at rest as the target's
    (routed experts MXFP4 as stored, FP8 dense as stored + fp32 tile scales, the rest fp32 + BF16
    copies of dense linears: the draft's dense backend registers its own weights)."""
    from ..runtime.dense_weights import is_dense_linear_name

    sizes: dict[tuple, float] = {}         # the stages' experts repeat a few shapes: size each once
    total = 0.0
    for spec in tensor_inventory(cfg, vision=False, dspark=True):
        if spec.name.startswith("mtp."):
            key = (spec.kind, tuple(spec.shape), is_dense_linear_name(spec.name, len(spec.shape)))
            if key not in sizes:
                sizes[key] = tensor_bytes_at_rest(spec, 1.0)[1]
            total += sizes[key]
    return total


def engram_host_shards(cfg: DeepseekV41Config, tp: int) -> tuple[float, ...]:
    """Pinned host bytes each rank r = 0..tp-1 maps in the per_rank layout: its balanced block of
    every Engram table's rows with their row scales (`ShardPlan.engram_rows`)."""
    from ..runtime.tensor_parallel import ShardPlan   # torch-only module; keeps deploy importable first

    plans = [ShardPlan.for_config(cfg.text, rank, tp) for rank in range(tp)]
    shards = [0.0] * tp
    for spec in tensor_inventory(cfg, vision=False, dspark=False):
        if spec.kind is not Kind.ENGRAM:
            continue
        for rank, plan in enumerate(plans):
            rows = plan.rows_of(spec.name)
            fraction = 1.0 if rows is None else len(rows) / spec.shape[0]
            shards[rank] += tensor_bytes_at_rest(spec, fraction)[1]
    return tuple(shards)


@functools.lru_cache(maxsize=32)
def _device_residency(cfg: DeepseekV41Config, tp: int) -> RuntimeResidency:
    """Rank 0's bytes with every weight, the Engram block included, on the GPU."""
    from ..runtime.tensor_parallel import ShardPlan   # torch-only module; keeps deploy importable first

    plan = ShardPlan.for_config(cfg.text, 0, tp)
    out = RuntimeResidency(tp=tp)
    for spec in tensor_inventory(cfg, vision=False, dspark=False):
        if not plan.holds(spec.name):
            continue
        fraction = plan.fraction_of(spec.name, spec.shape)     # rows and (row-parallel) columns held
        component, nbytes = tensor_bytes_at_rest(spec, fraction)
        out.by_component[component] = out.by_component.get(component, 0.0) + nbytes
    return out


__all__ = ["BF16_COPY", "ENGRAM_PLACEMENTS", "FP32_AT_REST", "HOST_LAYOUT", "RuntimeResidency",
           "dspark_draft_bytes", "engram_host_shards", "runtime_residency", "tensor_bytes_at_rest", "vision_tower_bytes"]

"""The memory plan of one deployment per rank (`make_plan` → `Plan`); `sglang-dsv41 plan` is
`plan_cli.cli`, its text report `plan_report.render`.

Per rank: weights by the card's components (`memory.weight_plan`), Engram placement and
sharding, this runtime's own weights (`runtime_residency`: what `runtime_weights` holds; with
`engram.placement: host` its Engram shard sits in pinned host memory, layout per_rank, and is
counted in the host need per node instead), the KV budget left in SGLang's static memory
(`mem_fraction_static × GPU memory − weights`: this runtime's where it can serve the layout, else
the card's layout), how the runtime's pool splits it (`runtime_pool.RuntimePool`), the token
capacity, and a verdict for `--batch` requests of `--context` tokens.

Invariant: every number is computed from the deployment config and the checkpoint's
config.json (`--checkpoint DIR`, else the preset the config names); the report prints each
assumption it used (GPU memory source, memory fraction, pool ratio and page size, token cap)
next to the result.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..config import DeepseekV41Config
from ..presets import flash_config_dict, tiny_config_dict, tiny_tp8_config_dict
from .hicache_plan import HostTier, hicache_setting, host_tier
from .kv import RequestCost, kv_bytes_per_token, per_request_bytes
from .memory import (GIB, HUGE_PAGE, ShardLayout, WeightPlan, check_against_checkpoint, layout_of, vram_minimum_gb,
                     weight_plan)
from .runtime_pool import RuntimePool, runtime_pool_for
from .runtime_residency import HOST_LAYOUT, RuntimeResidency, runtime_residency
from .schema import DeploymentConfig
from .vision_config import image_budget, serves_vision, vision_activation

__all__ = ["DEFAULT_MEM_FRACTION", "Plan", "RuntimePool", "launch_refusals", "make_plan", "model_config_for",
           "prefill_tokens", "runtime_pool_for"]

DEFAULT_MEM_FRACTION = 0.9


def model_config_for(dc: DeploymentConfig, checkpoint: str | None) -> tuple[DeepseekV41Config, str]:
    """The checkpoint's config.json, or the preset the deployment config names."""
    if checkpoint:
        return DeepseekV41Config.from_file(checkpoint), f"{Path(checkpoint) / 'config.json'}"
    if dc.model.architecture == "flash":
        return DeepseekV41Config.from_dict(flash_config_dict()), "preset flash (presets.flash_config_dict)"
    # engram_compressed_vocab_size enters no tensor shape (model.md §2.2); the tiny preset
    # takes it from the tokenizer, so the planner fills in vocab_size as a stand-in.
    vocab = tiny_config_dict(1)["text_config"]["vocab_size"]
    if dc.model.architecture == "tiny-tp8":
        return (DeepseekV41Config.from_dict(tiny_tp8_config_dict(vocab)),
                "preset tiny-tp8 (presets.tiny_tp8_config_dict)")
    return DeepseekV41Config.from_dict(tiny_config_dict(vocab)), "preset tiny (presets.tiny_config_dict)"


@dataclass
class Plan:
    name: str
    model_source: str
    gpu: str
    gpus: int
    gpu_mem_gib: float
    gpu_mem_source: str
    mem_fraction: float
    weights: WeightPlan  # what this deployment loads, per rank
    checkpoint: WeightPlan  # the whole checkpoint (vision and DSpark included), for the card's table
    pool: RuntimePool  # what the KV budget is sized with
    upstream_kv_layout: str  # features.kv_layout: SGLang 0.5.23's layout, for the comparison only
    upstream_kv_bytes_per_token: dict[str, float]
    upstream_request: RequestCost
    context: int
    batch: int
    servers_per_node: int
    host_mem_gib: float | None
    problems: list[str]
    status: str = "unvalidated"
    #: what this project's runtime holds per rank (deploy/runtime_residency.py); None with the reason
    #: in `runtime_weights_note` when the runtime cannot serve the layout
    runtime_weights: RuntimeResidency | None = None
    runtime_weights_note: str = ""
    #: what `sglang-dsv41 launch` refuses for this config (capability: reason), from the same
    #: `command.build_launch` the launcher and `--dry-run` use; empty when it launches
    launch_refusals: tuple[str, ...] = ()
    #: the image part of one request's prompt (`vision_config.image_budget`); None: no vision served
    images: dict[str, Any] | None = None
    #: the HiCache host tier (L2) per rank (deploy/hicache_plan.py); None without HiCache
    hicache: HostTier | None = None
    #: the vision tower's activation memory per rank in one prefill batch
    #: (`vision_config.vision_activation`); None: no vision served
    vision_activation: dict[str, Any] | None = None

    # ---- derived ----------------------------------------------------------------------------
    @property
    def static_budget(self) -> float:
        return self.gpu_mem_gib * GIB * self.mem_fraction

    @property
    def weights_per_rank(self) -> float:
        """The weights the KV budget is left after: this runtime's own (deploy/runtime_residency.py)
        where it can serve the layout, else the card's layout (deploy/memory.py)."""
        return self.runtime_weights.per_rank if self.runtime_weights is not None else self.weights.resident_per_rank

    @property
    def activation_room(self) -> float:
        """Per-rank memory SGLang leaves outside the static budget (activations, CUDA graphs)."""
        return self.gpu_mem_gib * GIB * (1 - self.mem_fraction)

    @property
    def kv_budget(self) -> float:
        return self.static_budget - self.weights_per_rank

    @property
    def dp(self) -> int:
        return self.weights.layout.dp_attention

    @property
    def batch_per_rank(self) -> int:
        return math.ceil(self.batch / self.dp)

    @property
    def capacity_tokens_per_rank(self) -> int:
        """Full-pool tokens per rank (every token of every request holds one)."""
        return self.pool.full_tokens(self.kv_budget)

    @property
    def swa_capacity_per_rank(self) -> int:
        return self.pool.swa_tokens(self.capacity_tokens_per_rank)

    @property
    def full_needed(self) -> int:
        return self.batch_per_rank * self.pool.full_tokens_of(self.context)

    @property
    def swa_needed(self) -> int:
        return self.batch_per_rank * self.pool.swa_tokens_of(self.context)

    @property
    def needed_kv(self) -> float:
        """KV bytes per rank SGLang's split needs for `batch` requests of `context` tokens."""
        return self.pool.budget_for(self.full_needed, self.swa_needed)

    @property
    def max_full_context_requests(self) -> int:
        if self.swa_capacity_per_rank <= self.pool.swa_tokens_per_request:
            return 0  # SGLang refuses to start (see verdict)
        per_full = self.capacity_tokens_per_rank // self.pool.full_tokens_of(self.context)
        per_swa = self.swa_capacity_per_rank // self.pool.swa_tokens_of(self.context)
        return min(per_full, per_swa) * self.dp

    @property
    def host_per_server(self) -> float:
        """Pinned host Engram bytes of one server: the sum of this runtime's per_rank shards where
        it serves the layout (`RuntimeResidency.host_per_server`), else the card's table size."""
        rw = self.runtime_weights
        return rw.host_per_server if rw is not None else self.weights.engram_host_per_server

    @property
    def host_need_per_node(self) -> float:
        """Host bytes per node: pinned Engram of each server + each rank's HiCache host tier."""
        tier = self.hicache.bytes_per_node if self.hicache is not None else 0
        return self.host_per_server * self.servers_per_node + tier

    def verdict(self) -> tuple[bool, str]:
        if self.problems:
            return False, "does not run as configured: " + "; ".join(self.problems)
        if self.gpu_mem_gib <= 0:
            return False, "no device memory budget (CPU config: pass --gpu-mem with the host memory to use)"
        if self.host_mem_gib is not None and self.host_need_per_node > self.host_mem_gib * GIB:
            over = (self.host_need_per_node - self.host_mem_gib * GIB) / GIB
            return False, f"does NOT fit: host Engram + HiCache need {self.host_need_per_node / GIB:.1f} GiB per node, " \
                          f"{over:.1f} GiB more than hardware.host_mem_gib ({self.host_mem_gib:g})"
        if self.kv_budget <= 0:
            return False, f"does NOT fit: resident weights exceed the static budget by {-self.kv_budget / GIB:.1f} GiB per rank"
        pool, full, swa = self.pool, self.capacity_tokens_per_rank, self.swa_capacity_per_rank
        if swa <= pool.swa_tokens_per_request:
            return False, f"does NOT start: SGLang's SWA pool ({swa:,} tokens) cannot hold one request (window + " \
                          f"page = {pool.swa_tokens_per_request}); raise --swa-full-tokens-ratio or the KV budget"
        what = f"{self.batch} request(s) × {self.context:,} tokens"
        tokens = f"{self.full_needed:,} of {full:,} full-pool and {self.swa_needed:,} of {swa:,} SWA tokens per rank"
        if self.full_needed > full or self.swa_needed > swa:
            over = self.needed_kv - self.kv_budget
            if over > 0:
                return False, f"does NOT fit: {what} need {self.needed_kv / GIB:.1f} GiB of KV per rank, " \
                              f"{over / GIB:.1f} GiB more than the {self.kv_budget / GIB:.1f} GiB left ({tokens})"
            return False, f"does NOT fit: {what} need {tokens}; --max-total-tokens {pool.max_total_tokens:,} caps " \
                          "the full pool"
        va = self.vision_activation
        if va is not None and va["total_bytes"] > self.activation_room:
            return False, f"does NOT fit: the vision tower's activations ({va['total_bytes'] / GIB:.2f} GiB per rank " \
                          f"in a prefill batch) exceed the {self.activation_room / GIB:.2f} GiB outside the static " \
                          f"budget ((1 − {self.mem_fraction:g}) × {self.gpu_mem_gib:g} GiB); lower mem_fraction_static"
        return True, f"fits: {what} need {self.needed_kv / GIB:.2f} GiB of KV per rank of the " \
                     f"{self.kv_budget / GIB:.1f} GiB left (margin {(self.kv_budget - self.needed_kv) / GIB:.1f} GiB; " \
                     f"{tokens})"

    def to_dict(self) -> dict[str, Any]:
        ok, text = self.verdict()
        w = self.weights
        return {
            "name": self.name, "model_source": self.model_source, "gpu": self.gpu, "gpus": self.gpus,
            "gpu_mem_gib": self.gpu_mem_gib, "gpu_mem_source": self.gpu_mem_source, "mem_fraction": self.mem_fraction,
            "layout": asdict(w.layout), "included": w.included,
            "components": {k: {"label": c.label, "entries": self.checkpoint.components[k].entries,
                               "stored_gib": self.checkpoint.components[k].stored / GIB,
                               "loaded_gib": c.stored / GIB, "per_rank_gib": c.per_rank / GIB}
                           for k, c in w.components.items()},
            "stored_total_gib": self.checkpoint.stored_total / GIB, "loaded_total_gib": w.stored_total / GIB,
            "vram_minimum_gb": vram_minimum_gb(self.checkpoint.stored_total),
            "load_transform_per_rank_gib": w.load_transform_per_rank / GIB,
            "resident_per_rank_gib": w.resident_per_rank / GIB,
            "engram": {"placement": w.engram_placement, "stored_gib": w.engram_stored / GIB,
                       "host_layout": HOST_LAYOUT if w.engram_placement == "host" else None,
                       "device_per_rank_gib": w.engram_device_per_rank / GIB,
                       "host_per_rank_gib": (self.runtime_weights.host_per_rank / GIB
                                             if self.runtime_weights is not None else None),
                       "host_per_server_gib": self.host_per_server / GIB,
                       "servers_per_node": self.servers_per_node, "host_per_node_gib": self.host_need_per_node / GIB,
                       "huge_pages_2mib": math.ceil(self.host_per_server / HUGE_PAGE)},
            "kv_pool": {**asdict(self.pool), "sources": [{"layer": la, "ratio": r, "latent_bytes": lb, "key_bytes": kb}
                                                          for la, r, lb, kb in self.pool.sources],
                        "global_kv_bytes_per_token": self.pool.row_bytes,
                        "swa_bytes_per_request": self.pool.swa_tokens_per_request * self.pool.swa_token_bytes,
                        "full_tokens_per_rank": self.capacity_tokens_per_rank,
                        "swa_tokens_per_rank": self.swa_capacity_per_rank},
            "upstream_comparison": {"note": "SGLang 0.5.23's own layouts, for comparison only; nothing is sized "
                                            "with them",
                                    "kv_layout": self.upstream_kv_layout,
                                    "kv_bytes_per_token": self.upstream_kv_bytes_per_token,
                                    "per_request_bytes": {**asdict(self.upstream_request),
                                                          "total": self.upstream_request.total}},
            "static_budget_gib": self.static_budget / GIB, "kv_budget_gib": self.kv_budget / GIB,
            "needed_kv_gib": self.needed_kv / GIB, "full_tokens_needed_per_rank": self.full_needed,
            "swa_tokens_needed_per_rank": self.swa_needed,
            "context": self.context, "batch": self.batch, "capacity_tokens_per_rank": self.capacity_tokens_per_rank,
            "capacity_tokens_per_server": self.capacity_tokens_per_rank * self.dp,
            "max_full_context_requests": self.max_full_context_requests,
            "fits": ok, "verdict": text, "problems": self.problems, "status": self.status,
            "launch_refusals": list(self.launch_refusals),
            "images": self.images,
            "vision_activation": self.vision_activation,
            "runtime_weights_per_rank_gib": None if self.runtime_weights is None else self.runtime_weights.per_rank / GIB,
            "runtime_weights_note": self.runtime_weights_note,
            "hicache_host_tier": None if self.hicache is None else self.hicache.to_dict(),
        }


def make_plan(dc: DeploymentConfig, cfg: DeepseekV41Config, model_source: str = "", *, gpu_mem: float | None = None,
              mem_fraction: float | None = None, context: int | None = None, batch: int = 1,
              hicache_ratio: float | None = None, hicache_size: float | None = None) -> Plan:
    hw = dc.hardware
    weights = weight_plan(cfg, layout_of(dc), vision=serves_vision(dc, cfg), dspark=dc.speculative.enabled,
                          engram_placement=dc.engram.placement)
    t = cfg.text
    draft = dc.speculative.block_size or 0
    if gpu_mem is not None:
        mem, mem_src = gpu_mem, "--gpu-mem"
    elif hw.gpu_mem_gib is not None:
        mem, mem_src = hw.gpu_mem_gib, "config hardware.gpu_mem_gib"
    elif hw.kind.is_cpu:
        mem, mem_src = hw.host_mem_gib or 0.0, "config hardware.host_mem_gib (CPU)"
    else:
        mem, mem_src = hw.kind.mem_gib, f"catalog ({hw.kind.note})"
    frac = mem_fraction if mem_fraction is not None else dc.serving.mem_fraction_static or DEFAULT_MEM_FRACTION
    ctx = context if context is not None else dc.serving.context_length or t.max_position_embeddings
    gpus = max(hw.gpus, 1)
    runtime_weights, runtime_note = _runtime_weights(dc, cfg)
    problems = check_against_checkpoint(dc, cfg)
    plan = Plan(
        launch_refusals=launch_refusals(dc),
        images=image_budget(dc, cfg),
        name=dc.name, model_source=model_source, gpu=hw.gpu, gpus=hw.gpus, gpu_mem_gib=mem, gpu_mem_source=mem_src,
        mem_fraction=frac, weights=weights, checkpoint=weight_plan(cfg, ShardLayout()), pool=runtime_pool_for(dc, t),
        upstream_kv_layout=dc.features.kv_layout,
        upstream_kv_bytes_per_token={lay: kv_bytes_per_token(t, lay) for lay in ("v4", "v41")},
        upstream_request=per_request_bytes(t, dc.features.kv_layout, draft_tokens=draft),
        context=ctx, batch=batch, servers_per_node=max(1, hw.per_node // gpus) if not hw.kind.is_cpu else 1,
        host_mem_gib=hw.host_mem_gib, problems=problems,
        status=(f"validated on {dc.validated_on.date} ({dc.validated_on.hardware})" if dc.validated
                else "unvalidated"),
        runtime_weights=runtime_weights, runtime_weights_note=runtime_note,
        vision_activation=vision_activation(dc, cfg, prefill_tokens(dc.serving.chunked_prefill_size, mem, ctx)),
    )
    ratio, size = hicache_setting(dc.serving.extra_args, hicache_ratio, hicache_size)
    if ratio is not None or size:
        lay = plan.weights.layout
        ranks = min(lay.tp, hw.per_node) * plan.servers_per_node if not hw.kind.is_cpu else lay.tp
        try:
            plan.hicache = host_tier(plan.pool.row_bytes, plan.pool.swa_token_bytes, plan.capacity_tokens_per_rank,
                                     plan.pool.page_size, ranks, ratio, size)
        except ValueError as e:
            plan.problems.append(str(e))
    return plan


def prefill_tokens(chunked_prefill_size: int | None, gpu_mem_gib: float, context: int) -> int:
    """Tokens of one prefill chunk: serving.chunked_prefill_size, else SGLang 0.5.17's default for
    the GPU's memory (`ServerArgs._handle_gpu_memory_settings`: 2K below 35 GiB, 4K below 60, 8K
    below 160, else 16K); -1 (chunking off) or a larger value than the context: the context."""
    size = chunked_prefill_size
    if size is None:
        size = 2048 if gpu_mem_gib < 35 else 4096 if gpu_mem_gib < 60 else 8192 if gpu_mem_gib < 160 else 16384
    return context if size <= 0 else min(size, context)


def _runtime_weights(dc: DeploymentConfig, cfg: DeepseekV41Config) -> tuple[RuntimeResidency | None, str]:
    """This runtime's per-rank weights for the deployment's TP size, or None and why it cannot
    serve the layout (DP attention; a TP size the model's output groups do not divide)."""
    from ..runtime.tensor_parallel import TensorParallelError

    lay = layout_of(dc)
    if lay.dp_attention > 1:
        return None, "DP attention is not supported by this runtime (runtime/requirements.py)"
    try:
        found = runtime_residency(cfg, lay.tp, dc.engram.placement, vision=serves_vision(dc, cfg),
                                  dspark=dc.speculative.enabled)
    except TensorParallelError as exc:
        return None, str(exc)
    engram = ("Engram tables as stored and on the GPU" if found.engram_placement == "device" else
              f"Engram shard in pinned host memory ({found.host_layout}): {found.host_per_rank / GIB:.2f} GiB per rank "
              f"on the host, not on the GPU")
    tower = (f", vision tower {found.by_component['vision'] / 2**20:.1f} MiB fp32 replicated per rank"
             if "vision" in found.by_component else "")
    if "dspark" in found.by_component:
        tower += f", DSpark draft {found.by_component['dspark'] / GIB:.2f} GiB whole on every rank"
    note = (f"TP {lay.tp}, text model{tower}, routed experts MXFP4 and FP8 dense weights as stored, {engram}, "
            "BF16/FP32 tensors as fp32 + BF16 copies of dense linears, embedding and head vocab-parallel")
    return found, note


def launch_refusals(dc: DeploymentConfig) -> tuple[str, ...]:
    """``capability: reason`` for each option the launcher refuses (runtime limits, capabilities
    the installed plugin lacks) — so `plan` never calls a config servable that `launch` refuses."""
    from .capabilities import available_capabilities
    from .command import build_launch

    return tuple(f"{u.capability}: {u.reason}" for u in build_launch(dc, available_capabilities()).unavailable)

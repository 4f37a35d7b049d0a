"""`sglang-dsv41 plan`: will this deployment fit, and with how much KV cache?

Per rank: weights by the card's components (`memory.weight_plan`), Engram placement and
sharding, KV bytes per token for both layouts and the config's (`kv`), the KV budget left in
SGLang's static memory (`mem_fraction_static × GPU memory − resident weights`), the token
capacity, and a verdict for `--batch` requests of `--context` tokens.

Invariant: every number is computed from the deployment config and the checkpoint's
config.json (`--checkpoint DIR`, else the preset the config names); the report prints each
assumption it used (GPU memory source, memory fraction, layout) next to the result.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..config import ConfigError, DeepseekV41Config
from ..presets import flash_config_dict, tiny_config_dict
from .kv import RequestCost, kv_bytes_per_token, kv_sources, per_request_bytes
from .memory import GIB, ShardLayout, WeightPlan, check_against_checkpoint, layout_of, vram_minimum_gb, weight_plan
from .schema import DeployConfigError, DeploymentConfig, apply_override, config_from_dict, raw_config

DEFAULT_MEM_FRACTION = 0.9
HUGE_PAGE = 2 << 20  # transparent huge page size the Engram host table asks for (runtime.md §A.7)


def model_config_for(dc: DeploymentConfig, checkpoint: str | None) -> tuple[DeepseekV41Config, str]:
    """The checkpoint's config.json, or the preset the deployment config names."""
    if checkpoint:
        return DeepseekV41Config.from_file(checkpoint), f"{Path(checkpoint) / 'config.json'}"
    if dc.model.architecture == "flash":
        return DeepseekV41Config.from_dict(flash_config_dict()), "preset flash (presets.flash_config_dict)"
    # engram_compressed_vocab_size enters no tensor shape (model.md §2.2); the tiny preset
    # takes it from the tokenizer, so the planner fills in vocab_size as a stand-in.
    vocab = tiny_config_dict(1)["text_config"]["vocab_size"]
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
    kv_layout: str
    kv_bytes_per_token: dict[str, float]
    kv_sources: list[dict[str, float]]
    request: RequestCost
    context: int
    batch: int
    servers_per_node: int
    host_mem_gib: float | None
    problems: list[str]
    status: str = "unvalidated"

    # ---- derived ----------------------------------------------------------------------------
    @property
    def static_budget(self) -> float:
        return self.gpu_mem_gib * GIB * self.mem_fraction

    @property
    def kv_budget(self) -> float:
        return self.static_budget - self.weights.resident_per_rank

    @property
    def dp(self) -> int:
        return self.weights.layout.dp_attention

    @property
    def batch_per_rank(self) -> int:
        return math.ceil(self.batch / self.dp)

    @property
    def bpt(self) -> float:
        return self.kv_bytes_per_token[self.kv_layout]

    @property
    def capacity_tokens_per_rank(self) -> int:
        free = self.kv_budget - self.batch_per_rank * self.request.total
        return max(0, int(free // self.bpt))

    @property
    def needed_kv(self) -> float:
        return self.batch_per_rank * (self.context * self.bpt + self.request.total)

    @property
    def max_full_context_requests(self) -> int:
        per = self.context * self.bpt + self.request.total
        return max(0, int(self.kv_budget // per)) * self.dp

    @property
    def host_need_per_node(self) -> float:
        return self.weights.engram_host_per_server * self.servers_per_node

    def verdict(self) -> tuple[bool, str]:
        if self.problems:
            return False, "does not run as configured: " + "; ".join(self.problems)
        if self.gpu_mem_gib <= 0:
            return False, "no device memory budget (CPU config: pass --gpu-mem with the host memory to use)"
        if self.host_mem_gib is not None and self.host_need_per_node > self.host_mem_gib * GIB:
            over = (self.host_need_per_node - self.host_mem_gib * GIB) / GIB
            return False, f"does NOT fit: host Engram needs {self.host_need_per_node / GIB:.1f} GiB per node, " \
                          f"{over:.1f} GiB more than hardware.host_mem_gib ({self.host_mem_gib:g})"
        if self.kv_budget <= 0:
            return False, f"does NOT fit: resident weights exceed the static budget by {-self.kv_budget / GIB:.1f} GiB per rank"
        margin = self.kv_budget - self.needed_kv
        what = f"{self.batch} request(s) × {self.context:,} tokens"
        if margin < 0:
            return False, f"does NOT fit: {what} need {self.needed_kv / GIB:.1f} GiB of KV per rank, " \
                          f"{-margin / GIB:.1f} GiB more than the {self.kv_budget / GIB:.1f} GiB left"
        return True, f"fits: {what} need {self.needed_kv / GIB:.2f} GiB of KV per rank of the " \
                     f"{self.kv_budget / GIB:.1f} GiB left (margin {margin / GIB:.1f} GiB)"

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
                       "device_per_rank_gib": w.engram_device_per_rank / GIB,
                       "host_per_server_gib": w.engram_host_per_server / GIB,
                       "servers_per_node": self.servers_per_node, "host_per_node_gib": self.host_need_per_node / GIB,
                       "huge_pages_2mib": math.ceil(w.engram_host_per_server / HUGE_PAGE)},
            "kv_layout": self.kv_layout, "kv_bytes_per_token": self.kv_bytes_per_token, "kv_sources": self.kv_sources,
            "per_request_bytes": {**asdict(self.request), "total": self.request.total},
            "static_budget_gib": self.static_budget / GIB, "kv_budget_gib": self.kv_budget / GIB,
            "context": self.context, "batch": self.batch, "capacity_tokens_per_rank": self.capacity_tokens_per_rank,
            "capacity_tokens_per_server": self.capacity_tokens_per_rank * self.dp,
            "max_full_context_requests": self.max_full_context_requests,
            "fits": ok, "verdict": text, "problems": self.problems, "status": self.status,
        }


def make_plan(dc: DeploymentConfig, cfg: DeepseekV41Config, model_source: str = "", *, gpu_mem: float | None = None,
              mem_fraction: float | None = None, context: int | None = None, batch: int = 1) -> Plan:
    hw = dc.hardware
    text_only = dc.features.text_only
    weights = weight_plan(cfg, layout_of(dc), vision=not text_only, dspark=dc.speculative.enabled,
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
    return Plan(
        name=dc.name, model_source=model_source, gpu=hw.gpu, gpus=hw.gpus, gpu_mem_gib=mem, gpu_mem_source=mem_src,
        mem_fraction=frac, weights=weights, checkpoint=weight_plan(cfg, ShardLayout()), kv_layout=dc.features.kv_layout,
        kv_bytes_per_token={lay: kv_bytes_per_token(t, lay) for lay in ("v4", "v41")},
        kv_sources=[{"layer": s.layer, "ratio": s.ratio, "latent": s.latent_per_token, "index": s.index_per_token}
                    for s in kv_sources(t, dc.features.kv_layout)],
        request=per_request_bytes(t, dc.features.kv_layout, draft_tokens=draft),
        context=ctx, batch=batch, servers_per_node=max(1, hw.per_node // gpus) if not hw.kind.is_cpu else 1,
        host_mem_gib=hw.host_mem_gib, problems=check_against_checkpoint(dc, cfg),
        status=(f"validated on {dc.validated_on.date} ({dc.validated_on.hardware})" if dc.validated
                else "unvalidated"),
    )


def _count(n: int) -> str:
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.1f}{suffix}"
    return str(n)


def render(p: Plan, source: str) -> str:
    w, lay = p.weights, p.weights.layout
    u, un = (GIB, "GiB") if p.checkpoint.stored_total >= GIB else (float(1 << 20), "MiB")  # tiny checkpoints
    lines = [f"sglang-dsv41 plan — {p.name} ({source}), {p.status}",
             f"model: {p.model_source}; loaded: vision {'yes' if w.included['vision'] else 'no'}, "
             f"DSpark draft {'yes' if w.included['dspark'] else 'no'}",
             f"hardware: {p.gpus} × {p.gpu}, {p.gpu_mem_gib:g} GiB per GPU [{p.gpu_mem_source}]; "
             f"static budget = {p.mem_fraction:g} × that = {p.static_budget / GIB:.1f} GiB per rank",
             f"parallel: tp {lay.tp} (attention tp {lay.attn_tp} × dp {lay.dp_attention}), ep {lay.ep}: routed experts "
             f"1/{lay.tp} per rank, head-split attention and vocab 1/{lay.attn_tp}, shared experts 1/{lay.moe_tp}, "
             "the rest replicated", "",
             f"{'weights by component':44s} {'entries':>9s} {'checkpoint':>10s} {'loaded':>8s} {'per rank':>9s}",
             f"{'':44s} {'':>9s} {un:>10s} {un:>8s} {un:>9s}"]
    for k, c in w.components.items():
        whole = p.checkpoint.components[k]
        lines.append(f"{c.label:44s} {_count(whole.entries):>9s} {whole.stored / u:10.1f} {c.stored / u:8.1f} "
                     f"{c.per_rank / u:9.2f}")
    lines += [f"{'total (stored form)':44s} {'':9s} {p.checkpoint.stored_total / u:10.1f} {w.stored_total / u:8.1f} "
              f"{w.stored_per_rank / u:9.2f}",
              f"{'load-time dequantisation (wo_a → BF16)':44s} {'':29s} {w.load_transform_per_rank / u:+9.2f}",
              f"{'resident weights per rank':44s} {'':29s} {w.resident_per_rank / u:9.2f}",
              f"vram_minimum_gb (whole checkpoint × 1.2, GB): {vram_minimum_gb(p.checkpoint.stored_total)}", ""]
    if w.engram_placement == "device":
        lines.append(f"Engram: on device, {w.engram_stored / u:.1f} {un} (tables + scales) with rows split over "
                     f"{lay.tp} rank(s): {w.engram_device_per_rank / u:.2f} {un} per rank (inside the weights above)")
    else:
        lines.append(f"Engram: in pinned host memory, {w.engram_host_per_server / u:.1f} {un} per server (read through "
                     f"UVA; {math.ceil(w.engram_host_per_server / HUGE_PAGE):,} × 2 MiB huge pages); "
                     f"{p.servers_per_node} server(s) per node → {p.host_need_per_node / u:.1f} {un} host per node")
    lines += ["", f"KV cache, layout {p.kv_layout}:",
              f"  global KV per token: v4 layout {p.kv_bytes_per_token['v4']:.1f} B, v41/FP4 layout "
              f"{p.kv_bytes_per_token['v41']:.1f} B (page-padded; MQA, so not split across TP ranks)"]
    for s in p.kv_sources:
        lines.append(f"    source layer {s['layer']:>2} (ratio {s['ratio']}): latent {s['latent']:.1f} + index key "
                     f"{s['index']:.1f} B/token")
    r = p.request
    lines += [f"  per running request: SWA {r.swa / 2**20:.2f} MiB + DSpark draft SWA {r.dspark_swa / 2**20:.2f} MiB + "
              f"ratio-2 pair state {r.pair_state / 2**10:.0f} KiB",
              f"  KV budget per rank: {p.static_budget / GIB:.1f} − {w.resident_per_rank / GIB:.1f} = "
              f"{p.kv_budget / GIB:.1f} GiB",
              f"  capacity: {p.capacity_tokens_per_rank:,} tokens per rank with {p.batch_per_rank} request(s) "
              f"per rank; {p.max_full_context_requests} concurrent request(s) of {p.context:,} tokens per server", ""]
    ok, text = p.verdict()
    lines.append(f"verdict: {text}")
    return "\n".join(lines)


def _scale_parallel(data: dict[str, Any], gpus: int) -> None:
    """`--gpus N`: the same layout on N GPUs (tp = N; DP/EP that spanned tp keep spanning it)."""
    par = data.setdefault("parallel", {})
    old = par.get("tp", 1)
    for key in ("dp_attention", "ep"):
        if par.get(key, 1) == old and old > 1:
            par[key] = gpus
    par["tp"] = gpus
    data.setdefault("hardware", {})["gpus"] = gpus


def cli(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="sglang-dsv41 plan", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="deployment config (configs/*.yaml)")
    ap.add_argument("--checkpoint", help="checkpoint directory: take the architecture from its config.json")
    ap.add_argument("--gpus", type=int, help="GPUs per server (rescales tp, and DP/EP where they span tp)")
    ap.add_argument("--gpu-mem", type=float, help="GiB of memory per GPU")
    ap.add_argument("--mem-fraction", type=float, help="SGLang mem_fraction_static (weights + KV share)")
    ap.add_argument("--context", type=int, help="tokens per request (default: serving.context_length or the model's)")
    ap.add_argument("--batch", type=int, default=1, help="concurrent requests of --context tokens (default 1)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    a = ap.parse_args(argv)
    try:
        data = raw_config(a.config)
        if a.gpus is not None:
            _scale_parallel(data, a.gpus)
        for s in a.set:
            apply_override(data, s)
        dc = config_from_dict(data, a.config)
        cfg, src = model_config_for(dc, a.checkpoint)
    except (DeployConfigError, ConfigError, FileNotFoundError) as e:
        print(f"sglang-dsv41 plan: {e}", file=sys.stderr)
        return 2
    if a.batch < 1 or (a.context is not None and a.context < 1):
        print("sglang-dsv41 plan: --batch and --context must be ≥ 1", file=sys.stderr)
        return 2
    p = make_plan(dc, cfg, src, gpu_mem=a.gpu_mem, mem_fraction=a.mem_fraction, context=a.context, batch=a.batch)
    print(json.dumps(p.to_dict(), indent=2) if a.json else render(p, a.config))
    return 0 if p.verdict()[0] else 1

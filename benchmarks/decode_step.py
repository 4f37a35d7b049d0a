"""Decode-step benchmark of one full-width DeepSeek-V4.1-Flash layer, per runtime component (issue 3).

The layer (default: layer 2 — ratio 2, kv source, runs the indexer, so every component is on the
path) is built directly on the device with valid random weights **in the stored formats** of the
checkpoint (spec §2.3: FP8 E4M3 with UE8M0 32×32 tile scales via `codecs.quantize_fp8_block`,
MXFP4 experts = random E2M1 bytes with UE8M0 group scales, BF16/FP32 rest; shapes and kinds from
`names.tensor_inventory`; every tensor checked with `loader.stored_problem`), then loaded the
way the CUDA runtime loads it: dense tensors dequantised to fp32 (`loader.logical_tensor`),
routed experts kept MXFP4 in the kernel layout (`runtime.weights.prepare_layer_experts`).

Per decode batch N ∈ {1, 8, 64, 256} (one query per request at position C − 1, C = context), it
times what the runtime runs on CUDA for that layer, separately:

* `attention` — Triton `sparse_sink_attention` (one key split, as the runtime calls it) over
  BF16 rows: W = 128 window keys + 512 selected compressed entries per query;
* `indexer` — Triton `index_scores` (float64 head sum) + `select_for_role` over C/2 entries;
* `moe_routed` — `kernels.moe_mxfp4.routed_experts_mxfp4` (MXFP4 W4A16) on the router's choice;
* `torch` — everything else the layer does, as the CUDA runtime does it today: the reference's
  torch code (mHC ×2, q/kv projections, compressor, latent/key FP4 round trips, indexer query,
  output projection, router, shared expert) with its dense products on tensor cores
  (`runtime.dense_ops.dense_math`: BF16 weight copies, fp32 accumulation, fixed row blocks);
  everything around the GEMMs is still unfused torch (float64 in places) — *not* a fast path;
* `torch_fp64` — the same work in the reference's float64 GEMMs on fp32 weights (the CPU path),
  for comparison.

For each: median µs (CUDA events, L2 flushed before every call, each region capped in time), the
bytes the step must read — `current` (what these implementations read: fp32 dense weights,
BF16 cache rows) and `design` (stored weight formats; packed FP4/FP8 KV of contracts §1–§2) —
and achieved GB/s as a fraction of the device copy bandwidth measured in the same run
(`device_bandwidth.copy_bandwidth_gbs`). Then prefill of one 8K-token request through the same
components (tokens/s), unless `--no-prefill`. Writes `benchmarks/results/decode_step.json`
and `.png`. A component that fails is recorded with its error and the script exits non-zero.

    python benchmarks/decode_step.py [--quick] [--batches 1 8 64 256] [--context 8192] [--layer 2]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, Mapping

import torch
from torch import Tensor

from sglang_dsv41.checkpoint.codecs import TILE, quantize_fp8_block
from sglang_dsv41.checkpoint.loader import logical_tensor, stored_problem
from sglang_dsv41.checkpoint.names import Kind, TensorSpec, tensor_inventory
from sglang_dsv41.config import DeepseekV41Config, LayerRole
from sglang_dsv41.presets import flash_config_dict
from sglang_dsv41.reference import ops
from sglang_dsv41.reference.attention import layer_inv_freq, output_projection, project_q_kv
from sglang_dsv41.reference.compressor import index_keys, linear_fp32_out, stored_latents
from sglang_dsv41.reference.indexer import index_query, visible_counts
from sglang_dsv41.reference.mhc import hc_coefficients, hc_residual_update, hc_sublayer_input
from sglang_dsv41.reference.moe import Routing, route, routed_expert, shared_expert

BATCHES = (1, 8, 64, 256)
QUICK_BATCHES = (1, 64)
CONTEXT, PREFILL_TOKENS = 8192, 8192
CAP_S, QUICK_CAP_S, MAX_REPS = 3.0, 0.6, 100
CACHE = ops.CacheProfile.NONE            # what the runtime's BF16 rows hold today


# ---- the layer ---------------------------------------------------------------------------------
def _fp32_value(spec: TensorSpec, shape, g: torch.Generator, device) -> Tensor:
    """Value rules of tests/reference_weights.py: activations stay O(1) through the layer."""
    n, randn = spec.name, (lambda *s: torch.randn(*s, generator=g, device=device))
    if "hc_" in n:
        return (randn(*shape) / math.sqrt(shape[1]) if n.endswith("_fn") else 0.5 * randn(*shape)
                if n.endswith("_base") else 0.5 + 0.5 * torch.rand(*shape, generator=g, device=device))
    if n.endswith(("attn_sink", "gate.bias", "gate.bias_vl")):
        return 0.3 * randn(*shape)
    return 1.0 + 0.1 * randn(*shape)                     # norm weights


def stored_layer(cfg: DeepseekV41Config, layer: int, device: torch.device, seed: int = 0) -> dict[str, Tensor]:
    """Every stored tensor of layer `layer` (names, shapes, dtypes of the checkpoint), on `device`."""
    g = torch.Generator(device=device).manual_seed(seed)
    out: dict[str, Tensor] = {}
    for spec in tensor_inventory(cfg, vision=False, dspark=False):
        if not spec.name.startswith(f"layers.{layer}."):
            continue
        shape = spec.shape
        if spec.kind is Kind.FP8:
            out[spec.name], out[spec.scale_name] = quantize_fp8_block(
                torch.randn(*shape, generator=g, device=device) / math.sqrt(shape[1]))
        elif spec.kind is Kind.FP4:       # random E2M1 pairs; scales near 2^-5 (w1/w3), 2^-9 (w2)
            exp = -9 if ".w2." in spec.name else -5
            out[spec.name] = torch.randint(0, 256, (shape[0], shape[1] // 2), generator=g, device=device,
                                           dtype=torch.uint8)
            out[spec.scale_name] = (127 + exp + torch.randint(-1, 2, (shape[0], shape[1] // TILE), generator=g,
                                                              device=device)).to(torch.uint8).view(torch.float8_e8m0fnu)
        elif spec.kind is Kind.BF16:
            out[spec.name] = (torch.randn(*shape, generator=g, device=device) / math.sqrt(shape[-1])).to(torch.bfloat16)
        elif spec.kind is Kind.FP32:
            out[spec.name] = _fp32_value(spec, shape, g, device).float()
        else:
            raise ValueError(f"{spec.name}: kind {spec.kind} is not generated here (pick a non-Engram layer)")
        for st in spec.stored():
            problem = stored_problem(st, out[st.name].dtype, tuple(out[st.name].shape))
            if problem:
                raise AssertionError(f"generated tensor not in the stored format: {problem}")
    return out


@dataclasses.dataclass
class Layer:
    cfg: DeepseekV41Config
    role: LayerRole
    weights: dict                 # runtime weights (fp32 logical + RoutedExpertsMxfp4 on CUDA)
    stored_bytes: dict[str, int]  # by group: dense / experts / norms (stored formats)
    held_dense_bytes: int         # bytes of the fp32 dense tensors the torch path reads
    expert_bytes: int             # stored bytes of one routed expert
    cached_dense_bytes: int = 0   # bytes the dense backend reads (BF16 linear weights, fp32 rest)
    dense_backend: object = None  # runtime.dense_ops.BlockedBf16Gemm on CUDA

    @property
    def text(self):
        return self.cfg.text


def build_layer(cfg: DeepseekV41Config, layer: int, device: torch.device, seed: int = 0) -> Layer:
    """`stored_layer` loaded like the runtime: CUDA keeps the routed experts MXFP4 (kernel layout),
    CPU dequantises them (the reference path)."""
    from sglang_dsv41.runtime.moe_ops import routed_experts_key
    stored = stored_layer(cfg, layer, device, seed)
    weights: dict = {}
    by_group: dict[str, int] = {}
    held = 0
    for spec in tensor_inventory(cfg, vision=False, dspark=False):
        if not spec.name.startswith(f"layers.{layer}."):
            continue
        nbytes = sum(stored[st.name].numel() * stored[st.name].element_size() for st in spec.stored())
        by_group[spec.group] = by_group.get(spec.group, 0) + nbytes
        if spec.kind is Kind.FP4 and device.type == "cuda":
            continue
        weights[spec.name] = logical_tensor(spec, stored.__getitem__).to(device=device, dtype=torch.float32)
        if spec.kind is not Kind.FP4:
            held += weights[spec.name].numel() * 4
    t = cfg.text
    if device.type == "cuda":
        from sglang_dsv41.runtime.weights import prepare_layer_experts
        prefix = f"layers.{layer}."
        weights[routed_experts_key(prefix)] = prepare_layer_experts(stored, prefix, t.n_routed_experts, device)
    del stored
    backend, cached = None, 0
    if device.type == "cuda":
        from sglang_dsv41.runtime.dense_ops import backend_for, is_dense_linear_weight
        backend = backend_for(weights)
        cached = sum(v.numel() * (2 if is_dense_linear_weight(k, v) else 4) for k, v in weights.items()
                     if isinstance(v, Tensor) and ".ffn.experts." not in k)
    per_expert = 3 * (t.moe_intermediate_size * t.hidden_size // 2 + t.moe_intermediate_size * t.hidden_size // TILE)
    return Layer(cfg, t.layer_roles()[layer], weights, by_group, held, per_expert, cached, backend)


# ---- inputs -----------------------------------------------------------------------------------
@dataclasses.dataclass
class Caches:
    """BF16 slot rows for `requests` requests of `context` tokens; request b owns slots b·C..b·C+C−1."""
    swa: Tensor
    latents: Tensor
    keys: Tensor
    context: int


def make_caches(layer: Layer, requests: int, context: int, device: torch.device, seed: int = 1) -> Caches:
    t = layer.text
    g = torch.Generator(device=device).manual_seed(seed)
    S = requests * context
    rows = lambda d: torch.randn(S, d, generator=g, device=device).to(torch.bfloat16)  # noqa: E731
    keys = ops.fp4_fake_quant_ue8m0_scale(torch.randn(S, t.index_head_dim, generator=g, device=device))
    return Caches(rows(t.head_dim), rows(t.head_dim), keys.to(torch.bfloat16), context)


def queries(layer: Layer, caches: Caches, req: Tensor, positions: Tensor) -> dict[str, Tensor]:
    """Slot tables of queries of requests `req` at `positions` (request b's slots b·C..b·C+C−1)."""
    t, dev = layer.text, positions.device
    win = positions[:, None] - t.sliding_window + 1 + torch.arange(t.sliding_window, device=dev)[None, :]
    swa_slots = torch.where(win >= 0, req[:, None] * caches.context + win, -1)
    R = int(req.max()) + 1
    req_to_token = torch.arange(R * caches.context, device=dev).view(R, caches.context)
    return dict(req=req, swa_slots=swa_slots, req_to_token=req_to_token, positions=positions)


# ---- components ---------------------------------------------------------------------------------
def torch_work(layer: Layer, R: Tensor, positions: Tensor) -> tuple[Tensor, Routing]:
    """The layer's torch work as the runtime runs it (module docstring); returns the MoE input
    and its routing. The attention output is stood in for by q (attention is timed apart)."""
    t, w, i = layer.text, layer.weights, layer.role.layer
    p, pa = f"layers.{i}.", f"layers.{i}.attn."
    hc = lambda sub, R_: hc_coefficients(R_, w[f"{p}hc_{sub}_fn"], w[f"{p}hc_{sub}_base"], w[f"{p}hc_{sub}_scale"],  # noqa: E731
                                         rms_eps=t.rms_norm_eps, hc_eps=t.hc_eps, sinkhorn_iters=t.hc_sinkhorn_iters)
    inv_freq = layer_inv_freq(t, layer.role.ratio).to(R.device)
    co = hc("attn", R)
    x = hc_sublayer_input(R, co.pre, w[p + "attn_norm.weight"], t.rms_norm_eps)
    q_lora, q, kv = project_q_kv(t, w, pa, x, positions, inv_freq, True)
    ops.swa_cache_roundtrip(kv, CACHE, t.qk_rope_head_dim)
    if layer.role.computes_latents:
        a = linear_fp32_out(x, w[pa + "compressor.wkv.weight"])
        if layer.role.ratio == 2:
            linear_fp32_out(x, w[pa + "compressor.wgate.weight"])
        latents = ops.rms_norm(ops.bf16(a), w[pa + "compressor.norm.weight"], t.rms_norm_eps)
        stored_latents(t, latents, positions, inv_freq, CACHE)
        index_keys(t, w, pa, latents, positions, inv_freq)
    if layer.role.runs_indexer:
        index_query(t, w, pa, x, q_lora, positions, inv_freq, True)
    y = output_projection(t, w, pa, q, positions, inv_freq, True)
    R = hc_residual_update(R, y, co)
    co_f = hc("ffn", R)
    x = hc_sublayer_input(R, co.pre, w[p + "ffn_norm.weight"], t.rms_norm_eps)
    routing = route(x, w[p + "ffn.gate.weight"], w[p + "ffn.gate.bias"], t.num_experts_per_tok)
    shared = shared_expert(x, w[p + "ffn.shared_experts.w1.weight"], w[p + "ffn.shared_experts.w2.weight"],
                           w[p + "ffn.shared_experts.w3.weight"], t.swiglu_limit, True)
    hc_residual_update(R, shared, co_f)
    return x, routing


def moe_routed(layer: Layer, x: Tensor, routing: Routing) -> Tensor:
    """Routed experts as the runtime runs them: CUDA → MXFP4 kernel; CPU → the reference."""
    t, p = layer.text, f"layers.{layer.role.layer}."
    if x.is_cuda:
        from sglang_dsv41.kernels import moe_mxfp4 as mx
        from sglang_dsv41.runtime.moe_ops import routed_experts_key
        return mx.routed_experts_mxfp4(x.to(torch.bfloat16), routing.experts, routing.weights,
                                       layer.weights[routed_experts_key(p)].prepared,
                                       swiglu_limit=t.swiglu_limit, routed_scale=t.routed_scaling_factor)
    T, k = routing.experts.shape
    per_slot = torch.zeros(T, k, x.shape[1], dtype=torch.float64)
    for e in torch.unique(routing.experts).tolist():
        rows, slot = torch.nonzero(routing.experts == e, as_tuple=True)
        q = f"{p}ffn.experts.{e}."
        per_slot[rows, slot] = routed_expert(x[rows], layer.weights[q + "w1.weight"], layer.weights[q + "w2.weight"],
                                             layer.weights[q + "w3.weight"], t.swiglu_limit).double()
    return ops.bf16((t.routed_scaling_factor * (routing.weights.double().unsqueeze(-1) * per_slot).sum(1)).float())


def kernel_components(layer: Layer, caches: Caches, qs: dict, q: Tensor, sink: Tensor) -> dict[str, Callable]:
    """Attention and indexer through the Triton kernels, as the runtime calls them (CUDA only)."""
    from sglang_dsv41.kernels import indexer as K
    from sglang_dsv41.kernels import sparse_attention as SA
    t, role, pos = layer.text, layer.role, qs["positions"]
    n_vis = visible_counts(pos, role.ratio)
    width = caches.context // role.ratio
    R = qs["req_to_token"].shape[0]
    entry_slots = K.entry_slot_table(qs["req_to_token"], torch.arange(R, device=pos.device),
                                     torch.full((R,), width, device=pos.device), role.ratio, width)
    g = torch.Generator(device=pos.device).manual_seed(7)
    iq = ops.fp4_fake_quant_ue8m0_scale(torch.randn(q.shape[0], t.index_n_heads, t.index_head_dim,
                                                    generator=g, device=pos.device))
    head_w = torch.rand(q.shape[0], t.index_n_heads, generator=g, device=pos.device) / t.index_n_heads
    sel = {}

    def indexer():
        scores = K.index_scores(iq, head_w, caches.keys, entry_slots, qs["req"], n_vis, head_sum_fp64=True,
                                check_inputs=False)
        sel["s"] = K.select_for_role(t, role, scores, n_vis, None, check_nan=False)[0]
        return sel["s"]

    indexer()
    comp_pos = torch.where(sel["s"] >= 0, sel["s"] * role.ratio + role.ratio - 1, -1)
    comp_slots = torch.where(comp_pos >= 0, qs["req"][:, None] * caches.context + comp_pos, -1)
    cfg_att = dataclasses.replace(SA.plan_config(q.shape[0], t.num_attention_heads, t.head_dim, t.sliding_window,
                                                 comp_slots.shape[1], 1), num_splits=1)
    qb = q.to(torch.bfloat16)

    def attention():
        return SA.sparse_sink_attention(qb, caches.swa, qs["swa_slots"], caches.latents, comp_slots, sink,
                                        ops.softmax_scale(t.head_dim), config=cfg_att)
    return {"attention": attention, "indexer": indexer}


# ---- bytes --------------------------------------------------------------------------------------
def step_bytes(layer: Layer, N: int, n_visible: int, distinct_experts: int) -> dict[str, dict[str, int]]:
    """Bytes one step must read per component (module docstring): `current` and `design`."""
    t = layer.text
    D, Dk, H, W, K = t.head_dim, t.index_head_dim, t.num_attention_heads, t.sliding_window, t.index_topk
    valid = W + min(K, n_visible)
    q_bytes = H * D * 2
    att_cur = N * (q_bytes + valid * D * 2 + (W + K) * 4)
    att_design = N * (q_bytes + W * (D + D // 32) + min(K, n_visible) * (D // 2 + D // 16) + (W + K) * 4)
    idx_cur = N * (n_visible * (Dk * 2 + 8) + t.index_n_heads * (Dk * 4 + 4) + n_visible * 4)
    idx_design = N * (n_visible * (Dk // 2 + Dk // 32 + 8) + t.index_n_heads * (Dk * 4 + 4) + n_visible * 4)
    experts = distinct_experts * layer.expert_bytes
    dense_stored = sum(v for k, v in layer.stored_bytes.items() if k != "experts")
    return {"attention": dict(current=att_cur, design=att_design),
            "indexer": dict(current=idx_cur, design=idx_design),
            "moe_routed": dict(current=experts, design=experts),
            "torch": dict(current=layer.cached_dense_bytes or layer.held_dense_bytes, design=dense_stored),
            "torch_fp64": dict(current=layer.held_dense_bytes, design=dense_stored)}


# ---- timing -------------------------------------------------------------------------------------
def measure(fn: Callable[[], object], cap_s: float, device: torch.device) -> dict:
    """Median µs of `fn` (one warm-up call, then ≤ MAX_REPS calls within ~cap_s; CUDA: events,
    a 256 MB L2 flush before each call)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    reps = max(1, min(MAX_REPS, int(cap_s / max(time.perf_counter() - t0, 1e-6))))
    flush = torch.empty(64 << 20, dtype=torch.int32, device=device) if device.type == "cuda" else None
    us = []
    for _ in range(reps):
        if flush is not None:
            flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            us.append(start.elapsed_time(end) * 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            us.append((time.perf_counter() - t0) * 1e6)
    return dict(median_us=statistics.median(us), min_us=min(us), reps=reps)


def run_point(layer: Layer, caches: Caches, req: Tensor, positions: Tensor, cap_s: float,
              copy_gbs: float | None, errors: list[str]) -> dict:
    """All components of one step: query i of request req[i] at positions[i] (decode: one query
    per request; prefill: one request); failures are recorded in `errors`."""
    t, dev, N = layer.text, positions.device, int(positions.numel())
    g = torch.Generator(device=dev).manual_seed(N)
    R = ops.bf16(torch.randn(N, t.hc_mult, t.hidden_size, generator=g, device=dev))
    x, routing = torch_work(layer, R, positions)
    q = ops.bf16(torch.randn(N, t.num_attention_heads, t.head_dim, generator=g, device=dev))
    sink = layer.weights[f"layers.{layer.role.layer}.attn.attn_sink"]
    comps: dict[str, Callable] = {"torch": lambda: torch_work(layer, R, positions),
                                  "moe_routed": lambda: moe_routed(layer, x, routing)}
    if layer.dense_backend is not None:
        from sglang_dsv41.runtime.dense_ops import dense_math

        def on_tensor_cores():
            with dense_math(layer.dense_backend):
                return torch_work(layer, R, positions)
        comps = {"torch": on_tensor_cores, "torch_fp64": comps["torch"], "moe_routed": comps["moe_routed"]}
    if dev.type == "cuda":
        try:
            comps.update(kernel_components(layer, caches, queries(layer, caches, req, positions), q, sink))
        except Exception as exc:
            errors.append(f"N={N} kernels setup: {type(exc).__name__}: {exc}")
    n_vis = int(visible_counts(positions, layer.role.ratio).max())
    nbytes = step_bytes(layer, N, n_vis, int(torch.unique(routing.experts).numel()))
    out = dict(tokens=N, distinct_experts=int(torch.unique(routing.experts).numel()), visible_entries=n_vis)
    for name, fn in comps.items():
        try:
            r = measure(fn, cap_s, dev) | dict(bytes=nbytes[name])
            if copy_gbs:
                r["fraction_of_copy_bw"] = {k: v / (r["median_us"] * 1e-6) / 1e9 / copy_gbs for k, v in nbytes[name].items()}
            out[name] = r
        except Exception as exc:
            errors.append(f"N={N} {name}: {type(exc).__name__}: {exc}")
            out[name] = dict(error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc(limit=3))
    timed = [out[c]["median_us"] for c in comps if c != "torch_fp64" and "median_us" in out.get(c, {})]
    out["layer_us_sum"] = sum(timed)
    return out


HONESTY = {"torch": "NOT a fast path: reference torch code (mHC, projections, compressor, indexer query, "
                    "router, shared expert), dense products on tensor cores (dense_ops: BF16 weight copies, "
                    "fixed row blocks), everything else unfused torch incl. float64 elementwise math",
           "torch_fp64": "the same with float64 GEMMs on fp32-dequantised weights (CPU path); not in layer_us_sum",
           "attention": "Triton kernel over BF16 cache rows (not yet the packed FP4 rows of the design)",
           "indexer": "Triton scores (float64 head sum) over BF16 FP4-valued keys + torch top-k",
           "moe_routed": "Triton matmul_ogs MXFP4 W4A16 (the design's format)",
           "not_measured": "CUDA graphs (eager launches only); Engram; the LM head; SGLang scheduling"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    ap.add_argument("--batches", type=int, nargs="+")
    ap.add_argument("--context", type=int, default=CONTEXT)
    ap.add_argument("--layer", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="batches 1 and 64, shorter caps, no prefill (< 2 min)")
    ap.add_argument("--no-prefill", action="store_true")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/decode_step.py needs a CUDA GPU")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from device_bandwidth import copy_bandwidth_gbs
    dev = torch.device("cuda")
    batches = args.batches or (QUICK_BATCHES if args.quick else BATCHES)
    cap = QUICK_CAP_S if args.quick else CAP_S
    t_start = time.perf_counter()
    cfg = DeepseekV41Config.from_dict(flash_config_dict())
    layer = build_layer(cfg, args.layer, dev)
    caches = make_caches(layer, max(batches), args.context, dev)
    copy_gbs = copy_bandwidth_gbs(dev)
    print(f"layer {args.layer} built ({time.perf_counter() - t_start:.0f} s); copy bandwidth {copy_gbs:.0f} GB/s", flush=True)
    errors: list[str] = []
    rows = []
    for N in batches:
        pos = torch.full((N,), args.context - 1, dtype=torch.long, device=dev)
        rows.append(run_point(layer, caches, torch.arange(N, device=dev), pos, cap, copy_gbs, errors))
        r = rows[-1]
        print(f"N={N:4d} " + "  ".join(f"{c} {r[c]['median_us']:.0f} us" for c in ("attention", "indexer", "moe_routed", "torch")
                                        if "median_us" in r.get(c, {})), flush=True)
    prefill = None
    if not (args.quick or args.no_prefill):
        pos = torch.arange(PREFILL_TOKENS, device=dev)
        try:
            pc = make_caches(layer, 1, PREFILL_TOKENS, dev, seed=2)
            prefill = run_point(layer, pc, torch.zeros_like(pos), pos, cap, copy_gbs, errors)
            prefill["tokens_per_s"] = PREFILL_TOKENS / (prefill["layer_us_sum"] * 1e-6)
        except Exception as exc:
            errors.append(f"prefill: {type(exc).__name__}: {exc}")
    props = torch.cuda.get_device_properties(dev)
    result = dict(device=props.name, torch=torch.__version__, python=platform.python_version(),
                  layer=args.layer, role=dataclasses.asdict(layer.role), context=args.context,
                  copy_bandwidth_gbs=copy_gbs, stored_layer_bytes=layer.stored_bytes,
                  timing=f"CUDA events, L2 flushed per call, median of ≤{MAX_REPS} calls within {cap} s, eager",
                  bytes=("current = what these implementations read (fp32 dense weights, BF16 rows); design = "
                         "stored formats (FP8/MXFP4 weights) and packed KV (FP4 latents/keys, FP8 SWA)"),
                  paths=HONESTY, decode=rows, prefill=prefill, errors=errors,
                  wall_s=time.perf_counter() - t_start)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode_step.json").write_text(json.dumps(result, indent=2))
    plot(rows, args.out / "decode_step.png", props.name)
    print(f"wrote {args.out / 'decode_step.json'} ({result['wall_s']:.0f} s); errors: {errors or 'none'}")
    return 1 if errors else 0


def plot(rows: list[dict], path: Path, device_name: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    Ns = [r["tokens"] for r in rows]
    bottom = [0.0] * len(rows)
    for c in ("attention", "indexer", "moe_routed", "torch"):
        us = [r.get(c, {}).get("median_us", 0.0) for r in rows]
        ax.bar([str(n) for n in Ns], us, bottom=bottom, label=c)
        bottom = [b + u for b, u in zip(bottom, us)]
    ax.set(yscale="log", xlabel="decode batch N", ylabel="µs per layer (stacked)",
           title=f"{device_name}: one Flash layer, decode step by component")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())

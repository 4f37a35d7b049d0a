"""Decode-step benchmark of one full-width DeepSeek-V4.1-Flash layer, per component and as one CUDA graph (issue 3).

The layer (default: layer 2 — ratio 2, kv source, runs the indexer, so every component is on the
path) is built directly on the device with valid random weights **in the stored formats** of the
checkpoint (spec §2.3: FP8 E4M3 with UE8M0 32×32 tile scales via `codecs.quantize_fp8_block`,
MXFP4 experts = random E2M1 bytes with UE8M0 group scales, BF16/FP32 rest; shapes and kinds from
`names.tensor_inventory`; every tensor checked with `loader.stored_problem`), then loaded the
way the CUDA runtime loads it: dense tensors dequantised to fp32 (`loader.logical_tensor`),
routed experts kept MXFP4 in the kernel layout (`runtime.weights.prepare_layer_experts`).

Caches are the runtime's formats (phase-2 contracts §1–§5): BF16 SWA rows, and the layer's kv
source as **packed FP4 entries** in uint8 per-token rows (`runtime.kv_layout.encode_entries` /
`write_entries`, `CompressedRowLayout.from_config`; 288 B latent + 68 B index key per entry),
read by the kernels through `kernels.packed_rows.PackedSource` with entry indices.

Per decode batch N ∈ {1, 8, 64, 256} (one query per request at position C − 1, C = context), it
times what the runtime runs on CUDA for that layer:

* `attention` — Triton `sparse_sink_attention` (one key split) over BF16 SWA rows (W = 128) +
  512 selected packed entries per query (`comp_cache=PackedSource`, `comp_slots` = entries);
* `indexer` — Triton `index_scores` (float64 head sum) over the packed keys of C/2 entries
  (`key_cache=PackedSource`, `entry_index_table`) + `select_for_role`;
* `moe_routed` — `kernels.moe_mxfp4.routed_experts_mxfp4` (MXFP4 W4A16) on the router's choice;
* `torch` — everything else the layer does, as the CUDA runtime does it today: the reference's
  torch code (mHC ×2, q/kv projections, compressor, latent/key FP4 round trips, indexer query,
  output projection, router, shared expert) with its dense products on tensor cores
  (`runtime.dense_ops.dense_math`); everything around the GEMMs is still unfused torch (float64
  in places) — *not* a fast path;
* `torch_fp64` — the same work with the reference's float64 GEMMs (the CPU path), for comparison;
* `attention_bf16` / `indexer_bf16` (full run only) — the same kernels over BF16 copies of the
  decoded entries (the pre-packing format); their outputs must equal the packed ones bit for bit
  (`packed_equals_bf16`: attention within 2 BF16 ulps of the output scale, index scores bitwise; checked
  once per N; a difference is an error).

Then the whole step — `torch`, `indexer`, `attention`, `moe_routed` in that order, each on its
static inputs, exactly the calls timed above — eagerly (`layer_us_eager`) and as one
`torch.cuda.CUDAGraph` replay (`layer_us_graph`; warm-up on a side stream, then capture). A part
that cannot be captured is named with its exception under `graph_excluded`, and the graph holds
the rest. The indexer's selection does not feed the attention inside the step (the attention
reads the selection computed at set-up — the same values); the attention output does not feed
the output projection (q stands in).

Every timing: median µs (CUDA events, 256 MB L2 flush before every call, ≤ MAX_REPS calls within
a cap), the bytes the step must read — `current` (what these implementations read) and `design`
(stored weight formats, FP8 SWA rows, packed FP4 entries) — and achieved GB/s as a fraction of the
device copy bandwidth measured in the same run (`device_bandwidth.copy_bandwidth_gbs`). Then
prefill of one 8K-token request through the same components (tokens/s), unless `--quick` or
`--no-prefill`. A wall budget (`--budget-s`) skips what would run past it (listed in `skipped`).
Writes `benchmarks/results/decode_step.json` (then `.png`); exit status 1 iff `errors` is non-empty
(a component or the graph of the step failed, a packed/BF16 mismatch, a malformed row, no plot).

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
from typing import Callable, Mapping, Sequence

import torch
from torch import Tensor

from sglang_dsv41.checkpoint.codecs import TILE, quantize_fp8_block
from sglang_dsv41.checkpoint.loader import logical_tensor, stored_problem
from sglang_dsv41.checkpoint.names import Kind, TensorSpec, tensor_inventory
from sglang_dsv41.config import DeepseekV41Config, LayerRole
from sglang_dsv41.kernels.packed_rows import PackedSource
from sglang_dsv41.presets import flash_config_dict
from sglang_dsv41.reference import ops
from sglang_dsv41.reference.attention import layer_inv_freq, output_projection, project_q_kv
from sglang_dsv41.reference.compressor import index_keys, linear_fp32_out, stored_latents
from sglang_dsv41.reference.indexer import index_query, visible_counts
from sglang_dsv41.reference.mhc import hc_coefficients, hc_residual_update, hc_sublayer_input
from sglang_dsv41.reference.moe import Routing, route, routed_expert, shared_expert
from sglang_dsv41.runtime.kv_layout import (CompressedRowLayout, decode_entry_keys, decode_entry_latents,
                                            encode_entries, key_bytes, latent_bytes, write_entries)

BATCHES = (1, 8, 64, 256)
QUICK_BATCHES = (1, 64)
CONTEXT, PREFILL_TOKENS = 8192, 8192
CAP_S, QUICK_CAP_S, MAX_REPS = 2.0, 0.5, 100
BUDGET_S, QUICK_BUDGET_S = 225.0, 105.0   # wall budgets (full < 4 min, quick < 2 min incl. start-up)
CACHE = ops.CacheProfile.NONE            # the stored latent is FP4 only (no further cache round trip)
STEP_PARTS = ("torch", "indexer", "attention", "moe_routed")   # one decode step of the layer, in order
GRAPH_WARMUP_CALLS = 2
ENCODE_CHUNK = 1 << 16                   # entries encoded per chunk when filling the packed rows
SLOT_ID_BYTES = 8                        # int64 slot / entry ids, as passed to the kernels
BUDGET_NOTE = "skipped: over the wall budget (--budget-s)"


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
    inv_freq: Tensor              # RoPE inverse frequencies on the device (made once, like the runtime)
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
    role = t.layer_roles()[layer]
    inv_freq = layer_inv_freq(t, role.ratio).to(device)
    return Layer(cfg, role, weights, by_group, held, per_expert, inv_freq, cached, backend)


# ---- inputs -----------------------------------------------------------------------------------
@dataclasses.dataclass
class Caches:
    """Request b owns token slots b·C .. b·C + C − 1 (C = context, a multiple of the ratio r).
    `swa`: BF16 SWA rows [S, D] (the runtime's format). `packed`: the layer's kv source in uint8
    packed rows [S, storage_row_bytes] (contracts §1–§2, only this source's columns written;
    entry e = slot // r holds the compressed position completed by slot e·r + r − 1). `latents` /
    `keys`: BF16 copies of the decoded entries at that completing slot (the BF16 variants), or None."""
    swa: Tensor
    packed: PackedSource
    layout: CompressedRowLayout
    latents: Tensor | None
    keys: Tensor | None
    context: int


def make_caches(layer: Layer, requests: int, context: int, device: torch.device, seed: int = 1,
                bf16_copies: bool = False) -> Caches:
    """Random SWA rows and one packed entry (random pre-quantisation latent and key, encoded with
    `encode_entries`) for every entry index of the layer's kv source."""
    t, role = layer.text, layer.role
    if role.kv_source is None:
        raise ValueError(f"layer {role.layer} (ratio 0) reads no compressed cache: pick a ratio-1/2 layer")
    layout = CompressedRowLayout.from_config(t)
    src = layout.source(role.kv_source)
    if context % src.ratio:
        raise ValueError(f"context {context} must be a multiple of the compress ratio {src.ratio}")
    g = torch.Generator(device=device).manual_seed(seed)
    S, D, Dk = requests * context, t.head_dim, t.index_head_dim
    swa = torch.randn(S, D, generator=g, device=device).to(torch.bfloat16)
    rows = torch.zeros(S, layout.storage_row_bytes, dtype=torch.uint8, device=device)
    latents = torch.zeros(S, D, dtype=torch.bfloat16, device=device) if bf16_copies else None
    keys = torch.zeros(S, Dk, dtype=torch.bfloat16, device=device) if bf16_copies else None
    n = S // src.ratio
    for e0 in range(0, n, ENCODE_CHUNK):
        e = torch.arange(e0, min(n, e0 + ENCODE_CHUNK), device=device)
        entries = encode_entries(layout, torch.randn(e.numel(), D, generator=g, device=device),
                                 torch.randn(e.numel(), Dk, generator=g, device=device))
        write_entries(rows, src, e, entries)
        if bf16_copies:          # decoded values are BF16-exact (kernels/packed_rows.py)
            slot = e * src.ratio + src.ratio - 1
            latents[slot] = decode_entry_latents(layout, entries).to(torch.bfloat16)
            keys[slot] = decode_entry_keys(layout, entries).to(torch.bfloat16)
    packed = PackedSource(rows, src.offset, src.share, src.ratio, D, Dk)
    return Caches(swa, packed, layout, latents, keys, context)


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
    and its routing. The attention output is stood in for by q (attention is timed apart). No host
    sync and no host → device copy (RoPE frequencies are made once in `build_layer`), so it can be
    captured in a CUDA graph."""
    t, w, i = layer.text, layer.weights, layer.role.layer
    p, pa = f"layers.{i}.", f"layers.{i}.attn."
    hc = lambda sub, R_: hc_coefficients(R_, w[f"{p}hc_{sub}_fn"], w[f"{p}hc_{sub}_base"], w[f"{p}hc_{sub}_scale"],  # noqa: E731
                                         rms_eps=t.rms_norm_eps, hc_eps=t.hc_eps, sinkhorn_iters=t.hc_sinkhorn_iters)
    inv_freq = layer.inv_freq
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


def kernel_components(layer: Layer, caches: Caches, qs: dict, q: Tensor,
                      sink: Tensor) -> tuple[dict[str, Callable], dict[str, bool]]:
    """Attention and indexer through the Triton kernels on the packed rows, as the runtime calls
    them (CUDA only, no host sync), plus the BF16 variants when `caches` holds BF16 copies; and
    {component: packed output == BF16 output} for those."""
    from sglang_dsv41.kernels import indexer as K
    from sglang_dsv41.kernels import sparse_attention as SA
    t, role, pos, req = layer.text, layer.role, qs["positions"], qs["req"]
    r = caches.packed.ratio
    n_vis = visible_counts(pos, r)
    width = caches.context // r
    R = qs["req_to_token"].shape[0]
    table_args = (qs["req_to_token"], torch.arange(R, device=pos.device), torch.full((R,), width, device=pos.device),
                  r, width)
    entries = K.entry_index_table(*table_args)
    g = torch.Generator(device=pos.device).manual_seed(7)
    iq = ops.fp4_fake_quant_ue8m0_scale(torch.randn(q.shape[0], t.index_n_heads, t.index_head_dim,
                                                    generator=g, device=pos.device))
    head_w = torch.rand(q.shape[0], t.index_n_heads, generator=g, device=pos.device) / t.index_n_heads

    def scores_packed():
        return K.index_scores(iq, head_w, caches.packed, entries, req, n_vis, head_sum_fp64=True, check_inputs=False)

    def indexer():
        return K.select_for_role(t, role, scores_packed(), n_vis, None, check_nan=False)[0]

    sel = indexer()
    comp_entries = torch.where(sel >= 0, entries[req[:, None], sel.clamp(min=0)], -1)
    cfg_att = dataclasses.replace(SA.plan_config(q.shape[0], t.num_attention_heads, t.head_dim, t.sliding_window,
                                                 comp_entries.shape[1], 1), num_splits=1)
    qb, scale = q.to(torch.bfloat16), ops.softmax_scale(t.head_dim)

    def attention():
        return SA.sparse_sink_attention(qb, caches.swa, qs["swa_slots"], caches.packed, comp_entries, sink, scale,
                                        config=cfg_att)
    comps: dict[str, Callable] = {"attention": attention, "indexer": indexer}
    if caches.latents is None:
        return comps, {}
    slots = K.entry_slot_table(*table_args)                      # where the BF16 copy of entry e lives
    comp_slots = torch.where(comp_entries >= 0, comp_entries * r + r - 1, -1)

    def scores_bf16():
        return K.index_scores(iq, head_w, caches.keys, slots, req, n_vis, head_sum_fp64=True, check_inputs=False)

    def attention_bf16():
        return SA.sparse_sink_attention(qb, caches.swa, qs["swa_slots"], caches.latents, comp_slots, sink, scale,
                                        config=cfg_att)
    comps["attention_bf16"] = attention_bf16
    comps["indexer_bf16"] = lambda: K.select_for_role(t, role, scores_bf16(), n_vis, None, check_nan=False)[0]
    same = {"attention": _within_two_bf16_ulps(attention(), attention_bf16()),
            "indexer": torch.equal(scores_packed(), scores_bf16())}
    return comps, same


def _within_two_bf16_ulps(got: Tensor, want: Tensor) -> bool:
    """The packed and BF16 attention kernels are different binaries, measured on the H200 to agree
    within one BF16 ulp of the output scale (max |o| per query and head), not bit for bit
    (tests/test_kernels_sparse_attention.py states ≤ 2); the index scores are bitwise equal."""
    scale = want.float().abs().amax(dim=-1, keepdim=True).clamp(min=2.0 ** -126)
    ulp = torch.exp2(torch.floor(torch.log2(scale)) - 7)
    return bool(((got.float() - want.float()).abs() <= 2 * ulp).all())


# ---- bytes --------------------------------------------------------------------------------------
def step_bytes(layer: Layer, N: int, n_visible: int, distinct_experts: int) -> dict[str, dict[str, int]]:
    """Bytes one decode step reads per component (module docstring): `current` = what the timed
    implementation reads, `design` = stored weight formats, FP8 SWA rows (D + D/32 B), packed
    entries. Attention: q, both int64 id lists, sink, W SWA rows, min(K, n) compressed keys
    (packed: D/2 + D/16 = 288 B at Flash; BF16: 2·D). Indexer: per visible entry its int64 entry id
    and key (packed: Dk/2 + Dk/32 = 68 B; BF16: 2·Dk) and a 4 B score, plus the fp32 query and
    head weights (the bounds of `kernels.sparse_attention.bytes_read_per_query` /
    `kernels.indexer.score_bytes_per_query`)."""
    t = layer.text
    D, Dk, H, Hi, W, K = (t.head_dim, t.index_head_dim, t.num_attention_heads, t.index_n_heads, t.sliding_window,
                          t.index_topk)
    k = min(K, n_visible)
    att_fixed = H * D * 2 + (W + K) * SLOT_ID_BYTES + H * 4
    att_design = N * (att_fixed + W * (D + D // 32) + k * latent_bytes(D))
    idx_fixed = Hi * (Dk * 4 + 4) + n_visible * (4 + SLOT_ID_BYTES)
    idx_packed = N * (idx_fixed + n_visible * key_bytes(Dk))
    experts = distinct_experts * layer.expert_bytes
    dense_stored = sum(v for g, v in layer.stored_bytes.items() if g != "experts")
    return {"attention": dict(current=N * (att_fixed + W * D * 2 + k * latent_bytes(D)), design=att_design),
            "attention_bf16": dict(current=N * (att_fixed + (W + k) * D * 2), design=att_design),
            "indexer": dict(current=idx_packed, design=idx_packed),
            "indexer_bf16": dict(current=N * (idx_fixed + n_visible * Dk * 2), design=idx_packed),
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


def timed(fn: Callable[[], object], cap_s: float, device: torch.device, nbytes: Mapping[str, int],
          copy_gbs: float | None) -> dict:
    """`measure` + bytes + the fraction of the copy bandwidth those bytes per median reach."""
    r = measure(fn, cap_s, device) | dict(bytes=dict(nbytes))
    if copy_gbs:
        r["fraction_of_copy_bw"] = {k: v / (r["median_us"] * 1e-6) / 1e9 / copy_gbs for k, v in nbytes.items()}
    return r


def _describe(exc: BaseException) -> str:
    """Exception text, with the one it was raised while handling (a failed capture's end)."""
    text = f"{type(exc).__name__}: {exc}"
    ctx = exc.__cause__ or exc.__context__
    if ctx is not None:
        text += f" [while handling {type(ctx).__name__}: {ctx}]"
    return text[:3000]


def attempt(label: str, fn: Callable[[], dict], errors: list[str], skipped: list[str], deadline: float) -> dict:
    """fn() unless past `deadline` (→ {"skipped"}, label in `skipped`); an exception → {"error",
    "traceback"} and a line in `errors`."""
    if time.perf_counter() > deadline:
        skipped.append(label)
        return dict(skipped=BUDGET_NOTE)
    try:
        return fn()
    except Exception as exc:
        errors.append(f"{label}: {_describe(exc)}")
        return dict(error=_describe(exc), traceback=traceback.format_exc(limit=4))


# ---- CUDA graph of the step ---------------------------------------------------------------------
def capture_graph(fns: Sequence[Callable[[], object]], warmup_calls: int = GRAPH_WARMUP_CALLS):
    """One `torch.cuda.CUDAGraph` of one call of every fn in order, after `warmup_calls` calls on a
    side stream (torch's recipe: Triton compiles, cuBLAS workspaces, allocator state)."""
    if not torch.cuda.is_available():
        raise RuntimeError("capture_graph: CUDA graphs need a CUDA device")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup_calls):
            for fn in fns:
                fn()
    caller = torch.cuda.current_stream()
    caller.wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for fn in fns:
                fn()
    finally:      # torch.cuda.graph's exit skips restoring the stream when ending a failed capture raises
        torch.cuda.set_stream(caller)
    return graph


def settle_after_failed_capture() -> None:
    """Wait for the device after a failed capture (capture errors are not sticky; if the context
    is broken this raises, and the caller records it)."""
    torch.cuda.synchronize()


def graph_of(parts: Mapping[str, Callable[[], object]]):
    """(graph, excluded): the graph of all parts in order; if that capture fails, each part is
    captured alone to find those that cannot be (a host sync, a host → device copy, ...) —
    `excluded` maps them to their exception text — and the graph holds the rest in order.
    Raises if no part can be captured, or if every part captures alone but not all together."""
    if not parts:
        raise ValueError("graph_of: no parts")
    try:
        return capture_graph(list(parts.values())), {}
    except Exception as exc:
        settle_after_failed_capture()
        together = _describe(exc)
    excluded: dict[str, str] = {}
    for name, fn in parts.items():
        try:
            capture_graph([fn], warmup_calls=1)
        except Exception as exc:
            settle_after_failed_capture()
            excluded[name] = _describe(exc)
    if not excluded:
        raise RuntimeError(f"every part captures alone but the whole step does not: {together}")
    kept = [fn for name, fn in parts.items() if name not in excluded]
    if not kept:
        raise RuntimeError(f"no part of the step can be captured: {excluded}")
    return capture_graph(kept), excluded


def step_timing(parts: Mapping[str, Callable[[], object]], nbytes: Mapping[str, Mapping[str, int]], cap_s: float,
                device: torch.device, copy_gbs: float | None, graph: bool, label: str, errors: list[str],
                skipped: list[str], deadline: float) -> dict:
    """The whole step (`parts` in order) eagerly and, if `graph`, as one CUDA graph replay
    (`graph_of`); keys of the decode row: eager, graph, layer_us_eager, layer_us_graph, graph_excluded."""
    def bytes_of(names):
        return {k: sum(nbytes[n][k] for n in names) for k in ("current", "design")}

    def run_all(names):
        return lambda: [parts[n]() for n in names]
    eager = (attempt(f"{label} eager step", lambda: dict(parts=list(parts)) | timed(
        run_all(list(parts)), cap_s, device, bytes_of(parts), copy_gbs), errors, skipped, deadline)
        if parts else dict(skipped="no component of the step ran"))

    def graph_run() -> dict:
        g, excluded = graph_of(parts)
        kept = [n for n in parts if n not in excluded]
        out = dict(parts=kept, excluded=excluded) | timed(g.replay, cap_s, device, bytes_of(kept), copy_gbs)
        del g
        if excluded:          # the eager time of exactly the graphed parts, for the comparison
            out["eager_same_parts_us"] = measure(run_all(kept), cap_s, device)["median_us"]
        return out
    if not graph:
        g_row = dict(skipped="not run: no CUDA device, or --no-graph")
    elif not parts:
        g_row = dict(skipped="no component of the step ran")
    else:
        g_row = attempt(f"{label} graph", graph_run, errors, skipped, deadline)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return dict(eager=eager, graph=g_row, layer_us_eager=eager.get("median_us"),
                layer_us_graph=g_row.get("median_us"), graph_excluded=g_row.get("excluded", {}))


# ---- one point ----------------------------------------------------------------------------------
def step_components(layer: Layer, caches: Caches, req: Tensor, positions: Tensor,
                    errors: list[str]) -> tuple[dict[str, Callable[[], object]], dict]:
    """The callables of one step (`torch` work, `moe_routed`, and on CUDA the kernels `indexer` /
    `attention` and their BF16 variants) on fixed random inputs, and the point's metadata row
    (tokens, distinct experts, visible entries, packed-vs-BF16 check); kernel set-up failures go to
    `errors`. Shared by `run_point` and benchmarks/decode_step_profile.py."""
    t, dev, N = layer.text, positions.device, int(positions.numel())
    label = f"N={N}"
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
    distinct = int(torch.unique(routing.experts).numel())
    n_vis = int(visible_counts(positions, layer.role.ratio).max())
    out: dict = dict(tokens=N, distinct_experts=distinct, visible_entries=n_vis)
    if dev.type == "cuda":
        try:
            kernels, same = kernel_components(layer, caches, queries(layer, caches, req, positions), q, sink)
            comps.update(kernels)
            if same:
                out["packed_equals_bf16"] = same
            errors.extend(f"{label} {c}: packed FP4 output differs from the BF16 path on the decoded values"
                          for c, ok in same.items() if not ok)
        except Exception as exc:
            errors.append(f"{label} kernels setup: {_describe(exc)}")
    return comps, out


def run_point(layer: Layer, caches: Caches, req: Tensor, positions: Tensor, cap_s: float,
              copy_gbs: float | None, errors: list[str], *, graph: bool = False, whole_step: bool = True,
              skipped: list[str] | None = None, deadline: float = math.inf) -> dict:
    """All components of one step: query i of request req[i] at positions[i] (decode: one query
    per request; prefill: one request), then (`whole_step`) the step eagerly and (`graph`) as a CUDA
    graph; failures are recorded in `errors`, parts past `deadline` in `skipped`."""
    skipped = [] if skipped is None else skipped
    dev, N = positions.device, int(positions.numel())
    label = f"N={N}"
    comps, out = step_components(layer, caches, req, positions, errors)
    distinct, n_vis = out["distinct_experts"], out["visible_entries"]
    nbytes = step_bytes(layer, N, n_vis, distinct)
    for name, fn in comps.items():
        out[name] = attempt(f"{label} {name}", lambda: timed(fn, cap_s, dev, nbytes[name], copy_gbs),
                            errors, skipped, deadline)
    step = [c for c in STEP_PARTS if "median_us" in out.get(c, {})]
    out["layer_us_sum"] = sum(out[c]["median_us"] for c in step)
    if whole_step:
        out |= step_timing({c: comps[c] for c in step}, nbytes, cap_s, dev, copy_gbs, graph, label, errors,
                           skipped, deadline)
    return out


#: Keys every decode row carries (`decode_row_problems`).
ROW_KEYS = ("tokens", "distinct_experts", "visible_entries", "layer_us_sum", "eager", "graph", "layer_us_eager",
            "layer_us_graph", "graph_excluded")


def failed_row(N: int, error: str) -> dict:
    """The decode row of a point whose set-up (before any part) failed: every key, no timing."""
    failed = dict(error=error)
    return dict(tokens=N, distinct_experts=None, visible_entries=None, layer_us_sum=0.0, eager=failed, graph=failed,
                layer_us_eager=None, layer_us_graph=None, graph_excluded={})


def decode_row_problems(row: Mapping) -> list[str]:
    """Schema check of one decode row (what `main` writes): [] when well formed."""
    problems = [f"missing key {k}" for k in ROW_KEYS if k not in row]
    for name in (*STEP_PARTS, "torch_fp64", "attention_bf16", "indexer_bf16", "eager", "graph"):
        part = row.get(name)
        if part is None:
            continue
        if not isinstance(part, Mapping) or not ({"median_us", "error", "skipped"} & part.keys()):
            problems.append(f"{name}: neither a timing nor an error nor a skip note")
        elif "median_us" in part and not ({"reps", "bytes"} <= part.keys()):
            problems.append(f"{name}: timing without reps/bytes")
    for key, part in (("layer_us_eager", "eager"), ("layer_us_graph", "graph")):
        if key in row and row[key] != (row.get(part) or {}).get("median_us"):
            problems.append(f"{key} is not {part}.median_us")
    graph = row.get("graph") or {}
    if "median_us" in graph and not ({"parts", "excluded"} <= graph.keys()):
        problems.append("graph timing without parts/excluded")
    if "median_us" in graph and set(graph["parts"]) & set(graph["excluded"]):
        problems.append("a part is both graphed and excluded")
    return problems


PATHS = {"torch": "NOT a fast path: reference torch code (mHC, projections, compressor, indexer query, "
                  "router, shared expert), dense products on tensor cores (dense_ops: BF16 weight copies, "
                  "fixed row blocks), everything else unfused torch incl. float64 elementwise math",
         "torch_fp64": "the same with float64 GEMMs on fp32-dequantised weights (CPU path); not in the step",
         "attention": "Triton sparse_sink_attention: BF16 SWA rows + packed FP4 latents (PackedSource, 288 B/entry, "
                      "decoded in the kernel) — the runtime's phase-2 format",
         "indexer": "Triton index_scores (float64 head sum) over packed FP4 keys (PackedSource, 68 B/entry) + "
                    "torch top-k over the full static width C/ratio",
         "attention_bf16": "same kernel over BF16 copies of the decoded latents (pre-packing format; full run only)",
         "indexer_bf16": "same kernel over BF16 copies of the decoded keys (pre-packing format; full run only)",
         "moe_routed": "Triton matmul_ogs MXFP4 W4A16 (the design's format)",
         "eager": "torch + indexer + attention + moe_routed called in order, eager launches, one timed region",
         "graph": "the same calls captured in one torch.cuda.CUDAGraph (side-stream warm-up), replay timed; "
                  "parts that cannot be captured are listed in graph_excluded and left out",
         "not_measured": "the indexer selection feeding attention and attention feeding the output projection "
                         "inside the step (static stand-ins); Engram; the LM head; SGLang scheduling; "
                         "the runtime's cache writes"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    ap.add_argument("--batches", type=int, nargs="+")
    ap.add_argument("--context", type=int, default=CONTEXT)
    ap.add_argument("--layer", type=int, default=2)
    ap.add_argument("--quick", action="store_true",
                    help="batches 1 and 64, shorter caps, no BF16 variants, no prefill (< 2 min)")
    ap.add_argument("--no-prefill", action="store_true")
    ap.add_argument("--no-graph", action="store_true", help="eager timings only")
    ap.add_argument("--budget-s", type=float,
                    help=f"wall budget (default {BUDGET_S:.0f} s, quick {QUICK_BUDGET_S:.0f} s)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/decode_step.py needs a CUDA GPU")
    t_start = time.perf_counter()
    deadline = t_start + (args.budget_s or (QUICK_BUDGET_S if args.quick else BUDGET_S))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from device_bandwidth import copy_bandwidth_gbs
    torch.backends.cuda.matmul.allow_tf32 = False        # the dense backend's fp32 GEMMs need it off
    dev = torch.device("cuda")
    batches = args.batches or (QUICK_BATCHES if args.quick else BATCHES)
    cap = QUICK_CAP_S if args.quick else CAP_S
    cfg = DeepseekV41Config.from_dict(flash_config_dict())
    props = torch.cuda.get_device_properties(dev)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "decode_step.json"
    try:
        layer = build_layer(cfg, args.layer, dev)
        caches = make_caches(layer, max(batches), args.context, dev, bf16_copies=not args.quick)
        copy_gbs = copy_bandwidth_gbs(dev)
    except Exception as exc:     # nothing can be measured: record why and stop
        path.write_text(json.dumps(dict(device=props.name, layer=args.layer, errors=[f"setup: {_describe(exc)}"],
                                        traceback=traceback.format_exc(limit=6)), indent=2))
        print(f"setup failed: {_describe(exc)} (wrote {path})")
        return 1
    print(f"layer {args.layer} built ({time.perf_counter() - t_start:.0f} s); copy bandwidth {copy_gbs:.0f} GB/s", flush=True)
    errors: list[str] = []
    skipped: list[str] = []
    rows = []
    for N in batches:
        pos = torch.full((N,), args.context - 1, dtype=torch.long, device=dev)
        try:
            rows.append(run_point(layer, caches, torch.arange(N, device=dev), pos, cap, copy_gbs, errors,
                                  graph=not args.no_graph, skipped=skipped, deadline=deadline))
        except Exception as exc:          # the point's own set-up failed (its parts record their own errors)
            errors.append(f"N={N} set-up: {_describe(exc)}")
            rows.append(failed_row(N, _describe(exc)))
        r = rows[-1]
        errors.extend(f"N={N} row: {p}" for p in decode_row_problems(r))
        parts = "  ".join(f"{c} {r[c]['median_us']:.0f}" for c in STEP_PARTS if "median_us" in r.get(c, {}))
        print(f"N={N:4d} µs: {parts}  | step eager {r['layer_us_eager'] or float('nan'):.0f}  graph "
              f"{r['layer_us_graph'] or float('nan'):.0f}  excluded {list(r['graph_excluded']) or 'none'}", flush=True)
    del caches
    torch.cuda.empty_cache()
    prefill = None
    if not (args.quick or args.no_prefill):
        pos = torch.arange(PREFILL_TOKENS, device=dev)

        def run_prefill() -> dict:
            pc = make_caches(layer, 1, PREFILL_TOKENS, dev, seed=2)
            p = run_point(layer, pc, torch.zeros_like(pos), pos, cap, copy_gbs, errors, whole_step=False,
                          skipped=skipped, deadline=deadline)
            return p | dict(tokens_per_s=PREFILL_TOKENS / (p["layer_us_sum"] * 1e-6) if p["layer_us_sum"] else None)
        prefill = attempt("prefill", run_prefill, errors, skipped, deadline)
    result = dict(device=props.name, torch=torch.__version__, python=platform.python_version(),
                  layer=args.layer, role=dataclasses.asdict(layer.role), context=args.context,
                  copy_bandwidth_gbs=copy_gbs, stored_layer_bytes=layer.stored_bytes,
                  kv_format=dict(row_bytes=CompressedRowLayout.from_config(cfg.text).row_bytes,
                                 latent_entry_bytes=latent_bytes(cfg.text.head_dim),
                                 key_entry_bytes=key_bytes(cfg.text.index_head_dim), swa="bf16 rows"),
                  timing=(f"CUDA events, 256 MB L2 flush before every call, median of ≤{MAX_REPS} calls within "
                          f"~{cap} s per region; eager components, the whole step eager (layer_us_eager) and as one "
                          "CUDA graph replay (layer_us_graph)"),
                  bytes=("current = what these implementations read (BF16 dense weight copies, BF16 SWA rows, "
                         "packed FP4 latents/keys); design = stored formats (FP8/MXFP4 weights), FP8 SWA rows, "
                         "packed FP4 latents/keys"),
                  paths=PATHS, decode=rows, prefill=prefill, errors=errors, skipped=skipped,
                  graph_capture_failures=[f"N={r['tokens']} {n}: {e}" for r in rows
                                          for n, e in r["graph_excluded"].items()],
                  wall_s=time.perf_counter() - t_start)
    path.write_text(json.dumps(result, indent=2))
    try:
        plot(rows, args.out / "decode_step.png", props.name)
    except Exception as exc:
        errors.append(f"plot: {_describe(exc)}")
        path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path} ({result['wall_s']:.0f} s); skipped: {skipped or 'none'}; "
          f"graph exclusions: {result['graph_capture_failures'] or 'none'}; errors: {errors or 'none'}")
    return 1 if errors else 0


def plot(rows: list[dict], path: Path, device_name: str) -> None:
    """Left: eager components stacked per N; right: the whole step eager vs CUDA graph per N, with
    the fraction of copy bandwidth (current bytes) over each bar ("partial": a part was excluded)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    labels = [str(r["tokens"]) for r in rows]
    bottom = [0.0] * len(rows)
    for c in STEP_PARTS:
        us = [r.get(c, {}).get("median_us", 0.0) for r in rows]
        ax.bar(labels, us, bottom=bottom, label=c)
        bottom = [b + u for b, u in zip(bottom, us)]
    ax.set(xlabel="decode batch N", ylabel="µs per layer (stacked)", title="components, eager")
    ax.legend(fontsize=8)
    width = 0.4
    for k, (key, name) in enumerate((("eager", "eager"), ("graph", "CUDA graph"))):
        xs = [i + (k - 0.5) * width for i in range(len(rows))]
        us = [(r.get(key) or {}).get("median_us") or 0.0 for r in rows]
        ax2.bar(xs, us, width, label=name)
        for x, u, r in zip(xs, us, rows):
            frac = (r.get(key) or {}).get("fraction_of_copy_bw", {}).get("current")
            partial = " partial" if key == "graph" and r.get("graph_excluded") else ""
            if u and frac is not None:
                ax2.annotate(f"{100 * frac:.0f}%{partial}", (x, u), ha="center", va="bottom", fontsize=7)
    ax2.set(xticks=list(range(len(rows))), xticklabels=labels, yscale="log", xlabel="decode batch N",
            ylabel="µs per layer step", title="whole step: eager vs graph (% of copy bandwidth)")
    ax2.legend(fontsize=8)
    fig.suptitle(f"{device_name}: one Flash layer, decode step")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())

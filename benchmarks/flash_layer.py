"""One full-width DeepSeek-V4.1-Flash layer in the stored formats, its caches, and the callables of its decode step (issue 3).

The layer (`build_layer`) is built directly on the device with valid random weights **in the
stored formats** of the checkpoint (spec §2.3: FP8 E4M3 with UE8M0 32×32 tile scales via
`codecs.quantize_fp8_block`, MXFP4 experts = random E2M1 bytes with UE8M0 group scales, BF16/FP32
rest; shapes and kinds from `names.tensor_inventory`; every tensor checked with
`loader.stored_problem`), then loaded the way the CUDA runtime loads it: FP8 dense weights kept
E4M3 + fp32 tile scales (`runtime.weights.stored_fp8_dense`, multiplied by `kernels.fp8_linear`),
the other dense tensors dequantised to fp32 (`loader.logical_tensor`), routed experts kept MXFP4
in the kernel layout (`runtime.weights.prepare_layer_experts`).

Caches (`make_caches`) are the runtime's formats (phase-2 contracts §1–§5): BF16 SWA rows, and
the layer's kv source as **packed FP4 entries** in two uint8 per-token row buffers, as the pool
holds them (`runtime.kv_layout.encode_entries` / `write_source_entries`,
`CompressedRowLayout.from_config`; 288 B latent part in the latent rows + 68 B index-key part in
the index-key rows per entry), read by the kernels through `kernels.packed_rows.PackedSource`
(attention: the latent rows, indexer: the key rows) with entry indices.

The step's components (`step_components`), each a callable on fixed inputs:

* `torch` (`torch_work`) — everything the layer does apart from the kernels below, as the CUDA
  runtime does it: mHC ×2 through `runtime.mhc_ops` (fused Triton kernels on CUDA), q/kv
  projections, compressor, latent/key FP4 round trips, indexer query, output projection, router
  and shared expert through the runtime's math (`runtime.attention_math`, `runtime.moe_ops`) on
  the layer's compute backend (`runtime.backend`: on CUDA `TritonBackend` as the server builds it
  — FP8 linears `w8a8_fold` unless SGLANG_DSV41_FP8_GEMM says otherwise, BF16 tensor-core products, one Triton
  launch per elementwise chain); the glue is still torch;
* `torch_<other>` (CUDA) — the same work with the first other FP8 arithmetic of
  `backend.FP8_GEMMS` (`torch_w8a8_f16` beside the `w8a8_fold` default) on the same weights, so one run
  compares both;
* `torch_fp64` — the same work on the exact torch backend (float64 GEMMs, the deterministic tier;
  CPU layers only: E4M3 weights have no fp32 copy);
* `moe_routed` — `kernels.moe_mxfp4.routed_experts_mxfp4` (MXFP4 W4A16) on the router's choice
  (CPU: the reference routed experts);
* `attention` / `indexer` (CUDA, `kernel_components`) — Triton `sparse_sink_attention` (split-KV
  `plan_decode_config`, the serving default; one key split with SGLANG_DSV41_ATTN_SPLITS=one) over the
  BF16 SWA rows + 512 selected packed entries per query (at prefill, the serving default
  SGLANG_DSV41_ATTN_PREFILL=bf16: over the runtime's BF16 workspace of the decoded entries,
  `runtime.attention_prefill`, its decode timed with it, launched with `plan_prefill_config`), and
  Triton `index_scores` (float64 head sum, or fp32 with
  SGLANG_DSV41_INDEXER_HEAD_SUM=fp32) over the packed keys + `select_for_role`;
* `attention_bf16` / `indexer_bf16` — the same kernels over BF16 copies of the decoded entries,
  when the caches hold them; `kernel_components` reports whether the packed outputs equal them
  (attention within 2 BF16 ulps of the output scale, index scores bitwise).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import sys
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor

from sglang_dsv41.checkpoint.codecs import TILE, quantize_fp8_block
from sglang_dsv41.checkpoint.loader import logical_tensor, stored_problem
from sglang_dsv41.checkpoint.names import Kind, TensorSpec, tensor_inventory
from sglang_dsv41.config import DeepseekV41Config, LayerRole
from sglang_dsv41.kernels.packed_rows import PackedSource
from sglang_dsv41.numerics import rounding as ops
from sglang_dsv41.numerics.geometry import softmax_scale, visible_counts
from sglang_dsv41.numerics.profile import CacheProfile
from sglang_dsv41.numerics.rope import layer_inv_freq
from sglang_dsv41.runtime.attention_math import (index_query, output_projection, pair_scores, project_q_kv,
                                                 rope_entry_values, swa_cache_roundtrip)
from sglang_dsv41.runtime.backend import FP8_GEMMS, ComputeBackend, ExactTorchBackend, backend_for
from sglang_dsv41.runtime.kv_layout import (CompressedRowLayout, decode_entry_keys, decode_entry_latents,
                                            encode_entries, write_source_entries)
from sglang_dsv41.runtime.indexer_select import select_for_role
from sglang_dsv41.runtime.triton_backend import TritonBackend
from sglang_dsv41.runtime.mhc_ops import mhc_for
from sglang_dsv41.runtime.moe_ops import Routing, route, routed_expert, shared_expert
from sglang_dsv41.runtime.parallel_linear import is_parallel_linear, linear_values, with_parallel_linears
from sglang_dsv41.runtime.stacked_linear import SHARED_STACKED, stack_attention_inputs, stack_shared_expert
from sglang_dsv41.runtime.quant_methods import apply_linear
from sglang_dsv41.runtime.tensor_parallel import SINGLE

if str(Path(__file__).resolve().parent) not in sys.path:   # sibling benchmark modules (loaded by path too)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_timing import _describe  # noqa: E402

CACHE = CacheProfile.NONE            # the stored latent is FP4 only (no further cache round trip)
ENCODE_CHUNK = 1 << 16                   # entries encoded per chunk when filling the packed rows


# ---- the layer ---------------------------------------------------------------------------------
#: std of the random router bias: small beside the logits (std ≈ 1), so the layer spreads a batch over about as
#: many experts as uniform routing (as a load-balanced real router and the dummy weights do; `routing_spread`;
#: docs/performance.md "Session 35")
ROUTER_BIAS_STD = 0.01


def _fp32_value(spec: TensorSpec, shape, g: torch.Generator, device) -> Tensor:
    """Value rules of tests/reference_weights.py: activations stay O(1) through the layer; the router bias
    is ROUTER_BIAS_STD · randn."""
    n, randn = spec.name, (lambda *s: torch.randn(*s, generator=g, device=device))
    if "hc_" in n:
        return (randn(*shape) / math.sqrt(shape[1]) if n.endswith("_fn") else 0.5 * randn(*shape)
                if n.endswith("_base") else 0.5 + 0.5 * torch.rand(*shape, generator=g, device=device))
    if n.endswith(("gate.bias", "gate.bias_vl")):
        return ROUTER_BIAS_STD * randn(*shape)
    if n.endswith("attn_sink"):
        return 0.3 * randn(*shape)
    return 1.0 + 0.1 * randn(*shape)                     # norm weights


def _bf16_value(shape, g: torch.Generator, device) -> Tensor:
    """A BF16 weight (router, compressor, ...): randn / √fan_in, so its products stay O(1)."""
    return (torch.randn(*shape, generator=g, device=device) / math.sqrt(shape[-1])).to(torch.bfloat16)


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
            out[spec.name] = _bf16_value(shape, g, device)
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
    weights: dict                 # runtime weights (fp32 logical + RoutedExpertsMxfp4 on CUDA) and, under their
                                  # prefixes, the linears as the runtime's SGLang layers (same storage)
    stored_bytes: dict[str, int]  # by group: dense / experts / norms (stored formats)
    held_dense_bytes: int         # bytes of the dense tensors as loaded (CUDA: FP8 kept E4M3 + scales, rest fp32)
    expert_bytes: int             # stored bytes of one routed expert
    inv_freq: Tensor              # RoPE inverse frequencies on the device (made once, like the runtime)
    cached_dense_bytes: int = 0   # bytes the dense path reads (E4M3 + scales, BF16 copies, fp32 rest)
    backend: ComputeBackend | None = None  # the runtime's compute backend for the weights' device

    @property
    def text(self):
        return self.cfg.text


def build_layer(cfg: DeepseekV41Config, layer: int, device: torch.device, seed: int = 0,
                deterministic: bool | None = None) -> Layer:
    """`stored_layer` loaded like the runtime: CUDA keeps the routed experts MXFP4 (kernel layout),
    CPU dequantises them (the reference path). The backend: `backend_for(device, weights,
    deterministic)`; None = the exact backend on CPU, the serving backend on CUDA."""
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
        if spec.kind is Kind.FP8 and device.type == "cuda":      # kept E4M3 + fp32 tile scales (runtime.weights)
            from sglang_dsv41.runtime.weights import stored_fp8_dense
            kept = stored_fp8_dense(spec, stored.__getitem__, device)
            if kept is not None:
                weights.update(kept)
                held += sum(t.numel() * t.element_size() for t in kept.values())
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
    if deterministic is None:
        deterministic = device.type == "cpu"
    linears = {k: v for k, v in with_parallel_linears(weights, cfg, SINGLE.plan(t)).items() if is_parallel_linear(v)}
    stack_attention_inputs(linears, f"layers.{layer}.attn.")     # the runtime's layers over the same storage,
    stack_shared_expert(linears, f"layers.{layer}.ffn.")         # stacked as the runtime does
    weights.update(linears)
    weights.update(linear_values(linears))
    backend, cached = backend_for(device, weights, deterministic), 0
    if device.type == "cuda":
        from sglang_dsv41.runtime.dense_weights import is_dense_linear_weight
        cached = backend.dense.cache.resident_bytes() + sum(        # + the non-linear fp32 tensors the torch path reads
            v.numel() * v.element_size() for k, v in weights.items()
            if isinstance(v, Tensor) and not is_dense_linear_weight(k, v) and not k.endswith(".scale"))
    per_expert = 3 * (t.moe_intermediate_size * t.hidden_size // 2 + t.moe_intermediate_size * t.hidden_size // TILE)
    role = t.layer_roles()[layer]
    inv_freq = layer_inv_freq(t, role.ratio).to(device)
    return Layer(cfg, role, weights, by_group, held, per_expert, inv_freq, cached, backend)


# ---- inputs -----------------------------------------------------------------------------------
@dataclasses.dataclass
class Caches:
    """Request b owns token slots b·C .. b·C + C − 1 (C = context, a multiple of the ratio r).
    `swa`: BF16 SWA rows [S, D] (the runtime's format). `packed_latents` / `packed_keys`: the
    layer's kv source in the uint8 latent rows [S, latent_row_stride] / index-key rows [S,
    key_row_stride] (contracts §1–§2, only this source's columns written; entry e = slot // r
    holds the compressed position completed by slot e·r + r − 1). `latents` /
    `keys`: BF16 copies of the decoded entries at that completing slot (the BF16 variants), or None."""
    swa: Tensor
    packed_latents: PackedSource
    packed_keys: PackedSource
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
    latent_rows = torch.zeros(S, layout.latent_row_stride, dtype=torch.uint8, device=device)
    key_rows = torch.zeros(S, layout.key_row_stride, dtype=torch.uint8, device=device)
    latents = torch.zeros(S, D, dtype=torch.bfloat16, device=device) if bf16_copies else None
    keys = torch.zeros(S, Dk, dtype=torch.bfloat16, device=device) if bf16_copies else None
    n = S // src.ratio
    for e0 in range(0, n, ENCODE_CHUNK):
        e = torch.arange(e0, min(n, e0 + ENCODE_CHUNK), device=device)
        entries = encode_entries(layout, torch.randn(e.numel(), D, generator=g, device=device),
                                 torch.randn(e.numel(), Dk, generator=g, device=device))
        write_source_entries(latent_rows, key_rows, src, e, entries)
        if bf16_copies:          # decoded values are BF16-exact (kernels/packed_rows.py)
            slot = e * src.ratio + src.ratio - 1
            latents[slot] = decode_entry_latents(layout, entries).to(torch.bfloat16)
            keys[slot] = decode_entry_keys(layout, entries).to(torch.bfloat16)
    packed_latents = PackedSource(latent_rows, src.latent.offset, src.latent.share, src.ratio, D, Dk, "latent")
    packed_keys = PackedSource(key_rows, src.key.offset, src.key.share, src.ratio, D, Dk, "key")
    return Caches(swa, packed_latents, packed_keys, layout, latents, keys, context)


def queries(layer: Layer, caches: Caches, req: Tensor, positions: Tensor) -> dict[str, Tensor]:
    """Slot tables of queries of requests `req` at `positions` (request b's slots b·C..b·C+C−1)."""
    t, dev = layer.text, positions.device
    win = positions[:, None] - t.sliding_window + 1 + torch.arange(t.sliding_window, device=dev)[None, :]
    swa_slots = torch.where(win >= 0, req[:, None] * caches.context + win, -1)
    R = int(req.max()) + 1
    req_to_token = torch.arange(R * caches.context, device=dev).view(R, caches.context)
    return dict(req=req, swa_slots=swa_slots, req_to_token=req_to_token, positions=positions)


# ---- components ---------------------------------------------------------------------------------
def torch_work(layer: Layer, R: Tensor, positions: Tensor, be: ComputeBackend | None = None) -> tuple[Tensor, Routing]:
    """The layer's torch work as the runtime runs it (module docstring) on `be` (default: the
    layer's backend); returns the MoE input and its routing. The attention output is stood in for
    by q (attention is timed apart). No host sync and no host → device copy (RoPE frequencies are
    made once in `build_layer`), so it can be captured in a CUDA graph."""
    be = layer.backend if be is None else be
    t, w, i = layer.text, layer.weights, layer.role.layer
    p, pa = f"layers.{i}.", f"layers.{i}.attn."
    mhc = mhc_for(R.device)
    hc = lambda sub, R_: mhc.coefficients(R_, w[f"{p}hc_{sub}_fn"], w[f"{p}hc_{sub}_base"], w[f"{p}hc_{sub}_scale"],  # noqa: E731
                                          rms_eps=t.rms_norm_eps, hc_eps=t.hc_eps, sinkhorn_iters=t.hc_sinkhorn_iters)
    inv_freq = layer.inv_freq
    co = hc("attn", R)
    x = mhc.sublayer_input(R, co.pre, w[p + "attn_norm.weight"], t.rms_norm_eps)
    q_lora, q, kv = project_q_kv(be, t, w, pa, x, positions, inv_freq, True, t.num_attention_heads)
    swa_cache_roundtrip(be, kv, positions, inv_freq, CACHE, t.qk_rope_head_dim)
    if layer.role.computes_latents:
        a, _ = pair_scores(be, w, pa, x) if layer.role.ratio == 2 else (
            apply_linear(w[pa + "compressor.wkv"], x, be, out_fp32=True), None)
        latents = be.rms_norm(be.bf16(a), w[pa + "compressor.norm.weight"], t.rms_norm_eps)
        roped, k = rope_entry_values(be, t, w, pa, latents, positions, inv_freq)
        be.fp4_fake_quant_e4m3_scale(roped)
        be.fp4_fake_quant_ue8m0_scale(k)
    if layer.role.runs_indexer:
        index_query(be, t, w, pa, x, q_lora, positions, inv_freq, True)
    y = output_projection(be, t, w, pa, q, positions, inv_freq, True)
    R = mhc.residual_update(R, y, co)
    co_f = hc("ffn", R)
    x = mhc.sublayer_input(R, co.pre, w[p + "ffn_norm.weight"], t.rms_norm_eps)
    routing = route(be, x, w[p + "ffn.gate"], w[p + "ffn.gate.bias"], t.num_experts_per_tok)
    shared = shared_expert(be, x, w[p + "ffn.shared_experts.w1"], w[p + "ffn.shared_experts.w2"],
                           w[p + "ffn.shared_experts.w3"], t.swiglu_limit, True, w.get(p + "ffn." + SHARED_STACKED))
    mhc.residual_update(R, shared, co_f)
    return x, routing


def moe_routed(layer: Layer, x: Tensor, routing: Routing) -> Tensor:
    """Routed experts as the runtime runs them: CUDA → MXFP4 kernel; CPU → the reference."""
    t, p = layer.text, f"layers.{layer.role.layer}."
    if x.is_cuda:
        from sglang_dsv41.kernels import moe_mxfp4 as mx
        from sglang_dsv41.runtime.moe_ops import routed_experts_key
        return mx.routed_experts_mxfp4(x.to(torch.bfloat16), routing.experts, routing.weights,
                                       layer.weights[routed_experts_key(p)].prepared,
                                       swiglu_limit=t.swiglu_limit, routed_scale=t.routed_scaling_factor,
                                       check_ids=False)     # as the runtime: the router's ids are < E
    T, k = routing.experts.shape
    per_slot = torch.zeros(T, k, x.shape[1], dtype=torch.float64)
    for e in torch.unique(routing.experts).tolist():
        rows, slot = torch.nonzero(routing.experts == e, as_tuple=True)
        q = f"{p}ffn.experts.{e}."
        per_slot[rows, slot] = routed_expert(ExactTorchBackend(), x[rows], layer.weights[q + "w1.weight"],
                                             layer.weights[q + "w2.weight"], layer.weights[q + "w3.weight"],
                                             t.swiglu_limit).double()
    return ops.bf16(ops.slot_sum_fp32(routing.weights * ops.fp32_scalar(t.routed_scaling_factor), per_slot))


def kernel_components(layer: Layer, caches: Caches, qs: dict, q: Tensor, sink: Tensor, *,
                      splits: str | None = None, head_sum: str | None = None,
                      block_h: int | None = None, att_config=None) -> tuple[dict[str, Callable], dict[str, bool]]:
    """Attention and indexer through the Triton kernels on the packed rows, as the runtime calls
    them (CUDA only, no host sync), plus the BF16 variants when `caches` holds BF16 copies; and
    {component: packed output == BF16 output} for those. `splits` / `head_sum`: the runtime's kernel
    choices (`runtime.attention_ops`: SGLANG_DSV41_ATTN_SPLITS / SGLANG_DSV41_INDEXER_HEAD_SUM when
    None); `block_h` overrides the decode plan's heads per program; `att_config` (a
    `SparseAttentionConfig`) replaces the attention launch configuration (prefill sweeps)."""
    from sglang_dsv41.runtime.attention_ops import (ATTENTION_SPLITS, ATTENTION_SPLITS_ENV, INDEXER_HEAD_SUM_ENV,
                                                    INDEXER_HEAD_SUMS, head_sum_is_exact, kernel_choice)
    from sglang_dsv41.runtime import attention_prefill as AP
    splits = splits or kernel_choice(ATTENTION_SPLITS_ENV, ATTENTION_SPLITS, "decode")   # the serving default
    head_sum = head_sum or kernel_choice(INDEXER_HEAD_SUM_ENV, INDEXER_HEAD_SUMS, "auto")  # the serving default
    exact = head_sum_is_exact(head_sum, q.shape[0])     # as a batch of these queries
    prefill = AP.prefill_choice(False)                                                   # the serving default
    from sglang_dsv41.kernels import entry_index as EI
    from sglang_dsv41.kernels import indexer as K
    from sglang_dsv41.kernels import indexer_select as SEL
    from sglang_dsv41.kernels import sparse_attention as SA
    t, role, pos, req = layer.text, layer.role, qs["positions"], qs["req"]
    r = caches.packed_keys.ratio
    n_vis = visible_counts(pos, r)
    width = caches.context // r
    R = qs["req_to_token"].shape[0]
    table_args = (qs["req_to_token"], torch.arange(R, device=pos.device), torch.full((R,), width, device=pos.device),
                  r, width)
    entries = EI.entry_index_table(*table_args)
    g = torch.Generator(device=pos.device).manual_seed(7)
    iq = ops.fp4_fake_quant_ue8m0_scale(torch.randn(q.shape[0], t.index_n_heads, t.index_head_dim,
                                                    generator=g, device=pos.device))
    head_w = torch.rand(q.shape[0], t.index_n_heads, generator=g, device=pos.device) / t.index_n_heads

    # the scoring kernel's query tiles, as in the runtime (attention_ops `query_tiles`): built once per forward
    # and shared by every indexer layer, so the first call below builds them and the timed calls reuse them
    tiles: dict = {}

    key_workspace = AP.key_workspace_applies(AP.key_choice(), q.shape[0], R, width)

    def scores_packed():
        if key_workspace:    # the runtime's prefill keys: decoded once per kv source and forward (here per call)
            ws, rows = AP.key_workspace(caches.packed_keys.rows, caches.layout.source(role.kv_source).key,
                                        t.index_head_dim, entries)
            return K.index_scores(iq, head_w, ws, rows, req, n_vis, head_sum_exact=exact, check_inputs=False,
                                  tile_cache=tiles)
        return K.index_scores(iq, head_w, caches.packed_keys, entries, req, n_vis, head_sum_exact=exact,
                              check_inputs=False, tile_cache=tiles)

    def indexer():
        return select_for_role(SEL, t, role, scores_packed(), n_vis, None, check_nan=False)[0]

    sel = indexer()
    comp_entries = torch.where(sel >= 0, entries[req[:, None], sel.clamp(min=0)], -1)
    shape = (q.shape[0], t.num_attention_heads, t.head_dim, t.sliding_window, comp_entries.shape[1])
    workspace = AP.applies(prefill, q.shape[0], R, width)   # the runtime's prefill workspace path
    cfg_att = (SA.plan_prefill_config(*shape) if workspace else
               SA.plan_decode_config(*shape, SA.device_sm_count(q.device), block_h=block_h) if splits == "decode"
               else dataclasses.replace(SA.plan_config(*shape, 1), num_splits=1))
    cfg_att = att_config or cfg_att
    qb, scale = q.to(torch.bfloat16), softmax_scale(t.head_dim)

    def attention():
        return SA.sparse_sink_attention(qb, caches.swa, qs["swa_slots"], caches.packed_latents, comp_entries, sink, scale,
                                        config=cfg_att)
    if workspace:                                             # decoded per call, as once per forward in the runtime
        latent_cols = caches.layout.source(role.kv_source).latent

        def attention():
            ws = AP.latent_workspace(caches.packed_latents.rows, latent_cols, t.head_dim, entries)
            return SA.sparse_sink_attention(qb, caches.swa, qs["swa_slots"], ws, AP.workspace_rows(req, sel, width),
                                            sink, scale, config=cfg_att)
    if workspace and prefill == "wide" and att_config is None:   # every head of a query in one program
        from sglang_dsv41.kernels import sparse_attention_prefill as SAP

        def attention():
            ws = AP.latent_workspace(caches.packed_latents.rows, latent_cols, t.head_dim, entries)
            return SAP.prefill_sink_attention(qb, caches.swa, qs["swa_slots"], ws, AP.workspace_rows(req, sel, width),
                                              sink, scale)
    if workspace and prefill == "flashmla":                   # one FlashMLA launch over [SWA block | workspace]
        from sglang_dsv41.runtime import attention_flashmla as FM
        fm_plan = FM.plan_flashmla(t.num_attention_heads, t.head_dim, torch.cuda.get_device_capability(q.device))
        if fm_plan.mode == "bf16":
            raise RuntimeError(f"SGLANG_DSV41_ATTN_PREFILL=flashmla: the kernel cannot take this layer ({fm_plan.reason})")
        fm_kernel, starts = FM.load_kernel(), torch.searchsorted(req, torch.arange(R, device=req.device))

        def attention():
            ws = AP.latent_workspace(caches.packed_latents.rows, latent_cols, t.head_dim, entries)
            inputs = FM.prefill_inputs(ws, req, starts, qs["swa_slots"], AP.workspace_rows(req, sel, width))
            return FM.attend(fm_kernel, fm_plan, qb, sink, caches.swa, inputs, scale)
    comps: dict[str, Callable] = {"attention": attention, "indexer": indexer}
    if not workspace:                                         # the opt-ins SGLANG_DSV41_ATTN_DECODE=flashmla / gather
        comps["attention_flashmla"] = lambda: _flashmla_decode(t, qb, sink, caches, qs["swa_slots"], comp_entries,
                                                               scale)

        def attention_gather():
            from sglang_dsv41.kernels.key_gather import gather_latent_rows
            rows, slots = gather_latent_rows(caches.packed_latents, comp_entries)
            return SA.sparse_sink_attention(qb, caches.swa, qs["swa_slots"], rows, slots, sink, scale, config=cfg_att)
        comps["attention_gather"] = attention_gather
    if caches.latents is None:
        return comps, {}
    slots = EI.entry_slot_table(*table_args)                      # where the BF16 copy of entry e lives
    comp_slots = torch.where(comp_entries >= 0, comp_entries * r + r - 1, -1)

    def scores_bf16():
        return K.index_scores(iq, head_w, caches.keys, slots, req, n_vis, head_sum_exact=exact, check_inputs=False,
                              tile_cache=tiles)

    def attention_bf16():
        return SA.sparse_sink_attention(qb, caches.swa, qs["swa_slots"], caches.latents, comp_slots, sink, scale,
                                        config=cfg_att)
    comps["attention_bf16"] = attention_bf16
    comps["indexer_bf16"] = lambda: select_for_role(SEL, t, role, scores_bf16(), n_vis, None, check_nan=False)[0]
    same = {"attention": _within_two_bf16_ulps(attention(), attention_bf16()),
            "indexer": torch.equal(scores_packed(), scores_bf16())}
    return comps, same


def _flashmla_decode(t, qb: Tensor, sink: Tensor, caches: Caches, swa_slots: Tensor, comp_entries: Tensor,
                     scale: float) -> Tensor:
    """The decode attention as `attention_flashmla.decode_attend` runs it (a device or sgl-kernel
    without the kernel raises, recorded by the caller)."""
    from sglang_dsv41.runtime import attention_flashmla as FM
    plan, kernel = _flashmla_planned(t.num_attention_heads, t.head_dim, torch.cuda.get_device_capability(qb.device))
    return FM.decode_attend(kernel, plan, qb, sink, caches.swa, swa_slots, caches.packed_latents, comp_entries, scale)


@functools.lru_cache(maxsize=None)
def _flashmla_planned(heads: int, head_dim: int, capability: tuple[int, int]):
    """(plan, kernel) of `attention_flashmla`, once per shape and device, as the runtime plans at start-up."""
    from sglang_dsv41.runtime import attention_flashmla as FM
    plan = FM.plan_flashmla(heads, head_dim, capability)
    if plan.mode == "bf16":
        raise RuntimeError(f"flashmla decode: the kernel cannot take this layer ({plan.reason})")
    return plan, FM.load_kernel()


def _within_two_bf16_ulps(got: Tensor, want: Tensor) -> bool:
    """The packed and BF16 attention kernels are different binaries, measured on the H200 to agree
    within one BF16 ulp of the output scale (max |o| per query and head), not bit for bit
    (tests/test_kernels_sparse_attention.py states ≤ 2); the index scores are bitwise equal."""
    scale = want.float().abs().amax(dim=-1, keepdim=True).clamp(min=2.0 ** -126)
    ulp = torch.exp2(torch.floor(torch.log2(scale)) - 7)
    return bool(((got.float() - want.float()).abs() <= 2 * ulp).all())


def step_components(layer: Layer, caches: Caches, req: Tensor, positions: Tensor,
                    errors: list[str]) -> tuple[dict[str, Callable[[], object]], dict]:
    """The callables of one step (`torch` work, `moe_routed`, and on CUDA the kernels `indexer` /
    `attention` and their BF16 variants) on fixed random inputs, and the point's metadata row
    (tokens, distinct experts, visible entries, packed-vs-BF16 check); kernel set-up failures go to
    `errors`. Shared by `run_point` and benchmarks/decode_step_profile.py."""
    t, dev, N = layer.text, positions.device, int(positions.numel())
    label = f"N={N}"
    g = torch.Generator(device=dev).manual_seed(N)
    R = ops.bf16(torch.randn(N, t.hc_mult, t.hidden_size, generator=g, device=dev)).to(mhc_for(dev).residual_dtype)
    x, routing = torch_work(layer, R, positions)
    q = ops.bf16(torch.randn(N, t.num_attention_heads, t.head_dim, generator=g, device=dev))
    sink = layer.weights[f"layers.{layer.role.layer}.attn.attn_sink"]
    comps: dict[str, Callable] = {"torch": lambda: torch_work(layer, R, positions),
                                  "moe_routed": lambda: moe_routed(layer, x, routing)}
    if dev.type == "cuda":
        comps["torch_fp64"] = lambda: torch_work(layer, R, positions, ExactTorchBackend())
        if layer.backend.dense.cache.fp8_elements:     # E4M3 weights: no fp32 copy for the float64 GEMMs
            del comps["torch_fp64"]
        if isinstance(layer.backend, TritonBackend):   # the other FP8 arithmetic on the same weights
            other = next(m for m in FP8_GEMMS if m != layer.backend.fp8_gemm)
            alt = TritonBackend(layer.backend.dense, fp8_gemm=other)
            comps[f"torch_{other}"] = lambda: torch_work(layer, R, positions, alt)
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

"""Decode-step benchmark of one full-width DeepSeek-V4.1-Flash layer, per component and as one CUDA graph (issue 3).

The layer (default: layer 2 — ratio 2, kv source, runs the indexer, so every component is on the
path), built in the checkpoint's stored formats and loaded the way the CUDA runtime loads it, its
caches in the runtime's formats (BF16 SWA rows, packed FP4 entries) and the step's components
come from `flash_layer.py` (its docstring says how); timing and the CUDA graph from
`step_timing.py`.

Per decode batch N ∈ {1, 8, 64, 256} (one query per request at position C − 1, C = context), it
times what the runtime runs on CUDA for that layer:

* `attention` — Triton `sparse_sink_attention` (one key split) over BF16 SWA rows (W = 128) +
  512 selected packed entries per query (`comp_cache=PackedSource`, `comp_slots` = entries);
* `indexer` — Triton `index_scores` (float64 head sum) over the packed keys of C/2 entries
  (`key_cache=PackedSource`, `entry_index_table`) + `select_for_role`;
* `moe_routed` — `kernels.moe_mxfp4.routed_experts_mxfp4` (MXFP4 W4A16) on the router's choice;
* `torch` — everything else the layer does, as the CUDA runtime does it today (the runtime's
  math on the serving backend: FP8 linears on the serving default (`w8a8_fold`: kernels.fp8_w8a8, exact-product
  MMAs, ≤ 16 rows on kernels.fp8_fold) —
  SGLANG_DSV41_FP8_GEMM=w8a16 / fp8_mma picks another —, fused elementwise kernels, torch glue; unfused) — *not* a fast path;
* `torch_w8a16` (or, when that is the step's, `torch_tiered`) — the same work with the W8A16
  kernel `kernels.fp8_linear` (session 7's decode default) on the same weights (before / after
  in one run; not in the step);
* `torch_fp64` — the same work with the reference's float64 GEMMs (CPU layers only), for comparison;
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

With `--variants`, the kernel choices of issue 21 are timed old against new per N (`kernel_variants.py`:
attention split-KV, fp32 indexer head sum, MoE launch flags, FP8 modes, the whole step) into
`decode_step_variants.json`. With `--profile`, the graphed step is also broken down by component for every --profile-fp8 mode
(`step_profile.py`: dense linears by name, attention, indexer, compressor, experts, mHC, norms,
launch gaps) into `decode_step_profile_graph.json` / `.png`.

    python benchmarks/decode_step.py [--quick] [--batches 1 8 64 256] [--context 8192] [--layer 2] [--variants] [--profile]
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import platform
import sys
import time
import traceback
from pathlib import Path
from typing import Mapping

import torch
from torch import Tensor

from sglang_dsv41.config import DeepseekV41Config
from sglang_dsv41.presets import flash_config_dict
from sglang_dsv41.runtime.backend import FP8_GEMMS
from sglang_dsv41.runtime.kv_layout import CompressedRowLayout, key_bytes, latent_bytes

if str(Path(__file__).resolve().parent) not in sys.path:   # sibling benchmark modules (loaded by path too)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from flash_layer import (Caches, Layer, build_layer, make_caches, moe_routed, queries,  # noqa: E402
                         step_components, stored_layer)
from plotting import pyplot, save_png  # noqa: E402
from step_timing import (BUDGET_NOTE, GRAPH_WARMUP_CALLS, MAX_REPS, _describe, attempt, capture_graph,  # noqa: E402
                         graph_of, settle_after_failed_capture, step_timing, timed)

#: This script's public names, and those of flash_layer.py / step_timing.py that the tests and
#: decode_step_profile.py use from it (re-exported).
__all__ = ["ALT_TORCH", "BATCHES", "QUICK_BATCHES", "CONTEXT", "PREFILL_TOKENS", "CAP_S", "QUICK_CAP_S", "BUDGET_S",
           "QUICK_BUDGET_S", "STEP_PARTS", "SLOT_ID_BYTES", "ROW_KEYS", "PATHS", "step_bytes", "run_point",
           "failed_row", "decode_row_problems", "main", "plot", "DeepseekV41Config", "flash_config_dict",
           "Caches", "Layer", "build_layer", "make_caches", "moe_routed", "queries", "step_components", "stored_layer",
           "BUDGET_NOTE", "GRAPH_WARMUP_CALLS", "MAX_REPS", "capture_graph", "graph_of", "settle_after_failed_capture"]

BATCHES = (1, 8, 64, 256)
QUICK_BATCHES = (1, 64)
CONTEXT, PREFILL_TOKENS = 8192, 8192
CAP_S, QUICK_CAP_S = 2.0, 0.5
BUDGET_S, QUICK_BUDGET_S = 225.0, 105.0   # wall budgets (full < 4 min, quick < 2 min incl. start-up)
STEP_PARTS = ("torch", "indexer", "attention", "moe_routed")   # one decode step of the layer, in order
SLOT_ID_BYTES = 8                        # int64 slot / entry ids, as passed to the kernels
ALT_TORCH = tuple(f"torch_{m}" for m in FP8_GEMMS)   # `torch` with either FP8 arithmetic (one is the step's)


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
    packed_attention = dict(current=N * (att_fixed + W * D * 2 + k * latent_bytes(D)), design=att_design)
    return {"attention": packed_attention,
            # the opt-ins read the same packed entries (their BF16 copies are transient)
            "attention_flashmla": dict(packed_attention), "attention_gather": dict(packed_attention),
            "attention_bf16": dict(current=N * (att_fixed + (W + k) * D * 2), design=att_design),
            "indexer": dict(current=idx_packed, design=idx_packed),
            "indexer_bf16": dict(current=N * (idx_fixed + n_visible * Dk * 2), design=idx_packed),
            "moe_routed": dict(current=experts, design=experts),
            "torch": dict(current=layer.cached_dense_bytes or layer.held_dense_bytes, design=dense_stored),
            "torch_fp64": dict(current=layer.held_dense_bytes, design=dense_stored),
            **{f"torch_{m}": dict(current=layer.cached_dense_bytes or layer.held_dense_bytes, design=dense_stored)
               for m in FP8_GEMMS}}


# ---- one point ----------------------------------------------------------------------------------
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
    for name in (*STEP_PARTS, *ALT_TORCH, "torch_fp64", "attention_bf16", "indexer_bf16", "eager", "graph"):
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


PATHS = {"torch": "NOT a fast path: the runtime's math (mHC kernels, projections, compressor, indexer query, "
                  "router, shared expert) on the serving backend: FP8 linears by fp8_gemm (W8A8 default), BF16 "
                  "products on tensor cores (dense_ops), fused elementwise kernels, unfused torch glue in fp32",
         "torch_w8a16": "torch with the W8A16 FP8 linears (kernels.fp8_linear, wo_a one launch per group): before",
         "torch_tiered": "torch with the tiered FP8 linears (kernels.fp8_w8a8, wo_a one grouped launch): after",
         "torch_fp8_mma": "torch with the fp8_mma FP8 linears (tiered with the mid row tier on FP8 wgmma)",
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


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be ≥ 1, got {value}")
    return value


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
    ap.add_argument("--profile", action="store_true",
                    help="also profile the graphed step by component (step_profile.py): "
                         "decode_step_profile_graph.json / .png")
    ap.add_argument("--profile-fp8", nargs="+", default=["w8a8_fold", "w8a8_f16"], choices=FP8_GEMMS,
                    help="FP8 linear modes the profile runs (default: w8a8_fold w8a8_f16)")
    ap.add_argument("--profile-prefill", action="store_true",
                    help="also profile one --prefill-tokens prefill by component for every --prefill-variants entry "
                         "(prefill_profile.py): prefill_profile.json / .png")
    ap.add_argument("--prefill-tokens", type=_positive, default=PREFILL_TOKENS,
                    help=f"tokens of the timed and profiled prefill (default {PREFILL_TOKENS}; e.g. 1024: a short prompt)")
    ap.add_argument("--prefill-variants", nargs="+",
                    help="prefill_profile.VARIANTS names (default: prefill_profile.DEFAULT_VARIANTS)")
    ap.add_argument("--no-decode", action="store_true", help="skip the decode batches (e.g. with --profile-prefill)")
    ap.add_argument("--variants", action="store_true",
                    help="also time the kernel choices old against new per N (kernel_variants.py): "
                         "decode_step_variants.json")
    ap.add_argument("--budget-s", type=float,
                    help=f"wall budget (default {BUDGET_S:.0f} s, quick {QUICK_BUDGET_S:.0f} s)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/decode_step.py needs a CUDA GPU")
    t_start = time.perf_counter()
    budget = args.budget_s or (QUICK_BUDGET_S if args.quick else BUDGET_S)
    deadline = t_start + budget
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
    for N in () if args.no_decode else batches:
        pos = torch.full((N,), args.context - 1, dtype=torch.long, device=dev)
        try:
            rows.append(run_point(layer, caches, torch.arange(N, device=dev), pos, cap, copy_gbs, errors,
                                  graph=not args.no_graph, skipped=skipped, deadline=deadline))
        except Exception as exc:          # the point's own set-up failed (its parts record their own errors)
            errors.append(f"N={N} set-up: {_describe(exc)}")
            rows.append(failed_row(N, _describe(exc)))
        r = rows[-1]
        errors.extend(f"N={N} row: {p}" for p in decode_row_problems(r))
        parts = "  ".join(f"{c} {r[c]['median_us']:.0f}" for c in (*STEP_PARTS, *ALT_TORCH)
                          if "median_us" in r.get(c, {}))
        print(f"N={N:4d} µs: {parts}  | step eager {r['layer_us_eager'] or float('nan'):.0f}  graph "
              f"{r['layer_us_graph'] or float('nan'):.0f}  excluded {list(r['graph_excluded']) or 'none'}", flush=True)
    if args.variants:
        attempt("variants", functools.partial(write_variants, layer, caches, batches, args, props.name, errors,
                                              deadline - 0.3 * budget if args.profile else deadline),
                errors, skipped, deadline)
    if args.profile:
        profile_path = attempt("profile", functools.partial(write_profile, layer, caches, batches, args, props.name, errors,
                                                               deadline),
                               errors, skipped, deadline)
        print(f"profile: {profile_path}", flush=True)
    del caches
    torch.cuda.empty_cache()
    if args.profile_prefill:
        import prefill_profile as pp
        attempt("prefill profile", functools.partial(
            pp.write_prefill_profile, layer, args.out, props.name, args.prefill_tokens, STEP_PARTS,
            args.prefill_variants or pp.DEFAULT_VARIANTS, errors, deadline), errors, skipped, deadline)
    prefill = None
    if not (args.quick or args.no_prefill):
        pos = torch.arange(args.prefill_tokens, device=dev)

        def run_prefill() -> dict:
            pc = make_caches(layer, 1, args.prefill_tokens, dev, seed=2)
            p = run_point(layer, pc, torch.zeros_like(pos), pos, cap, copy_gbs, errors, whole_step=False,
                          skipped=skipped, deadline=deadline)
            return p | dict(tokens=args.prefill_tokens,
                            tokens_per_s=args.prefill_tokens / (p["layer_us_sum"] * 1e-6) if p["layer_us_sum"] else None)
        prefill = attempt("prefill", run_prefill, errors, skipped, deadline)
    result = dict(device=props.name, torch=torch.__version__, python=platform.python_version(),
                  layer=args.layer, fp8_gemm=getattr(layer.backend, "fp8_gemm", None), role=dataclasses.asdict(layer.role), context=args.context,
                  copy_bandwidth_gbs=copy_gbs, stored_layer_bytes=layer.stored_bytes,
                  kv_format=dict(row_bytes=CompressedRowLayout.from_config(cfg.text).row_bytes,
                                 latent_row_bytes=CompressedRowLayout.from_config(cfg.text).latent_row_stride,
                                 key_row_bytes=CompressedRowLayout.from_config(cfg.text).key_row_stride,
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
        if rows:
            plot(rows, args.out / "decode_step.png", props.name)
    except Exception as exc:
        errors.append(f"plot: {_describe(exc)}")
        path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path} ({result['wall_s']:.0f} s); skipped: {skipped or 'none'}; "
          f"graph exclusions: {result['graph_capture_failures'] or 'none'}; errors: {errors or 'none'}")
    return 1 if errors else 0


def write_variants(layer: Layer, caches: Caches, batches, args, device_name: str, errors: list[str],
                   deadline: float) -> dict:
    """`--variants`: kernel_variants.run_variants at every N → decode_step_variants.json (what is
    past `deadline` is recorded as skipped)."""
    import kernel_variants as kv
    t0 = time.perf_counter()
    rows = {}
    for N in batches:
        rows[N] = kv.run_variants(layer, caches, N, args.context, errors, deadline)
        print(kv.summary_line(N, rows[N]), flush=True)
    path = args.out / "decode_step_variants.json"
    path.write_text(json.dumps(dict(device=device_name, layer=args.layer, context=args.context, method=kv.__doc__,
                                    rows=rows, wall_s=time.perf_counter() - t0), indent=1))
    return dict(path=str(path))


def write_profile(layer: Layer, caches: Caches, batches, args, device_name: str, errors: list[str],
                  deadline: float) -> dict:
    """`--profile`: step_profile.profile_rows at every N and --profile-fp8 mode → JSON (+ PNG)."""
    import step_profile as sp
    t0 = time.perf_counter()
    rows = sp.profile_rows(layer, caches, batches, args.profile_fp8, args.context, STEP_PARTS, errors,
                           deadline=deadline)
    engram = layer.role.layer in layer.text.engram_layer_ids
    result = dict(device=device_name, layer=args.layer, context=args.context, method=sp.__doc__,
                  components=sp.COMPONENTS, rows=rows, wall_s=time.perf_counter() - t0,
                  engram=("in this layer's torch part" if engram else
                          f"not in layer {args.layer}'s step (Engram layers {list(layer.text.engram_layer_ids)})"))
    path = args.out / "decode_step_profile_graph.json"
    path.write_text(json.dumps(result, indent=1))
    try:
        sp.plot(rows, args.out / "decode_step_profile_graph.png", device_name)
    except Exception as exc:
        errors.append(f"profile plot: {_describe(exc)}")
    for r in rows:
        comps = "  ".join(f"{c} {us:.0f}" for c, us in r.get("by_component", {}).items())
        print(f"profile {r['fp8_gemm']} N={r['tokens']}: span {r.get('span_us', float('nan')):.0f} µs "
              f"(events {r.get('graph_wall_us', float('nan')):.0f}) | {comps or r.get('error')}", flush=True)
    return dict(path=str(path), rows=len(rows))


def plot(rows: list[dict], path: Path, device_name: str) -> None:
    """Left: eager components stacked per N; right: the whole step eager vs CUDA graph per N, with
    the fraction of copy bandwidth (current bytes) over each bar ("partial": a part was excluded)."""
    plt = pyplot(required=True)
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
    save_png(fig, path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())

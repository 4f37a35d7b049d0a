"""Per-component profile of the graphed decode step of one Flash layer (issue 21; `decode_step.py --profile`).

What it answers: of the CUDA-graph replay time of one decode step (`decode_step.STEP_PARTS`),
how much each component takes — every dense linear by name (FP8 E4M3 or BF16), attention, the
indexer (kernel + query), the compressor, routed experts, router, shared expert, mHC, norms,
elementwise rounding / quantisation / RoPE, the remaining torch glue — and how much is launch gaps
(graph span minus the union of its kernels' device time). Engram is not in the step of a ratio-2
layer without Engram (the JSON says so; `engram` is then absent, not 0).

Method (two passes under `torch.profiler`, CUDA activity, chrome trace parsed here):
1. **eager, labelled**: the step runs once with `record_function` ranges "dsv41:<label>" around the
   runtime calls (instance attributes on the compute backend, names of `flash_layer`'s globals and
   the mHC object, all restored afterwards — nothing in `runtime/` changes). A kernel's label is
   the innermost range open on the launching thread at its launch (CPU launch time via the CUPTI
   correlation id; else the op with its "External id"), except that a `linear:` range dominates the ranges nested in it (its activation
   quantisation and rounding belong to the linear);
2. **graphed**: the same parts captured in one CUDA graph (`step_timing.capture_graph`, inside the
   trace) replayed 1 + REPLAYS times, a 256 MB L2 flush (outside the graph) before each; each
   replay's kernels (one graph-launch correlation id) sorted by start, the first replay dropped. Labels come from the eager pass by aligning the
   two kernel-name sequences (`difflib`, exact names; unmatched graph kernels → "unattributed").
Per label and component: the median over replays of the summed device µs; `gaps_us` = span − busy.
The profiler's own overhead lengthens spans a little; `graph_wall_us` (CUDA events, no profiler,
`step_timing.measure`) is the figure to compare with `decode_step.py`'s `layer_us_graph`.
"""
from __future__ import annotations

import contextlib
import difflib
import json
import math
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

import torch

PREFIX = "dsv41:"
REPLAYS = 5
DEVICE_CATS = ("kernel", "gpu_memset", "gpu_memcpy")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
#: backend primitives labelled "elementwise:<name>" / "norm"
ELEMENTWISE = ("bf16", "fp8_act_fake_quant", "fp4_fake_quant_e4m3_scale", "fp4_fake_quant_ue8m0_scale",
               "apply_rope_tail", "bf16_rope_tail", "clamped_swiglu", "route_select", "engram_gate")
#: flash_layer globals wrapped with a component label
FUNCTIONS = {"project_q_kv": "glue:qkv_proj", "swa_cache_roundtrip": "glue:swa_roundtrip",
             "pair_scores": "compressor", "rope_entry_values": "compressor", "index_query": "indexer_query",
             "output_projection": "glue:out_proj", "route": "router", "shared_expert": "shared_expert"}
#: component of a label (first matching prefix); `linear:` labels are split by weight kind
COMPONENT_OF = (("part:attention", "attention"), ("part:indexer", "indexer"), ("indexer_query", "indexer"),
                ("part:moe_routed", "moe_routed"), ("compressor", "compressor"), ("router", "router"),
                ("shared_expert", "shared_expert"), ("mhc", "mhc"), ("norm", "norms"),
                ("elementwise:", "elementwise"), ("glue:", "torch_glue"), ("part:torch", "torch_glue"))
COMPONENTS = ("dense_fp8", "dense_bf16", "attention", "indexer", "compressor", "moe_routed", "router",
              "shared_expert", "mhc", "norms", "elementwise", "torch_glue", "engram", "unattributed", "launch_gaps")


def component(label: str, fp8_linears: Iterable[str] = ()) -> str:
    """The COMPONENTS entry a label belongs to (shared-expert linears count as `shared_expert`)."""
    if label.startswith("linear:"):
        name = label[len("linear:"):]
        if "shared_experts" in name:
            return "shared_expert"
        if "engram" in name:
            return "engram"
        return "dense_fp8" if name in set(fp8_linears) else "dense_bf16"
    for prefix, comp in COMPONENT_OF:
        if label.startswith(prefix):
            return comp
    return "unattributed"


# ---- labelling the step -------------------------------------------------------------------------
def _labelled(label: str, fn: Callable) -> Callable:
    def run(*args, **kwargs):
        with torch.profiler.record_function(PREFIX + label):
            return fn(*args, **kwargs)
    return run


def weight_names(weights: Mapping[str, object], layer: int) -> dict[int, str]:
    """{id(tensor): short name} of a layer's weights ("attn.wq_a", "ffn.shared_experts.w1", ...):
    the tensors, and the parameters a linear layer's quantisation method passes to the backend."""
    prefix = f"layers.{layer}."
    items = [(k, v) for k, v in weights.items() if isinstance(v, torch.Tensor)]
    items += [(f"{k}.{leaf}", t) for k, v in weights.items() if hasattr(v, "runtime_values")
              for leaf, t in v.runtime_values().items()]
    return {id(v): k[len(prefix):].removesuffix(".weight") for k, v in items if k.startswith(prefix)}


@contextlib.contextmanager
def labels_on(backend, names: Mapping[int, str], flash_layer_module, mhc_module=None):
    """While open: the backend's linears / norms / elementwise primitives, `flash_layer`'s runtime
    functions (FUNCTIONS) and the mHC object from `mhc_for` record "dsv41:" ranges. Restored on exit."""
    patched_backend = []

    def linear(method: str):
        inner = getattr(backend, method)

        def run(x, weight, *args, **kwargs):
            with torch.profiler.record_function(PREFIX + "linear:" + names.get(id(weight), "?")):
                return inner(x, weight, *args, **kwargs)
        return run
    for method in ("linear_fp8", "linear_bf16", "linear_bf16_grouped", "linear_fp8_partial"):
        if hasattr(backend, method):
            setattr(backend, method, linear(method))
            patched_backend.append(method)
    for method in (*ELEMENTWISE, "rms_norm", "rms_norm_pair"):
        if hasattr(backend, method):
            setattr(backend, method, _labelled("norm" if method.startswith("rms_norm") else f"elementwise:{method}",
                                               getattr(backend, method)))
            patched_backend.append(method)
    saved = {n: getattr(flash_layer_module, n) for n in FUNCTIONS if hasattr(flash_layer_module, n)}
    for n, fn in saved.items():
        setattr(flash_layer_module, n, _labelled(FUNCTIONS[n], fn))
    mhc_for = getattr(flash_layer_module, "mhc_for", None)
    if mhc_for is not None:
        def labelled_mhc(*args, **kwargs):
            m = mhc_for(*args, **kwargs)
            return _MhcLabels(m)
        flash_layer_module.mhc_for = labelled_mhc
    try:
        yield
    finally:
        for method in patched_backend:
            delattr(backend, method)               # back to the class's method
        for n, fn in saved.items():
            setattr(flash_layer_module, n, fn)
        if mhc_for is not None:
            flash_layer_module.mhc_for = mhc_for


class _MhcLabels:
    """An mHC object whose three calls record "dsv41:mhc" ranges."""

    def __init__(self, inner) -> None:
        self._inner = inner

    def __getattr__(self, name):
        attr = getattr(self._inner, name)
        labelled = ("coefficients", "sublayer_input", "sublayer_inputs", "residual_update")
        return _labelled("mhc", attr) if name in labelled else attr


# ---- trace parsing ------------------------------------------------------------------------------
def _device_events(trace: Mapping) -> list[dict]:
    return [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and e.get("cat") in DEVICE_CATS]


def _launches(trace: Mapping) -> dict[int, dict]:
    return {e["args"]["correlation"]: e for e in trace.get("traceEvents", [])
            if e.get("ph") == "X" and e.get("cat") in LAUNCH_CATS and "correlation" in e.get("args", {})}


def label_at(ranges: Sequence[dict], tid, t: float) -> str:
    """The label of a launch at CPU time `t` on thread `tid` (module doc: innermost "dsv41:" range
    open at t, a `linear:` range dominating those nested in it); "unlabelled" when none is open."""
    open_ = [r for r in ranges if r.get("tid") == tid and r["ts"] <= t <= r["ts"] + r["dur"]]
    if not open_:
        return "unlabelled"
    open_.sort(key=lambda r: (r["ts"], -r["dur"]))                      # outermost first
    names = [r["name"][len(PREFIX):] for r in open_]
    linears = [n for n in names if n.startswith("linear:")]
    return linears[0] if linears else names[-1]


def labelled_kernels(trace: Mapping) -> list[tuple[str, str, float]]:
    """[(kernel name, label, device µs)] of a trace, in device start order."""
    ranges = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and e.get("cat") == "user_annotation"
              and str(e.get("name", "")).startswith(PREFIX)]
    launches = _launches(trace)
    ops = {e["args"]["External id"]: e for e in trace.get("traceEvents", [])     # fallback: the launching op
           if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation")
           and "External id" in e.get("args", {})}
    out = []
    for k in sorted(_device_events(trace), key=lambda e: e["ts"]):
        args = k.get("args", {})
        launch = launches.get(args.get("correlation")) or ops.get(args.get("External id"))
        label = label_at(ranges, launch.get("tid"), launch["ts"]) if launch else "unlabelled"
        out.append((k["name"], label, float(k["dur"])))
    return out


def graph_replays(trace: Mapping) -> list[list[dict]]:
    """Device events of each graph launch (one list per replay, by start), in launch order."""
    launches = _launches(trace)
    graph_ids = sorted((c for c, e in launches.items() if "GraphLaunch" in e.get("name", "")),
                       key=lambda c: launches[c]["ts"])
    by_corr: dict[int, list[dict]] = defaultdict(list)
    for e in _device_events(trace):
        by_corr[e.get("args", {}).get("correlation")].append(e)
    return [sorted(by_corr[c], key=lambda e: e["ts"]) for c in graph_ids if by_corr.get(c)]


def busy_span(events: Sequence[dict]) -> tuple[float, float]:
    """(union of the events' device intervals, first start → last end) in µs."""
    if not events:
        return 0.0, 0.0
    spans = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events)
    busy, (lo, hi) = 0.0, spans[0]
    for a, b in spans[1:]:
        if a > hi:
            busy, lo, hi = busy + hi - lo, a, b
        else:
            hi = max(hi, b)
    busy += hi - lo
    return busy, max(b for _, b in spans) - spans[0][0]


def align_labels(eager: Sequence[tuple[str, str, float]], graph_names: Sequence[str]) -> list[str]:
    """Labels for a graph replay's kernels by aligning its names with the labelled eager kernels."""
    out = ["unattributed"] * len(graph_names)
    sm = difflib.SequenceMatcher(None, [n for n, _, _ in eager], list(graph_names), autojunk=False)
    for a, b, size in sm.get_matching_blocks():
        for i in range(size):
            out[b + i] = eager[a + i][1]
    return out


#: kernel names kept in the JSON's per-kernel list (templated names run to kilobytes)
KERNEL_NAME_CHARS = 96


def summarise(eager: Sequence[tuple[str, str, float]], replays: Sequence[Sequence[dict]],
              fp8_linears: Iterable[str]) -> dict:
    """Per label / component µs (median over replays), span, busy, gaps and kernel counts; the first
    replay's kernels as (name, label, µs) and their count per component (where the launches go)."""
    fp8 = set(fp8_linears)
    per_label: dict[str, list[float]] = defaultdict(list)
    spans, busys, counts, matched = [], [], [], []
    first: list[tuple[dict, str]] = []                       # the first replay's (kernel, label)
    for events in replays:
        labels = align_labels(eager, [e["name"] for e in events])
        first = first or list(zip(events, labels))
        sums: dict[str, float] = defaultdict(float)
        for e, label in zip(events, labels):
            sums[label] += float(e["dur"])
        for label in set(sums) | set(per_label):
            per_label[label].append(sums.get(label, 0.0))
        busy, span = busy_span(events)
        spans.append(span)
        busys.append(busy)
        counts.append(len(events))
        matched.append(sum(label != "unattributed" for label in labels) / max(1, len(events)))
    med = {k: statistics.median(v) for k, v in per_label.items()}
    by_comp: dict[str, float] = defaultdict(float)
    for label, us in med.items():
        by_comp[component(label, fp8)] += us
    span, busy = statistics.median(spans or [0.0]), statistics.median(busys or [0.0])
    by_comp["launch_gaps"] = span - busy
    kernel_counts: dict[str, int] = defaultdict(int)
    for _, label in first:
        kernel_counts[component(label, fp8)] += 1
    eager_us: dict[str, float] = defaultdict(float)
    eager_comp: dict[str, float] = defaultdict(float)
    for _, label, us in eager:
        eager_us[label] += us
        eager_comp[component(label, fp8)] += us
    return dict(replays=len(replays), kernels_per_replay=counts, span_us=span, busy_us=busy, gaps_us=span - busy,
                matched_fraction=min(matched or [0.0]),
                by_component={c: by_comp[c] for c in COMPONENTS if c in by_comp},
                by_linear={k[len("linear:"):]: v for k, v in sorted(med.items()) if k.startswith("linear:")},
                by_label=dict(sorted(med.items(), key=lambda kv: -kv[1])),
                eager_device_us=dict(sorted(eager_us.items(), key=lambda kv: -kv[1])),
                eager_by_component={c: eager_comp[c] for c in COMPONENTS if c in eager_comp},
                eager_launches=len(eager),
                kernels_by_component={c: kernel_counts[c] for c in COMPONENTS if c in kernel_counts},
                kernels=[(str(e["name"])[:KERNEL_NAME_CHARS], label, float(e["dur"])) for e, label in first])


# ---- running it ---------------------------------------------------------------------------------
def _trace_of(run: Callable[[], None]) -> dict:
    acts = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        run()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        return json.loads(path.read_text())


def profile_step(parts: Mapping[str, Callable[[], object]], labels: Callable[[], contextlib.AbstractContextManager],
                 fp8_linears: Iterable[str], replays: int = REPLAYS) -> dict:
    """Both passes (module doc) over the step's `parts` (in order); `labels()` opens the labelling."""
    from step_timing import capture_graph, measure
    dev = torch.device("cuda")
    flush = torch.empty(64 << 20, dtype=torch.int32, device=dev)

    def eager_once():
        for name, fn in parts.items():
            with torch.profiler.record_function(PREFIX + "part:" + name):
                fn()
        torch.cuda.synchronize()
    with labels():
        eager_once()                                # warm-up (compiles, autotunes) outside the trace
        flush.zero_()
        eager = labelled_kernels(_trace_of(eager_once))
    held = []

    def capture_and_replay():          # captured inside the trace, so CUPTI sees the graph's kernels
        held.append(capture_graph(list(parts.values())))
        for _ in range(replays + 1):
            flush.zero_()
            held[0].replay()
        torch.cuda.synchronize()
    def replay_only():
        for _ in range(replays + 1):
            flush.zero_()
            held[0].replay()
        torch.cuda.synchronize()
    note = None
    try:
        trace = _trace_of(capture_and_replay)
    except Exception as exc:            # capture under the profiler refused: capture outside, replay inside
        from step_timing import _describe, settle_after_failed_capture
        settle_after_failed_capture()
        note = f"captured outside the trace ({_describe(exc)[:300]})"
        held[:] = [capture_graph(list(parts.values()))]
        trace = _trace_of(replay_only)
    replays_events = graph_replays(trace)[1:]                             # the first replay warms up
    out = summarise(eager, replays_events, fp8_linears)
    if note:
        out["capture_note"] = note
    out["graph_wall_us"] = measure(held[0].replay, 0.3, dev)["median_us"]
    if not replays_events:
        out["error"] = "no kernels of a graph launch in the trace: only eager_* figures hold"
    return out


def profile_rows(layer, caches, batches: Sequence[int], modes: Sequence[str], context: int, parts_order: Sequence[str],
                 errors: list[str], replays: int = REPLAYS, deadline: float = math.inf) -> list[dict]:
    """`profile_step` of the step (`parts_order`) at every FP8 mode × N (decode: one query per
    request at position context − 1); the mode is set on the layer's backend for the duration
    (`TritonBackend.fp8_gemm`, read per call). Points past `deadline` (time.perf_counter) are
    recorded as skipped."""
    import flash_layer
    from step_timing import _describe
    be, dev = layer.backend, torch.device("cuda")
    names = weight_names(layer.weights, layer.role.layer)
    fp8 = [names[id(v)] for v in layer.weights.values()
           if isinstance(v, torch.Tensor) and v.dtype == torch.float8_e4m3fn and id(v) in names]
    rows, saved = [], be.fp8_gemm
    try:
        for mode in modes:
            be.fp8_gemm = mode
            for N in batches:
                pos = torch.full((N,), context - 1, dtype=torch.long, device=dev)
                row = dict(fp8_gemm=mode, tokens=N)
                if time.perf_counter() > deadline:
                    rows.append(row | dict(skipped="over the wall budget"))
                    continue
                try:
                    comps, meta = flash_layer.step_components(layer, caches, torch.arange(N, device=dev), pos, errors)
                    parts = {c: comps[c] for c in parts_order if c in comps}
                    row |= dict(parts=list(parts), distinct_experts=meta.get("distinct_experts"))
                    row |= profile_step(parts, lambda: labels_on(be, names, flash_layer), fp8, replays)
                    if "error" in row:
                        errors.append(f"profile {mode} N={N}: {row['error']}")
                except Exception as exc:
                    errors.append(f"profile {mode} N={N}: {_describe(exc)}")
                    row["error"] = _describe(exc)
                rows.append(row)
                torch.cuda.empty_cache()
    finally:
        be.fp8_gemm = saved
    return rows


def plot(rows: Sequence[Mapping], path: Path, device_name: str) -> None:
    """One horizontal stacked bar per (FP8 mode, N): the graphed step by component (µs)."""
    from plotting import pyplot, save_png

    plt = pyplot(required=True)
    rows = [r for r in rows if "by_component" in r]
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(rows) + 2))
    names = [f"{r['fp8_gemm']} N={r['tokens']}" for r in rows]
    left = [0.0] * len(rows)
    cmap = plt.get_cmap("tab20")
    for i, c in enumerate(COMPONENTS):
        us = [r["by_component"].get(c, 0.0) for r in rows]
        if any(us):
            ax.barh(names, us, left=left, label=c, color=cmap(i % 20))
            left = [a + b for a, b in zip(left, us)]
    for y, r in enumerate(rows):
        ax.annotate(f"{r['span_us']:.0f} µs (events {r.get('graph_wall_us', 0):.0f})", (left[y], y), va="center",
                    fontsize=7)
    ax.set(xlabel="µs of the graphed decode step (median of replays)", title=f"{device_name}: one Flash layer")
    ax.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.12))
    save_png(fig, path, dpi=120)

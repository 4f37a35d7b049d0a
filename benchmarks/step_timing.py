"""Timing of benchmark callables and the CUDA graph of a decode step (issue 3).

`measure`: median µs (CUDA events, a 256 MB L2 flush before every call, one warm-up call, then
≤ MAX_REPS calls within a cap; CPU: wall clock); `timed` adds the bytes read and the fraction of
the device copy bandwidth they reach. `attempt` runs one part under a wall deadline and records an
exception instead of raising. `step_timing` times the whole step (its parts in order) eagerly and
as one `torch.cuda.CUDAGraph` replay (`capture_graph`: warm-up on a side stream, then capture); a
part that cannot be captured is named with its exception (`graph_of`) and the graph holds the rest.
"""
from __future__ import annotations

import statistics
import time
import traceback
from typing import Callable, Mapping, Sequence

import torch

MAX_REPS = 100
GRAPH_WARMUP_CALLS = 2
BUDGET_NOTE = "skipped: over the wall budget (--budget-s)"


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

"""Where a graphed step's time goes when kernels run on two streams (issue 21; `model_step.py --profile`).

`step_profile.py` sums each kernel's device time; with work forked to a side stream
(`runtime/overlap.py`) a sum no longer says what a shorter kernel would save. This reads one
graph replay's kernels as intervals and gives each its **exposed** time: the part of its interval
during which no other kernel of the replay runs. Shortening a kernel saves at most its exposed
time plus the idle gaps it causes; a kernel that is fully overlapped (exposed 0) saves nothing
until whatever runs beside it is shortened too. The record needs no stream ids (CUPTI may report
a graph's kernels on the launching stream), only start and end times.

Per replay: `span_us` (first start → last end), `busy_us` (union of the intervals), `sum_us` (sum of
durations), `overlap_us` = sum − busy (device time hidden by concurrency), `gaps_us` = span − busy
(no kernel running: launch latency and dependency waits). Kernels are listed in start order with
their duration and exposed time (medians over replays, matched by position; replays with a
different kernel count are dropped), and summed by kernel name.
"""
from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Callable, Mapping, Sequence

import torch

#: kernel names kept in the record (templated names run to kilobytes)
NAME_CHARS = 80


def intervals(events: Sequence[Mapping]) -> list[tuple[str, float, float]]:
    """(name, start µs, end µs) of trace events, by start."""
    out = [(str(e["name"]), float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events]
    return sorted(out, key=lambda k: (k[1], k[2]))


def _union_length(spans: Sequence[tuple[float, float]]) -> float:
    total, hi = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b <= hi:
            continue
        total += b - max(a, hi)
        hi = b
    return total


def exposed(kernels: Sequence[tuple[str, float, float]]) -> list[float]:
    """For each kernel, its duration less the time some other kernel of the list runs too."""
    out = []
    for i, (_, s, e) in enumerate(kernels):
        others = [(max(s, a), min(e, b)) for j, (_, a, b) in enumerate(kernels) if j != i and a < e and b > s]
        out.append(max(0.0, (e - s) - _union_length(others)))
    return out


def replay_summary(kernels: Sequence[tuple[str, float, float]]) -> dict:
    """span / busy / sum / overlap / gaps (µs) of one replay's kernels and each kernel's exposed time."""
    if not kernels:
        return dict(span_us=0.0, busy_us=0.0, sum_us=0.0, overlap_us=0.0, gaps_us=0.0, exposed=[])
    span = max(e for _, _, e in kernels) - kernels[0][1]
    busy = _union_length([(s, e) for _, s, e in kernels])
    total = sum(e - s for _, s, e in kernels)
    return dict(span_us=span, busy_us=busy, sum_us=total, overlap_us=total - busy, gaps_us=span - busy,
                exposed=exposed(kernels))


def summarise(replays: Sequence[Sequence[Mapping]]) -> dict:
    """Medians over the replays (module doc): the totals, the kernels in start order as
    [name, µs, exposed µs], and per kernel name [count, µs, exposed µs], largest exposed first."""
    per = [intervals(r) for r in replays if r]
    if not per:
        return dict(replays=0)
    count = statistics.mode(len(k) for k in per)
    per = [k for k in per if len(k) == count]
    sums = [replay_summary(k) for k in per]
    med = {key: round(statistics.median(s[key] for s in sums), 2)
           for key in ("span_us", "busy_us", "sum_us", "overlap_us", "gaps_us")}
    rows = []
    for i in range(count):
        name = per[0][i][0]
        dur = statistics.median(k[i][2] - k[i][1] for k in per)
        exp = statistics.median(s["exposed"][i] for s in sums)
        rows.append([name[:NAME_CHARS], round(dur, 2), round(exp, 2)])
    by_name: dict[str, list] = defaultdict(lambda: [0, 0.0, 0.0])
    for name, dur, exp in rows:
        entry = by_name[name]
        entry[0] += 1
        entry[1] = round(entry[1] + dur, 2)
        entry[2] = round(entry[2] + exp, 2)
    return dict(replays=len(per), kernels_per_replay=count, **med,
                exposed_us=round(sum(r[2] for r in rows), 2),
                by_name=dict(sorted(by_name.items(), key=lambda kv: -kv[1][2])), kernels=rows)


def profile_graph(replay: Callable[[], None], device: torch.device, replays: int = 5) -> dict:
    """`summarise` of `replays` + 1 traced replays of a captured graph (the first dropped), a
    256 MB L2 flush outside the graph before each."""
    from step_profile import _trace_of, graph_replays

    flush = torch.empty(64 << 20, dtype=torch.int32, device=device)

    def run():
        for _ in range(replays + 1):
            flush.zero_()
            replay()
        torch.cuda.synchronize(device)
    replay()
    torch.cuda.synchronize(device)
    return summarise(graph_replays(_trace_of(run))[1:])

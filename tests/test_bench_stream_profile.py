"""benchmarks/stream_profile.py on synthetic replays: exposed time per kernel, the replay totals,
medians matched by position, and the graph-replay grouping it reads (the GPU pass runs from
`model_step.py --profile` in scripts/gpu/)."""
from __future__ import annotations

import sys

import pytest

from benchmark_loader import BENCHMARKS, load_benchmark


@pytest.fixture(scope="module")
def sp():
    sys.path.insert(0, str(BENCHMARKS))
    return load_benchmark("stream_profile.py")


def _ev(name, ts, dur, corr=1):
    return dict(ph="X", cat="kernel", name=name, ts=ts, dur=dur, args=dict(correlation=corr))


def test_exposed_time_is_the_part_no_other_kernel_covers(sp) -> None:
    # main: a [0, 10], b [10, 30], c [30, 35]; side: s [5, 25] overlaps the end of a and most of b
    k = sp.intervals([_ev("a", 0, 10), _ev("b", 10, 20), _ev("c", 30, 5), _ev("s", 5, 20)])
    assert [n for n, _, _ in k] == ["a", "s", "b", "c"]
    assert sp.exposed(k) == [5.0, 0.0, 5.0, 5.0]
    r = sp.replay_summary(k)
    assert (r["span_us"], r["busy_us"], r["sum_us"], r["overlap_us"], r["gaps_us"]) == (35, 35, 55, 20, 0)


def test_nested_and_triple_overlaps_count_once(sp) -> None:
    k = sp.intervals([_ev("long", 0, 100), _ev("x", 10, 20), _ev("y", 20, 20), _ev("tail", 120, 10)])
    assert sp.exposed(k) == [70.0, 0.0, 0.0, 10.0]          # x ∪ y = [10, 40]
    r = sp.replay_summary(k)
    assert r["busy_us"] == 110 and r["gaps_us"] == 20 and r["overlap_us"] == 40


def test_summary_takes_medians_by_position_and_drops_odd_replays(sp) -> None:
    replays = [[_ev("a", 0, d), _ev("b", 50, 10)] for d in (10, 12, 14)]
    replays.append([_ev("a", 0, 10)])                                   # a different kernel count: dropped
    s = sp.summarise(replays)
    assert s["replays"] == 3 and s["kernels_per_replay"] == 2
    assert s["kernels"] == [["a", 12.0, 12.0], ["b", 10.0, 10.0]]
    assert s["span_us"] == 60 and s["gaps_us"] == 50 - 12 and s["exposed_us"] == 22.0
    assert s["by_name"] == {"a": [1, 12.0, 12.0], "b": [1, 10.0, 10.0]}
    assert sp.summarise([]) == dict(replays=0)


def test_by_name_sums_repeats_largest_exposed_first(sp) -> None:
    s = sp.summarise([[_ev("g", 0, 5), _ev("h", 5, 30), _ev("g", 35, 5), _ev("side", 36, 2)]])
    assert list(s["by_name"]) == ["h", "g", "side"]
    assert s["by_name"]["g"] == [2, 10.0, 8.0] and s["by_name"]["side"] == [1, 2.0, 0.0]


def test_graph_replays_group_kernels_by_their_graph_launch(sp) -> None:
    from step_profile import graph_replays
    launches = [dict(ph="X", cat="cuda_runtime", name="cudaGraphLaunch", ts=t, dur=1, args=dict(correlation=c))
                for t, c in ((0, 7), (100, 9))]
    kernels = [_ev("a", 10, 5, 7), _ev("s", 11, 5, 7), _ev("a", 110, 5, 9), _ev("flush", 90, 5, 8)]
    groups = graph_replays(dict(traceEvents=launches + kernels))
    assert [[e["name"] for e in g] for g in groups] == [["a", "s"], ["a"]]

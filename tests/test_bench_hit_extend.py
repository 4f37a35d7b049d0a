"""`benchmarks/hit_extend.py`'s host profile on CPU: the package grouping of source paths and one
profiled call's tables (the benchmark's forward needs the tiny checkpoint; its GPU run is
scripts/gpu/hit_extend.sh)."""
from __future__ import annotations

import time

from benchmark_loader import load_benchmark

bench = load_benchmark("hit_extend.py")


def test_package_of_groups_libraries_and_names_our_files() -> None:
    assert bench.package_of("/x/site/triton_kernels/matmul_ogs.py") == "triton_kernels"
    assert bench.package_of("/x/site/triton/runtime/jit.py") == "triton"
    assert bench.package_of("/x/site/torch/nn/modules/module.py") == "torch"
    assert bench.package_of("/work/main/sglang_dsv41/runtime/forward.py") == "sglang_dsv41/runtime/forward.py"
    assert bench.package_of("/work/main/kernels/rope.py") == "kernels/rope.py"
    assert bench.package_of("<built-in>") == "other"
    assert bench.package_of("~") == "C built-ins"           # pstats' file of torch ops and driver calls


def _busy_leaf() -> None:
    t = time.perf_counter()
    while time.perf_counter() - t < 0.02:
        pass


def _caller() -> None:
    for _ in range(3):
        _busy_leaf()


def test_host_profile_names_where_the_time_goes() -> None:
    synced = []
    got = bench.host_profile(_caller, lambda: synced.append(1), top=5)
    assert len(synced) == 2                                  # before and after the profiled call
    assert got["profiled_wall_ms"] >= 60
    leaf = next(r for r in got["by_cumulative"] if "(_busy_leaf)" in r["fn"])
    assert leaf["calls"] == 3 and leaf["cum_ms"] >= 55
    caller = next(r for r in got["by_cumulative"] if "(_caller)" in r["fn"])
    assert caller["cum_ms"] >= leaf["cum_ms"] and caller["self_ms"] < leaf["cum_ms"]
    assert len(got["by_self"]) <= 5 and sum(got["self_ms_by_package"].values()) > 55
    callers = got["callers"]                                 # the hottest self-time functions, with who called them
    leaf_callers = next(v for k, v in callers.items() if "(_busy_leaf)" in k)
    assert [c["caller"].endswith("(_caller)") for c in leaf_callers] == [True] and leaf_callers[0]["calls"] == 3
    lines = bench.summary_lines(got, rows=2)
    assert len(lines) == 3 and "self ms by package" in lines[0]

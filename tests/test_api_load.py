"""The load benchmark on the CPU server (issue 20 item 3; `benchmarks/load.py`,
docs/performance.md "Load") and the Grafana list of docs/observability.md against the metrics
that server exports afterwards (issue 20 item 4).

One `sglang-dsv41 serve` on the tiny checkpoint with ``--enable-metrics --enable-cache-report``;
`LOAD_REQUESTS` concurrent streaming chat requests with `LOAD_MAX_TOKENS` tokens each (the H200
run uses 256). Every check of the benchmark must pass: 0 lost, 0 streams without ``[DONE]``,
0 garbled, identical greedy prompts identical, shared-prefix requests with cache hits, no
request left and the pool back to its baseline afterwards.
"""
from __future__ import annotations

import json
import os
import re
import time
import urllib.request
from pathlib import Path

import pytest

from benchmark_loader import load_benchmark
from server_helpers import REQUEST_TIMEOUT_S, Server

pytestmark = pytest.mark.slow

LOAD_REQUESTS = 64
LOAD_MAX_TOKENS = 4
LOAD_WALL_BOUND_S = 240   # the burst on 2 shared cores; it must not hang
DOCS = Path(__file__).resolve().parents[1] / "docs" / "observability.md"


@pytest.fixture(scope="module")
def server(shared_servers) -> Server:
    """The shared ``api`` server (tests/shared_servers.py: ``--max-running-requests`` =
    `LOAD_REQUESTS`, ``--enable-metrics --enable-cache-report``)."""
    srv = shared_servers.get("api")
    assert srv.get("/get_server_info")["max_running_requests"] >= LOAD_REQUESTS
    return srv


@pytest.fixture(scope="module")
def load_result(server: Server, tmp_path_factory: pytest.TempPathFactory) -> dict:
    load = load_benchmark("load.py")
    # LOAD_RESULT_OUT=benchmarks/results/load_cpu.json keeps the run (docs/performance.md "Load")
    out = Path(os.environ.get("LOAD_RESULT_OUT") or tmp_path_factory.mktemp("load_out") / "load.json")
    t0 = time.monotonic()
    status = load.main(["--url", server.url(""), "--requests", str(LOAD_REQUESTS), "--max-tokens",
                        str(LOAD_MAX_TOKENS), "--timeout-s", str(REQUEST_TIMEOUT_S), "--out", str(out),
                        "--label", "pytest CPU"])
    result = json.loads(out.read_text())
    result["exit_status"], result["test_wall_s"] = status, time.monotonic() - t0
    return result


def test_load_checks_all_pass(load_result: dict, server: Server) -> None:
    summary = {k: load_result[k] for k in ("checks", "counts", "pool", "examples")}
    assert load_result["passed"] and load_result["exit_status"] == 0, f"{summary}\n{server.log_tail()}"
    counts = load_result["counts"]
    assert counts["lost"] == counts["streams_without_done"] == counts["garbled"] == 0
    assert counts["identical"] == counts["prefix"] == LOAD_REQUESTS // 4
    assert counts["distinct_texts_in_identical"] == 1
    assert counts["prefix_with_cache_hit"] == counts["prefix"]
    assert load_result["pool"]["after"] == load_result["pool"]["before"]
    peak = load_result["pool"]["peak_during_burst"]  # the pool reading is live, not a constant
    assert peak["num_running_reqs"] > 0 and peak["num_used_tokens"] > load_result["pool"]["before"]["num_used_tokens"]
    assert load_result["completion_tokens"] == LOAD_REQUESTS * LOAD_MAX_TOKENS  # EOS ignored
    assert load_result["wall_s"] < LOAD_WALL_BOUND_S


def _grafana_metric_names() -> set[str]:
    """Every metric name in the "A Grafana-ready list" table of docs/observability.md."""
    text = DOCS.read_text()
    table = text[text.index("## A Grafana-ready list"):]
    table = table[: table.index("\n\n", table.index("|"))]
    return set(re.findall(r"\b(sglang(?:_dsv41)?:\w+)", table))


def test_grafana_list_names_metrics_the_server_exports(load_result: dict, server: Server) -> None:
    """The docs' Grafana list is current: each name it queries is served at /metrics after the
    load (histograms by their ``_bucket`` series), and the load moved SGLang's counters."""
    with urllib.request.urlopen(server.url("/metrics"), timeout=REQUEST_TIMEOUT_S) as r:
        text = r.read().decode()
    exported = {m.group(1) for m in re.finditer(r"^(sglang(?:_dsv41)?:\w+?)(?:\{| )", text, re.M)}
    names = _grafana_metric_names()
    assert len(names) >= 10, names
    missing = sorted(n for n in names if n not in exported)
    assert not missing, f"docs/observability.md names metrics the server does not export: {missing}"
    generated = sum(float(v) for v in re.findall(r"^sglang:generation_tokens_total\{.*\} (\S+)$", text, re.M))
    assert generated >= LOAD_REQUESTS * LOAD_MAX_TOKENS

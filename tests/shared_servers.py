"""Servers shared by several test modules (CI time: one start-up instead of one per module).

Each entry of `GROUPS` is one server, started on the first test that asks for it
(`SharedServers.get`) and stopped after the last collected test of its modules (`tests/conftest.py`
knows the order; it also moves the modules of a group next to each other). A group's arguments are
the union of what its modules need; every module's checks hold on a server that other modules have
used before (they bound cache hits from below, or compare against a reference, never against a
fresh server's counters):

* ``api``: `test_api_bad_input.py` (metrics, indexer statistics every forward), `test_api_load.py`
  (64 concurrent requests, cache report), `test_api_server.py` (the plugin's parsers, named
  explicitly; JSON without free whitespace).
* ``chunked``: `test_runtime_server.py` and `test_vision_server.py` — 12-token chunks mixed with
  decode, at most 4 images per request.
* ``plain``: `test_plain_launch_server.py` and `test_runtime_weights_server.py` — plain
  ``python -m sglang.launch_server`` in the environment ``serve --dry-run`` prints (the weights
  module swaps the weights and back).
* ``pd``: `test_pd_faults.py` and `test_pd_server.py` — one 1P1D with the router
  (`pd_cluster.PDCluster`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest

from server_helpers import Server

PARSER = "deepseek-v41"
API_ARGS = ["--max-running-requests", "64", "--enable-metrics", "--enable-cache-report",
            "--reasoning-parser", PARSER, "--tool-call-parser", PARSER, "--constrained-json-disable-any-whitespace"]
API_ENV = {"SGLANG_DSV41_INDEXER_STATS_EVERY": "1"}
CHUNKED_ARGS = ["--max-total-tokens", "4096", "--chunked-prefill-size", "12", "--enable-mixed-chunk",
                "--max-running-requests", "8", "--limit-mm-data-per-request", '{"image": 4}']


def _api(checkpoint: Path, log: Path) -> Server:
    return Server(checkpoint, log, API_ARGS, env=API_ENV)


def _chunked(checkpoint: Path, log: Path) -> Server:
    return Server(checkpoint, log, CHUNKED_ARGS)


def _plain(checkpoint: Path, log: Path) -> Server:
    from test_plain_launch_server import PlainServer, dry_run_environment

    return PlainServer(["--model-path", str(checkpoint), "--device", "cpu"], dry_run_environment(checkpoint)[0], log)


GROUPS: dict[str, tuple[tuple[str, ...], Callable[[Path, Path], Server] | None]] = {
    "api": (("test_api_bad_input.py", "test_api_load.py", "test_api_server.py"), _api),
    "chunked": (("test_runtime_server.py", "test_vision_server.py"), _chunked),
    "plain": (("test_plain_launch_server.py", "test_runtime_weights_server.py"), _plain),
    "pd": (("test_pd_faults.py", "test_pd_server.py"), None),      # `SharedServers.pd` (tests/pd_cluster.py)
}


class SharedServers:
    """The running shared servers of the session, by group name."""

    def __init__(self, checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
        self.checkpoint, self.tmp = checkpoint, tmp_path_factory
        self.running: dict[str, Any] = {}     # Server, or the PDCluster under "pd"

    def get(self, name: str) -> Server:
        if name not in self.running:
            srv = GROUPS[name][1](self.checkpoint, self.tmp.mktemp(f"shared_{name}") / "server.log")
            try:
                srv.wait_ready()
            except BaseException:
                srv.stop()
                raise
            self.running[name] = srv
        srv = self.running[name]
        if srv.proc.poll() is not None:
            raise RuntimeError(f"the shared {name!r} server exited with {srv.proc.returncode}:\n{srv.log_tail()}")
        return srv

    def pd(self):
        """The session's 1P1D (`pd_cluster.PDCluster`), (re)started when a process of it is gone."""
        from pd_cluster import PDCluster

        if "pd" not in self.running:
            self.running["pd"] = PDCluster(self.checkpoint, self.tmp.mktemp("shared_pd"))
        return self.running["pd"].ensure()

    def stop(self, name: str) -> None:
        srv = self.running.pop(name, None)
        if srv is not None:
            srv.stop()

    def stop_all(self) -> None:
        for name in list(self.running):
            self.stop(name)


def group_of(module_file: str) -> str | None:
    return next((name for name, (modules, _) in GROUPS.items() if module_file in modules), None)


def grouped_order(items: list[pytest.Item]) -> list[pytest.Item]:
    """`items` with each group's later modules moved right after its first module's items (the
    relative order of everything else unchanged)."""
    out: list[pytest.Item] = []
    placed: set[int] = set()
    for i, item in enumerate(items):
        if i in placed:
            continue
        group = group_of(item.path.name)
        out.append(item)
        placed.add(i)
        if group is None:
            continue
        ends_module = i + 1 == len(items) or items[i + 1].path != item.path
        if ends_module:      # pull the group's other modules in here, in their collected order
            for j in range(i + 1, len(items)):
                if j not in placed and group_of(items[j].path.name) == group:
                    out.append(items[j])
                    placed.add(j)
    return out

"""Servers shared by several test modules (CI time: one start-up instead of one per module).

Each entry of `GROUPS` is one server, started on the first test that asks for it
(`SharedServers.get`) and stopped after the last collected test of its modules (`tests/conftest.py`
knows the order; it also moves the modules of a group next to each other). A group's arguments are
the union of what its modules need; every module's checks hold on a server that other modules have
used before (they bound cache hits from below, or compare against a reference, never against a
fresh server's counters):

* ``api``: `test_api_bad_input.py` (metrics, indexer statistics every forward), `test_api_load.py`
  (64 concurrent requests, cache report), `test_api_server.py` (the plugin's parsers, named
  explicitly; JSON without free whitespace), then `test_api_shutdown.py`, which takes the server
  (`SharedServers.take`: a drain timeout of `API_DRAIN_S`) and shuts it down with SIGTERM.
* ``chunked``: `test_runtime_server.py` and `test_vision_server.py` — 12-token chunks mixed with
  decode, at most 4 images per request.
* ``plain``: `test_plain_launch_server.py` and `test_runtime_weights_server.py` — plain
  ``python -m sglang.launch_server`` in the environment ``serve --dry-run`` prints (the weights
  module swaps the weights and back).
* ``forced``: `test_api_forced_replies.py` alone (its forced-reply logit processor, DeepSeek-API
  effort table): a group only so that its server starts ahead.
* ``launch``: `test_deploy_launch_server.py` alone (`sglang-dsv41 launch` of a config; it makes
  its own checkpoint): the same.
* ``hicache``: `test_runtime_hicache_server.py` alone (a small device pool and a host tier): the
  same.
* ``pd``: `test_pd_faults.py` and `test_pd_server.py` — one 1P1D with the router
  (`pd_cluster.PDCluster`).

Start-up ahead (`prestart`): a group's server (``pd``: the prefill and decode) is launched when the suite reaches the
module `PRESTART_MODULES` modules before the group's first, at nice 19, so that its start-up uses
the CPU the tests before it leave idle; `get` raises it back to nice 0 and waits for it as usual
(the tests see the same server, only started earlier). Only where priority can be raised again
(root); ``SGLANG_DSV41_PREFETCH=0`` turns it off with the child-run lane (tests/child_runs.py).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import pytest

from child_runs import PREFETCH_ENV, renice
from server_helpers import Server
from sglang_dsv41.api.shutdown import DRAIN_TIMEOUT_ENV

PARSER = "deepseek-v41"
API_ARGS = ["--max-running-requests", "64", "--enable-metrics", "--enable-cache-report",
            "--reasoning-parser", PARSER, "--tool-call-parser", PARSER, "--constrained-json-disable-any-whitespace"]
API_DRAIN_S = 15
API_ENV = {"SGLANG_DSV41_INDEXER_STATS_EVERY": "1", DRAIN_TIMEOUT_ENV: str(API_DRAIN_S)}
PRESTART_MODULES = 4
CHUNKED_ARGS = ["--max-total-tokens", "4096", "--chunked-prefill-size", "12", "--enable-mixed-chunk",
                "--max-running-requests", "8", "--limit-mm-data-per-request", '{"image": 4}']


def _api(checkpoint: Path, log: Path) -> Server:
    return Server(checkpoint, log, API_ARGS, env=API_ENV)


def _chunked(checkpoint: Path, log: Path) -> Server:
    return Server(checkpoint, log, CHUNKED_ARGS)


def _forced(checkpoint: Path, log: Path) -> Server:
    from test_api_forced_replies import forced_server

    return forced_server(checkpoint, log)


def _launched(checkpoint: Path, log: Path) -> Server:
    from test_deploy_launch_server import launched_server

    return launched_server(checkpoint, log)


def _hicache(checkpoint: Path, log: Path) -> Server:
    from test_runtime_hicache_server import hicache_server

    return hicache_server(checkpoint, log)


def _plain(checkpoint: Path, log: Path) -> Server:
    from test_plain_launch_server import PlainServer, dry_run_environment

    return PlainServer(["--model-path", str(checkpoint), "--device", "cpu"], dry_run_environment(checkpoint)[0], log)


GROUPS: dict[str, tuple[tuple[str, ...], Callable[[Path, Path], Server] | None]] = {
    "api": (("test_api_bad_input.py", "test_api_load.py", "test_api_server.py", "test_api_shutdown.py"), _api),
    "forced": (("test_api_forced_replies.py",), _forced),
    "launch": (("test_deploy_launch_server.py",), _launched),
    "hicache": (("test_runtime_hicache_server.py",), _hicache),
    "chunked": (("test_runtime_server.py", "test_vision_server.py"), _chunked),
    "plain": (("test_plain_launch_server.py", "test_runtime_weights_server.py"), _plain),
    "pd": (("test_pd_faults.py", "test_pd_server.py"), None),      # `SharedServers.pd` (tests/pd_cluster.py)
}


class SharedServers:
    """The running shared servers of the session, by group name."""

    def __init__(self, checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
        self.checkpoint, self.tmp = checkpoint, tmp_path_factory
        self.running: dict[str, Any] = {}     # Server, or the PDCluster under "pd"
        self.starting: dict[str, Server] = {}  # prestarted, not yet asked for (nice 19)

    def _launch(self, name: str) -> Server:
        return GROUPS[name][1](self.checkpoint, self.tmp.mktemp(f"shared_{name}") / "server.log")

    def prestart(self, name: str) -> None:
        """Launch the group's server now at nice 19 (module docstring); no-op if it runs already."""
        if name in self.running or name in self.starting:
            return
        if name == "pd":                    # the pair is launched; `pd()` waits for it, then the router
            from pd_cluster import PDCluster
            from test_pd_server import _pd_missing

            if _pd_missing():               # the modules skip (or fail) without the PD stack
                return

            cluster = self.running["pd"] = PDCluster(self.checkpoint, self.tmp.mktemp("shared_pd"))
            cluster.launch()
            procs = [cluster.prefill.proc, cluster.decode.proc]
        else:
            srv = self.starting[name] = self._launch(name)
            procs = [srv.proc]
        for proc in procs:
            renice(proc.pid, 19)           # its own process group; its workers inherit the value

    def get(self, name: str) -> Server:
        if name not in self.running:
            srv = self.starting.pop(name, None)
            if srv is None:
                srv = self._launch(name)
            else:
                renice(srv.proc.pid, 0)
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

    def take(self, name: str) -> Server:
        """The group's ready server, handed over: the caller stops it (a module that ends the
        server's life itself must be the group's last)."""
        srv = self.get(name)
        del self.running[name]
        return srv

    def pd(self):
        """The session's 1P1D (`pd_cluster.PDCluster`), (re)started when a process of it is gone."""
        from pd_cluster import PDCluster

        if "pd" not in self.running:
            self.running["pd"] = PDCluster(self.checkpoint, self.tmp.mktemp("shared_pd"))
        return self.running["pd"].ensure()

    def stop(self, name: str) -> None:
        for srv in (self.running.pop(name, None), self.starting.pop(name, None)):
            if srv is not None:
                srv.stop()

    def stop_all(self) -> None:
        for name in list(self.running) + list(self.starting):
            self.stop(name)


def group_of(module_file: str) -> str | None:
    return next((name for name, (modules, _) in GROUPS.items() if module_file in modules), None)


def prestart_plan(module_files: list[str]) -> dict[str, tuple[int, int]]:
    """Group -> the range of module positions (in run order, one entry per module) during which its
    server is prestarted: from `PRESTART_MODULES` modules before its first module up to it (empty
    when nothing runs before it, or when prestarting is off)."""
    if os.environ.get(PREFETCH_ENV, "1") == "0" or os.geteuid() != 0:     # nice 19 could not be undone
        return {}
    plan = {}
    for name, (modules, _) in GROUPS.items():
        first = next((i for i, m in enumerate(module_files) if m in modules), None)
        if first:
            plan[name] = (max(0, first - PRESTART_MODULES), first)
    return plan


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

"""`shared_servers.grouped_order`: the modules of a shared-server group run next to each other, in
their collected order, and nothing else moves; `prestart_plan`: where each group's server is
launched ahead (no server starts here)."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import os
import subprocess
import sys

import pytest

from child_runs import PREFETCH_ENV, autogroup_nice, autogroups_on, renice
from shared_servers import GROUPS, PRESTART_MODULES, SharedServers, group_of, grouped_order, prestart_plan


def _items(*names: str) -> list[SimpleNamespace]:
    return [SimpleNamespace(path=Path("tests") / n, n=i) for i, n in enumerate(names)]


def test_group_modules_are_pulled_next_to_the_first():
    items = _items("test_a.py", "test_runtime_server.py", "test_runtime_server.py", "test_b.py",
                   "test_vision_server.py", "test_c.py", "test_vision_server.py")
    got = [(i.path.name, i.n) for i in grouped_order(items)]
    assert got == [("test_a.py", 0), ("test_runtime_server.py", 1), ("test_runtime_server.py", 2),
                   ("test_vision_server.py", 4), ("test_vision_server.py", 6), ("test_b.py", 3), ("test_c.py", 5)]


def test_without_groups_the_order_is_unchanged():
    items = _items("test_b.py", "test_a.py", "test_b.py")
    assert grouped_order(items) == items


def test_every_module_is_in_at_most_one_group():
    modules = [m for mods, _ in GROUPS.values() for m in mods]
    assert len(modules) == len(set(modules))
    assert all(group_of(m) is not None for m in modules) and group_of("test_config.py") is None


def test_prestart_plan_covers_the_modules_before_each_group_but_not_a_first_group(monkeypatch):
    monkeypatch.setenv(PREFETCH_ENV, "1")
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    runs = (["test_api_bad_input.py", "test_api_load.py"] + [f"test_u{i}.py" for i in range(6)]
            + ["test_pd_faults.py", "test_plain_launch_server.py", "test_x.py", "test_runtime_server.py"])
    assert prestart_plan(runs) == {"pd": (8 - PRESTART_MODULES, 8), "plain": (9 - PRESTART_MODULES, 9),
                                   "chunked": (11 - PRESTART_MODULES, 11)}
    monkeypatch.setenv(PREFETCH_ENV, "0")
    assert prestart_plan(runs) == {}
    monkeypatch.setenv(PREFETCH_ENV, "1")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)     # nice 19 could not be raised back
    assert prestart_plan(runs) == {}


class _Sleeper:
    """A stand-in server: a process in its own group that only sleeps."""

    def __init__(self, checkpoint: Path, log: Path) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
        self.waited = False

    def wait_ready(self) -> None:
        self.waited = True

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(30)


def test_a_prestarted_server_runs_at_nice_19_until_asked_for_then_at_0(monkeypatch, tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("raising priority back to 0 needs root (prestart_plan plans nothing then)")
    monkeypatch.setitem(GROUPS, "sleeper", (("test_sleeper.py",), _Sleeper))
    servers = SharedServers(Path("unused"), tmp_path_factory)
    try:
        servers.prestart("sleeper")
        srv = servers.starting["sleeper"]
        assert os.getpriority(os.PRIO_PGRP, srv.proc.pid) == 19 and not srv.waited
        assert autogroup_nice(srv.proc.pid) == (19 if autogroups_on() else None)
        servers.prestart("sleeper")                          # once only
        assert servers.starting == {"sleeper": srv}
        assert servers.get("sleeper") is srv and srv.waited
        assert os.getpriority(os.PRIO_PGRP, srv.proc.pid) == 0 and servers.starting == {}
        assert autogroup_nice(srv.proc.pid) == (0 if autogroups_on() else None)
        servers.prestart("sleeper")                          # running: nothing new
        assert servers.starting == {}
    finally:
        servers.stop_all()
    assert srv.proc.poll() is not None and servers.running == servers.starting == {}


def test_renice_also_sets_the_autogroup_of_a_new_session():
    """Where the kernel has autogroups, a child of its own session is ranked against the tests by
    its autogroup's nice value only (child_runs.renice): that value must follow."""
    if not autogroups_on():
        pytest.skip("the kernel has no autogroups here: the processes' nice values rank them directly")
    if os.geteuid() != 0:
        pytest.skip("raising priority back to 0 needs root")
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        assert autogroup_nice(proc.pid) == 0
        renice(proc.pid, 19)
        assert autogroup_nice(proc.pid) == 19 and os.getpriority(os.PRIO_PGRP, proc.pid) == 19
        renice(proc.pid, 0)
        assert autogroup_nice(proc.pid) == 0 and os.getpriority(os.PRIO_PGRP, proc.pid) == 0
    finally:
        proc.kill()
        proc.wait(30)


@pytest.mark.parametrize("rc, last, ok", [(0, "12 passed in 3.0s", True), (1, "1 failed, 11 passed in 3.0s", False),
                                          (0, "11 passed, 1 skipped in 3.0s", False), (0, "", False)])
def test_assert_all_passed_wants_rc_0_passes_and_no_skips(monkeypatch, rc, last, ok):
    """`child_runs.assert_all_passed`, the verdict of every interpreter child run: exit status 0 and a summary
    line with passes and no skip."""
    import child_runs

    asked = []
    monkeypatch.setattr(child_runs, "run", lambda argv, timeout_s: asked.append((argv, timeout_s)) or
                        subprocess.CompletedProcess(argv, rc, stdout=f"..\n{last}\n" if last else "", stderr=""))
    if ok:
        child_runs.assert_all_passed(("-k", "x"))
    else:
        with pytest.raises(AssertionError):
            child_runs.assert_all_passed(("-k", "x"))
    assert asked == [(("-k", "x"), 600)]

"""Child pytest runs (Triton-interpreter kernel cases) started ahead of time on a spare core.

A child run is one `python -m pytest <argv>` under ``TRITON_INTERPRET=1`` (the variable must be set
before triton is imported, hence the child). Its result depends only on its argv and the
environment, never on the parent's state, so `tests/conftest.py` queues every child run of the
collected items when collection ends; one background thread runs them one at a time, at nice 19,
in the items' order: they use the CPU the serial suite leaves idle (server start-ups, waits,
one-thread unit tests on a 2-core host) instead of the suite's wall time. `run` is what a test
calls: the prefetched result if done; else it waits for the running child (priority raised back to
0), or, if not started yet, runs it in the foreground. Either way the test asserts on the same
child output as a run in place; only when it ran changes. ``SGLANG_DSV41_PREFETCH=0`` turns the
lane off (every child then runs in place, as before).
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PREFETCH_ENV = "SGLANG_DSV41_PREFETCH"
BACKGROUND_TIMEOUT_S = 3600      # a niced child may wait long for a core; the test's own cap runs from its call


def interpreter_argv(target: str | Path, *select: str) -> tuple[str, ...]:
    """The child pytest's arguments: quiet, no cache, `select` (-k/-m/-W ...), then the target file."""
    return ("-q", "-p", "no:cacheprovider", *select, str(Path(target).resolve()))


def _child_env() -> dict[str, str]:
    return dict(os.environ, TRITON_INTERPRET="1", **{PREFETCH_ENV: "0"})


class _Job:
    def __init__(self, argv: tuple[str, ...]) -> None:
        self.argv = argv
        self.proc: subprocess.Popen | None = None
        self.result: subprocess.CompletedProcess | None = None
        self.done = threading.Event()

    def start(self, nice: bool) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "pytest", *self.argv], cwd=ROOT, env=_child_env(),
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)
        if nice:
            renice(self.proc.pid, 19)

    def finish(self, timeout_s: float) -> subprocess.CompletedProcess:
        assert self.proc is not None
        try:
            out, err = self.proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill(self.proc)
            out, err = self.proc.communicate()
            out += f"\n[child_runs] killed after {timeout_s:.0f} s"
        self.result = subprocess.CompletedProcess(self.proc.args, self.proc.returncode, out, err)
        self.done.set()
        return self.result


def renice(pid: int, value: int) -> None:
    """Set the nice value of the process group that `pid` leads, and of its autogroup.

    With the kernel's autogroups on (/proc/sys/kernel/sched_autogroup_enabled), a child started
    with start_new_session gets an autogroup of its own, and CFS shares the CPU between autogroups
    by the autogroup's nice value alone: the processes' own values then only rank them inside the
    group, so without the autogroup's a "nice 19" child competes as an equal with the tests.
    Raising priority needs privileges (else the child stays niced); without autogroups, or once the
    child is gone, the autogroup write fails and is skipped."""
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PGRP, pid, value)    # the child leads its own group (start_new_session)
    with contextlib.suppress(OSError), open(f"/proc/{pid}/autogroup", "w") as f:
        f.write(str(value))


def autogroup_nice(pid: int) -> int | None:
    """The nice value of `pid`'s autogroup, or None where the kernel has no autogroups."""
    try:
        with open(f"/proc/{pid}/autogroup") as f:
            return int(f.read().split()[-1])        # "/autogroup-207 nice 19"
    except (OSError, ValueError, IndexError):
        return None


def autogroups_on() -> bool:
    try:
        with open("/proc/sys/kernel/sched_autogroup_enabled") as f:
            return f.read().strip() == "1"
    except OSError:
        return False


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class _Lane:
    """The queue of child runs and the one background thread that works through it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.queue: list[_Job] = []
        self.jobs: dict[tuple[str, ...], _Job] = {}
        self.running: _Job | None = None
        self.stopped = False
        self.thread: threading.Thread | None = None

    def submit(self, argvs: list[tuple[str, ...]]) -> None:
        with self.lock:
            for argv in argvs:
                if argv not in self.jobs:
                    self.jobs[argv] = job = _Job(argv)
                    self.queue.append(job)
            if self.queue and self.thread is None:
                self.thread = threading.Thread(target=self._work, name="child-runs", daemon=True)
                self.thread.start()

    def _work(self) -> None:
        while True:
            with self.lock:
                if self.stopped or not self.queue:
                    self.running = None
                    return
                job = self.running = self.queue.pop(0)
                job.start(nice=True)
            job.finish(BACKGROUND_TIMEOUT_S)

    def take(self, argv: tuple[str, ...]) -> tuple[_Job | None, bool]:
        """(the job for argv or None, whether the caller must run it itself)."""
        with self.lock:
            job = self.jobs.get(argv)
            if job is None or self.stopped:
                return None, True
            if job in self.queue:                     # not started: the caller runs it now
                self.queue.remove(job)
                return job, True
            if job is self.running and job.proc is not None:
                renice(job.proc.pid, 0)
            return job, False

    def stop(self) -> None:
        with self.lock:
            self.stopped = True
            self.queue.clear()
            job = self.running
        if job is not None and job.proc is not None:
            _kill(job.proc)
        if self.thread is not None:
            self.thread.join(timeout=60)


_LANE = _Lane()


def prefetch(argvs: list[tuple[str, ...]]) -> None:
    """Queue child runs for the background lane (no-op when the lane is off)."""
    if os.environ.get(PREFETCH_ENV, "1") != "0" and os.environ.get("TRITON_INTERPRET") != "1":
        _LANE.submit(argvs)


def stop() -> None:
    """Kill a running background child and drop the queue (end of the session)."""
    _LANE.stop()


def assert_all_passed(argv: tuple[str, ...], timeout_s: float = 600) -> None:
    """`run(argv)`, then fail unless the child pytest exited 0 and its summary line reports passes and
    no skips (a skip inside an interpreter child means a case did not run where it should)."""
    proc = run(argv, timeout_s)
    summary = proc.stdout.strip().splitlines()[-1:] if proc.stdout.strip() else []
    assert proc.returncode == 0, f"interpreter tests failed:\n{proc.stdout[-12000:]}\n{proc.stderr[-4000:]}"
    assert summary and " passed" in summary[0] and "skipped" not in summary[0], proc.stdout[-4000:]


def run(argv: tuple[str, ...], timeout_s: float) -> subprocess.CompletedProcess:
    """The child run's result: prefetched, awaited, or run now; `timeout_s` bounds the wait from here."""
    job, mine = _LANE.take(argv)
    if mine:
        job = job or _Job(argv)
        job.start(nice=False)
        return job.finish(timeout_s)
    assert job is not None
    if not job.done.wait(timeout_s):
        if job.proc is not None:
            _kill(job.proc)
        job.done.wait(60)
        raise TimeoutError(f"child pytest {' '.join(argv)} not done {timeout_s:.0f} s after the test asked")
    assert job.result is not None
    return job.result

"""A benchmark's server never outlives the benchmark (benchmarks/serving_client.py `Proc`; issue 14: a
`timeout`-killed hicache_l3_write.py left its server and 73 GB of host memory behind).

A driver script starts a fake server through `Proc`: a process-group leader with one child (SGLang's
launcher and its scheduler). SIGTERM (what `timeout` sends) or SIGINT to the driver alone, or a normal
exit, stops the whole group; SIGKILL to the driver kills the leader through the parent-death signal
(and the child, which, like SGLang's scheduler, asks to die with its parent); `stop` escalates to
SIGKILL for a child that ignores SIGTERM. Every HiCache benchmark starts its servers through `Proc`.
No model, no sockets; every wait is capped.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmark_loader import BENCHMARKS, load_benchmark

#: the fake server: one child that asks for SIGKILL when its parent dies (as SGLang's scheduler does),
#: ignores SIGTERM when argv[2] == "stubborn", then writes its pid to argv[1] (ready) and sleeps
FAKE = """
import subprocess, sys, time
child = ("import ctypes, os, signal, sys, time\\n"
         "ctypes.CDLL(None).prctl(1, signal.SIGKILL)\\n"
         "if sys.argv[1] == 'stubborn': signal.signal(signal.SIGTERM, signal.SIG_IGN)\\n"
         "open(sys.argv[2] + '.tmp', 'w').write(str(os.getpid())); os.replace(sys.argv[2] + '.tmp', sys.argv[2])\\n"
         "time.sleep(600)\\n")
subprocess.Popen([sys.executable, "-c", child, sys.argv[2], sys.argv[1]])
time.sleep(600)
"""

#: the benchmark: starts FAKE through `Proc`, waits until its child is ready, prints the leader's pid,
#: then sleeps, or exits normally on a line on stdin (argv[5] == "exit")
DRIVER = """
import os, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from serving_client import Proc
p = Proc([sys.executable, "-c", sys.argv[2], sys.argv[3], "plain"], Path(sys.argv[4]))
deadline = time.monotonic() + 60
while not os.path.exists(sys.argv[3]) and time.monotonic() < deadline:
    time.sleep(0.05)
print(p.p.pid, flush=True)
if sys.argv[5] == "exit":
    sys.stdin.readline()
    sys.exit(0)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    """Running (a zombie or a reaped pid is not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _wait(cond, cap_s: float = 60) -> bool:
    deadline = time.monotonic() + cap_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return cond()


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.mark.parametrize("how", ["sigterm", "sigint", "sigkill", "exit"])
def test_the_server_group_dies_with_the_benchmark(tmp_path: Path, how: str) -> None:
    pidfile = tmp_path / "child.pid"
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, str(BENCHMARKS), FAKE, str(pidfile), str(tmp_path / "log"),
                               "exit" if how == "exit" else "sleep"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    leader = int(driver.stdout.readline())
    try:
        assert pidfile.exists()
        child = int(pidfile.read_text())
        assert _alive(leader) and _alive(child) and os.getpgid(child) == leader
        sig = {"sigterm": signal.SIGTERM, "sigint": signal.SIGINT, "sigkill": signal.SIGKILL}.get(how)
        if sig is not None:
            driver.send_signal(sig)                       # the driver alone, as `timeout` does
        else:
            driver.stdin.write("go\n")
            driver.stdin.flush()
        driver.wait(timeout=60)
        assert _wait(lambda: not _alive(leader) and not _alive(child)), f"{how}: the server outlived the benchmark: {_alive(leader)} {_alive(child)}"
    finally:
        driver.kill()
        _kill_group(leader)


def test_stop_kills_a_child_that_ignores_sigterm(tmp_path: Path) -> None:
    sc = load_benchmark("serving_client.py")
    pidfile = tmp_path / "child.pid"
    p = sc.Proc([sys.executable, "-c", FAKE, str(pidfile), "stubborn"], tmp_path / "log")
    try:
        assert _wait(pidfile.exists)
        child = int(pidfile.read_text())
        p.stop(grace_s=0.5)
        assert not _alive(p.p.pid) and _wait(lambda: not _alive(child), 5)
        assert p not in sc._LIVE
    finally:
        _kill_group(p.p.pid)


@pytest.mark.parametrize("script", ["hicache_l3_write.py", "hicache_prefix.py", "hicache.py"])
def test_hicache_benchmarks_start_servers_through_proc(script: str) -> None:
    text = (BENCHMARKS / script).read_text()
    assert "subprocess.Popen" not in text and "Proc(" in text

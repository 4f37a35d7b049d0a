"""Shared HTTP serving-benchmark pieces (standard library only): a server process in its own group
(never outlives the benchmark: see `Proc`), bounded readiness waits, random-id prompts, one streamed greedy ``/generate`` with client-side TTFT
and ITL, and a closed-loop load level. Used by `benchmarks/serving_e2e.py`, `hicache.py` (servers, waits,
streamed requests) and `pd.py` (servers, waits).

Metrics (client clock): TTFT = time to the first streamed chunk that carries a token; ITL = (last −
first token time) / (tokens − 1) of one request (a chunk holding several tokens — speculative
decoding — counts each); output tokens/s of a level = all completion tokens / level wall time.
"""
from __future__ import annotations

import atexit
import ctypes
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(url: str, body: dict[str, Any] | None = None, timeout: float = 300) -> Any:
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        raw = r.read()
    return json.loads(raw) if raw.strip().startswith((b"{", b"[")) else raw.decode()


#: every started `Proc` not yet stopped (stopped at exit, `_stop_live`)
_LIVE: list["Proc"] = []
_GUARDED = False


def _raise_exit(signum, frame) -> None:
    raise SystemExit(f"stopped by signal {signum}")


def _stop_live() -> None:
    for p in list(_LIVE):
        p.stop()


def guard_exit() -> None:
    """Idempotent: at interpreter exit stop every live `Proc`; in the main thread, SIGTERM and SIGHUP
    whose handler is still the default raise SystemExit instead of ending the process at once, so
    `finally` blocks and the exit hook run (SIGINT already raises KeyboardInterrupt). Handlers a
    benchmark installed itself are kept."""
    global _GUARDED
    if _GUARDED:
        return
    atexit.register(_stop_live)
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) is signal.SIG_DFL:
                signal.signal(sig, _raise_exit)
    _GUARDED = True


def _die_with_parent() -> None:
    """In the child before exec (Linux): SIGKILL when the benchmark process dies, even by SIGKILL.
    SGLang's own children (scheduler, detokenizer) die with the server the same way
    (`kill_itself_when_parent_died`)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)      # PR_SET_PDEATHSIG


class Proc:
    """One process in its own group, output to `log`. It never outlives the benchmark: `stop` kills the
    whole group (SIGTERM, then SIGKILL after `grace_s`); `guard_exit` stops it on SIGTERM / SIGHUP /
    SIGINT / normal exit; if the benchmark (started from its main thread) is SIGKILLed, the kernel kills the server
    (parent-death signal)."""

    def __init__(self, argv: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        guard_exit()
        main = threading.current_thread() is threading.main_thread()   # the death signal follows the forking thread
        self.log = log
        self._f = open(log, "w")
        self.p = subprocess.Popen(argv, stdout=self._f, stderr=subprocess.STDOUT, start_new_session=True,
                                  env=None if env is None else {**os.environ, **env}, preexec_fn=_die_with_parent if main else None)
        _LIVE.append(self)

    def tail(self, n: int = 3000) -> str:
        self._f.flush()
        return f"--- {self.log.name}\n" + self.log.read_text(errors="replace")[-n:]

    def stop(self, grace_s: float = 20) -> None:
        """Kill the process group (also when the leader already exited: its children may still run)."""
        if self in _LIVE:
            _LIVE.remove(self)
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 30)):
            try:
                os.killpg(self.p.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.p.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                continue
            if not _group_alive(self.p.pid):
                break
            time.sleep(0.5)
        self._f.close()


def _group_alive(pgid: int) -> bool:
    """Does a process of group `pgid` still run (zombies do not count)?"""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            rest = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(rest[2]) == pgid and rest[0] != "Z":
            return True
    return False


def wait_up(url: str, procs: list[Proc], timeout_s: float) -> None:
    """Poll `url` until it answers 200; raise (with the logs' tails) when a process exits or at the cap."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(p.p.poll() is not None for p in procs):
            raise RuntimeError(f"a process exited before {url} answered:\n" + "\n".join(p.tail() for p in procs))
        try:
            with urllib.request.urlopen(url, timeout=min(30, max(1, deadline - time.monotonic()))) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    raise TimeoutError(f"{url} not up after {timeout_s} s:\n" + "\n".join(p.tail() for p in procs))


def prompt(seed: int, n: int, low: int = 3, high: int = 900) -> list[int]:
    """`n` ids: BOS 0, then uniform in [low, high)."""
    rng = random.Random(seed)
    return [0] + [rng.randrange(low, high) for _ in range(n - 1)]


def stream_generate(url: str, ids: list[int], new_tokens: int, extra: dict[str, Any],
                    timeout: float = 600, keep_last: bool = False) -> dict[str, Any]:
    """One streamed greedy /generate with EOS ignored: TTFT, ITL, tokens (client clock); with
    `keep_last`, also the last streamed chunk as ``last`` (its ``output_ids`` and ``meta_info``,
    e.g. ``cached_tokens``)."""
    body = {"input_ids": ids, "stream": True, "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0,
                                                                  "ignore_eos": True}, **extra}
    req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first = last = None
    tokens = 0
    chunk: dict[str, Any] | None = None
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for line in r:
            line = line.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            n = int(chunk["meta_info"]["completion_tokens"])
            if n > tokens:
                last = time.perf_counter() - t0
                first = last if first is None else first
                tokens = n
    if tokens != new_tokens:
        raise RuntimeError(f"{tokens} of {new_tokens} tokens streamed; last chunk: {json.dumps(chunk)[:400]}")
    row = {"ttft_s": first, "itl_s": (last - first) / (tokens - 1) if tokens > 1 else None, "tokens": tokens,
           "latency_s": time.perf_counter() - t0}
    if keep_last:
        row["last"] = chunk
    return row


def stat(rows: list[dict[str, Any]], key: str) -> dict[str, float | None]:
    """mean / p50 / p90 / max of `key` over the rows that have it."""
    vals = sorted(x[key] for x in rows if x.get(key) is not None)
    if not vals:
        return {"mean": None, "p50": None, "p90": None, "max": None}
    return {"mean": sum(vals) / len(vals), "p50": vals[len(vals) // 2],
            "p90": vals[min(len(vals) - 1, int(0.9 * len(vals)))], "max": vals[-1]}


def summarize_level(rows: list[Any], wall: float, concurrency: int) -> dict[str, Any]:
    """One load level: requests, errors (first 3), TTFT / ITL statistics, output tokens/s."""
    ok = [x for x in rows if isinstance(x, dict)]
    return {"concurrency": concurrency, "requests": len(rows), "errors": [x for x in rows if not isinstance(x, dict)][:3],
            "n_errors": len(rows) - len(ok), "wall_s": wall, "ttft_s": stat(ok, "ttft_s"), "itl_s": stat(ok, "itl_s"),
            "output_tokens_per_s": sum(x["tokens"] for x in ok) / wall if wall > 0 else None}


def closed_loop(send: Callable[[int], dict[str, Any]], concurrency: int, n_requests: int,
                timeout_s: float) -> dict[str, Any]:
    """`concurrency` workers each send the next request index until `n_requests` were sent (a new
    request starts as soon as one finishes); `send(i)` returns a `stream_generate` row. Requests
    still running at `timeout_s` count as errors."""
    rows: list[Any] = ["not finished"] * n_requests
    counter = iter(range(n_requests))
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            try:
                rows[i] = send(i)
            except Exception as e:       # counted as an error in the result
                rows[i] = repr(e)[:300]

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=max(1.0, timeout_s - (time.perf_counter() - t0)))
    return summarize_level(rows, time.perf_counter() - t0, concurrency)

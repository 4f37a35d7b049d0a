"""A real `sglang-dsv41 serve` process for slow end-to-end tests (shared by
`test_runtime_server.py` and `test_api_server.py`).

The server is started exactly as a user would (`python -m sglang_dsv41.cli serve`, which prepares
the CPU environment itself), on CUDA when torch sees a GPU and on CPU otherwise, in its own process
group; every wait and every request is bounded by a timeout, and `stop()` kills the whole group.
"""
from __future__ import annotations

import contextlib

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

STARTUP_TIMEOUT_S = 600
REQUEST_TIMEOUT_S = 300


#: where `free_port` looks: below the kernel's ephemeral range (32768-60999 by default, which
#: `bind(0)`, SGLang's own `get_free_port` and every outgoing connection draw from) and clear of
#: Mooncake's (12001, 12300-14300, 15000-17000), sglang-router's metrics (29000) and SGLang's
#: default (30000)
PORT_RANGE = (20000, 29000)
_given: set[int] = set()
_next = random.Random().randrange(*PORT_RANGE)


def _ephemeral() -> range:
    try:
        lo, hi = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        lo, hi = 32768, 60999
    return range(lo, hi + 1)


def free_port() -> int:
    """A port nothing listens on now that no earlier call of this session returned. A server binds
    its port only after its start-up (minutes on CPU), so a port from `bind(0)` could meanwhile be
    handed to another server's internal port or to an outgoing connection; this range is not."""
    global _next
    ephemeral = _ephemeral()
    for _ in range(PORT_RANGE[1] - PORT_RANGE[0]):
        port, _next = _next, PORT_RANGE[0] + (_next + 1 - PORT_RANGE[0]) % (PORT_RANGE[1] - PORT_RANGE[0])
        if port in _given or port in ephemeral:
            continue
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))       # also taken when something listens on 127.0.0.1 only
            except OSError:
                continue
        _given.add(port)
        return port
    raise RuntimeError(f"no free port in {PORT_RANGE} outside the ephemeral range {ephemeral}")


class Server:
    """One server process; ``extra_args`` go to `sglang-dsv41 serve` (and on to SGLang)."""

    def __init__(self, checkpoint: Path, log: Path, extra_args: Sequence[str] = (),
                 env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.log_path = log
        # CPU in CI; on the GPU machine the same tests serve from the H200 (torch path on CUDA).
        device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = device
        argv = [sys.executable, "-m", "sglang_dsv41.cli", "serve", "--device", device, "--model-path",
                str(checkpoint), "--port", str(self.port), *extra_args]
        self._log = open(log, "w")
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env=None if env is None else {**os.environ, **env})

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def _healthy(self) -> bool:
        """One /health_generate probe; a server that is not listening yet is simply not healthy."""
        try:
            with urllib.request.urlopen(self.url("/health_generate"), timeout=60) as r:
                return r.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            if self._healthy():
                return
            time.sleep(1)
        raise TimeoutError(f"server not ready after {timeout_s} s:\n{self.log_tail()}")

    def get(self, path: str) -> dict[str, Any]:
        with urllib.request.urlopen(self.url(path), timeout=REQUEST_TIMEOUT_S) as r:
            return json.loads(r.read())

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST a JSON body; the JSON answer (HTTPError on a non-2xx status)."""
        req = urllib.request.Request(self.url(path), data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
            return json.loads(r.read())

    def post_status(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """POST a JSON body; ``(status, JSON answer)`` for any status."""
        try:
            return 200, self.post(path, body)
        except urllib.error.HTTPError as e:
            with e:
                return e.code, json.loads(e.read() or b"{}")

    def stream(self, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
        """POST a streaming request; the JSON payloads of its SSE ``data:`` lines. Raises unless
        the stream ends with ``data: [DONE]``."""
        req = urllib.request.Request(self.url(path), data=json.dumps({**body, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json"})
        chunks: list[dict[str, Any]] = []
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
            for payload in _sse_payloads(r):
                if payload == "[DONE]":
                    return chunks
                chunks.append(json.loads(payload))
        raise AssertionError(f"stream ended without [DONE] after {len(chunks)} chunks")

    def generate(self, ids: list[int], n: int, logprob: bool = False) -> dict[str, Any]:
        """Greedy `/generate` of ``n`` tokens from token ids (EOS ignored)."""
        return self.post("/generate", {"input_ids": ids, "return_logprob": logprob,
                                       "sampling_params": {"max_new_tokens": n, "temperature": 0,
                                                           "ignore_eos": True}})

    def log_tail(self, n: int = 4000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-n:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        self._log.close()


def _sse_payloads(response: Any) -> Iterator[str]:
    for raw in response:
        line = raw.decode().strip()
        if line.startswith("data:"):
            yield line[len("data:"):].strip()


@contextlib.contextmanager
def running(srv: "Server") -> Iterator["Server"]:
    """`srv` once it answers; stopped on exit, also when it fails to start."""
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def concurrently(calls: list[Callable[[], Any]], timeout_s: float = REQUEST_TIMEOUT_S + 30) -> list[Any]:
    """Run `calls` in threads at once; each result, or the exception a call raised, in order
    (None for a call still running after `timeout_s`)."""
    import threading

    results: list[Any] = [None] * len(calls)

    def one(i: int) -> None:
        try:
            results[i] = calls[i]()
        except Exception as e:        # returned: the caller decides how to report it
            results[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout_s)
    return results

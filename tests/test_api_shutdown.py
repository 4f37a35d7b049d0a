"""SIGTERM drains in-flight requests within a timeout and exits 0; a restart on the same cache
directory starts clean (issue 20 item 6; `api/shutdown.py`).

The shared ``api`` server (tests/shared_servers.py; this module is its group's last and takes it
over), which runs with ``SGLANG_DSV41_DRAIN_TIMEOUT_S`` = `DRAIN_S`; two streamed requests are
in flight when the server gets SIGTERM: a short one, which must finish normally (all its tokens,
``[DONE]``), and one far longer than the drain timeout, which must be aborted at the timeout and
still end its stream with ``[DONE]``. The server must then exit with status 0 (stock SGLang 0.5.17
SIGKILLs itself: -9) within the timeout plus the abort and scheduler-exit allowances. A second
server on the same checkpoint and cache must then start and serve.
"""
from __future__ import annotations

import json
import signal
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from server_helpers import REQUEST_TIMEOUT_S, Server
from shared_servers import API_DRAIN_S
from sglang_dsv41.api.shutdown import ABORT_GRACE_S, SCHEDULER_EXIT_S

pytestmark = pytest.mark.slow

DRAIN_S = API_DRAIN_S
SHORT, LONG = 6, 3000
PROMPT = [0, 17, 250, 3, 999, 41]
ARGS = ["--max-total-tokens", "8192", "--max-running-requests", "4"]


class StreamedGenerate(threading.Thread):
    """One streamed greedy `/generate`; ``started`` is set at its first chunk."""

    def __init__(self, server: Server, n: int) -> None:
        super().__init__(daemon=True)
        self.server, self.n = server, n
        self.started = threading.Event()
        self.payloads: list[str] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        body = {"input_ids": PROMPT, "stream": True,
                "sampling_params": {"max_new_tokens": self.n, "temperature": 0, "ignore_eos": True}}
        req = urllib.request.Request(self.server.url("/generate"), data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
                for raw in r:
                    line = raw.decode().strip()
                    if line.startswith("data:"):
                        self.payloads.append(line[len("data:"):].strip())
                        self.started.set()
        except BaseException as e:  # reported by the test
            self.error = e
        finally:
            self.started.set()

    def last(self) -> dict[str, Any]:
        data = [json.loads(p) for p in self.payloads if p != "[DONE]"]
        return data[-1] if data else {}


def test_sigterm_drains_then_exits_0_and_a_restart_serves(shared_servers, tiny_checkpoint: Path,
                                                          tmp_path: Path) -> None:
    srv = shared_servers.take("api")
    try:
        short, long_ = StreamedGenerate(srv, SHORT), StreamedGenerate(srv, LONG)
        long_.start()
        short.start()
        assert short.started.wait(REQUEST_TIMEOUT_S) and long_.started.wait(REQUEST_TIMEOUT_S)
        assert short.error is None and long_.error is None, (short.error, long_.error)
        sent = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)          # `serve` exec'd SGLang: this is its main process
        rc = srv.proc.wait(timeout=DRAIN_S + ABORT_GRACE_S + SCHEDULER_EXIT_S + 60)
        took = time.monotonic() - sent
        short.join(60)
        long_.join(60)
        log = srv.log_tail(20000)
        assert rc == 0, f"exit status {rc}\n{log}"
        assert took < DRAIN_S + ABORT_GRACE_S + SCHEDULER_EXIT_S + 30, took
        assert short.error is None and short.payloads[-1] == "[DONE]", (short.error, short.payloads[-3:])
        assert len(short.last()["output_ids"]) == SHORT       # drained: it finished normally
        assert long_.error is None and long_.payloads[-1] == "[DONE]", (long_.error, long_.payloads[-3:])
        assert "drain timeout" in log and "exiting with status 0" in log
        assert len(long_.last().get("output_ids", [])) < LONG   # aborted at the timeout
    finally:
        srv.stop()

    again = Server(tiny_checkpoint, tmp_path / "second.log", ARGS)
    try:
        again.wait_ready()
        assert len(again.generate(PROMPT, 4)["output_ids"]) == 4
    finally:
        again.stop()

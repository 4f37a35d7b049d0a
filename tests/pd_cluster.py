"""The one 1P1D of the test session (issue 15): a prefill and a decode `sglang-dsv41 serve
--disaggregation-mode ...` and `sglang-router`, all on 127.0.0.1 over Mooncake TCP, shared by
`test_pd_faults.py` and `test_pd_server.py` (CI time: one start-up of the pair, not two).

Its settings serve both modules: chunked prefill of `CHUNK` (the output checks' oracle prompts take
two chunks each; the tool-call prompt, ~600 tokens, ten), and SGLang's transfer timeouts lowered to
`TIMEOUT_S` on both sides (the prefill drops a request whose decode never bootstraps, the decode one
whose KV never arrives) for the timeout faults. The destructive faults run last in their module:
the prefill-killed test registers a new prefill with the same router (`adopt_prefill`), the
decode-killed test is the session's last PD test. `ensure` (each module's fixture) restarts the
whole set-up when one of its processes is gone (a module run alone after the other, or a failed
fault), so no module ever sees another's wreck.
"""
from __future__ import annotations

from pathlib import Path

from child_runs import renice
from server_helpers import Server, free_port
from test_pd_server import COMMON, Router, _up, _wait

CHUNK = 64
TIMEOUT_S = 60          # both transfer timeouts; above a loaded host's stalls of a small prefill (docs/pd.md)
ENV = {"SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": str(TIMEOUT_S),
       "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": str(TIMEOUT_S)}


class PDCluster:
    """Prefill, decode and router; `prefill` / `boot` follow a replaced prefill (`adopt_prefill`)."""

    def __init__(self, checkpoint: Path, logs: Path) -> None:
        self.checkpoint, self.logs = checkpoint, logs
        self.prefill: Server | None = None
        self.decode: Server | None = None
        self.router: Router | None = None
        self.boot = 0
        self.retired: list[Server] = []     # replaced prefills, stopped with the rest
        self.starts = 0

    def new_prefill(self, name: str) -> tuple[Server, int]:
        """A new prefill server (not waited for, not registered) and its bootstrap port."""
        boot = free_port()
        srv = Server(self.checkpoint, self.logs / f"{name}.log",
                     [*COMMON, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(boot),
                      "--chunked-prefill-size", str(CHUNK)], env=ENV)
        return srv, boot

    def launch(self) -> None:
        """Start the prefill and decode processes, not waiting for them (`start` does)."""
        self.starts += 1
        n = self.starts
        self.prefill, self.boot = self.new_prefill(f"prefill{n}")
        self.decode = Server(self.checkpoint, self.logs / f"decode{n}.log", [*COMMON, "--disaggregation-mode", "decode"],
                             env=ENV)

    def start(self) -> None:
        """Wait for the launched pair (at nice 0, also when launched ahead at 19), then start the router."""
        p, d = self.prefill, self.decode
        assert p is not None and d is not None and self.router is None, "start() needs a launched pair"
        for srv in (p, d):
            renice(srv.proc.pid, 0)
        try:
            _wait("prefill and decode", lambda: _up(p.url("/health")) and _up(d.url("/health")), [p, d],
                  [p.log_tail, d.log_tail])
            r = self.router = Router(p, self.boot, d, self.logs / f"router{self.starts}.log")
            # /health is 200 before any worker is registered; /readiness waits for a healthy pair
            _wait("router", lambda: _up(r.url("/readiness")), [p, d, r], [p.log_tail, d.log_tail, r.log_tail],
                  timeout_s=300)
        except BaseException:
            self.stop()
            raise

    def alive(self) -> bool:
        procs = (self.prefill, self.decode, self.router)
        return all(p is not None and p.proc.poll() is None for p in procs) and _up(self.router.url("/readiness"))

    def ensure(self) -> "PDCluster":
        """The running set-up: a pair launched ahead is waited for; the whole set-up is started
        again if any of its processes is gone."""
        if self.router is None and self.prefill is not None:
            self.start()
        elif not self.alive():
            self.stop()
            self.launch()
            self.start()
        return self

    def adopt_prefill(self, srv: Server, boot: int) -> None:
        """`srv` (bootstrap port `boot`) replaces the prefill; the caller registers it with the router."""
        if self.prefill is not None:
            self.retired.append(self.prefill)
        self.prefill, self.boot = srv, boot

    def stop(self) -> None:
        for proc in (self.router, self.decode, self.prefill, *self.retired):
            if proc is not None:
                proc.stop()
        self.router = self.decode = self.prefill = None
        self.retired = []

"""PD servers on a CPU host: no busy-wait while requests only wait on the peer (docs/pd.md
"Concurrent PD requests on CPU"; spec cpu.md §5).

SGLang 0.5.17's PD event loops (`disaggregation/prefill.py`, `decode.py`) call `Scheduler.on_idle`
when there is no batch to run; `on_idle` returns at once unless the server is *fully* idle, and a
request waiting in a disaggregation queue (prefill: bootstrap or in-flight transfer; decode:
pre-allocation or transfer) makes it not idle. So while a request waits on the other server the
loop spins at full speed: one core per waiting server. On a GPU host that is one host core; on a
CPU host it is a core taken from the peer's forward — the prefill computes while the decode spins
waiting for its KV, and the reverse — which serialised concurrent PD requests (measured: docs/pd.md).

`on_idle_hook` (AFTER `Scheduler.on_idle`): on a CPU PD server that is not fully idle, wait up to
`WAIT_MS` on SGLang's own idle poller (a new request wakes it at once) before the loop polls the
disaggregation queues again. A transfer or bootstrap is then seen at most `WAIT_MS` later. GPU
servers and non-PD servers are untouched. `SGLANG_DSV41_PD_CPU_WAIT_MS` sets the wait; 0 restores
SGLang's spinning loop (for measuring it).
"""
from __future__ import annotations

from .idle_wait import env_ms, wait_on_idle_poller

#: Longest wait of one loop iteration with nothing to run (milliseconds).
WAIT_MS = 2
ENV = "SGLANG_DSV41_PD_CPU_WAIT_MS"


def wait_ms() -> float:
    return env_ms(ENV, WAIT_MS)


def on_idle_hook(result, self):
    """AFTER `Scheduler.on_idle` (module docstring)."""
    args = self.server_args
    if getattr(args, "device", None) != "cpu" or getattr(args, "disaggregation_mode", "null") == "null":
        return result
    ms = wait_ms()
    if ms == 0:
        return result
    if self.is_fully_idle():
        return result                      # SGLang's own sleeper (--sleep-on-idle) already waited
    wait_on_idle_poller(self, ms)
    return result

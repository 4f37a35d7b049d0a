"""Graceful shutdown of a DeepSeek-V4.1 server on SIGTERM (issue 20 item 6).

SGLang 0.5.17's `TokenizerManager.sigterm_watchdog` drains in-flight requests after SIGTERM, but
with no bound (a long request, or clients that keep sending, hold the server forever) and it
ends by SIGKILLing its own process tree, so the server always exits with status -9 (137 from a
shell) even after a clean drain. For V4.1 servers `serving.sigterm_watchdog_hook` (AROUND,
`hooks.py`) runs `sigterm_watchdog_replacement` instead, the same shutdown with a bound and a
clean status:

1. wait for SIGTERM (SGLang's handler sets ``gracefully_exit``);
2. let in-flight requests finish for at most `drain_timeout_s()` seconds
   (``SGLANG_DSV41_DRAIN_TIMEOUT_S``, default 30); then abort the rest (their streams end with
   ``finish_reason`` abort and ``[DONE]``) and give the abort `ABORT_GRACE_S` to reach them;
   a server whose health check failed is not drained (as SGLang);
3. ask the schedulers to exit (SGLang's ``ShutdownReq``), wait up to `SCHEDULER_EXIT_S` for them,
   kill what is left of the children, and exit with status 0.
"""
from __future__ import annotations

import asyncio
import logging
import os
import sys
import time

logger = logging.getLogger(__name__)

DRAIN_TIMEOUT_ENV = "SGLANG_DSV41_DRAIN_TIMEOUT_S"
DEFAULT_DRAIN_TIMEOUT_S = 30.0
ABORT_GRACE_S = 5.0
SCHEDULER_EXIT_S = 15.0
POLL_S = 0.2


def drain_timeout_s() -> float:
    raw = os.environ.get(DRAIN_TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_DRAIN_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ValueError(f"{DRAIN_TIMEOUT_ENV}={raw!r}: the drain timeout must be a number of "
                         "seconds >= 0")
    return value


async def drain(manager, timeout_s: float) -> int:
    """Wait until ``manager`` has no request left, aborting all after ``timeout_s``; returns the
    number of requests aborted (0 for a clean drain)."""
    from sglang.srt.managers.tokenizer_manager import ServerStatus

    deadline = time.monotonic() + timeout_s
    aborted = 0
    while manager.rid_to_state:
        if manager.server_status == ServerStatus.UnHealthy:
            logger.error("SIGTERM with a failed health check: not draining %d request(s)",
                         len(manager.rid_to_state))
            return len(manager.rid_to_state)
        now = time.monotonic()
        if not aborted and now >= deadline:
            aborted = len(manager.rid_to_state)
            logger.warning("drain timeout (%s=%g s): aborting %d in-flight request(s)",
                           DRAIN_TIMEOUT_ENV, timeout_s, aborted)
            manager.abort_request(abort_all=True)
        elif aborted and now >= deadline + ABORT_GRACE_S:
            break
        await asyncio.sleep(POLL_S)
    return aborted


async def sigterm_watchdog_replacement(self) -> None:
    """`TokenizerManager.sigterm_watchdog` with a bounded drain and exit status 0 (module doc)."""
    from sglang.srt.managers.io_struct import ShutdownReq
    from sglang.srt.utils import kill_process_tree
    from sglang.srt.utils.cudacore_pyspy_dump_utils import collect_scheduler_processes

    timeout_s = drain_timeout_s()
    while not self.gracefully_exit:
        await asyncio.sleep(POLL_S)
    logger.info("SIGTERM: draining %d request(s) for at most %g s", len(self.rid_to_state), timeout_s)
    aborted = await drain(self, timeout_s)
    if self._subprocess_watchdog is not None:
        self._subprocess_watchdog.stop()   # child exits are expected from here on
    self._dispatch_to_scheduler(ShutdownReq())
    deadline = time.monotonic() + SCHEDULER_EXIT_S
    while time.monotonic() < deadline and collect_scheduler_processes():
        await asyncio.sleep(POLL_S)
    logger.info("shutdown complete (%d request(s) aborted); exiting with status 0", aborted)
    kill_process_tree(os.getpid(), include_parent=False)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    logging.shutdown()
    os._exit(0)

"""The scheduler process's CPython switch interval while a HiCache storage tier runs
(docs/hicache.md "L3 and the GIL").

SGLang's storage threads (backup, prefetch, read helper) run in the scheduler process and share its
GIL with the scheduler loop, which keeps the GIL while it runs. A thread that gives the GIL up for a
system call waits up to the switch interval (CPython's default: 5 ms) to get it back, and one page
file costs several such hand-offs. `apply` sets a shorter interval when a storage backend is
configured and `SGLANG_DSV41_HICACHE_SWITCH_INTERVAL_MS` (milliseconds; unset or `off` leaves CPython's
value) asks for it. Opt-in on every device: it made L3 slower in CPU servers and is not yet measured in
an H200 server (docs/hicache.md); `TRIAL_MS` is the value the device scripts try. Called once per
process, in `hicache_stack`'s stack build; logged either way.
"""
from __future__ import annotations

import logging
import os
import sys

logger = logging.getLogger(__name__)

ENV = "SGLANG_DSV41_HICACHE_SWITCH_INTERVAL_MS"
TRIAL_MS = 0.2


def interval_s(device: str = "cuda", environ=os.environ) -> float | None:
    """The switch interval (seconds) to set, or None (unset or `off`, on any `device`). Raises on a
    value that is not a positive number."""
    raw = environ.get(ENV, "").strip().lower()
    if not raw:
        return None
    if raw == "off":
        return None
    try:
        ms = float(raw)
    except ValueError:
        ms = -1.0
    if not ms > 0 or ms > 1e4:
        raise RuntimeError(f"sglang-dsv41: {ENV}={raw!r}: give milliseconds > 0 (e.g. {TRIAL_MS}) or 'off'")
    return ms / 1e3


def apply(storage_backend: str | None, device: str = "cuda", environ=os.environ) -> float | None:
    """With a storage backend, set the switch interval (`interval_s`); the interval now set, or None
    when nothing changed (no storage backend, or `off`)."""
    if storage_backend is None:
        return None
    before, want = sys.getswitchinterval(), interval_s(device, environ)
    if want is None:
        logger.info("sglang-dsv41 HiCache: storage %s; switch interval left at %.3f ms (%s=%s)", storage_backend,
                    before * 1e3, ENV, environ.get(ENV) or f"unset, device {device}")
        return None
    sys.setswitchinterval(want)
    now = sys.getswitchinterval()
    logger.info("sglang-dsv41 HiCache: storage %s; scheduler process (pid %d) switch interval %.3f -> %.3f ms "
                "(storage threads get the GIL back sooner; %s)", storage_backend, os.getpid(), before * 1e3,
                now * 1e3, ENV)
    return now

"""The scheduler's bounded wait when it has nothing to run, shared by the `Scheduler.on_idle` hooks
(`runtime/pd_cpu.py`: a CPU PD server waiting on its peer; `runtime/hicache_idle.py`: requests
waiting on a storage prefetch). The wait is on SGLang's idle poller, so a new request ends it at
once, and it releases the GIL."""
from __future__ import annotations

import os
import time


def env_ms(env: str, default: float) -> float:
    """Milliseconds from `env` (`default` when unset); ValueError naming `env` unless a number ≥ 0."""
    raw = os.environ.get(env)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{env}={raw!r}: expected milliseconds (a number >= 0)") from None
    if not value >= 0:
        raise ValueError(f"{env}={raw!r}: expected milliseconds (a number >= 0)")
    return value


def wait_on_idle_poller(scheduler, ms: float) -> None:
    """Wait up to `ms` on the scheduler's idle poller, or sleep `ms` where it has none."""
    poller = getattr(getattr(scheduler, "idle_sleeper", None), "poller", None)
    if poller is not None:
        poller.poll(ms)
    else:
        time.sleep(ms / 1000)

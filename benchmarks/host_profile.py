"""Where an eager forward's host time goes: one call under cProfile (issue 21; used by `hit_extend.py`
and `prefill_profile.py`).

`host_profile(fn, sync)` runs fn() once under cProfile, synchronised before and after, and returns the top
functions by self and by cumulative milliseconds ("file:line(name)"), the self time summed by package
(`package_of`: triton_kernels, triton, torch, C built-ins such as torch ops and driver calls, and our own files
by path), the callers of the top self-time functions (who issues the `torch.empty`s), and the profiled wall.
cProfile roughly doubles the wall of launch-bound code: compare its shares, not its milliseconds, with
unprofiled walls.
"""
from __future__ import annotations

import collections
import cProfile
import pstats
import time
from pathlib import Path
from typing import Callable

#: functions kept per table
CPROFILE_TOP = 30
#: top self-time functions whose callers are listed, and callers kept per function
CALLER_FUNCTIONS, CALLERS_EACH = 10, 4
#: self time grouped by these path markers (first match; None: our own file by its path from the marker), else "other"
PACKAGES = (("triton_kernels/", "triton_kernels"), ("/triton/", "triton"), ("/torch/", "torch"),
            ("sglang_dsv41/", None), ("/kernels/", None))
#: pstats' file name of C functions (built-in methods: torch ops, tensor methods, driver calls)
BUILTIN_FILE, BUILTIN_PACKAGE = "~", "C built-ins"


def package_of(path: str) -> str:
    """The PACKAGES group of a source path; our own files (None) by their path from the package root;
    C functions (pstats' "~") as BUILTIN_PACKAGE."""
    if path == BUILTIN_FILE:
        return BUILTIN_PACKAGE
    for marker, name in PACKAGES:
        if marker in path:
            return name or marker.strip("/") + "/" + path.split(marker, 1)[1]
    return "other"


def _name(key: tuple) -> str:
    f, line, name = key
    return f"{Path(f).name}:{line}({name})"


def host_profile(fn: Callable[[], object], sync: Callable[[], object], top: int = CPROFILE_TOP) -> dict:
    """fn() once under cProfile (module doc): by_self, by_cumulative, self_ms_by_package, callers,
    profiled_wall_ms."""
    prof = cProfile.Profile()
    sync()
    t0 = time.perf_counter()
    prof.enable()
    fn()
    sync()
    prof.disable()
    wall = time.perf_counter() - t0
    stats = pstats.Stats(prof).stats                 # {(file, line, name): (cc, nc, tt, ct, callers)}
    rows = [(key, nc, tt, ct, callers) for key, (_, nc, tt, ct, callers) in stats.items()]
    by_pkg: dict[str, float] = collections.Counter()
    for key, _, tt, _, _ in rows:
        by_pkg[package_of(key[0])] += tt

    def table(index: int) -> list[dict]:
        best = sorted(rows, key=lambda r: -r[index])[:top]
        return [{"fn": _name(r[0]), "calls": r[1], "self_ms": round(r[2] * 1e3, 3), "cum_ms": round(r[3] * 1e3, 3)}
                for r in best]

    callers = {}
    for key, _, _, _, by in sorted(rows, key=lambda r: -r[2])[:CALLER_FUNCTIONS]:
        ranked = sorted(by.items(), key=lambda kv: -kv[1][3])[:CALLERS_EACH]    # (cc, nc, tt, ct) per caller
        callers[_name(key)] = [{"caller": _name(c), "calls": v[1], "cum_ms": round(v[3] * 1e3, 3)} for c, v in ranked]
    return {"profiled_wall_ms": round(wall * 1e3, 2), "by_self": table(2), "by_cumulative": table(3),
            "self_ms_by_package": {k: round(v * 1e3, 3) for k, v in sorted(by_pkg.items(), key=lambda kv: -kv[1])[:25]},
            "callers": callers}


def summary_lines(profile: dict, rows: int = 12) -> list[str]:
    """Printable lines: the profiled wall and self ms by package, then the top `rows` functions by self time."""
    lines = [f"  cProfile wall {profile['profiled_wall_ms']} ms; self ms by package: {profile['self_ms_by_package']}"]
    lines += [f"    self {r['self_ms']:8.3f} ms  cum {r['cum_ms']:8.3f} ms  x{r['calls']:5d}  {r['fn']}"
              for r in profile["by_self"][:rows]]
    return lines


__all__ = ["BUILTIN_PACKAGE", "CPROFILE_TOP", "PACKAGES", "host_profile", "package_of", "summary_lines"]

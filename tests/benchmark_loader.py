"""Load a script of `benchmarks/` as a module for CPU tests (the scripts are not a package)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(filename: str) -> ModuleType:
    """`benchmarks/<filename>` executed as module `bench_<stem>` (registered in sys.modules so
    dataclasses and pickling resolve it)."""
    path = BENCHMARKS / filename
    spec = importlib.util.spec_from_file_location(f"bench_{path.stem}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod

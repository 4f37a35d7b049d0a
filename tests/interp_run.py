"""Run a script under the test suite's Triton-interpreter wraps (`tests/triton_interp_compat.py`).

``TRITON_INTERPRET=1 python tests/interp_run.py SCRIPT [ARG …]`` installs the wraps, then runs
SCRIPT as ``__main__`` with ARG … as its arguments, in this process. The caller sets the variable:
Triton reads it when a kernel is decorated, and the wraps import Triton first.
"""
from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("interp_run.py: set TRITON_INTERPRET=1 (Triton reads it before the script can)")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import triton_interp_compat

    triton_interp_compat.install()
    script, *args = sys.argv[1:]
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")

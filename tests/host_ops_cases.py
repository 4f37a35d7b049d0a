"""The host-work test's two `benchmarks/host_ops.py` cases, as a child pytest run (`tests/child_runs.py`).

`tests/test_runtime_host_ops.py::test_cuda_path_host_work_is_bounded_and_flat_in_context` asserts that
this file's one test passed in a child pytest (``pytest tests/host_ops_cases.py``; the name keeps it out
of the suite's own collection). As a child run it is queued when collection ends and may run ahead at
nice 19 on a core the suite leaves idle; the checks are the same wherever it runs. The child makes its
own tiny checkpoint (`make_checkpoint("tiny", seed=0)`, the same files as the suite's `tiny_checkpoint`)
in a temporary directory of its own, not under pytest's numbered base directories: a child session
that made one there could retire the parent's (docs/validation.md, "CI time", session 42).
Its processes have no time limit of their own (`-o timeout=0` in the parent's argv): a run at nice 19
may wait long for a core; the parent test bounds its wait from when it asks and then kills the child's
process group, these processes included.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from test_runtime_host_ops import MAX_ATEN_OPS, MAX_LAUNCHES

ROOT = Path(__file__).resolve().parents[1]


def test_cuda_path_host_work_is_bounded_and_flat_in_context() -> None:
    from sglang_dsv41.checkpoint.synth import make_checkpoint

    with tempfile.TemporaryDirectory(prefix="host_ops_") as tmp:
        tmp_path = Path(tmp)
        checkpoint = make_checkpoint("tiny", tmp_path / "tiny" / "ckpt", seed=0, progress=False)
        env = dict(os.environ, TRITON_INTERPRET="1")
        procs = []
        for prefix in (64, 1024):                  # one process a case, side by side on two cores
            out, log = tmp_path / f"host_ops_{prefix}.json", tmp_path / f"host_ops_{prefix}.log"
            cmd = [sys.executable, str(ROOT / "tests" / "interp_run.py"), str(ROOT / "benchmarks" / "host_ops.py"),
                   "--model-path", str(checkpoint), "--cases", str(prefix), "32", "--out", str(out)]
            with log.open("w") as sink:
                procs.append((subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT),
                              out, log))
        cases = []
        for proc, out, log in procs:
            proc.wait()                            # bounded by the parent's wait, which kills this group
            assert proc.returncode == 0, log.read_text()[-6000:]
            cases += json.loads(out.read_text())["cases"]
    short, long = cases
    for case in (short, long):
        assert case["host_syncs"] == 0, case["host_sync_sites"]
        assert case["aten_ops"] <= MAX_ATEN_OPS, case["by_file"]
        assert case["launches"] <= MAX_LAUNCHES, case["launches_by_line"]
    assert short["by_line"] == long["by_line"]
    assert short["launches_by_line"] == long["launches_by_line"]

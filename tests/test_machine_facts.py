"""`scripts/machine_facts.py`, which `.ci/run` prints before the tests: the CPU, the BLAS kernels
numpy and torch use, and the BLAS variables set (so a host-dependent failure can be read)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def facts(**env: str) -> str:
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "machine_facts.py")], capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, **env), check=True)
    return proc.stdout


def test_prints_cpu_blas_and_variables() -> None:
    out = facts(OPENBLAS_CORETYPE="Haswell")
    lines = out.splitlines()
    assert lines[0].startswith("machine: ") and f"{os.cpu_count()} cores" in lines[0]
    assert any(line.startswith("numpy ") and "CPU capability" in line for line in lines)
    assert any(line.startswith("openblas ") and "architecture Haswell" in line for line in lines), out
    assert "BLAS variables: " in out and "OPENBLAS_CORETYPE=Haswell" in out


def test_ci_prints_the_facts_before_the_tests() -> None:
    run = (ROOT / ".ci" / "run").read_text().splitlines()
    steps = [i for i, line in enumerate(run) if line.startswith("python3 ")]
    commands = [run[i] for i in steps]
    assert [c.split("#")[0].strip() for c in commands] == [
        'python3 -m pip install -e ".[test]"', 'python3 -m pip install -e ".[pd]"', "python3 scripts/machine_facts.py", "python3 -m ruff check .",
        "python3 -m pytest -q"]


def test_ci_installs_the_pd_stack_and_requires_it() -> None:
    """`.ci/run` installs libibverbs1 when the loader lacks it (Mooncake links it) and makes the PD
    server tests fail rather than skip without the PD stack (docs/pd.md)."""
    run = (ROOT / ".ci" / "run").read_text()
    assert "apt-get install -y -qq libibverbs1" in run and "ldconfig -p | grep 'libibverbs" in run
    assert "export SGLANG_DSV41_PD_REQUIRED=1" in run
    assert run.index("SGLANG_DSV41_PD_REQUIRED") < run.index("python3 -m pytest")

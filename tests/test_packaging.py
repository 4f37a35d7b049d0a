"""Packaging invariants: every package directory is installed, `kernels/` installs as
`sglang_dsv41.kernels` (never a top-level `kernels`), the console script dispatches."""
from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import sglang_dsv41
from sglang_dsv41 import cli

ROOT = Path(__file__).resolve().parents[1]


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_package_directory_is_listed_in_pyproject() -> None:
    listed = set(_pyproject()["tool"]["setuptools"]["packages"])
    found = {
        ".".join(p.parent.relative_to(ROOT).parts)
        for p in (ROOT / "sglang_dsv41").rglob("__init__.py")
        if "__pycache__" not in p.parts
    }
    found.add("sglang_dsv41.kernels")
    assert found <= listed, f"missing from [tool.setuptools].packages: {sorted(found - listed)}"


def test_kernels_install_under_the_package() -> None:
    import sglang_dsv41.kernels as k

    assert Path(k.__file__).resolve().parent == ROOT / "kernels"
    dirs = _pyproject()["tool"]["setuptools"]["package-dir"]
    assert dirs["sglang_dsv41.kernels"] == "kernels" and "kernels" not in dirs


def test_pins() -> None:
    deps = _pyproject()["project"]["dependencies"]
    assert "sglang==0.5.17" in deps and "deepseek-recipe==0.2.0" in deps
    assert sglang_dsv41.__version__ == _pyproject()["project"]["version"]


def test_cli_lists_commands_and_rejects_unknown(capsys) -> None:
    assert cli.main([]) == 0
    out = capsys.readouterr().out
    for name in cli.COMMANDS:
        assert name in out
    assert cli.main(["no-such-command"]) == 2
    assert "unknown command" in capsys.readouterr().err


def test_cli_targets_resolve() -> None:
    import importlib

    missing = []
    for name, (target, _) in cli.COMMANDS.items():
        module, func = target.split(":")
        try:
            getattr(importlib.import_module(module), func)
        except (ImportError, AttributeError) as e:
            missing.append(f"{name}: {e}")
    assert not missing, missing


def test_console_script_is_installed() -> None:
    out = subprocess.run([sys.executable, "-m", "sglang_dsv41.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "make-checkpoint" in out.stdout


def test_readme_keeps_three_commands_and_warns_about_max_tokens_on_cpu() -> None:
    """Issue 20: without `max_tokens` the card's request runs to the tiny checkpoint's context on CPU
    (minutes) — the README says so in prose, says what to expect (install, start-up and test
    times, thinking on by default) and still shows exactly its three commands."""
    import re

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert text.count("```sh") == 3
    prose = " ".join(text.split())
    assert re.search(r"always send `max_tokens` on CPU", prose) and "4,096-token context" in prose
    assert "Thinking is on by default" in prose
    # what to expect: install time, server start-up, test time
    assert "about half a minute" in prose and "about 1.5–2 minutes" in prose
    suite = re.search(r"whole suite takes about (\d+)(?:–(\d+))? minutes", prose)
    assert suite, "the README states the suite's time"
    assert int(suite.group(2) or suite.group(1)) <= 40, "the suite must fit the 40-minute CI limit"

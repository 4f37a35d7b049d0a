"""The cookbook cannot drift from the configs: every config has its script(s), every script is
exactly what `sglang_dsv41.deploy.cookbook` generates, and the README walks a user from pip
install to the card's verification requests."""
from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

from sglang_dsv41.deploy.cookbook import expected_scripts

ROOT = Path(__file__).resolve().parents[1]
BOOK = ROOT / "cookbook"


def test_every_config_has_exactly_its_generated_scripts() -> None:
    want = expected_scripts(ROOT / "configs")
    have = {p.name for p in BOOK.glob("*.sh")}
    assert have == set(want), {"missing": sorted(set(want) - have), "orphans": sorted(have - set(want))}
    for name, text in want.items():
        path = BOOK / name
        assert path.read_text() == text, f"cookbook/{name} drifted; run `python -m sglang_dsv41.deploy.cookbook`"
        assert path.stat().st_mode & stat.S_IXUSR, f"cookbook/{name} is not executable"


def test_pd_configs_have_prefill_decode_router_scripts() -> None:
    for role in ("prefill", "decode", "router"):
        assert f"--role {role}" in (BOOK / f"gb200-pd-1p1d-{role}.sh").read_text()


def test_a_script_runs_the_launcher(tmp_path: Path) -> None:
    """The wrapper passes its arguments through: `--dry-run` prints the command."""
    env = dict(os.environ)
    out = subprocess.run(["bash", str(BOOK / "tiny-cpu.sh"), "--dry-run"], capture_output=True, text=True,
                         env=env, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "python -m sglang.launch_server" in out.stdout and "--device cpu" in out.stdout


def test_readme_covers_install_to_verification() -> None:
    text = (BOOK / "README.md").read_text()
    for needle in ("pip install", "sglang-dsv41 doctor", "sglang-dsv41 plan", "--dry-run", "17*19", "323",
                   "image_url", "/v1/chat/completions"):
        assert needle in text, needle
    for script in expected_scripts(ROOT / "configs"):
        assert script in text, f"README does not mention cookbook/{script}"

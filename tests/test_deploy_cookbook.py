"""The cookbook cannot drift from the configs: every config has its script(s), every script is
exactly what `sglang_dsv41.deploy.cookbook` generates, and the README walks a user from pip
install to the card's verification requests."""
from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

from sglang_dsv41 import plugin
from sglang_dsv41.deploy.command import build_launch
from sglang_dsv41.deploy.cookbook import expected_scripts
from sglang_dsv41.deploy.schema import load_config

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


# Short words of the README's "today" column for each thing a config cannot get yet.
SHORT = {"tensor_parallel": "TP size", "dp_attention": "DP attention", "vision": "vision", "cuda_graphs": "CUDA graphs", "kv_cache_dtype": "fp8 KV",
         "kv_layout_v41": "FP4 KV", "engram_host_table": "Engram host", "dspark": "DSpark", "pd_disaggregation": "PD",
         "bounded_replay_encoder": "encoder replay", "bounded_replay_decoder": "decoder replay",
         "encoder_data_parallel": "encoder DP", "model": "no plugin", "reasoning_parser": "no parser",
         "tool_parser": "no parser", "text_only": "text-only switch", "pd_vision": "PD images"}


def test_readme_status_column_matches_what_launch_does() -> None:
    """The "today" column says "launches" or lists exactly what `launch` refuses for."""
    rows = {line.split("`")[1].removesuffix(".sh").removesuffix("-prefill"): line.rsplit(" | ", 1)[1].rstrip(" |")
            for line in (BOOK / "README.md").read_text().splitlines() if line.startswith("| `")}
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        unavailable = build_launch(load_config(path), frozenset(plugin.LAUNCH_CAPABILITIES)).unavailable
        if unavailable:
            assert rows[path.stem] == "refused: " + ", ".join(SHORT[u.capability] for u in unavailable), path.stem
        else:
            assert rows[path.stem].startswith("**launches**"), path.stem

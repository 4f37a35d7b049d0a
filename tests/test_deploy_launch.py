"""`sglang-dsv41 launch`: dry-run output pinned per config (tests/golden/launch/*.txt), every
generated flag accepted by SGLang 0.5.17's own argument parser, unavailable plugin options
reported (never dropped), and the run path's refusal/exec behaviour.

Regenerate the golden files after an intended change with
`SGLANG_DSV41_UPDATE_GOLDEN=1 python -m pytest -q tests/test_deploy_launch.py`.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from sglang_dsv41.deploy import capabilities, launch
from sglang_dsv41.deploy.capabilities import CAPABILITIES
from sglang_dsv41.deploy.command import build_launch, render_dry_run, required_capabilities
from sglang_dsv41.deploy.schema import load_config

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
GOLDEN = ROOT / "tests" / "golden" / "launch"
NONE: frozenset[str] = frozenset()
ALL = frozenset(CAPABILITIES)
# Values 0.5.17 cannot know until the plugin registers them before argument parsing (spec runtime.md §B).
PLUGIN_REGISTERED_CHOICES = {("--tool-call-parser", "deepseekv41")}


@pytest.fixture(scope="session")
def sglang_parser() -> argparse.ArgumentParser:
    """SGLang 0.5.17's own CLI parser (importing server_args takes several seconds: once per session)."""
    from sglang.srt.server_args import ServerArgs

    ap = argparse.ArgumentParser(exit_on_error=False)
    ServerArgs.add_cli_args(ap)
    return ap


def _dry_run_text(path: Path) -> str:
    dc = load_config(path)
    return render_dry_run(build_launch(dc, NONE), f"configs/{path.name}", launch._status(dc))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_dry_run_matches_golden(path: Path) -> None:
    text = _dry_run_text(path)
    golden = GOLDEN / f"{path.stem}.txt"
    if os.environ.get("SGLANG_DSV41_UPDATE_GOLDEN") == "1":
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(text)
    assert golden.is_file(), f"no golden file {golden}; regenerate (see module docstring)"
    assert text == golden.read_text(), f"launch --dry-run output for {path.stem} drifted from {golden}"


def test_no_orphan_golden_files() -> None:
    assert {p.stem for p in GOLDEN.glob("*.txt")} == {p.stem for p in CONFIGS}


def _parse(parser: argparse.ArgumentParser, args: tuple[str, ...]) -> argparse.Namespace:
    try:
        return parser.parse_args(list(args))
    except (argparse.ArgumentError, SystemExit) as e:  # pragma: no cover - the assertion message
        raise AssertionError(f"SGLang 0.5.17 rejects {' '.join(args)}: {e}") from None


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_every_generated_flag_exists_in_sglang_0_5_17(path: Path, sglang_parser) -> None:
    dc = load_config(path)
    for c in build_launch(dc, NONE).commands:
        if c.role == "router":
            continue  # sglang-router is a separate package (checked by doctor)
        ns = _parse(sglang_parser, c.args)
        assert ns.model_path == dc.model.path and ns.tp_size == dc.parallel.tp
    # With every capability provided, each flag name still exists; only plugin-registered values differ.
    known = sglang_parser._option_string_actions
    for c in build_launch(dc, ALL).commands:
        if c.role == "router":
            continue
        flags = [a for a in c.args if a.startswith("--")]
        assert all(f in known for f in flags), [f for f in flags if f not in known]
        pairs = set(zip(c.args, c.args[1:]))
        stripped = list(c.args)
        for flag, value in PLUGIN_REGISTERED_CHOICES & pairs:
            i = stripped.index(flag)
            del stripped[i:i + 2]
        _parse(sglang_parser, tuple(stripped))


def test_language_only_is_not_text_only(sglang_parser) -> None:
    """0.5.17's --language-only exists but is EPD disaggregation, so text-only must not map to it."""
    assert "--language-model-only" not in sglang_parser._option_string_actions
    assert "--language-only" in sglang_parser._option_string_actions
    dc = load_config(ROOT / "configs" / "gb200-tp4-text-only.yaml")
    for caps in (NONE, ALL):
        args = build_launch(dc, caps).commands[0].args
        assert "--language-only" not in args


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_unavailable_options_are_listed_not_dropped(path: Path) -> None:
    dc = load_config(path)
    want = required_capabilities(dc)
    plan = build_launch(dc, NONE)
    assert [u.capability for u in plan.unavailable] == want
    text = render_dry_run(plan, str(path), "unvalidated")
    for u in plan.unavailable:
        assert f"- {u.capability}: {u.what}" in text
    full = build_launch(dc, ALL)
    assert full.unavailable == ()
    env = dict(full.commands[0].env)
    args = full.commands[0].args
    for name in want:
        cap = CAPABILITIES[name]
        assert all(k in env for k, _ in cap.env) and all(a in args for a in cap.args)


def test_dspark_and_engram_host_emitted_when_provided() -> None:
    dc = load_config(ROOT / "configs" / "h200-tp4-dspark.yaml")
    cmd = build_launch(dc, ALL).commands[0]
    assert ("--speculative-algorithm", "DSPARK") in set(zip(cmd.args, cmd.args[1:]))
    assert ("--speculative-dspark-block-size", "5") in set(zip(cmd.args, cmd.args[1:]))
    env = dict(cmd.env)
    assert env["SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE"] == "1"
    assert env["SGLANG_DSV41_ENGRAM_HOST_TABLE_LAYOUT"] == "shared"


def test_pd_gives_prefill_decode_router() -> None:
    dc = load_config(ROOT / "configs" / "gb200-pd-1p1d.yaml")
    plan = build_launch(dc, NONE)
    assert [c.role for c in plan.commands] == ["prefill", "decode", "router"]
    pre, dec, router = plan.commands
    assert ("--disaggregation-mode", "prefill") in set(zip(pre.args, pre.args[1:]))
    assert ("--disaggregation-transfer-backend", "nixl") in set(zip(dec.args, dec.args[1:]))
    assert router.module == "sglang_router.launch_router"
    assert "http://gb200-tray-0:30000" in router.args and "8998" in router.args


@pytest.fixture
def no_plugin(monkeypatch):
    monkeypatch.setattr(launch, "available_capabilities", lambda: NONE)


def test_cli_dry_run_prints_the_golden_text(no_plugin, capsys) -> None:
    path = ROOT / "configs" / "h200-tp4.yaml"
    assert launch.cli(["--config", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.split("\n", 1)[1] == (GOLDEN / "h200-tp4.txt").read_text().split("\n", 1)[1]


def test_cli_overrides_and_passthrough(no_plugin, capsys) -> None:
    path = str(ROOT / "configs" / "tiny-h200-tp1.yaml")
    rc = launch.cli(["--config", path, "--dry-run", "--model-path", "/ckpt/tiny", "--port", "31000",
                     "--set", "serving.max_running_requests=4", "--", "--log-level", "debug"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "--model-path /ckpt/tiny" in out and "--port 31000" in out and "--max-running-requests 4" in out
    assert out.rstrip().endswith("--log-level debug")
    assert launch.cli(["--config", path, "--dry-run", "--set", "serving.bogus=1"]) == launch.EXIT_BAD_CONFIG
    assert "bogus" in capsys.readouterr().err
    assert launch.cli(["--config", path, "--dry-run", "--role", "decode"]) == launch.EXIT_BAD_CONFIG


def test_cli_role_selection_for_pd(no_plugin, capsys) -> None:
    path = str(ROOT / "configs" / "h200-pd-1p1d.yaml")
    assert launch.cli(["--config", path, "--dry-run", "--role", "decode"]) == 0
    out = capsys.readouterr().out
    assert "# decode" in out and "# prefill" not in out and "--base-gpu-id 4" in out


def test_cli_refuses_to_run_without_the_plugin(no_plugin, monkeypatch, capsys) -> None:
    calls: list = []
    monkeypatch.setattr(launch, "_exec", calls.append)
    monkeypatch.setattr(launch, "_run_group", lambda cmds: pytest.fail("a single server must be exec'd"))
    path = str(ROOT / "configs" / "h200-tp4.yaml")
    assert launch.cli(["--config", path]) == launch.EXIT_UNAVAILABLE
    err = capsys.readouterr().err
    assert "refusing to launch" in err and "engram_host_table" in err and not calls
    launch.cli(["--config", path, "--allow-unavailable"])
    err = capsys.readouterr().err
    assert "WARNING" in err and "engram_host_table" in err
    (cmd,) = calls
    argv = cmd.argv("python")
    assert argv[1:3] == ["-m", "sglang.launch_server"] and "--tp-size" in argv
    assert launch._child_env(cmd)["PATH"] == os.environ["PATH"]  # the caller's environment is kept


def test_capabilities_come_from_the_plugin_module(monkeypatch) -> None:
    import sys
    import types

    def fake_import(name: str):
        if name == capabilities.PLUGIN_MODULE and name in sys.modules:
            return sys.modules[name]
        err = ModuleNotFoundError(f"No module named {name!r}")
        err.name = name
        raise err

    monkeypatch.setattr(capabilities.importlib, "import_module", fake_import)
    monkeypatch.delitem(sys.modules, capabilities.PLUGIN_MODULE, raising=False)
    assert capabilities.available_capabilities() == NONE  # no plugin module yet
    mod = types.ModuleType(capabilities.PLUGIN_MODULE)
    mod.LAUNCH_CAPABILITIES = ("model", "engram_host_table")
    monkeypatch.setitem(sys.modules, capabilities.PLUGIN_MODULE, mod)
    monkeypatch.setattr(capabilities, "plugin_entry_points", lambda: [])
    assert capabilities.available_capabilities() == {"engram_host_table"}  # 'model' needs the entry point
    monkeypatch.setattr(capabilities, "plugin_entry_points", lambda: ["ep"])
    assert capabilities.available_capabilities() == {"model", "engram_host_table"}
    mod.LAUNCH_CAPABILITIES = ("teleport",)
    with pytest.raises(RuntimeError, match="unknown capabilities"):
        capabilities.available_capabilities()

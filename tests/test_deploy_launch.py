"""`sglang-dsv41 launch`: dry-run output pinned per config (tests/golden/launch/*.txt, rendered
with the capabilities the plugin declares and the current runtime), every generated flag
accepted by SGLang 0.5.17's own argument parser once the plugin's parsers are registered, the
model's server defaults left to the plugin (named in notes, never emitted), unavailable plugin options and runtime limits reported
(never dropped), and the run path's refusal/exec behaviour.

Regenerate the golden files after an intended change with
`SGLANG_DSV41_UPDATE_GOLDEN=1 python -m pytest -q tests/test_deploy_launch.py` and review the diff.
The tiny configs' checkpoint path lives in the cache; the golden files are rendered with
`XDG_CACHE_HOME=/home/user/.cache`.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path

import pytest

from sglang_dsv41 import plugin, serve
from sglang_dsv41.deploy import capabilities, launch
from sglang_dsv41.deploy.capabilities import CAPABILITIES
from sglang_dsv41.deploy.command import build_launch, model_path, render_dry_run, required_capabilities, runtime_limits
from sglang_dsv41.deploy.schema import load_config
from sglang_dsv41.runtime import cpu_env
from sglang_dsv41.runtime.requirements import CURRENT_RUNTIME, TORCH_PATH, RuntimeProfile

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
GOLDEN = ROOT / "tests" / "golden" / "launch"
GOLDEN_CACHE_HOME = "/home/user/.cache"
NONE: frozenset[str] = frozenset()
ALL = frozenset(CAPABILITIES)
PLUGIN = frozenset(plugin.LAUNCH_CAPABILITIES)
NOT_PROVIDED = {"kv_layout_v41", "bounded_replay_encoder", "bounded_replay_decoder"}
HOST_TABLE_ENV = {"SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE": "1", "SGLANG_DSV41_ENGRAM_HOST_TABLE_LAYOUT": "per_rank"}
# A runtime without today's limits: what the launcher does once the runtime grows.
FULL_RUNTIME = RuntimeProfile(name="full", doc="-", flags=(), tp_sizes=(1, 2, 4, 8), vision=True, cuda_graphs=True,
                              pd_disaggregation=True, kv_cache_dtypes=("auto", "bf16", "fp8_e4m3"), dp_attention=True,
                              pd_vision=True)
# Today's runtime with TP1 only: the tensor-parallel refusal the launcher gives for a size it cannot shard.
TP1_RUNTIME = RuntimeProfile(name="tp1", doc="-", flags=(), tp_sizes=(1,), vision=True, cuda_graphs=False,
                             pd_disaggregation=False, kv_cache_dtypes=("auto",), reasons=TORCH_PATH.reasons)


@pytest.fixture(autouse=True)
def fixed_cache_home(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny checkpoint's path depends on the cache dir; pin it for the golden files."""
    monkeypatch.setenv("XDG_CACHE_HOME", GOLDEN_CACHE_HOME)


@pytest.fixture(scope="session")
def sglang_parser() -> argparse.ArgumentParser:
    """SGLang 0.5.17's own CLI parser, built after the plugin registered its parser names (as SGLang
    does: plugins load before argument parsing) with the plugin's `--language-model-only` added (the
    `ServerArgs.add_cli_args` hook's function). Importing server_args takes seconds: once per session."""
    from sglang.srt.server_args import ServerArgs

    from sglang_dsv41.api.register import register_parsers
    from sglang_dsv41.overrides import add_cli_args_hook
    from sglang_dsv41.runtime import graph_backend

    register_parsers()
    graph_backend.register()                  # `--attention-backend dsv41`, as the plugin load does
    ap = argparse.ArgumentParser(exit_on_error=False)
    ServerArgs.add_cli_args(ap)
    add_cli_args_hook(None, ap)
    return ap


def _dry_run_text(path: Path) -> str:
    dc = load_config(path)
    return render_dry_run(build_launch(dc, PLUGIN), f"configs/{path.name}", launch._status(dc))


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
    gpu = not dc.hardware.kind.is_cpu
    for caps in (PLUGIN, ALL):
        for c in build_launch(dc, caps).commands:
            if c.role == "router":
                continue  # sglang-router is a separate package (checked by doctor)
            ns = _parse(sglang_parser, c.args)
            assert ns.model_path == model_path(dc) and ns.tp_size == dc.parallel.tp
            assert ns.reasoning_parser == "deepseek-v41" and ns.tool_call_parser == "deepseek-v41"
            # the model's server defaults are the plugin's, applied inside SGLang: never emitted
            assert ns.attention_backend is None and ns.page_size is None and ns.sampling_backend is None
            assert ns.swa_full_tokens_ratio == 0.8 and not ns.sleep_on_idle and not ns.disable_cuda_graph
            assert ns.device == (None if gpu else "cpu")


def test_parser_names_are_the_ones_the_api_registers() -> None:
    from sglang_dsv41.api import reasoning_parser, tool_parser

    assert capabilities.REASONING_PARSER in reasoning_parser.PARSER_NAMES
    assert capabilities.TOOL_CALL_PARSER in tool_parser.PARSER_NAMES


def test_plugin_declares_what_it_provides_and_nothing_else() -> None:
    assert PLUGIN == {"model", "reasoning_parser", "tool_parser", "engram_host_table", "text_only",
                      "encoder_data_parallel", "dspark"}
    assert capabilities.available_capabilities() == PLUGIN   # entry point installed: "model" counts
    assert NOT_PROVIDED <= set(CAPABILITIES) - PLUGIN
    assert CAPABILITIES["text_only"].args == ("--language-model-only",) and not CAPABILITIES["text_only"].env
    assert CAPABILITIES["encoder_data_parallel"].args == ("--mm-enable-dp-encoder",)   # SGLang's own flag


def test_language_only_is_not_text_only(sglang_parser) -> None:
    """0.5.17's --language-only exists but is EPD disaggregation, so text-only must not map to it;
    it maps to the plugin's --language-model-only (enable_multimodal False), which stock 0.5.17 lacks."""
    from sglang.srt import server_args

    # read SGLang's own source: once the plugin's hook has run in this process (another test file
    # started the plugin), ServerArgs.add_cli_args registers the flag, so a parser built here would not be stock
    assert "--language-model-only" not in Path(server_args.__file__).read_text()
    assert "--language-only" in sglang_parser._option_string_actions
    dc = load_config(ROOT / "configs" / "gb200-tp4-text-only.yaml")
    for caps in (NONE, ALL):
        args = build_launch(dc, caps).commands[0].args
        assert "--language-only" not in args
    args = build_launch(dc, PLUGIN).commands[0].args
    assert "--language-model-only" in args and _parse(sglang_parser, args).enable_multimodal is False
    assert [u.capability for u in build_launch(dc, NONE).unavailable if u.capability == "text_only"] == ["text_only"]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_unavailable_options_are_listed_not_dropped(path: Path) -> None:
    dc = load_config(path)
    want = required_capabilities(dc)
    limits = [u.capability for u in runtime_limits(dc)]
    plan = build_launch(dc, NONE)
    assert [u.capability for u in plan.unavailable if u.source == "plugin"] == want
    assert [u.capability for u in plan.unavailable if u.source == "runtime"] == limits
    text = render_dry_run(plan, str(path), "unvalidated")
    for u in plan.unavailable:
        assert f"- {u.capability}: {u.what}" in text and u.reason in text
    full = build_launch(dc, ALL)
    assert [u.capability for u in full.unavailable] == limits     # the plugin cannot lift runtime limits
    env = dict(full.commands[0].env)
    args = full.commands[0].args
    for name in want:
        cap = CAPABILITIES[name]
        assert all(k in env for k, _ in cap.env) and all(a in args for a in cap.args)
    assert build_launch(dc, ALL, FULL_RUNTIME).unavailable == ()


def test_the_configs_servable_today() -> None:
    """The tiny configs, and the card recipes that ask for nothing beyond the runtime (TP 4/8, Engram
    per_rank, BF16 KV, images, DSpark): h200-tp4, h200-tp4-dspark, h200-tp8, mi355x-tp2."""
    servable = {p.stem for p in CONFIGS if not build_launch(load_config(p), PLUGIN).unavailable}
    assert servable == {"tiny-cpu", "tiny-cpu-pd-1p1d", "tiny-h200-tp1", "tiny-h200-tp1-dspark", "tiny-h200-tp2",
                        "tiny-h200-tp4", "tiny-h200-tp8", "h200-tp4", "h200-tp4-dspark", "h200-tp8", "mi355x-tp2"}


@pytest.mark.parametrize("tp", [4, 8])
def test_tiny_tp4_and_tp8_configs_serve_the_tiny_tp8_checkpoint(tp: int, monkeypatch, tmp_path: Path) -> None:
    """The issue-6 configs name the tiny-tp8 preset: the command's --model-path is its cache
    directory, and the launcher makes exactly that preset there (the default tiny preset's 2
    output groups cannot be sharded 4 or 8 ways)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    dc = load_config(ROOT / "configs" / f"tiny-h200-tp{tp}.yaml")
    assert (dc.model.architecture, dc.model.tiny_seed, dc.parallel.tp, dc.validated) == ("tiny-tp8", 0, tp, False)
    (cmd,) = build_launch(dc, PLUGIN).commands
    want = tmp_path / "sglang-dsv41" / "tiny-tp8-seed0"
    assert cmd.args[cmd.args.index("--model-path") + 1] == str(want) == model_path(dc)
    assert cmd.args[cmd.args.index("--tp-size") + 1] == str(tp)
    made: list[tuple[int, str]] = []
    monkeypatch.setattr(launch, "tiny_checkpoint", lambda seed, preset="tiny":
                        made.append((seed, preset)) or serve.tiny_checkpoint_dir(seed, preset=preset))
    launch.prepare_model(dc)
    assert made == [(0, "tiny-tp8")]


def test_serve_cache_makes_the_tiny_tp8_preset(tmp_path: Path) -> None:
    made = serve.tiny_checkpoint(0, tmp_path, preset="tiny-tp8")
    assert made == tmp_path / "tiny-tp8-seed0" == serve.tiny_checkpoint_dir(0, tmp_path, "tiny-tp8")
    from sglang_dsv41.config import DeepseekV41Config

    text = DeepseekV41Config.from_file(made).text
    assert (text.num_attention_heads, text.o_groups) == (8, 8)
    assert serve.tiny_checkpoint_dir(0, tmp_path) == tmp_path / "tiny-seed0"     # the default preset's name


def test_tp_sizes_the_runtime_cannot_shard_are_refused_naming_the_rule() -> None:
    """TP 2/4/8 pass; 3 and 16 (no divisor of Flash's 8 output groups) are refused with the rule."""
    dc = load_config(ROOT / "configs" / "h200-tp8.yaml")
    assert "tensor_parallel" not in {u.capability for u in build_launch(dc, PLUGIN).unavailable}
    for tp in (3, 16):
        odd = dc.model_copy(update={"parallel": dc.parallel.model_copy(update={"tp": tp})})
        (u,) = [u for u in runtime_limits(odd) if u.capability == "tensor_parallel"]
        assert u.what == f"tensor parallel size {tp}" and u.source == "runtime"
        assert "runtime supports TP1/TP2/TP4/TP8 only" in u.reason and "must divide o_groups" in u.reason
    tp2 = build_launch(load_config(ROOT / "configs" / "tiny-h200-tp2.yaml"), PLUGIN, TP1_RUNTIME).unavailable
    assert [(u.capability, u.source) for u in tp2] == [("tensor_parallel", "runtime")]
    assert "runtime supports TP1 only for now" in tp2[0].reason


def test_dp_attention_is_a_runtime_limit_with_its_reason() -> None:
    for name in ("b200-dep8", "gb200-dep4"):
        dc = load_config(ROOT / "configs" / f"{name}.yaml")
        limits = {u.capability: u for u in runtime_limits(dc)}
        assert "tensor_parallel" not in limits                   # TP 8 / 4 themselves are fine
        assert limits["dp_attention"].what == f"DP attention {dc.parallel.dp_attention} (--enable-dp-attention)"
        assert "whole TP group" in limits["dp_attention"].reason
        assert "--enable-dp-attention" in build_launch(dc, PLUGIN).commands[0].args   # reported, not dropped


def test_runtime_limits_name_their_reason() -> None:
    h200 = {u.capability: u for u in build_launch(load_config(ROOT / "configs" / "h200-tp4.yaml"), PLUGIN).unavailable}
    assert h200 == {}             # Engram host placement is provided (per_rank), vision is served
    no_vision = dataclasses.replace(TORCH_PATH, vision=False)   # a text-only runtime refuses image input
    h200 = {u.capability: u for u in build_launch(load_config(ROOT / "configs" / "h200-tp4.yaml"), PLUGIN,
                                                  no_vision).unavailable}
    assert set(h200) == {"vision"} and "features.text_only" in h200["vision"].reason
    text_only = build_launch(load_config(ROOT / "configs" / "gb200-tp4-text-only.yaml"), PLUGIN).unavailable
    assert "vision" not in {u.capability for u in text_only}
    mi325 = {u.capability: u
             for u in build_launch(load_config(ROOT / "configs" / "mi325x-tp4.yaml"), PLUGIN).unavailable}
    assert "decode full" in mi325["cuda_graphs"].what
    b300 = {u.capability for u in build_launch(load_config(ROOT / "configs" / "b300-dep8.yaml"), PLUGIN).unavailable}
    assert {"kv_cache_dtype", "kv_layout_v41"} <= b300
    pd = {u.capability: u for u in build_launch(load_config(ROOT / "configs" / "h200-pd-1p1d.yaml"), PLUGIN).unavailable}
    assert set(pd) == {"pd_vision"}             # PD over Mooncake is served (docs/pd.md), images through it are not
    assert "features.text_only" in pd["pd_vision"].reason


def test_a_runtime_with_vision_needs_the_text_only_switch() -> None:
    dc = load_config(ROOT / "configs" / "gb200-tp4-text-only.yaml")
    assert "text_only" in required_capabilities(dc, TORCH_PATH)       # today's runtime loads the tower
    assert "text_only" in required_capabilities(dc, FULL_RUNTIME)
    assert "text_only" not in required_capabilities(dc, dataclasses.replace(TORCH_PATH, vision=False))


def test_launch_names_the_plugin_defaults_its_command_leaves_to_sglang() -> None:
    """The dry run's notes list exactly the declared defaults the command does not set (one
    declaration, `runtime/requirements.py`); a config's own value (tiny-cpu's pool size) is kept."""
    for config, device, tp in (("tiny-h200-tp1", "cuda", 1), ("tiny-h200-tp2", "cuda", 2), ("tiny-cpu", "cpu", 1)):
        plan = build_launch(load_config(ROOT / "configs" / f"{config}.yaml"), PLUGIN)
        args = plan.commands[0].args
        noted = [n for n in plan.notes if n.startswith("default the plugin declares")]
        want = [f for f in CURRENT_RUNTIME.flags if f.wanted(device, tp) and f.flag not in args]
        assert [n.split(": ", 1)[1].split(" — ")[0] for n in noted] == [" ".join(f.args()) for f in want]
        assert not any(f.flag in args for f in want)
    cpu = build_launch(load_config(ROOT / "configs" / "tiny-cpu.yaml"), PLUGIN).commands[0].args
    assert cpu[cpu.index("--max-total-tokens") + 1] == "8192"


def test_a_flag_the_user_sets_wins_over_the_runtime(capsys) -> None:
    path = str(ROOT / "configs" / "tiny-h200-tp1.yaml")
    assert launch.cli(["--config", path, "--dry-run", "--", "--attention-backend", "torch_native"]) == 0
    out = capsys.readouterr().out
    assert out.count("--attention-backend") == 1 and "--attention-backend torch_native" in out
    assert "default the plugin declares for the torch path runtime, applied by SGLang at start-up " \
           "(docs/runtime.md): --attention-backend" not in out


def test_dspark_and_engram_host_emitted_when_provided() -> None:
    dc = load_config(ROOT / "configs" / "h200-tp4-dspark.yaml")
    cmd = build_launch(dc, ALL).commands[0]
    assert ("--speculative-algorithm", "DSPARK") in set(zip(cmd.args, cmd.args[1:]))
    assert ("--speculative-dspark-block-size", "5") in set(zip(cmd.args, cmd.args[1:]))
    env = dict(cmd.env)
    assert {k: env[k] for k in HOST_TABLE_ENV} == HOST_TABLE_ENV


def test_dspark_adaptive_verification_follows_the_hardware() -> None:
    """NVIDIA: adaptive verification on by default (SGLang's compact ragged verify), with the
    config's profiled SPS table when given; ROCm (the card) or `adaptive_verification: false`:
    off, the whole block verified; the settings are refused without DSpark or with adaptive off;
    synthetic acceptance (benchmarks only) is emitted only when asked, with verification off."""
    from sglang_dsv41.deploy.schema import config_from_dict, raw_config

    def launched(**spec):
        data = raw_config(ROOT / "configs" / "h200-tp4-dspark.yaml")
        gpu = spec.pop("gpu", None)
        if gpu:
            data["hardware"]["gpu"] = gpu
        data["speculative"].update(spec)
        plan = build_launch(config_from_dict(data), ALL)
        cmd = plan.commands[0]
        return dict(cmd.env), dict(zip(cmd.args, cmd.args[1:])), " ".join(plan.notes)

    env, args, notes = launched()
    assert env["SGLANG_RAGGED_VERIFY_MODE"] == "compact" and "--speculative-dspark-sps-table-path" not in args
    assert "without a profiled SPS cost table" in notes
    env, args, notes = launched(sps_table="/tables/h200.json")
    assert env["SGLANG_RAGGED_VERIFY_MODE"] == "compact" and args["--speculative-dspark-sps-table-path"] == "/tables/h200.json"
    assert "SPS" not in notes
    for off in ({"adaptive_verification": False}, {"gpu": "MI355X"}):
        env, args, notes = launched(**off)
        assert "SGLANG_RAGGED_VERIFY_MODE" not in env and args["--speculative-algorithm"] == "DSPARK", off
        assert "every round verifies the whole block" in notes
    base = raw_config(ROOT / "configs" / "h200-tp4.yaml")
    base["speculative"] = {"adaptive_verification": True}
    with pytest.raises(Exception, match="algorithm is 'none'"):
        config_from_dict(base)
    data = raw_config(ROOT / "configs" / "h200-tp4-dspark.yaml")
    data["speculative"].update(adaptive_verification=False, sps_table="t.json")
    with pytest.raises(Exception, match="adaptive verification is off"):
        config_from_dict(data)
    env, _, notes = launched(adaptive_verification=False, synthetic_acceptance_length=3.51)  # benchmarks only
    assert env["SGLANG_SIMULATE_ACC_LEN"] == "3.51" and "SYNTHETIC acceptance" in notes
    assert "SGLANG_SIMULATE_ACC_LEN" not in launched()[0]                                     # never the default
    for bad, why in (({"synthetic_acceptance_length": 3.51}, "needs speculative.adaptive_verification: false"),
                     ({"adaptive_verification": False, "synthetic_acceptance_length": 7}, "exceeds block_size")):
        data = raw_config(ROOT / "configs" / "h200-tp4-dspark.yaml")
        data["speculative"].update(bad)
        with pytest.raises(Exception, match=why):
            config_from_dict(data)


def test_host_placement_configs_get_the_host_table_environment_from_the_declared_plugin() -> None:
    """configs/h200-tp4.yaml (engram.placement host) launched with what the plugin declares: both
    host-table variables, layout per_rank, in the environment and in the printed shell command; a
    device-placement config gets neither."""
    assert "engram_host_table" in plugin.LAUNCH_CAPABILITIES
    plan = build_launch(load_config(ROOT / "configs" / "h200-tp4.yaml"), PLUGIN)
    assert "engram_host_table" not in {u.capability for u in plan.unavailable}
    (cmd,) = plan.commands
    env = dict(cmd.env)
    assert {k: env[k] for k in HOST_TABLE_ENV} == HOST_TABLE_ENV
    assert cmd.shell().startswith("env SGLANG_DSV41_ENGRAM_HOST_TABLE_LAYOUT=per_rank SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE=1 ")
    for stem in ("h200-tp4-dspark", "mi355x-tp2", "b200-tp2"):
        env = dict(build_launch(load_config(ROOT / "configs" / f"{stem}.yaml"), PLUGIN).commands[0].env)
        assert {k: env[k] for k in HOST_TABLE_ENV} == HOST_TABLE_ENV, stem
    pd = build_launch(load_config(ROOT / "configs" / "h200-pd-1p1d.yaml"), PLUGIN)
    for cmd in pd.commands:
        if cmd.role != "router":
            assert {k: dict(cmd.env)[k] for k in HOST_TABLE_ENV} == HOST_TABLE_ENV, cmd.role
    device = dict(build_launch(load_config(ROOT / "configs" / "h200-tp8.yaml"), PLUGIN).commands[0].env)
    assert not set(HOST_TABLE_ENV) & set(device)


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


def test_cli_dry_run_prints_the_golden_text(capsys) -> None:
    path = ROOT / "configs" / "h200-tp4.yaml"
    assert launch.cli(["--config", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.split("\n", 1)[1] == (GOLDEN / "h200-tp4.txt").read_text().split("\n", 1)[1]


def test_cli_overrides_and_passthrough(capsys) -> None:
    path = str(ROOT / "configs" / "tiny-h200-tp1.yaml")
    rc = launch.cli(["--config", path, "--dry-run", "--model-path", "/ckpt/tiny", "--port", "31000",
                     "--set", "serving.max_running_requests=4", "--", "--log-level", "debug"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "--model-path /ckpt/tiny" in out and "--port 31000" in out and "--max-running-requests 4" in out
    assert "tiny random checkpoint (seed 0)" not in out       # --model-path replaces model.tiny_seed
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
    assert "refusing to launch" in err and "engram_host_table" in err and "model" in err and not calls
    launch.cli(["--config", path, "--allow-unavailable"])
    err = capsys.readouterr().err
    assert "WARNING" in err and "engram_host_table" in err
    (cmd,) = calls
    argv = cmd.argv("python")
    assert argv[1:3] == ["-m", "sglang.launch_server"] and "--tp-size" in argv
    assert launch._child_env(cmd)["PATH"] == os.environ["PATH"]  # the caller's environment is kept


def test_cli_runs_tp2_and_refuses_dp_attention_naming_the_runtime_limit(monkeypatch, capsys) -> None:
    calls: list = []
    monkeypatch.setattr(launch, "_exec", calls.append)
    monkeypatch.setattr(launch, "tiny_checkpoint", lambda seed, preset="tiny": serve.tiny_checkpoint_dir(seed, preset=preset))
    tp2 = str(ROOT / "configs" / "tiny-h200-tp2.yaml")
    assert launch.cli(["--config", tp2]) == 0
    (cmd,) = calls
    assert ("--tp-size", "2") in set(zip(cmd.args, cmd.args[1:])) and not cmd.cpu_engine
    assert "WARNING" not in capsys.readouterr().err
    calls.clear()
    dep = str(ROOT / "configs" / "b200-dep8.yaml")
    assert launch.cli(["--config", dep]) == launch.EXIT_UNAVAILABLE
    err = capsys.readouterr().err
    assert "dp_attention" in err and "whole TP group" in err and "tensor_parallel" not in err and not calls
    assert launch.cli(["--config", dep, "--allow-unavailable"]) == 0
    assert "WARNING" in capsys.readouterr().err
    (cmd,) = calls
    assert ("--tp-size", "8") in set(zip(cmd.args, cmd.args[1:])) and "--enable-dp-attention" in cmd.args


def test_cpu_tp_passed_through_gets_the_cpu_tp_environment(monkeypatch, tmp_path) -> None:
    """`-- --tp-size 2` on tiny-cpu: the launcher adds the CPU TP variables (runtime/cpu_env.py)."""
    calls: list = []
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(launch, "_exec", calls.append)
    monkeypatch.setattr(launch, "tiny_checkpoint", lambda seed, preset="tiny": serve.tiny_checkpoint_dir(seed, preset=preset))
    assert launch.cli(["--config", str(ROOT / "configs" / "tiny-cpu.yaml"), "--", "--tp-size", "2"]) == 0
    (cmd,) = calls
    env = launch._child_env(cmd)
    assert env["SGLANG_CPU_OMP_THREADS_BIND"] == cpu_env.omp_thread_binding(2)
    assert env["SGLANG_NCCL_SO_PATH"] == cpu_env.NO_NCCL_LIBRARY and not Path(env["SGLANG_NCCL_SO_PATH"]).exists()
    one = launch._child_env(build_launch(load_config(ROOT / "configs" / "tiny-cpu.yaml"), PLUGIN).commands[0])
    assert "SGLANG_CPU_OMP_THREADS_BIND" not in one and "SGLANG_NCCL_SO_PATH" not in one


def test_cli_runs_tiny_cpu_with_the_cpu_environment_and_the_cached_checkpoint(monkeypatch, tmp_path) -> None:
    calls: list = []
    made: list = []
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(launch, "_exec", calls.append)
    monkeypatch.setattr(launch, "tiny_checkpoint", lambda seed, preset="tiny": made.append(seed) or serve.tiny_checkpoint_dir(seed, preset=preset))
    assert launch.cli(["--config", str(ROOT / "configs" / "tiny-cpu.yaml")]) == 0
    (cmd,) = calls
    assert made == [0]                                        # made (or found) before exec
    assert cmd.args[cmd.args.index("--model-path") + 1] == str(tmp_path / "sglang-dsv41" / "tiny-seed0")
    env = launch._child_env(cmd)
    assert env["SGLANG_USE_CPU_ENGINE"] == "1" and env["HF_HUB_OFFLINE"] == "1"
    assert env["LD_LIBRARY_PATH"].split(os.pathsep)[0] == str(tmp_path / "sglang-dsv41" / "cuda-stub")
    assert (tmp_path / "sglang-dsv41" / "cuda-stub" / "libcuda.so.1").is_file()


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

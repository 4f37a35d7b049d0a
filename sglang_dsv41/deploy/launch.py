"""`sglang-dsv41 launch --config FILE [--dry-run] [overrides] [-- extra SGLang args]`.

Turns a deployment config into the SGLang 0.5.17 command(s) (`command.build_launch`) and
either prints them (`--dry-run`) or runs them: a single server is `exec`'d in place; a PD
config runs the role named by `--role` (`exec`), or with `--role all` the prefill server,
the decode server and the router on this host as child processes, stopping the others when
one exits.

Policy for what cannot be served yet — options the plugin does not provide, and settings
beyond the current runtime (e.g. DP attention, vision, or a TP size it cannot shard;
`runtime/requirements.py`): `--dry-run` lists them above the command; a real launch refuses
(exit 3) and names each with its reason, unless `--allow-unavailable`, which launches anyway
and repeats the list on stderr. Nothing is dropped silently.

Before a real launch the launcher prepares what the command needs on this machine: the tiny
checkpoint of `model.tiny_seed` (made in the sglang-dsv41 cache on first use, exactly as
`sglang-dsv41 serve` does) and, for CPU configs, SGLang's CPU environment
(`runtime/cpu_env.cpu_environment`).
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from typing import Any

from ..runtime.cpu_env import cpu_environment
from ..runtime.requirements import TP_FLAGS, flag_value
from ..serve import tiny_checkpoint
from .capabilities import available_capabilities
from .command import Command, LaunchPlan, build_launch, describe_unavailable, model_path, render_dry_run
from .schema import DeployConfigError, DeploymentConfig, apply_override, config_from_dict, raw_config

EXIT_BAD_CONFIG = 2
EXIT_UNAVAILABLE = 3


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="sglang-dsv41 launch", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="deployment config (configs/*.yaml)")
    ap.add_argument("--dry-run", action="store_true", help="print the command(s) and environment, run nothing")
    ap.add_argument("--role", choices=("server", "prefill", "decode", "router", "all"),
                    help="which command to run (PD configs: prefill | decode | router | all; default all)")
    ap.add_argument("--model-path", help="override model.path (a checkpoint directory or hub id; replaces "
                                          "model.tiny_seed)")
    ap.add_argument("--served-model-name", help="override model.served_name")
    ap.add_argument("--host", help="override serving.host")
    ap.add_argument("--port", type=int, help="override serving.port")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override any config field by dotted key, e.g. serving.max_running_requests=64")
    ap.add_argument("--allow-unavailable", action="store_true",
                    help="launch even though the plugin lacks options the config asks for (they are listed)")
    return ap


def load_with_overrides(path: str, a: argparse.Namespace, passthrough: list[str]) -> DeploymentConfig:
    data: dict[str, Any] = raw_config(path)
    shortcuts = {"model.path": a.model_path, "model.served_name": a.served_model_name,
                 "serving.host": a.host, "serving.port": a.port}
    for key, value in shortcuts.items():
        if value is not None:
            section, field = key.split(".")
            data.setdefault(section, {})[field] = value
    if a.model_path is not None:
        data["model"].pop("tiny_seed", None)  # an explicit directory replaces the cached tiny checkpoint
    for s in a.set:
        apply_override(data, s)
    if passthrough:
        serving = data.setdefault("serving", {})
        serving["extra_args"] = list(serving.get("extra_args") or []) + passthrough
    return config_from_dict(data, path)


def _status(dc: DeploymentConfig) -> str:
    v = dc.validated_on
    return "unvalidated" if isinstance(v, str) else f"validated on {v.date} ({v.hardware}; {v.log})"


def _select(plan: LaunchPlan, dc: DeploymentConfig, role: str | None) -> list[Command]:
    if dc.pd is None:
        if role not in (None, "server", "all"):
            raise DeployConfigError(f"--role {role}: {dc.name} is a single-server config (roles: server)")
        return list(plan.commands)
    if role in (None, "all"):
        return list(plan.commands)
    if role == "server":
        raise DeployConfigError(f"--role server: {dc.name} is a PD config (roles: prefill, decode, router, all)")
    return [plan.command(role)]


def _child_env(cmd: Command) -> dict[str, str]:
    """The caller's environment, SGLang's CPU environment for CPU commands, then the command's own."""
    tp = flag_value(cmd.args, TP_FLAGS)
    env = (cpu_environment(dict(os.environ), tp_size=int(tp) if tp else 1) if cmd.cpu_engine
           else dict(os.environ))
    env.update(dict(cmd.env))
    return env


def prepare_model(dc: DeploymentConfig) -> None:
    """Make the tiny checkpoint (preset `model.architecture`) of `model.tiny_seed` if it is not in
    the cache yet."""
    if dc.model.tiny_seed is not None:
        made = tiny_checkpoint(dc.model.tiny_seed, preset=dc.model.architecture)
        if str(made) != model_path(dc):
            raise RuntimeError(f"tiny checkpoint made at {made}, but the command names {model_path(dc)}")


def _run_group(cmds: list[Command]) -> int:
    """Start every command; when one exits, stop the rest (by PID) and return its status."""
    procs = [subprocess.Popen(c.argv(sys.executable), env=_child_env(c)) for c in cmds]
    names = {p.pid: c.role for p, c in zip(procs, cmds)}

    def stop_all(*_: object) -> None:
        for p in procs:
            if p.poll() is None:
                p.terminate()

    signal.signal(signal.SIGTERM, stop_all)
    signal.signal(signal.SIGINT, stop_all)
    try:
        while True:
            for p in procs:
                rc = p.poll()
                if rc is not None:
                    print(f"sglang-dsv41 launch: {names[p.pid]} (pid {p.pid}) exited with {rc}; stopping the others",
                          file=sys.stderr)
                    stop_all()
                    for q in procs:
                        try:
                            q.wait(timeout=60)
                        except subprocess.TimeoutExpired:
                            q.kill()
                    return rc
            time.sleep(1.0)
    finally:
        stop_all()


def cli(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    passthrough: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, passthrough = argv[:cut], argv[cut + 1:]
    a = _parser().parse_args(argv)
    try:
        dc = load_with_overrides(a.config, a, passthrough)
        plan = build_launch(dc, available_capabilities())
        cmds = _select(plan, dc, a.role)
    except DeployConfigError as e:
        print(f"sglang-dsv41 launch: {e}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    if a.dry_run:
        shown = LaunchPlan(plan.name, tuple(cmds), plan.unavailable, plan.notes)
        sys.stdout.write(render_dry_run(shown, a.config, _status(dc)))
        return 0
    if plan.unavailable:
        listing = "\n".join("  " + line for u in plan.unavailable for line in describe_unavailable(u))
        if not a.allow_unavailable:
            print(f"sglang-dsv41 launch: {dc.name} cannot be served as configured yet:\n{listing}\n"
                  "refusing to launch; see `--dry-run`, or pass --allow-unavailable to launch anyway", file=sys.stderr)
            return EXIT_UNAVAILABLE
        print(f"sglang-dsv41 launch: WARNING: launching {dc.name} although:\n{listing}", file=sys.stderr)
    prepare_model(dc)
    sys.stdout.flush()
    if len(cmds) == 1:
        _exec(cmds[0])
        return 0  # reached only when _exec is replaced (tests)
    return _run_group(cmds)


def _exec(cmd: Command) -> None:
    """Replace this process with the command (same interpreter, so the same SGLang install)."""
    os.execvpe(sys.executable, cmd.argv(sys.executable), _child_env(cmd))

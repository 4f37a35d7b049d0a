"""`sglang-dsv41` console script: a thin dispatcher to each subcommand's own `cli(argv)`.

Each subcommand lives with the code it drives and owns its argparse; this module only maps
names to `module:function` (imported lazily, so `sglang-dsv41 --help` stays instant and a
broken optional subcommand cannot break the others).
"""
from __future__ import annotations

import importlib
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "make-checkpoint": ("sglang_dsv41.checkpoint.synth:cli", "write a synthetic checkpoint (tiny | tiny-tp8 | slice) in the real format"),
    "verify": ("sglang_dsv41.checkpoint.verify:cli", "check a checkpoint directory against its config.json"),
    "demo": ("sglang_dsv41.demo:cli", "render a chat request and generate with the pure-PyTorch reference"),
    "plan": ("sglang_dsv41.deploy.plan_cli:cli", "memory plan per rank for a deployment config"),
    "launch": ("sglang_dsv41.deploy.launch:cli", "turn a deployment config into the SGLang launch command(s) and run them"),
    "doctor": ("sglang_dsv41.deploy.doctor:cli", "check the environment for serving DeepSeek-V4.1"),
    "serve": ("sglang_dsv41.serve:cli", "serve a V4.1 checkpoint with SGLang on GPU or CPU (default: the tiny checkpoint)"),
}


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: sglang-dsv41 <command> [options]", "", "commands:"]
    lines += [f"  {name.ljust(width)}  {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "`sglang-dsv41 <command> --help` for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"sglang-dsv41: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    target = COMMANDS[name][0]
    module_name, func_name = target.split(":")
    func = getattr(importlib.import_module(module_name), func_name)
    return int(func(rest) or 0)


if __name__ == "__main__":
    raise SystemExit(main())

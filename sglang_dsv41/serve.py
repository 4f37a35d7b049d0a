"""`sglang-dsv41 serve`: run `python -m sglang.launch_server` for a V4.1 checkpoint, on GPU or CPU.

It adds only what plain SGLang cannot do itself:

* Device: CUDA when `torch.cuda.is_available()`, else SGLang's CPU engine (`--device` overrides).
* CPU: the environment SGLang 0.5.17 needs is prepared here (`runtime/cpu_env.py`: the
  `libcuda.so.1` stand-in compiled into the cache dir, `SGLANG_USE_CPU_ENGINE=1`,
  `LD_LIBRARY_PATH`, `HF_HUB_OFFLINE=1`; with `--tp-size N > 1` the per-rank core binding).
* Checkpoint: `--model-path`, or the tiny random checkpoint made on first use in
  `~/.cache/sglang-dsv41/tiny-seed<seed>` (written to a temporary directory, then renamed).

The model's server flags (page size, attention backend, parsers, ...) are not added here: the
plugin declares them as the model's defaults inside SGLang (`sglang_dsv41/overrides.py`), which
also refuses, at start-up, values the runtime cannot serve. Every other argument is passed to
SGLang unchanged. A short banner (what runs, the tiny checkpoint being made, the exact command)
goes to stderr; the server then replaces this process (`exec`), so signals reach SGLang
directly. The plugin is loaded by SGLang through its entry point; the user sets no environment
variables. `--dry-run` prints the environment and the command instead.
"""
from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .runtime.cpu_env import cache_root, cpu_environment
from .runtime.requirements import TP_FLAGS, flag_value

BANNER = "sglang-dsv41 serve:"


@dataclass(frozen=True)
class LaunchCommand:
    """The server command line and its environment."""

    argv: list[str]
    env: dict[str, str]
    device: str
    dry_run: bool = False
    model: str = ""

    def prepared_env(self) -> dict[str, str]:
        """The variables this launcher set or changed (the CPU environment; none on CUDA)."""
        return {k: v for k, v in sorted(self.env.items()) if os.environ.get(k) != v}

    def shell(self) -> str:
        """The command with the prepared environment in front, copy-pastable."""
        prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.prepared_env().items())
        return (prefix + " " if prefix else "") + " ".join(shlex.quote(a) for a in self.argv)


def tiny_checkpoint_dir(seed: int = 0, root: Path | None = None, preset: str = "tiny") -> Path:
    """Where the `preset` (tiny | tiny-tp8) random checkpoint for `seed` lives
    (`<cache>/<preset>-seed<seed>`); pure."""
    return (Path(root) if root is not None else cache_root()) / f"{preset}-seed{seed}"


def tiny_checkpoint(seed: int = 0, root: Path | None = None, preset: str = "tiny",
                    on_make: Callable[[Path], None] | None = None) -> Path:
    """Path of the `preset` (tiny | tiny-tp8) random checkpoint for `seed`, made on first use
    (spec model.md §7).

    A cached checkpoint written by another generator version (`synth.GENERATOR_VERSION`, kept
    in the index metadata) is replaced: the cache never serves weights of older value rules.
    `on_make(target)` is called before a checkpoint is written (not when the cache has it)."""
    from .checkpoint.synth import GENERATOR_VERSION, generator_version, make_checkpoint

    target = tiny_checkpoint_dir(seed, root, preset)
    root = target.parent
    if generator_version(target) == GENERATOR_VERSION:
        return target
    if on_make is not None:
        on_make(target)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{preset}-seed{seed}-", dir=root))
    stale = root / f"{tmp.name}-stale"
    try:
        make_checkpoint(preset, tmp, seed, progress=False)
        if target.exists() and generator_version(target) != GENERATOR_VERSION:
            os.replace(target, stale)             # older generator: move aside, then swap in
        try:
            os.replace(tmp, target)
        except OSError:                           # another process finished first
            if generator_version(target) != GENERATOR_VERSION:
                raise
    finally:
        for leftover in (tmp, stale):
            if leftover.exists():
                shutil.rmtree(leftover, ignore_errors=True)
    return target


def pick_device(requested: str) -> str:
    if requested != "auto":
        return requested
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def say(line: str) -> None:
    """One banner line on stderr (stdout stays the dry run's command)."""
    print(f"{BANNER} {line}", file=sys.stderr, flush=True)


def _announce_tiny(target: Path) -> None:
    say(f"making the tiny checkpoint in {target} (first use; once per generator version)…")


def build_launch(argv: list[str]) -> LaunchCommand:
    """Parse `sglang-dsv41 serve` arguments into the SGLang launch command (no side effects
    except building the CPU stub / tiny checkpoint when needed)."""
    ap = argparse.ArgumentParser(prog="sglang-dsv41 serve", description=__doc__.split("\n\n")[0],
                                 epilog="Other arguments are passed to sglang.launch_server unchanged.")
    ap.add_argument("--model-path", type=Path, default=None,
                    help="V4.1 checkpoint directory (default: the tiny random checkpoint, made on first use)")
    ap.add_argument("--tiny-seed", type=int, default=0, help="seed of the default tiny checkpoint")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--dry-run", action="store_true", help="print the command instead of running it")
    ours, rest = ap.parse_known_args(argv)
    device = pick_device(ours.device)
    if ours.model_path is not None:
        model, what = Path(ours.model_path).resolve(), "the V4.1 checkpoint"
    else:
        model = tiny_checkpoint(ours.tiny_seed, on_make=_announce_tiny).resolve()
        what = f"the tiny random checkpoint (seed {ours.tiny_seed})"
    args = ["--model-path", str(model), "--host", ours.host, "--port", str(ours.port), "--device", device]
    if device == "cpu":
        tp = flag_value(rest, TP_FLAGS)
        mode = flag_value(rest, ("--disaggregation-mode",))
        env = cpu_environment(tp_size=int(tp) if tp and tp.isdigit() else 1, pd=mode not in (None, "null"))
    else:
        env = dict(os.environ)
    argv_out = [sys.executable, "-m", "sglang.launch_server", *args, *rest]
    return LaunchCommand(argv=argv_out, env=env, device=device, dry_run=ours.dry_run,
                         model=f"{what} {model}")


def cli(argv: list[str]) -> int:
    """Entry point of `sglang-dsv41 serve`: exec the SGLang server (does not return on success)."""
    launch = build_launch(argv)
    say(f"DeepSeek-V4.1 on {launch.device}: {launch.model}, served by SGLang with the sglang-dsv41 plugin "
        "(the model's server defaults come from the plugin)")
    if launch.dry_run:
        print(launch.shell())
        return 0
    say(f"running: {launch.shell()}")
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe(launch.argv[0], launch.argv, launch.env)
    return 1  # unreachable: execvpe replaces the process or raises

"""`sglang-dsv41 serve`: run `python -m sglang.launch_server` for a V4.1 checkpoint, on GPU or CPU.

* Device: CUDA when `torch.cuda.is_available()`, else SGLang's CPU engine (`--device` overrides).
* CPU: the environment SGLang 0.5.17 needs is prepared here (`runtime/cpu_env.py`: the
  `libcuda.so.1` stand-in compiled into the cache dir, `SGLANG_USE_CPU_ENGINE=1`,
  `LD_LIBRARY_PATH`, `HF_HUB_OFFLINE=1`).
* Runtime flags: whatever the current runtime declares for the device
  (`runtime/requirements.py`, shared with `sglang-dsv41 launch`): today the torch path's
  `--attention-backend torch_native` everywhere, `--disable-cuda-graph --sampling-backend
  pytorch` on CUDA, a bounded `--max-total-tokens` and `--sleep-on-idle` on CPU. A flag the
  user passes wins. A `--tp-size` the runtime cannot run is refused before SGLang starts.
* Checkpoint: `--model-path`, or the tiny random checkpoint made on first use in
  `~/.cache/sglang-dsv41/tiny-seed<seed>` (written to a temporary directory, then renamed).
* Every other argument is passed to SGLang unchanged. The server replaces this process (`exec`),
  so signals reach SGLang directly. The plugin is loaded by SGLang through its entry point; the
  user sets no environment variables.
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

from .runtime.cpu_env import cache_root, cpu_environment
from .runtime.requirements import CURRENT_RUNTIME, TP_FLAGS, flag_value


@dataclass(frozen=True)
class LaunchCommand:
    """The server command line and its environment."""

    argv: list[str]
    env: dict[str, str]
    device: str
    dry_run: bool = False

    def shell(self) -> str:
        keys = ("SGLANG_USE_CPU_ENGINE", "LD_LIBRARY_PATH", "HF_HUB_OFFLINE")
        prefix = " ".join(f"{k}={shlex.quote(self.env[k])}" for k in keys if k in self.env and self.device == "cpu")
        return (prefix + " " if prefix else "") + " ".join(shlex.quote(a) for a in self.argv)


def tiny_checkpoint_dir(seed: int = 0, root: Path | None = None, preset: str = "tiny") -> Path:
    """Where the `preset` (tiny | tiny-tp8) random checkpoint for `seed` lives
    (`<cache>/<preset>-seed<seed>`); pure."""
    return (Path(root) if root is not None else cache_root()) / f"{preset}-seed{seed}"


def tiny_checkpoint(seed: int = 0, root: Path | None = None, preset: str = "tiny") -> Path:
    """Path of the `preset` (tiny | tiny-tp8) random checkpoint for `seed`, made on first use
    (spec model.md §7).

    A cached checkpoint written by another generator version (`synth.GENERATOR_VERSION`, kept
    in the index metadata) is replaced: the cache never serves weights of older value rules."""
    from .checkpoint.synth import GENERATOR_VERSION, INDEX_FILE, generator_version, make_checkpoint

    target = tiny_checkpoint_dir(seed, root, preset)
    root = target.parent
    if generator_version(target) == GENERATOR_VERSION:
        return target
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
    try:
        CURRENT_RUNTIME.check_server_args(rest)
    except ValueError as e:
        ap.error(str(e))
    device = pick_device(ours.device)
    model = ours.model_path if ours.model_path is not None else tiny_checkpoint(ours.tiny_seed)
    args = ["--model-path", str(Path(model).resolve()), "--host", ours.host, "--port", str(ours.port)]
    if device == "cpu":
        tp = flag_value(rest, TP_FLAGS)
        env = cpu_environment(tp_size=int(tp) if tp else 1)
        args += ["--device", "cpu"]
    else:
        env = dict(os.environ)
        args += ["--device", "cuda"]
    args += CURRENT_RUNTIME.server_args(device, rest)
    argv_out = [sys.executable, "-m", "sglang.launch_server", *args, *rest]
    return LaunchCommand(argv=argv_out, env=env, device=device, dry_run=ours.dry_run)


def cli(argv: list[str]) -> int:
    """Entry point of `sglang-dsv41 serve`: exec the SGLang server (does not return on success)."""
    launch = build_launch(argv)
    if launch.dry_run:
        print(launch.shell())
        return 0
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe(launch.argv[0], launch.argv, launch.env)
    return 1  # unreachable: execvpe replaces the process or raises

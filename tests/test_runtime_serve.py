"""`sglang-dsv41 serve` command building and the CPU environment it prepares (spec cpu.md §3)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_dsv41 import cli, serve
from sglang_dsv41.runtime import cpu_env


@pytest.fixture()
def cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path / "sglang-dsv41"


def test_serve_is_a_cli_command() -> None:
    assert cli.COMMANDS["serve"][0] == "sglang_dsv41.serve:cli"


def test_cuda_stub_builds_once_and_answers_no_device(cache_home: Path) -> None:
    stub_dir = cpu_env.ensure_cuda_stub()
    lib = stub_dir / "libcuda.so.1"
    assert stub_dir == cache_home / "cuda-stub" and lib.is_file()
    mtime = lib.stat().st_mtime_ns
    assert cpu_env.ensure_cuda_stub() == stub_dir and lib.stat().st_mtime_ns == mtime   # cached
    (stub_dir / "source.sha256").write_text("stale\n")
    cpu_env.ensure_cuda_stub()
    assert (stub_dir / "source.sha256").read_text().strip() != "stale"                   # rebuilt
    probe = ("import ctypes; c = ctypes.CDLL('libcuda.so.1'); n = ctypes.c_int(7); "
             "print(c.cuInit(0), c.cuDeviceGetCount(ctypes.byref(n)), n.value)")
    env = cpu_env.cpu_environment(dict(os.environ))
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["100", "100", "0"]              # CUDA_ERROR_NO_DEVICE, no devices


def test_cpu_launch_prepares_environment_and_passes_flags_through(cache_home: Path, tiny_checkpoint: Path) -> None:
    launch = serve.build_launch(["--device", "cpu", "--model-path", str(tiny_checkpoint), "--port", "31234",
                                 "--chunked-prefill-size", "64"])
    a = launch.argv
    assert a[:3] == [sys.executable, "-m", "sglang.launch_server"]
    assert a[3:] == ["--model-path", str(tiny_checkpoint.resolve()), "--host", "127.0.0.1", "--port", "31234",
                     "--device", "cpu", "--chunked-prefill-size", "64"]      # no model flags: the plugin's defaults
    env = launch.env
    assert env["SGLANG_USE_CPU_ENGINE"] == "1" and env["HF_HUB_OFFLINE"] == "1"
    assert env["LD_LIBRARY_PATH"].split(os.pathsep)[0] == str(cache_home / "cuda-stub")


def test_no_runtime_flag_is_injected_on_any_device(cache_home: Path, tiny_checkpoint: Path) -> None:
    from sglang_dsv41.runtime.requirements import CURRENT_RUNTIME

    for device in ("cpu", "cuda"):
        for tp in ("1", "2"):
            a = serve.build_launch(["--device", device, "--model-path", str(tiny_checkpoint), "--tp-size", tp]).argv
            assert not [f.flag for f in CURRENT_RUNTIME.flags if f.flag in a], (device, tp)
            assert a[-2:] == ["--tp-size", tp]


def test_default_model_is_the_tiny_checkpoint_made_once(cache_home: Path) -> None:
    first = serve.tiny_checkpoint(seed=3)
    assert first == cache_home / "tiny-seed3" and (first / "config.json").is_file()
    stamp = (first / "model.safetensors.index.json").stat().st_mtime_ns
    assert serve.tiny_checkpoint(seed=3) == first
    assert (first / "model.safetensors.index.json").stat().st_mtime_ns == stamp
    assert not [p for p in cache_home.iterdir() if p.name.startswith(".tiny")]   # no temp dirs left


def test_dry_run_prints_the_environment_and_the_command(cache_home: Path, tiny_checkpoint: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert serve.cli(["--dry-run", "--device", "cpu", "--model-path", str(tiny_checkpoint)]) == 0
    captured = capsys.readouterr()
    (line,) = captured.out.splitlines()
    assert line.startswith("HF_HUB_OFFLINE=1 LD_LIBRARY_PATH=") and " SGLANG_USE_CPU_ENGINE=1 " in line
    assert "-m sglang.launch_server --model-path" in line and "--dry-run" not in line
    assert captured.err.startswith("sglang-dsv41 serve: DeepSeek-V4.1 on cpu: the V4.1 checkpoint ")


def test_banner_names_the_tiny_checkpoint_being_made_and_the_command(cache_home: Path,
                                                                     capsys: pytest.CaptureFixture[str],
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """`serve` without --model-path: 'making the tiny checkpoint…' once, then (real run) the exact
    command on stderr before SGLang replaces the process."""
    made: list[Path] = []
    monkeypatch.setattr("sglang_dsv41.checkpoint.synth.make_checkpoint",
                        lambda preset, out, seed, progress: made.append(Path(out)))
    ran: list[list[str]] = []
    monkeypatch.setattr(serve.os, "execvpe", lambda file, argv, env: ran.append(argv))
    serve.cli(["--device", "cpu", "--tiny-seed", "5"])
    err = capsys.readouterr().err.splitlines()
    target = cache_home / "tiny-seed5"
    assert err[0] == f"sglang-dsv41 serve: making the tiny checkpoint in {target} (first use; once per generator version)…"
    assert err[1].startswith("sglang-dsv41 serve: DeepSeek-V4.1 on cpu: the tiny random checkpoint (seed 5)")
    assert err[2].startswith("sglang-dsv41 serve: running: HF_HUB_OFFLINE=1 ") and ran and made
    assert err[2].endswith(" ".join(ran[0][1:]))


def test_a_cached_tiny_checkpoint_is_not_announced(cache_home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    serve.tiny_checkpoint(seed=4)
    capsys.readouterr()
    assert serve.cli(["--dry-run", "--device", "cpu", "--tiny-seed", "4"]) == 0
    assert "making the tiny checkpoint" not in capsys.readouterr().err


def test_cpu_environment_for_tensor_parallel_binds_cores_and_disables_pynccl() -> None:
    """TP > 1 on CPU: one core range per rank and no NCCL library (see runtime/cpu_env.py)."""
    assert cpu_env.omp_thread_binding(2, cores=2) == "0|1"
    assert cpu_env.omp_thread_binding(2, cores=8) == "0-3|4-7"
    with pytest.raises(ValueError, match="one core per rank"):
        cpu_env.omp_thread_binding(4, cores=2)
    one = cpu_env.cpu_environment({}, tp_size=1)
    assert "SGLANG_CPU_OMP_THREADS_BIND" not in one and "SGLANG_NCCL_SO_PATH" not in one
    two = cpu_env.cpu_environment({}, tp_size=2)
    assert two["SGLANG_CPU_OMP_THREADS_BIND"].count("|") == 1
    assert not Path(two["SGLANG_NCCL_SO_PATH"]).exists()

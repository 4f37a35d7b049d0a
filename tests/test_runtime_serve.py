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


def test_cpu_launch_prepares_environment_and_flags(cache_home: Path, tiny_checkpoint: Path) -> None:
    launch = serve.build_launch(["--device", "cpu", "--model-path", str(tiny_checkpoint), "--port", "31234",
                                 "--chunked-prefill-size", "64"])
    a = launch.argv
    assert a[:3] == [sys.executable, "-m", "sglang.launch_server"]
    flags = dict(zip(a[3::1], a[4::1]))
    assert flags["--model-path"] == str(tiny_checkpoint.resolve()) and flags["--port"] == "31234"
    assert flags["--device"] == "cpu" and flags["--attention-backend"] == "torch_native"
    assert flags["--max-total-tokens"] == "16384"                    # the runtime's CPU default
    assert "--sleep-on-idle" in a and a[-2:] == ["--chunked-prefill-size", "64"]   # passed through
    env = launch.env
    assert env["SGLANG_USE_CPU_ENGINE"] == "1" and env["HF_HUB_OFFLINE"] == "1"
    assert env["LD_LIBRARY_PATH"].split(os.pathsep)[0] == str(cache_home / "cuda-stub")


def test_user_flags_win_over_cpu_defaults(cache_home: Path, tiny_checkpoint: Path) -> None:
    launch = serve.build_launch(["--device", "cpu", "--model-path", str(tiny_checkpoint),
                                 "--max-total-tokens=2048", "--attention-backend", "torch_native"])
    assert launch.argv.count("--attention-backend") == 1
    assert "--max-total-tokens=2048" in launch.argv and "--max-total-tokens" not in launch.argv


def test_default_model_is_the_tiny_checkpoint_made_once(cache_home: Path) -> None:
    first = serve.tiny_checkpoint(seed=3)
    assert first == cache_home / "tiny-seed3" and (first / "config.json").is_file()
    stamp = (first / "model.safetensors.index.json").stat().st_mtime_ns
    assert serve.tiny_checkpoint(seed=3) == first
    assert (first / "model.safetensors.index.json").stat().st_mtime_ns == stamp
    assert not [p for p in cache_home.iterdir() if p.name.startswith(".tiny")]   # no temp dirs left


def test_dry_run_prints_the_command(cache_home: Path, tiny_checkpoint: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert serve.cli(["--dry-run", "--device", "cpu", "--model-path", str(tiny_checkpoint)]) == 0
    out = capsys.readouterr().out
    assert "SGLANG_USE_CPU_ENGINE=1" in out and "-m sglang.launch_server" in out and "--dry-run" not in out


def test_cuda_launch_uses_the_runtime_flags_without_cpu_environment(tiny_checkpoint: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SGLANG_USE_CPU_ENGINE", raising=False)
    launch = serve.build_launch(["--device", "cuda", "--model-path", str(tiny_checkpoint)])
    a = launch.argv
    assert a[a.index("--device") + 1] == "cuda" and a[a.index("--attention-backend") + 1] == "dsv41"
    assert "--disable-cuda-graph" not in a and a[a.index("--cuda-graph-max-bs-decode") + 1] == "16"   # decode graphs at TP 1
    assert "--sleep-on-idle" not in a and "--max-total-tokens" not in a
    assert a[a.index("--sampling-backend") + 1] == "pytorch"   # no flashinfer JIT on a fresh GPU machine
    assert "SGLANG_USE_CPU_ENGINE" not in launch.env
    tp2 = serve.build_launch(["--device", "cuda", "--model-path", str(tiny_checkpoint), "--tp-size", "2"]).argv
    assert "--disable-cuda-graph" in tp2                              # TP > 1 stays eager for now


def test_flags_come_from_the_runtime_declaration(tiny_checkpoint: Path, cache_home: Path) -> None:
    from sglang_dsv41.runtime.requirements import CURRENT_RUNTIME

    for device in ("cpu", "cuda"):
        a = serve.build_launch(["--device", device, "--model-path", str(tiny_checkpoint)]).argv
        want = CURRENT_RUNTIME.server_args(device)
        i = a.index(want[0])
        assert a[i:i + len(want)] == want


def test_tp_beyond_the_runtime_is_refused_before_sglang_starts(tiny_checkpoint: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    for flag in (["--tp-size", "3"], ["--tensor-parallel-size=16"]):
        with pytest.raises(SystemExit):
            serve.build_launch(["--device", "cuda", "--model-path", str(tiny_checkpoint), *flag])
        err = capsys.readouterr().err
        assert "runtime supports TP1/TP2/TP4/TP8 only" in err and "must divide o_groups" in err
    with pytest.raises(SystemExit):
        serve.build_launch(["--device", "cuda", "--model-path", str(tiny_checkpoint), "--tp-size", "2",
                            "--dp-size", "2", "--enable-dp-attention"])
    assert "--enable-dp-attention: the runtime shards attention over the whole TP group" in capsys.readouterr().err
    assert "--tp-size" in serve.build_launch(["--device", "cuda", "--model-path", str(tiny_checkpoint),
                                              "--tp-size", "2"]).argv
    assert "--tp-size" in serve.build_launch(["--device", "cuda", "--model-path", str(tiny_checkpoint),
                                              "--tp-size", "1"]).argv


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

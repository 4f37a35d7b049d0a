"""`sglang-dsv41 doctor`: runs here (no GPU: reported as a failure), says the plugin is not yet
available while it has no entry point, and judges host memory / huge pages for host Engram."""
from __future__ import annotations

from pathlib import Path

from sglang_dsv41.deploy import doctor
from sglang_dsv41.deploy.schema import load_config

ROOT = Path(__file__).resolve().parents[1]


def test_doctor_runs_on_this_machine_and_reports_no_gpu(capsys) -> None:
    rc = doctor.cli([])
    out = capsys.readouterr().out
    assert "[  OK] sglang: 0.5.17" in out
    if doctor.gpu_inventory()[0] == 0:
        assert "[FAIL] gpus: no GPU" in out and rc == 1
    if not doctor.plugin_entry_points():
        assert "[FAIL] plugin: not yet available" in out and rc == 1
    assert out.rstrip().splitlines()[-1].endswith("; ready") == (rc == 0)


def test_doctor_with_a_host_engram_config_checks_host_memory(capsys) -> None:
    rc = doctor.cli(["--config", str(ROOT / "configs" / "h200-tp4.yaml")])
    out = capsys.readouterr().out
    assert "host Engram: needs 377.7 GiB" in out  # two TP4 servers per 8-GPU node, one table each
    assert rc == 1


def test_host_memory_and_huge_pages_rules() -> None:
    gib = 1 << 30
    mi = {"MemTotal": 1000 * gib, "MemAvailable": 900 * gib, "HugePages_Total": 0}
    ok = doctor.check_host_memory(189.0, meminfo=mi, thp="madvise")
    assert [c.status for c in ok] == ["INFO", "OK", "OK"]
    short = doctor.check_host_memory(1000.0, meminfo=mi, thp="always")
    assert short[1].status == "FAIL" and "900.0 GiB available" in short[1].detail
    never = doctor.check_host_memory(189.0, meminfo=mi, thp="never")
    assert never[2].status == "FAIL" and "10× slower" in never[2].detail
    assert doctor.check_host_memory(None, meminfo=mi, thp="never")[-1].status == "WARN"


def test_gpu_checks_against_a_config() -> None:
    dc = load_config(ROOT / "configs" / "h200-tp4.yaml")
    two = lambda: (2, [("NVIDIA H200", 139.8), ("NVIDIA H200", 139.8)], "")  # noqa: E731
    checks = doctor.check_gpus(dc, 73.5, inventory=two)
    assert any(c.status == "FAIL" and "needs 4 GPU(s)" in c.detail for c in checks)
    four = lambda: (4, [("NVIDIA H200", 60.0)] * 4, "")  # noqa: E731
    checks = doctor.check_gpus(dc, 73.5, inventory=four)
    assert any(c.status == "FAIL" and c.name == "gpu memory" for c in checks)
    cpu = load_config(ROOT / "configs" / "tiny-cpu.yaml")
    none = lambda: (0, [], "no device")  # noqa: E731
    assert [c.status for c in doctor.check_gpus(cpu, None, inventory=none)] == ["INFO"]
    assert doctor.check_gpus(None, None, inventory=none)[0].status == "FAIL"


def test_thp_mode_parsing(tmp_path: Path) -> None:
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    assert doctor.thp_mode(str(f)) == "madvise"
    assert doctor.thp_mode(str(tmp_path / "missing")) is None

"""`sglang-dsv41 doctor`: runs here (no GPU and no config: a warning, the CPU engine checked —
the README's main job runs on the CPU), checks that the plugin really
registers through SGLang's own loader (slow: a fresh interpreter), reports the runtime's limits
and a config's excess over them, and judges host memory / huge pages for host Engram."""
from __future__ import annotations

from pathlib import Path

import pytest

from sglang_dsv41.deploy import doctor
from sglang_dsv41.deploy.memory import GIB, ShardLayout, weight_plan
from sglang_dsv41.deploy.plan import make_plan, model_config_for
from sglang_dsv41.deploy.registration import ITEMS, RegistrationReport, probe_registration
from sglang_dsv41.deploy.runtime_residency import engram_host_shards
from sglang_dsv41.deploy.schema import load_config

ROOT = Path(__file__).resolve().parents[1]
REGISTERED = RegistrationReport(registered={k: True for k in ITEMS})


@pytest.fixture(autouse=True)
def fast_probe(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fast tests stand in for the registration probe (one slow test runs the real one)."""
    if request.node.name != "test_the_plugin_really_registers_through_sglangs_loader":
        monkeypatch.setattr(doctor, "probe_registration", lambda: REGISTERED)


def test_doctor_runs_on_this_machine_and_reports_no_gpu(capsys) -> None:
    rc = doctor.cli([])
    out = capsys.readouterr().out
    assert "[  OK] sglang: 0.5.17" in out
    if doctor.gpu_inventory()[0] == 0:   # issue 20: the README's CPU job must not fail the doctor
        assert "[WARN] gpus: no GPU" in out and "sglang-dsv41 serve` runs the tiny checkpoint on the CPU" in out
        assert "[  OK] cpu engine: sgl_kernel imports with the libcuda.so.1 stand-in" in out
        assert "[FAIL]" not in out and rc == 0
    assert "[  OK] plugin: entry point(s) dsv41: SGLang's load_plugins() registers" in out
    assert "[INFO] capabilities: provided: dspark, encoder_data_parallel, engram_host_table, model, reasoning_parser, text_only, tool_parser; " \
           "not provided yet:" in out
    assert "[INFO] runtime: torch path (docs/runtime.md): tensor parallel sizes: 1, 2, 4, 8; vision (image input): yes" in out
    assert out.rstrip().splitlines()[-1].endswith("; ready") == (rc == 0)


def test_plugin_failures_are_reported_not_raised(monkeypatch) -> None:
    broken = RegistrationReport(error="loading the plugin through SGLang exited with 1: sglang-dsv41: boom")
    (check,) = doctor.check_plugin(probe=lambda: broken)
    assert check.status == "FAIL" and "boom" in check.detail
    half = RegistrationReport(registered={"config": True, "model": True, "reasoning_parser": False,
                                          "tool_parser": True})
    (check,) = doctor.check_plugin(probe=lambda: half)
    assert check.status == "FAIL" and "lack our reasoning_parser" in check.detail
    monkeypatch.setenv("SGLANG_PLUGINS", "someone-else")
    (check,) = doctor.check_plugin(probe=lambda: pytest.fail("an excluded plugin is not probed"))
    assert check.status == "FAIL" and "excludes dsv41" in check.detail


@pytest.mark.slow
def test_the_plugin_really_registers_through_sglangs_loader(monkeypatch) -> None:
    report = probe_registration()
    assert report.ok, report
    monkeypatch.setenv("SGLANG_PLUGINS", "only-a-plugin-that-does-not-exist")
    assert probe_registration().missing() == list(ITEMS)       # the probe can fail: it reads the registries


def test_runtime_limits_per_config() -> None:
    for name in ("tiny-h200-tp1", "tiny-h200-tp2"):
        checks = doctor.check_runtime(load_config(ROOT / "configs" / f"{name}.yaml"))
        assert [c.status for c in checks] == ["INFO", "OK"], name
    h200 = doctor.check_runtime(load_config(ROOT / "configs" / "h200-tp4.yaml"))
    assert [c.status for c in h200] == ["INFO", "OK"]                  # the card's recipe, vision included
    dep = doctor.check_runtime(load_config(ROOT / "configs" / "gb200-dep4.yaml"))
    fails = {c.detail.split(" asks for ")[1].split(" ")[0]: c.detail for c in dep if c.status == "FAIL"}
    assert set(fails) == {"dp_attention", "kv_cache_dtype", "kv_layout_v41"}
    assert "runtime limit: the runtime shards attention over the whole TP group" in fails["dp_attention"]


def test_cpu_engine_check_uses_the_launchers_stub(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    (check,) = doctor.check_cpu_engine(load_config(ROOT / "configs" / "tiny-cpu.yaml"))
    assert check.status == "OK" and str(tmp_path / "sglang-dsv41" / "cuda-stub") in check.detail
    assert doctor.check_cpu_engine(load_config(ROOT / "configs" / "tiny-h200-tp1.yaml")) == []
    assert doctor.check_cpu_engine(None) == []
    assert doctor.check_cpu_engine(None, no_gpu=True)[0].status == "OK"


def test_doctor_with_a_host_engram_config_checks_host_memory(capsys) -> None:
    """per_rank layout: each of the 4 ranks pins its own block of rows; one server's blocks add up
    to one copy of the tables, and an 8-GPU node runs two TP4 servers."""
    dc = load_config(ROOT / "configs" / "h200-tp4.yaml")
    cfg = model_config_for(dc, None)[0]
    shards = engram_host_shards(cfg, 4)
    per_server = sum(shards)
    assert per_server == weight_plan(cfg, ShardLayout(tp=4), engram_placement="host").engram_host_per_server
    rc = doctor.cli(["--config", str(ROOT / "configs" / "h200-tp4.yaml")])
    out = capsys.readouterr().out
    assert f"host Engram: needs {2 * per_server / GIB:.1f} GiB of pinned host memory on this node (layout per_rank: " \
           f"each of the 4 rank(s) pins its own block of rows, at most {max(shards) / GIB:.2f} GiB; " \
           f"{per_server / GIB:.1f} GiB per server × 2 server(s) per node)" in out
    assert "host Engram: needs 377.7 GiB" in out   # the card's 188.8 GiB of tables, twice
    assert rc == 1
    with pytest.raises(ValueError, match="there is no host table"):
        doctor.host_engram_layout(make_plan(load_config(ROOT / "configs" / "h200-tp8.yaml"), cfg))


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


def test_unreadable_meminfo_is_reported_as_unknown(tmp_path) -> None:
    assert doctor._meminfo(str(tmp_path / "no-such-file")) == {}
    need = doctor.check_host_memory(189.0, meminfo={}, thp="madvise")
    assert [c.status for c in need] == ["FAIL"] and "unknown" in need[0].detail
    assert doctor.check_host_memory(None, meminfo={}, thp="madvise")[0].status == "WARN"


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
    assert doctor.check_gpus(None, None, inventory=none)[0].status == "WARN"   # serve runs on the CPU
    assert doctor.check_gpus(load_config(ROOT / "configs" / "tiny-h200-tp1.yaml"), None,
                             inventory=none)[0].status == "FAIL"


def test_thp_mode_parsing(tmp_path: Path) -> None:
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    assert doctor.thp_mode(str(f)) == "madvise"
    assert doctor.thp_mode(str(tmp_path / "missing")) is None

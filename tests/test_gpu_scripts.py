"""The device scripts (scripts/gpu/*.sh) without a GPU: every script parses (`bash -n`) and takes
its preamble from scripts/gpu/lib.sh; lib.sh's helpers behave — budget arithmetic, `gpu_setup`,
`tiny_checkpoint` called twice (today's warm-machine failure), server process groups stopped at
EXIT, `wait_up`, `result` — sourced in a bash subprocess whose working directory holds a fake
`.gpu/bin/setup.sh` and whose PATH starts with stub `python3` / `curl` / `nvidia-smi` (tests/gpu_script_stubs/);
tiny_checkpoint_ok.py against real tiny checkpoints; two scripts dry-run end to end on the stubs.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GPU = ROOT / "scripts" / "gpu"
LIB = GPU / "lib.sh"
STUBS = Path(__file__).resolve().parent / "gpu_script_stubs"
SCRIPTS = sorted(GPU.glob("*.sh"))
# scripts that do not run on the device (nothing of lib.sh to share)
NOT_DEVICE = {"lib.sh", "mooncake_store_pack.sh"}


@pytest.fixture
def sandbox(tmp_path: Path) -> dict[str, str]:
    """A fake checkout root (cwd) with `.gpu/bin/setup.sh`, stubs first on PATH; returns the env."""
    (tmp_path / ".gpu" / "bin").mkdir(parents=True)
    (tmp_path / ".gpu" / "bin" / "setup.sh").write_text('export FAKE_SETUP_RAN=1\nreturn "${FAKE_SETUP_RC:-0}"\n')
    (tmp_path / "stub").mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "BUDGET", "SUMMARY", "STOP_GRACE")}
    env.update(PATH=f"{STUBS}:{env['PATH']}", STUB_DIR=str(tmp_path / "stub"), OUT=str(tmp_path / "out"),
               HOME=str(tmp_path))
    return env


def bash(snippet: str, env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess:
    """`snippet` after `set -uo pipefail` and sourcing lib.sh, in the sandbox's root."""
    script = f'set -uo pipefail\nsource "{LIB}"\n{snippet}\n'
    return subprocess.run(["bash", "-c", script], cwd=Path(env["STUB_DIR"]).parent, env=env,
                          capture_output=True, text=True, timeout=timeout)


def calls(env: dict[str, str]) -> list[str]:
    log = Path(env["STUB_DIR"]) / "calls.log"
    return log.read_text().splitlines() if log.exists() else []


def WAIT_FOR_FILE(path: str, cap_s: int = 30) -> str:
    """A bash loop that waits (up to `cap_s`) for `path` to exist: a started process's own signal
    that it got past a point, instead of a sleep that a loaded host can outlast."""
    return f'for _ in $(seq {cap_s * 20}); do [ -e "{path}" ] && break; sleep 0.05; done'


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes whose process group is `pgid`."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            members.append(int(stat.parent.name))
    return members


def kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, 9)
    except ProcessLookupError:
        pass


# ---------------------------------------------------------------------------------------------
# every script
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_parses(script: Path) -> None:
    r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("script", [s for s in SCRIPTS if s.name not in NOT_DEVICE], ids=lambda p: p.name)
def test_device_script_takes_its_preamble_from_lib(script: Path) -> None:
    text = script.read_text()
    assert text.startswith("#!/usr/bin/env bash\n#"), "the header comment (docs/validation.md rows cite it) stays first"
    assert re.search(r'^source "\$\(dirname "\$0"\)/lib\.sh"$', text, re.M), "sources lib.sh next to itself"
    assert text.index("set -uo pipefail") < text.index('/lib.sh"')
    for own in (r"^source \.gpu/bin/setup\.sh", r"^\s*left\(\)", r"^\s*cap\(\)", r"^\s*wait_up\(\)",
                r"make-checkpoint --preset tiny", r"\bsetsid\b", r"^: \"\$\{OUT:=", r"^T0="):
        assert not re.search(own, text, re.M), f"{own!r}: lib.sh has this"


# ---------------------------------------------------------------------------------------------
# lib.sh
# ---------------------------------------------------------------------------------------------
def test_sourcing_sets_out_and_t0(sandbox: dict[str, str], tmp_path: Path) -> None:
    sandbox["OUT"] = str(tmp_path / "new" / "out")
    r = bash('echo "out=$OUT t0=$T0 servers=${#SERVERS[@]}"', sandbox)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "new" / "out").is_dir()
    assert re.fullmatch(r"out=\S+/new/out t0=\d+ servers=0\n", r.stdout)


def test_left_and_cap(sandbox: dict[str, str]) -> None:
    # SECONDS unset loses its clock: elapsed is exactly 30 s
    r = bash("unset SECONDS; SECONDS=1000; T0=970; BUDGET=100\n"
             'echo "$(left) $(left 20) $(left 69) $(left 200)"\n'
             'echo "$(cap 10) $(cap 69) $(cap 70) $(cap 100)"\n'
             'BUDGET=34; echo "$(left) $(cap 2) $(cap 10)"\n'
             'BUDGET=20; echo "$(left) $(left 5) $(cap 5)"', sandbox)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["70 50 1 1", "10 69 65 65", "4 2 1", "1 1 1"]


def test_left_needs_a_budget(sandbox: dict[str, str]) -> None:
    r = bash("left", sandbox)
    assert r.returncode != 0 and "BUDGET" in r.stderr


def test_result_line_and_summary(sandbox: dict[str, str], tmp_path: Path) -> None:
    r = bash('unset SECONDS; SECONDS=50; T0=8\nresult pd_bench rc=0 router=1\n'
             f'SUMMARY={tmp_path}/summary.txt; result "tests/x.py" rc=1 "1 failed"; result "done"', sandbox)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["RESULT pd_bench rc=0 router=1 at 42 s", "RESULT tests/x.py rc=1 1 failed at 42 s",
                                     "RESULT done at 42 s"]
    assert (tmp_path / "summary.txt").read_text().splitlines() == r.stdout.splitlines()[1:]


def test_pack_logs(sandbox: dict[str, str], tmp_path: Path) -> None:
    out = tmp_path / "out"
    sandbox["OUT"] = str(out)
    (out / "tests").mkdir(parents=True)
    (out / "tests" / "a.log").write_text("A")
    (out / "logs").mkdir()
    (out / "logs" / "b.log").write_text("B")
    (out / "step").mkdir()
    (out / "step" / "plot.png").write_bytes(b"png")
    (out / "step" / "r.json").write_text("{}")
    r = bash("pack_logs", sandbox)
    assert r.returncode == 0, r.stderr
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == ["logs.tar.gz", "step", "step/r.json"]
    listed = subprocess.run(["tar", "tzf", str(out / "logs.tar.gz")], capture_output=True, text=True).stdout.split()
    assert sorted(listed) == ["logs/", "logs/a.log", "logs/b.log"]


def test_prefill_profile(sandbox: dict[str, str]) -> None:
    """`prefill_profile VARIANTS CAP`: one decode_step.py process over the variants, its budget CAP − 20 s
    (capped by what is left), its RESULT line, its status."""
    r = bash('unset SECONDS; SECONDS=100; T0=100; BUDGET=500\nprefill_profile "default wide" 110', sandbox)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == "RESULT prefill rc=0 at 0 s"
    assert calls(sandbox) == ["python3 benchmarks/decode_step.py --out " + sandbox["OUT"] + " --quick --no-decode "
                              "--batches 1 --profile-prefill --prefill-variants default wide --budget-s 90"]
    r = bash('unset SECONDS; SECONDS=100; T0=100; BUDGET=50\nprefill_profile default 110', sandbox)
    assert r.returncode == 0 and calls(sandbox)[-1].endswith("--prefill-variants default --budget-s 25")
    r = bash('unset SECONDS; SECONDS=100; T0=100; BUDGET=500\nprefill_profile default 110 1024', sandbox)
    assert r.returncode == 0 and r.stdout.splitlines()[0] == "RESULT prefill 1024 rc=0 at 0 s", r.stderr
    assert calls(sandbox)[-1] == ("python3 benchmarks/decode_step.py --out " + sandbox["OUT"] + "/prefill_1024 --quick "
                                  "--no-decode --batches 1 --profile-prefill --prefill-variants default "
                                  "--prefill-tokens 1024 --budget-s 90")
    assert (Path(sandbox["OUT"]) / "logs" / "prefill_1024.log").exists()


def test_prefill_host(sandbox: dict[str, str], tmp_path: Path) -> None:
    """`prefill_host CAP TOKENS`: prefill_profile of the default variant at TOKENS tokens; its summary lines and
    the host profile the benchmark logged after its "prefill default" line go to $SUMMARY, the RESULT line once."""
    logged = tmp_path / "decode_step.out"
    profile = [f"    self {i}.000 ms  cum {i}.000 ms  x    1  f{i}" for i in range(17)]
    logged.write_text("\n".join(["warming up", "prefill default: 98,000 tokens/s (105,000 chained)", *profile,
                                 "attention sweep (workspace) µs: plan 1"]) + "\n")
    env = dict(sandbox, STUB_DECODE_STEP_OUT=str(logged))
    summary = tmp_path / "summary.txt"
    r = bash(f'unset SECONDS; SECONDS=100; T0=100; BUDGET=500; SUMMARY={summary}\nprefill_host 110 1024', env)
    assert r.returncode == 0, r.stderr
    assert calls(env)[-1].endswith("--prefill-variants default --prefill-tokens 1024 --budget-s 90")
    lines = summary.read_text().splitlines()
    assert lines[0] == "RESULT prefill 1024 rc=0 at 0 s"
    assert lines[1:3] == ["prefill default: 98,000 tokens/s (105,000 chained)", "attention sweep (workspace) µs: plan 1"]
    assert lines[3:] == profile                                          # the 17 cProfile lines, once


def test_graph_summary(sandbox: dict[str, str], tmp_path: Path) -> None:
    """`graph_summary NAME LOG`: graphed / eager prefill-batch counts and the capture and first-replay lines,
    prefixed with NAME, also in $SUMMARY; a missing log prints nothing."""
    log = tmp_path / "s.log"
    log.write_text("[t] Capture target prefill CUDA graph end. elapsed=39.04 s, mem usage=0.21 GB\n"
                   "[t] sglang-dsv41: first prefill CUDA-graph replay (1 request(s), 11 tokens)\n"
                   "[t] Prefill batch, #new-seq: 1, #new-token: 12, cuda graph: True, input throughput\n"
                   "[t] Prefill batch, #new-seq: 1, #new-token: 2, cuda graph: False, input throughput\n"
                   "[t] Prefill batch, #new-seq: 1, #new-token: 1024, cuda graph: True, input throughput\n")
    summary = tmp_path / "summary.txt"
    r = bash(f'SUMMARY={summary}; graph_summary b2k {log}; graph_summary none {tmp_path / "absent.log"}', sandbox)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [
        "b2k: prefill batches cuda graph True 2 False 1",
        "b2k: [t] Capture target prefill CUDA graph end. elapsed=39.04 s, mem usage=0.21 GB",
        "b2k: [t] sglang-dsv41: first prefill CUDA-graph replay (1 request(s), 11 tokens)"]
    assert summary.read_text() == r.stdout


def test_gpu_setup(sandbox: dict[str, str]) -> None:
    r = bash('gpu_setup; echo "$FAKE_SETUP_RAN $XDG_CACHE_HOME $HF_HUB_OFFLINE"', sandbox)
    assert (r.returncode, r.stdout) == (0, "1 /tmp/cache 1\n"), r.stderr
    sandbox["FAKE_SETUP_RC"] = "3"
    r = bash("gpu_setup; echo after", sandbox)
    assert (r.returncode, r.stdout) == (3, "")


def test_gpu_start(sandbox: dict[str, str], tmp_path: Path) -> None:
    """`gpu_start`: $OUT/logs made, `gpu_setup` run, the GPU line as $SUMMARY's first line (a failed set-up exits 3)."""
    summary = tmp_path / "summary.txt"
    r = bash(f'SUMMARY={summary}; gpu_start; echo "setup $FAKE_SETUP_RAN"', sandbox)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["Stub GPU, 1980 MHz, 2619 MHz", "setup 1"]
    assert summary.read_text() == "Stub GPU, 1980 MHz, 2619 MHz\n" and (Path(sandbox["OUT"]) / "logs").is_dir()
    sandbox["FAKE_SETUP_RC"] = "3"
    r = bash(f"SUMMARY={summary}; gpu_start; echo after", sandbox)
    assert (r.returncode, r.stdout) == (3, "")


def test_stub_refuses_a_second_make_like_make_checkpoint(sandbox: dict[str, str], tmp_path: Path) -> None:
    """The stub reproduces today's failure: the old preamble's command run twice fails the second time."""
    old = f"python3 -m sglang_dsv41.cli make-checkpoint --preset tiny --out {tmp_path}/ck --quiet"
    r = bash(f"{old} && {old}", sandbox)
    assert r.returncode == 1 and "--overwrite" in r.stderr


def test_tiny_checkpoint_twice(sandbox: dict[str, str], tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    r = bash(f"tiny_checkpoint {ck} || exit 4; tiny_checkpoint {ck} || exit 4; echo ok", sandbox)
    assert (r.returncode, r.stdout.splitlines()[-1]) == (0, "ok"), r.stderr
    makes = [c for c in calls(sandbox) if "make-checkpoint" in c]
    assert len(makes) == 2 and all(f"--out {ck} " in c and c.endswith("--overwrite") for c in makes)


def test_tiny_checkpoint_reuses_a_complete_one(sandbox: dict[str, str], tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "model.safetensors.index.json").write_text("{}")
    (ck / "STUB_VALID").touch()             # the stub checker's verdict
    r = bash(f"tiny_checkpoint {ck} 30", sandbox)
    assert r.returncode == 0, r.stderr
    assert [c.split()[1].endswith("tiny_checkpoint_ok.py") for c in calls(sandbox)] == [True]
    (ck / "STUB_VALID").unlink()            # partial / stale: written again over it
    r = bash(f"tiny_checkpoint {ck} 30", sandbox)
    assert r.returncode == 0, r.stderr
    assert "make-checkpoint" in calls(sandbox)[-1] and calls(sandbox)[-1].endswith("--overwrite")


def test_tiny_checkpoint_reports_a_failed_make(sandbox: dict[str, str], tmp_path: Path) -> None:
    sandbox["STUB_MAKE_FAIL"] = "1"
    r = bash(f"tiny_checkpoint {tmp_path}/ck || exit 4; echo unreachable", sandbox)
    assert r.returncode == 4 and "unreachable" not in r.stdout


def test_tiny_checkpoint_reuses_a_real_checkpoint(sandbox: dict[str, str], tmp_path: Path,
                                                  tiny_checkpoint: Path) -> None:
    """The real checker through lib.sh, on a copy of the session's tiny checkpoint: nothing rewritten."""
    ck = tmp_path / "ck"
    shutil.copytree(tiny_checkpoint, ck)
    real = tmp_path / "real"
    real.mkdir()
    (real / "python3").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (real / "python3").chmod(0o755)
    sandbox["PATH"] = f"{real}:{sandbox['PATH']}"
    before = {p.name: p.stat().st_mtime_ns for p in ck.iterdir()}
    r = bash(f"tiny_checkpoint {ck}", sandbox, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"tiny checkpoint: reusing {ck}" in r.stdout
    assert {p.name: p.stat().st_mtime_ns for p in ck.iterdir()} == before


def test_exit_trap_stops_the_server_groups(sandbox: dict[str, str]) -> None:
    r = bash('start_server "$OUT/a.log" bash -c "sleep 300 & sleep 300"; a=$SERVER_PID\n'
             'start_server "$OUT/b.log" bash -c "sleep 301 & sleep 301"\n'
             'sleep 0.5; echo "$a $SERVER_PID ${#SERVERS[@]}"; any_alive "$a" && echo alive; exit 7', sandbox)
    pids = [int(x) for x in r.stdout.split()[:2]]
    try:
        assert r.returncode == 7, r.stderr           # the script's own status survives the trap
        assert r.stdout.split()[2:] == ["2", "alive"]
        assert all(group_members(p) == [] for p in pids)
    finally:
        for p in pids:
            kill_group(p)


def test_stop_servers_kills_a_group_that_ignores_term(sandbox: dict[str, str]) -> None:
    sandbox["STOP_GRACE"] = "1"
    # TERM goes out once the group ignores it (its marker file), not after a guessed sleep
    r = bash('start_server "$OUT/s.log" bash -c \'trap "" TERM; touch "$OUT/trapped"; sleep 300 & sleep 300\'\n'
             f'{WAIT_FOR_FILE("$OUT/trapped")}\n'
             'echo "$SERVER_PID"; t=$EPOCHREALTIME; stop_servers; echo "left ${#SERVERS[@]}"\n'
             'echo "$t $EPOCHREALTIME"', sandbox)
    pid = int(r.stdout.split()[0])
    try:
        assert r.returncode == 0 and r.stdout.split()[1:3] == ["left", "0"], r.stderr
        assert group_members(pid) == []
        t0, t1 = (float(x.replace(",", ".")) for x in r.stdout.split()[3:5])   # EPOCHREALTIME: locale decimal mark
        assert t1 - t0 >= 1.0                                # TERM was ignored: KILL after the grace
    finally:
        kill_group(pid)


def test_start_server_logs_and_makes_a_group(sandbox: dict[str, str], tmp_path: Path) -> None:
    r = bash('start_server "$OUT/s.log" bash -c "echo hello; echo oops >&2; touch \\"\\$OUT/said\\"; sleep 300"\n'
             f'{WAIT_FOR_FILE("$OUT/said")}\n'
             'echo "$SERVER_PID $(cut -d" " -f5 "/proc/$SERVER_PID/stat")"', sandbox)
    pid, pgid = (int(x) for x in r.stdout.split())
    kill_group(pid)
    assert r.returncode == 0, r.stderr
    assert pid == pgid
    assert (tmp_path / "out" / "s.log").read_text() == "hello\noops\n"


def test_wait_up(sandbox: dict[str, str]) -> None:
    (Path(sandbox["STUB_DIR"]) / "up").touch()
    r = bash("wait_up http://127.0.0.1:1/health 10 && echo up", sandbox)
    assert r.stdout == "up\n" and calls(sandbox) == ["curl -sf -m 10 -o /dev/null http://127.0.0.1:1/health"]
    (Path(sandbox["STUB_DIR"]) / "up").unlink()
    t = time.monotonic()
    r = bash("wait_up http://127.0.0.1:1/health 3 || echo down", sandbox)
    took = time.monotonic() - t
    assert r.stdout == "down\n" and 1.5 < took < 8, took
    assert "curl -sf -m 3 " in calls(sandbox)[1]      # no curl outlives the wait
    t = time.monotonic()
    r = bash("sleep 0 & p=$!; wait $p; wait_up http://127.0.0.1:1/health 60 $p || echo died", sandbox)
    assert r.stdout == "died\n" and time.monotonic() - t < 10


# ---------------------------------------------------------------------------------------------
# tiny_checkpoint_ok.py (real checkpoints)
# ---------------------------------------------------------------------------------------------
def _checker():
    spec = importlib.util.spec_from_file_location("tiny_checkpoint_ok", GPU / "tiny_checkpoint_ok.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_checker_accepts_the_tiny_checkpoint(tiny_checkpoint: Path) -> None:
    ok = _checker()
    assert ok.problem(tiny_checkpoint) is None
    assert "seed 1" in ok.problem(tiny_checkpoint, seed=1)


@pytest.mark.parametrize("damage", ["no_index", "shard", "config", "version"])
def test_checker_refuses_a_damaged_copy(damage: str, tiny_checkpoint: Path, tmp_path: Path) -> None:
    import json

    ck = tmp_path / "ck"
    shutil.copytree(tiny_checkpoint, ck)
    index = ck / "model.safetensors.index.json"
    if damage == "no_index":
        index.unlink()
    elif damage == "shard":
        sorted(ck.glob("model-*.safetensors"))[-1].unlink()
    elif damage == "config":
        cfg = json.loads((ck / "config.json").read_text())
        cfg["text_config"]["num_attention_heads"] = 8     # the tiny-tp8 preset's
        (ck / "config.json").write_text(json.dumps(cfg))
    else:
        d = json.loads(index.read_text())
        d["metadata"]["sglang_dsv41_generator_version"] = 1
        index.write_text(json.dumps(d))
    ok = _checker()
    why = ok.problem(ck)
    assert why is not None
    assert {"no_index": "generator version None", "shard": "shards missing", "config": "config.json",
            "version": "generator version 1"}[damage] in why
    assert ok.main([str(ck)]) == 1


# ---------------------------------------------------------------------------------------------
# whole scripts on the stubs
# ---------------------------------------------------------------------------------------------
def _run_script(name: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(GPU / name), *args], cwd=Path(env["STUB_DIR"]).parent, env=env,
                          capture_output=True, text=True, timeout=60)


def test_pd_1p1d_bench_twice_on_a_warm_machine(sandbox: dict[str, str]) -> None:
    """Today's failure: the second call found /tmp/tiny made by the first and exited 4 at once."""
    for _ in range(2):
        r = _run_script("pd_1p1d.sh", sandbox, "bench")
        assert r.returncode == 0, r.stdout + r.stderr
        assert re.search(r"^RESULT pd_bench rc=0 router=1 at \d+ s$", r.stdout, re.M), r.stdout
    bench = [c for c in calls(sandbox) if "benchmarks/pd.py" in c]
    assert len(bench) == 2 and "--checkpoint /tmp/tiny" in bench[0]


def test_load_256_starts_waits_and_stops_its_server(sandbox: dict[str, str]) -> None:
    (Path(sandbox["STUB_DIR"]) / "up").touch()
    r = _run_script("load_256.sh", sandbox)
    server = [c for c in calls(sandbox) if c.startswith("server pid=")]
    pid = int(server[0].split("=")[1]) if server else None
    try:
        assert r.returncode == 0, r.stdout + r.stderr
        assert re.search(r"^RESULT load_256 up=1 rc=0 at \d+ s$", r.stdout, re.M), r.stdout
        assert pid is not None and group_members(pid) == []
        assert any("benchmarks/load.py --url http://127.0.0.1:30000 --requests 256" in c for c in calls(sandbox))
    finally:
        if pid:
            kill_group(pid)


def test_hicache_prefix_flash_modes(sandbox: dict[str, str]) -> None:
    """flash: the dummy Flash-width model with the hit-cost phase; tiny-hit: the tiny checkpoint's
    hit cost alone; an unknown MODE refuses before anything runs."""
    r = _run_script("hicache_prefix_flash.sh", sandbox)
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"^RESULT hicache_prefix_flash mode=flash rc=0 at \d+ s$", r.stdout, re.M), r.stdout
    bench = [c for c in calls(sandbox) if "benchmarks/hicache.py --mode prefix" in c]
    assert len(bench) == 1 and "--model-path /tmp/hicache_flash_model --dummy-flash 4 --device cuda" in bench[0]
    assert "--hit-lengths 1024 8192 32768 --profile-hit " in bench[0] and "--mem-fraction-static 0.7" in bench[0]
    # decode graphs by default: with --disable-cuda-graph the overlap scheduler puts an eager decode
    # forward into every TTFT (docs/hicache.md "What a hit costs")
    assert "--cuda-graph-max-bs 8" in bench[0] and "--disable-cuda-graph" not in bench[0]
    assert not any("make-checkpoint" in c for c in calls(sandbox))
    r = _run_script("hicache_prefix_flash.sh", {**sandbox, "MODE": "tiny-hit", "HIT_LENGTHS": "64 128"})
    assert r.returncode == 0, r.stdout + r.stderr
    bench = [c for c in calls(sandbox) if "benchmarks/hicache.py --mode prefix" in c]
    assert len(bench) == 2 and "--model-path /tmp/tiny --hit-cost-only" in bench[1] and "--hit-lengths 64 128 " in bench[1]
    r = _run_script("hicache_prefix_flash.sh", {**sandbox, "MODE": "tiny-hit", "GRAPH": "0"})
    assert r.returncode == 0, r.stdout + r.stderr
    bench = [c for c in calls(sandbox) if "benchmarks/hicache.py --mode prefix" in c]
    assert len(bench) == 3 and "--disable-cuda-graph" in bench[2] and "--cuda-graph-max-bs" not in bench[2]
    r = _run_script("hicache_prefix_flash.sh", {**sandbox, "MODE": "bogus"})
    assert r.returncode == 2 and len([c for c in calls(sandbox) if "hicache.py" in c]) == 3


def test_hit_extend_runs_the_forward_benchmark_on_the_tiny_checkpoint(sandbox: dict[str, str]) -> None:
    r = _run_script("hit_extend.sh", sandbox)
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"^RESULT hit_extend rc=0 at \d+ s$", r.stdout, re.M), r.stdout
    bench = [c for c in calls(sandbox) if "benchmarks/hit_extend.py" in c]
    assert len(bench) == 1 and "--model-path /tmp/tiny " in bench[0] and "--new-tokens 32 1 " in bench[0]


# ---------------------------------------------------------------------------------------------
# test verdicts: a killed pytest is never a pass (session 14: prefill7.json said gpu_tests_pass
# for a run cut at its cap, 15 passed + one unnamed entry, rc 137)
# ---------------------------------------------------------------------------------------------
def _junit(path: Path, named: int, *, unnamed: int = 0, failed: int = 0, collected: int | None = None) -> Path:
    props = "" if collected is None else f'<properties><property name="collected" value="{collected}" /></properties>'
    cases = "".join(f'<testcase classname="tests.test_x" name="test_{i}" time="1.0">'
                    + ('<failure message="boom" />' if i < failed else "") + "</testcase>" for i in range(named))
    cases += '<testcase time="0.000" />' * unnamed
    path.write_text(f'<?xml version="1.0" encoding="utf-8"?><testsuites name="pytest tests"><testsuite name="pytest" '
                    f'errors="0" failures="{failed}" skipped="0" tests="{named}">{props}{cases}</testsuite></testsuites>')
    return path


def _gpu_module(name: str):
    sys.path.insert(0, str(GPU))
    try:
        spec = importlib.util.spec_from_file_location(f"gpu_{name}", GPU / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(GPU))


def test_junit_verdict_needs_rc_zero_and_every_collected_test(tmp_path: Path) -> None:
    jv = _gpu_module("junit_verdict")
    killed = _junit(tmp_path / "killed.xml", 15, unnamed=1, collected=16)
    v = jv.verdict(killed, 137)
    assert v["pass"] is False and v["total"] == 15 and v["unnamed"] == 1 and v["collected"] == 16
    assert any("exit status 137" in w for w in v["why"]) and any("interrupted" in w for w in v["why"])
    assert jv.verdict(killed, 0)["pass"] is False                       # the unnamed entry alone fails it
    old_style = _junit(tmp_path / "old.xml", 15, unnamed=1)            # today's file: no collected count
    assert jv.verdict(old_style, 137)["pass"] is False
    good = _junit(tmp_path / "good.xml", 16, collected=16)
    assert jv.verdict(good, 0)["pass"] is True and jv.verdict(good, "0")["pass"] is True
    for rc in (1, 2, 124, 137, None, ""):
        assert jv.verdict(good, rc)["pass"] is False, rc
    short = _junit(tmp_path / "short.xml", 15, collected=16)            # a case missing, rc 0
    assert jv.verdict(short, 0)["pass"] is False and any("of 16 collected" in w for w in jv.verdict(short, 0)["why"])
    assert jv.verdict(_junit(tmp_path / "f.xml", 16, failed=1, collected=16), 0)["pass"] is False
    assert jv.verdict(tmp_path / "missing.xml", 0)["pass"] is False
    no_count = _junit(tmp_path / "nocount.xml", 3)
    assert jv.verdict(no_count, 0)["pass"] is False and jv.verdict(no_count, 0, expected=3)["pass"] is True
    assert jv.verdict(no_count, 0, expected=4)["pass"] is False
    assert jv.verdict(_junit(tmp_path / "none.xml", 0, collected=0), 0)["pass"] is False


def test_summaries_call_a_killed_run_a_failure(tmp_path: Path) -> None:
    """Every summary that judges a test run, fed today's killed run (junit 15 + unnamed, rc 137)."""
    out = tmp_path / "out"
    out.mkdir()
    _junit(out / "gpu_tests.xml", 15, unnamed=1, collected=16)
    s5 = _gpu_module("speed5_summary")
    assert s5.base_checks(dict(tests=s5.tests(out, 137)))[0]["gpu_tests_pass"] is False
    assert s5.base_checks(dict(tests=s5.tests(out)))[0]["gpu_tests_pass"] is False   # rc unknown
    p8 = _gpu_module("prefill8_summary")
    for mod, args, name in ((s5, [str(out), "137"], "speed5.json"), (p8, [str(out), "137"], "prefill8.json"),
                            (_gpu_module("mhc_sweep_summary"), [str(out), "137"], "mhc_sweep.json"),
                            (_gpu_module("flashmla_summary"), [str(out), "137"], "flashmla.json")):
        assert mod.main(args) == 0
        assert json.loads((out / name).read_text())["checks"]["gpu_tests_pass"] is False, name
    s4 = _gpu_module("speed4_summary")
    assert s4.main([str(out), "137"]) == 0
    assert json.loads((out / "speed4.json").read_text())["tests"]["pass"] is False
    _junit(out / "gpu_tests.xml", 16, collected=16)                     # the same run complete: a pass
    for mod, name in ((s5, "speed5.json"), (p8, "prefill8.json")):
        mod.main([str(out), "0"])
        assert json.loads((out / name).read_text())["checks"]["gpu_tests_pass"] is True, name


def test_mhc_checks_judge_auto_against_the_faster_kernel() -> None:
    p8 = _gpu_module("prefill8_summary")
    row = dict(tokens=64, coefficients_dot_us=135.4, coefficients_rows_us=92.0, dot_vs_rows_max_abs=3e-7)
    assert p8.mhc_checks(dict(rows=[dict(row, auto_kernel="rows", auto_over_best=1.0)])) == dict(
        mhc_auto_within_slack_of_best=True, mhc_dot_close_to_rows=True)
    assert p8.mhc_checks(dict(rows=[dict(row, auto_kernel="dot", auto_over_best=1.47)]))[
        "mhc_auto_within_slack_of_best"] is False
    assert p8.mhc_checks(dict(rows=[row]))["mhc_auto_within_slack_of_best"] is False    # an old sweep: no auto
    assert not any(p8.mhc_checks(None).values()) and not any(p8.mhc_checks(dict(error="x")).values())


@pytest.mark.parametrize("rc,junit,verdict", [(137, "killed", "FAIL"), (0, "killed", "FAIL"), (0, "good", "pass")])
def test_lib_tests_result(sandbox: dict[str, str], tmp_path: Path, rc: int, junit: str, verdict: str) -> None:
    sandbox["STUB_REAL_PYTHON"] = sys.executable
    x = _junit(tmp_path / "j.xml", 15 + (junit == "good"), unnamed=int(junit == "killed"), collected=16)
    r = bash(f'tests_result tests "{x}" {rc}; echo "status=$?"', sandbox)
    lines = r.stdout.splitlines()
    assert re.fullmatch(rf"RESULT tests rc={rc} {verdict}.* at \d+ s", lines[0]), r.stdout + r.stderr
    assert lines[-1] == f"status={0 if verdict == 'pass' else 1}"


def test_prefill7_calls_a_killed_run_a_failure(sandbox: dict[str, str], tmp_path: Path) -> None:
    """prefill7.sh end to end on the stubs: pytest killed at its cap (rc 137, junit 15 + unnamed)."""
    (tmp_path / "scripts").symlink_to(ROOT / "scripts")
    sandbox.update(STUB_REAL_PYTHON=sys.executable, STUB_PYTEST_RC="137",
                   STUB_JUNIT=str(_junit(tmp_path / "killed.xml", 15, unnamed=1, collected=16)))
    r = _run_script("prefill7.sh", sandbox)
    assert r.returncode == 137, r.stdout + r.stderr
    assert re.search(r"^RESULT tests rc=137 FAIL", r.stdout, re.M), r.stdout
    res = json.loads((Path(sandbox["OUT"]) / "prefill7.json").read_text())
    assert res["checks"]["gpu_tests_pass"] is False and res["tests"]["unnamed"] == 1
    assert "prefill: not in STEPS" in r.stdout
    assert any("--junitxml" in c and "test_gpu_prefill_plan_flash_matches_oracle" in c for c in calls(sandbox))


def test_prefill7_tests_fit_the_call() -> None:
    """The tests' cap fits one call: set-up + TEST_CAP + the kill grace + the summary ≤ BUDGET ≤ 300 s,
    and it exceeds today's 156 s of tests before the one the old cap cut."""
    text = (GPU / "prefill7.sh").read_text()
    budget = int(re.search(r'BUDGET:=(\d+)', text).group(1))
    cap = int(re.search(r'TEST_CAP:=(\d+)', text).group(1))
    grace = int(re.search(r'timeout -s INT -k (\d+) "\$t" python3 -m pytest', text).group(1))
    assert budget <= 300 and 10 + cap + grace + 15 <= budget and cap >= 156 + 60


def test_pytest_junit_records_the_collected_count(tmp_path: Path) -> None:
    """tests/conftest.py as a plugin of a real pytest: the junit's `collected` property; a run
    interrupted in its second test (SIGINT, as `timeout -s INT` at the cap) is a failure, a whole run a pass."""
    jv = _gpu_module("junit_verdict")
    mark = tmp_path / "b_started"
    (tmp_path / "test_sleepy.py").write_text(
        "import os, time\n\ndef test_a():\n    pass\n\ndef test_b():\n    open(os.environ['MARK'], 'w').close()\n"
        "    time.sleep(float(os.environ['NAP']))\n\ndef test_c():\n    pass\n")
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'tests'}:{os.environ.get('PYTHONPATH', '')}", MARK=str(mark))

    def run(nap: float, interrupt: bool) -> tuple[int, Path]:
        junit = tmp_path / f"nap{nap}.xml"
        mark.unlink(missing_ok=True)
        proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest",
                                 "--rootdir", str(tmp_path), "-c", os.devnull, "--junitxml", str(junit),
                                 str(tmp_path / "test_sleepy.py")], cwd=tmp_path, env=dict(env, NAP=str(nap)),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.monotonic() + 120
            while interrupt and proc.poll() is None and not mark.exists() and time.monotonic() < deadline:
                time.sleep(0.1)
            if interrupt and proc.poll() is None:
                time.sleep(0.5)
                proc.send_signal(2)
            out, _ = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert junit.exists(), out
        return proc.returncode, junit

    rc, junit = run(0, interrupt=False)
    assert rc == 0 and jv.verdict(junit, rc)["pass"] is True and jv.verdict(junit, rc)["collected"] == 3
    rc, junit = run(60, interrupt=True)
    v = jv.verdict(junit, rc)
    assert rc != 0 and v["pass"] is False and v["collected"] == 3 and v["total"] < 3, v


def test_mhc_mix_fit_from_a_sweep() -> None:
    """benchmarks/mhc_mix.py's threshold fit: the smallest swept T > 1 from which `dot` wins at every
    larger T (today's four H200 points give 1,024, the value of mhc_ops.MIX_DOT_MIN_TOKENS)."""
    spec = importlib.util.spec_from_file_location("mhc_mix_bench", ROOT / "benchmarks" / "mhc_mix.py")
    mm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mm)
    from sglang_dsv41.runtime import mhc_ops

    def rows(points):
        return [dict(tokens=t, coefficients_dot_us=d, coefficients_rows_us=r) for t, d, r in points]

    today = mm.fit(rows([(1, 98.4, 115.5), (64, 135.4, 92.0), (1024, 239.3, 268.1), (8192, 1726.9, 1946.5)]), 1024)
    assert today == dict(fit_dot_min_tokens=1024, threshold_now=1024, swept=[64, 1024, 8192], dot_faster_at=[1, 1024, 8192],
                         rows_faster_at=[64])
    assert today["fit_dot_min_tokens"] == mhc_ops.MIX_DOT_MIN_TOKENS
    assert mm.fit(rows([(2, 1, 2), (128, 1, 2), (256, 2, 1), (512, 1, 2), (8192, 1, 2)]), 0)["fit_dot_min_tokens"] == 512
    assert mm.fit(rows([(2, 1, 2), (8192, 2, 1)]), 0)["fit_dot_min_tokens"] is None
    assert mm.fit(rows([(1, 1, 2), (2, 1, 2), (64, 1, 2)]), 0)["fit_dot_min_tokens"] == 2
    assert set(mm.TOKENS) == {1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 8192}


def test_topk_kernels_runs_the_gpu_tests_then_the_benchmark(sandbox: dict[str, str], tmp_path: Path) -> None:
    """topk_kernels.sh on the stubs: a complete test run and the benchmark → rc 0; a killed test run
    → rc ≠ 0 though the benchmark still runs; the call fits one device command (BUDGET ≤ 300 s)."""
    (tmp_path / "scripts").symlink_to(ROOT / "scripts")
    sandbox.update(STUB_REAL_PYTHON=sys.executable,
                   STUB_JUNIT=str(_junit(tmp_path / "good.xml", 7, collected=7)))
    r = _run_script("topk_kernels.sh", sandbox)
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"^RESULT tests rc=0 pass at \d+ s$", r.stdout, re.M), r.stdout
    assert re.search(r"^RESULT bench rc=0 at \d+ s$", r.stdout, re.M), r.stdout
    tests = [c for c in calls(sandbox) if "-m pytest" in c]
    bench = [c for c in calls(sandbox) if "benchmarks/topk_kernels.py" in c]
    assert len(tests) == 1 and "-m gpu " in tests[0] and tests[0].endswith(" tests/test_kernels_topk_sglang.py")
    assert len(bench) == 1 and f"--out {sandbox['OUT']} --budget-s " in bench[0]
    assert calls(sandbox).index(tests[0]) < calls(sandbox).index(bench[0])
    sandbox.update(STUB_PYTEST_RC="137", STUB_JUNIT=str(_junit(tmp_path / "killed.xml", 6, unnamed=1, collected=7)))
    r = _run_script("topk_kernels.sh", sandbox)
    assert r.returncode != 0 and re.search(r"^RESULT tests rc=137 FAIL", r.stdout, re.M), r.stdout
    assert len([c for c in calls(sandbox) if "benchmarks/topk_kernels.py" in c]) == 2
    text = (GPU / "topk_kernels.sh").read_text()
    assert int(re.search(r'BUDGET:=(\d+)', text).group(1)) <= 300


def test_serving_e2e_restores_and_packs_sglang_jit_and_shares_graph_sizes(sandbox: dict[str, str],
                                                                          tmp_path: Path) -> None:
    """serving_e2e.sh on the stubs, STEPS="sglang ours jitpack", GRAPH_BS="1 16 64", a carried .gpu_jit/: the
    JIT cache is restored before SGLang's server starts, both servers capture exactly those decode sizes,
    SGLang's client budget leaves PACK_RESERVE_S for the pack, and the pack writes to $OUT/jit."""
    (tmp_path / "scripts").symlink_to(ROOT / "scripts")
    (tmp_path / ".gpu_jit").mkdir()
    sandbox.update(STEPS="sglang ours jitpack", GRAPH_BS="1 16 64", BUDGET="300", PACK_RESERVE_S="50")
    r = _run_script("serving_e2e.sh", sandbox)
    assert r.returncode == 0, r.stdout + r.stderr
    log = calls(sandbox)
    restore = [i for i, c in enumerate(log) if "sglang_jit_cache.py restore /tmp/sglang_jit .gpu_jit" in c]
    clients = [(i, c) for i, c in enumerate(log) if "serving_e2e.py client" in c]
    pack = [i for i, c in enumerate(log) if f"sglang_jit_cache.py pack /tmp/sglang_jit {sandbox['OUT']}/jit" in c]
    assert len(restore) == 1 and len(clients) == 2 and len(pack) == 1, log
    (i_sg, sg), (_, ours) = clients
    assert restore[0] < i_sg < pack[0] and "--label sglang_v4" in sg and "--label ours" in ours
    for c in (sg, ours):
        assert " --cuda-graph-bs-decode 1 16 64 " in c and "--cuda-graph-max-bs" not in c
    assert int(re.search(r"--budget-s (\d+)", sg).group(1)) <= 300 - 50 - 15
    assert re.search(r"^RESULT jitpack rc=0 at \d+ s$", r.stdout, re.M), r.stdout
    assert re.search(r"^sglang env: ", r.stdout, re.M), r.stdout          # the switches SGLang ran with, logged
    sandbox.update(STEPS="ours")
    del sandbox["GRAPH_BS"]
    r = _run_script("serving_e2e.sh", sandbox)
    ours = [c for c in calls(sandbox) if "--label ours" in c][-1]
    assert " --cuda-graph-max-bs 64 " in ours and "--budget-s" in ours


def test_serving_e2e_watches_sglang_start_up(sandbox: dict[str, str], tmp_path: Path) -> None:
    """STEPS="sglang" on the stubs: SGLang's server starts with PYTHONFAULTHANDLER=1 (stacks on SIGABRT), and
    while its client runs a watcher logs processes, compilers and cache sizes to $OUT/e2e/sglang_watch.log
    every WATCH_EVERY s until SGLANG_STARTUP_S − 15 s; it stops with the step."""
    (tmp_path / "scripts").symlink_to(ROOT / "scripts")
    sandbox.update(STEPS="sglang", BUDGET="300", WATCH_EVERY="1", SGLANG_STARTUP_S="19", STUB_CLIENT_SLEEP="6")
    r = _run_script("serving_e2e.sh", sandbox)
    assert r.returncode == 0, r.stdout + r.stderr
    client = [c for c in calls(sandbox) if "--label sglang_v4" in c]
    assert len(client) == 1 and client[0].startswith("[faulthandler] "), calls(sandbox)
    ours = [c for c in calls(sandbox) if "serving_e2e.py client" in c and "sglang_v4" not in c]
    assert not ours
    watch = (Path(sandbox["OUT"]) / "e2e" / "sglang_watch.log").read_text()
    entries = re.findall(r"^== \S+ \+\d+ s compilers: \d+$", watch, re.M)
    assert 2 <= len(entries) <= 5, watch


def test_serving_e2e_variants_of_our_server(sandbox: dict[str, str], tmp_path: Path) -> None:
    """serving_e2e.sh STEPS="ours ours_host ours_c2k ours_overlap" on the stubs: four launches of our
    server with the same arguments but for the variant's own — the Engram host-table variable (label
    ours_engram_host), chunked prefill + buckets to 2,048 (label ours_c2k) and the side stream
    (SGLANG_DSV41_OVERLAP=on, label ours_overlap)."""
    (tmp_path / "scripts").symlink_to(ROOT / "scripts")
    sandbox.update(STEPS="ours ours_host ours_c2k ours_overlap", BUDGET="1200")
    r = _run_script("serving_e2e.sh", sandbox)
    assert r.returncode == 0, r.stdout + r.stderr
    runs = {re.search(r"--label (\S+)", c).group(1): c for c in calls(sandbox) if "serving_e2e.py client" in c}
    assert set(runs) == {"ours", "ours_engram_host", "ours_c2k", "ours_overlap"}, runs
    assert "--chunked-prefill-size 2048" in runs["ours_c2k"] and "--chunked-prefill-size" not in runs["ours"]
    assert "--chunked-prefill-size" not in runs["ours_engram_host"] + runs["ours_overlap"]
    assert runs["ours_engram_host"].startswith("[engram_host=1] ")
    assert runs["ours_overlap"].startswith("[overlap=on] ")
    assert not runs["ours"].startswith("[") and not runs["ours_c2k"].startswith("[")

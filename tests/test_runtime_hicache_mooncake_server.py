"""End to end on CPU: HiCache L3 on a Mooncake store (`--hicache-storage-backend mooncake`, our
`runtime/hicache_mooncake.py`) serves the tiny V4.1 checkpoint (docs/hicache.md "L3: the Mooncake
store"; issue 14).

A local `mooncake_master` (HTTP metadata server) and a `mooncake_client` that holds the store's
memory (256 MB segment) run for the module, over TCP. Then, with the settings of
tests/test_runtime_hicache_storage_server.py (512 device tokens, `--hicache-ratio 2`, write_through,
prefetch threshold 16, `timeout` prefetch policy):

* server A serves a long prompt cold; its pages become Mooncake objects (the master's key count);
  A is stopped;
* server B, started fresh on the same master, reloads the prompt from L3
  (`cached_tokens_details.storage`), tokens and logprobs equal to A's cold run;
* the master goes down: B serves the same prompt (device and host tiers flushed, so only L3 could
  provide it) with a cold prefill, equal to the cold run, a warning naming the failed query, a count
  in `sglang_dsv41:hicache_storage_failures_total` (once the ~4 s Mooncake call returns), and no
  traceback or exit.

Mooncake comes with `.[pd]` (`.ci/run`); without it the module is skipped unless
`SGLANG_DSV41_PD_REQUIRED=1`, where it fails. Every wait is bounded; every process started here is
stopped by its own handle.
"""
from __future__ import annotations

import json
import os
import random
import re
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from server_helpers import Server, free_port, running
from test_runtime_hicache_server import LONG, _assert_equal_to_cold, _prompt
from test_runtime_hicache_storage_server import _args as file_args
from test_runtime_hicache_storage_server import _details, _failures, _flush, _run, _wait_for

pytestmark = pytest.mark.slow

WAIT_S = 180
SEGMENT_BYTES = 256 << 20     # the client's segment: the store's memory


def _binaries() -> tuple[Path, Path]:
    try:
        import mooncake
        from mooncake.store import MooncakeDistributedStore  # noqa: F401
    except ImportError as e:
        missing = f"the Mooncake store is not installed ({e}); pip install -e '.[pd]'"
        if os.environ.get("SGLANG_DSV41_PD_REQUIRED") == "1":
            pytest.fail(f"SGLANG_DSV41_PD_REQUIRED=1 but {missing}")
        pytest.skip(missing)
    root = Path(mooncake.__file__).parent
    return root / "mooncake_master", root / "mooncake_client"


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)


class Mooncake:
    """A local master (with its HTTP metadata server) and a client process holding the store's memory."""

    def __init__(self, log_dir: Path) -> None:
        master, client = _binaries()
        self.rpc, self.meta, self.metrics = free_port(), free_port(), free_port()
        self.master_address = f"127.0.0.1:{self.rpc}"
        self.metadata = f"http://127.0.0.1:{self.meta}/metadata"
        self.client: subprocess.Popen | None = None
        self.master = subprocess.Popen(
            [str(master), f"--rpc_port={self.rpc}", "--enable_http_metadata_server",
             f"--http_metadata_server_port={self.meta}", "--http_metadata_server_host=127.0.0.1",
             f"--metrics_port={self.metrics}"],
            stdout=open(log_dir / "master.log", "w"), stderr=subprocess.STDOUT)
        try:
            self._wait(lambda: self.key_count() is not None, "the master's metrics", log_dir / "master.log")
            self.client = subprocess.Popen(
                [str(client), f"--master_server_address={self.master_address}", f"--metadata_server={self.metadata}",
                 f"--global_segment_size={SEGMENT_BYTES >> 20}MB", "--host=127.0.0.1", f"--port={free_port()}",
                 "--protocol=tcp"],
                stdout=open(log_dir / "client.log", "w"), stderr=subprocess.STDOUT)
            # the store has memory once the client's segment is mounted with the master (seen, not slept for)
            self._wait(lambda: (self._gauge("master_total_capacity_bytes") or 0) >= SEGMENT_BYTES,
                       "the client's segment mounted", log_dir / "client.log")
        except BaseException:
            self.stop()
            raise

    def _gauge(self, name: str) -> int | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics}/metrics", timeout=10) as r:
                text = r.read().decode()
        except OSError:
            return None
        m = re.search(rf"^{name} (\d+)", text, re.M)
        return int(m.group(1)) if m else None

    def key_count(self) -> int | None:
        return self._gauge("master_key_count")

    def _wait(self, cond, what: str, log: Path | None = None) -> None:
        deadline = time.monotonic() + WAIT_S
        while not cond():
            procs = [p for p in (self.master, self.client) if p is not None]
            tail = log.read_text(errors="replace")[-2000:] if log is not None and log.exists() else ""
            assert all(p.poll() is None for p in procs), f"{what}: a Mooncake process exited\n{tail}"
            assert time.monotonic() < deadline, f"{what} not seen after {WAIT_S} s\n{tail}"
            time.sleep(0.5)

    def stop(self) -> None:
        for p in (self.client, self.master):
            if p is not None:
                _stop(p)


def _args(mc: Mooncake) -> list[str]:
    args = file_args()
    at = args.index("--hicache-storage-backend")
    args[at + 1] = "mooncake"
    extra = {"prefetch_threshold": 16, "master_server_address": mc.master_address, "metadata_server": mc.metadata,
             "protocol": "tcp", "global_segment_size": 0}
    args[args.index("--hicache-storage-backend-extra-config") + 1] = json.dumps(extra)
    return args


@pytest.fixture(scope="module")
def mooncake(tmp_path_factory: pytest.TempPathFactory):
    mc = Mooncake(tmp_path_factory.mktemp("mooncake"))
    try:
        yield mc
    finally:
        mc.stop()


@pytest.fixture(scope="module")
def cold_a(tiny_checkpoint: Path, mooncake: Mooncake, tmp_path_factory: pytest.TempPathFactory):
    """Server A: the long prompt's cold run, its pages stored as Mooncake objects; A stopped."""
    from sglang_dsv41.runtime.requirements import PAGE_SIZE

    long = _prompt(random.Random(21), LONG)
    log = tmp_path_factory.mktemp("mc_a") / "server.log"
    with running(Server(tiny_checkpoint, log, _args(mooncake))) as a:
        assert "served by dsv41-mooncake" in a.log_tail(10_000_000)
        before = mooncake.key_count()
        cold = _run(a, long)
        assert cold["meta_info"]["cached_tokens"] == 0
        # one KV object per page of the prompt, and the trailing window's SWA pages
        mooncake._wait(lambda: mooncake.key_count() - before > len(long) // PAGE_SIZE, "the prompt's pages")
    return long, cold


@pytest.fixture(scope="module")
def server_b(cold_a, tiny_checkpoint: Path, mooncake: Mooncake, tmp_path_factory: pytest.TempPathFactory):
    with running(Server(tiny_checkpoint, tmp_path_factory.mktemp("mc_b") / "server.log", _args(mooncake))) as b:
        yield b


def test_a_restarted_server_reloads_the_prefix_from_mooncake(cold_a, server_b: Server) -> None:
    long, cold = cold_a
    warm = _run(server_b, long)
    d = _details(warm)
    assert d.get("storage", 0) >= LONG - 2 and warm["meta_info"]["cached_tokens"] == d["storage"], warm["meta_info"]
    assert warm["output_ids"] == cold["output_ids"]
    _assert_equal_to_cold(warm, cold)
    assert _failures(server_b) == {"query": 0, "read": 0, "write": 0}


def test_master_down_costs_a_cold_prefill_with_a_warning(cold_a, server_b: Server, mooncake: Mooncake) -> None:
    long, cold = cold_a
    mooncake.stop()
    _flush(server_b)                                  # only L3 could provide the prompt now
    out = _run(server_b, long)
    assert out["meta_info"]["cached_tokens"] == 0 and not _details(out).get("storage"), out["meta_info"]
    assert out["output_ids"] == cold["output_ids"]
    _assert_equal_to_cold(out, cold)
    # a Mooncake call to a dead master returns after ~4 s: the scheduler's prefetch timeout has sent the
    # request cold by then, and the query's failure is counted when the call returns
    _wait_for(lambda: _failures(server_b)["query"] > 0, "a counted query failure", server_b, timeout_s=60)
    log = server_b.log_tail(10_000_000)
    assert re.search(r"sglang-dsv41 HiCache: storage query failed on the dsv41-mooncake backend", log)
    assert server_b.proc.poll() is None and "Traceback" not in log

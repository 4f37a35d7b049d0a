"""End to end on CPU: HiCache L3 with SGLang's `file` storage backend serves the tiny V4.1 checkpoint
(docs/hicache.md "L3"; issue 14).

Two servers in turn on ONE storage directory, each `--enable-hierarchical-cache
--hicache-storage-backend file` over a small device pool (`--max-total-tokens 512`, SWA pool 128)
and a small host tier (`--hicache-ratio 2`: 1,024 host slots), write_through:

* server A serves a long prompt (cold run) and writes its pages to storage: one `KV` file per page
  (the page's global latent rows + index-key rows) and one `SWA` file per page (every layer's SWA
  rows), of exactly those sizes; A is stopped;
* server B, started fresh on the same directory, serves the same prompt: SGLang prefetches its
  prefix from storage (`cached_tokens_details.storage`, `cached_tokens_total{cache_source=storage}`)
  and the greedy tokens and logprobs equal A's cold run;
* within B, a prompt pushed out of the device AND the host tier by other traffic comes back from
  storage, equal to its cold run;
* storage faults in B (runtime/hicache_faults.py; issue 14 "down or full"): pages truncated on disk
  (a read that raises), then the directory replaced by a plain file (existence queries and writes
  raise or fail): every request is served, equal to its cold run; the host tier holds exactly what
  it holds after a fault-free cold run (the failed prefetch's host slots are released); each
  failed op is logged as a warning and counted in `sglang_dsv41:hicache_storage_failures_total`; once
  the directory is back, the same server (no flush since the faults) reloads from storage again;
* B's scheduler process (not its launcher) sets and logs the storage threads' shorter switch interval
  (runtime/hicache_gil.py; opt-in through its variable).

The servers above pin `--page-size 2` (`requirements.PAGE_SIZE`): with a storage backend the
plugin's default page is `STORAGE_PAGE_SIZE` (64, docs/hicache.md "L3 write throughput"), longer
than these small pools and prompts are built for. That default, end to end: a server started
without `--page-size` (SWA pool = device pool, so a 301-token prefill fits) resolves page 64, writes
a 301-token prompt's 4 full pages to its own storage directory and, its device and host tiers
flushed, reloads exactly those 256 tokens from storage, equal to the cold run; the cold run equals
server B's (page 2) for the same prompt. (A flush, not a restart: one server start less; the
restart path is tested above at page 2.)
`prefetch_threshold` is lowered to 16 tokens (SGLang's default, 256, is longer than these prompts);
the prefetch stop policy is `timeout` (a prefetch is used once complete, or dropped after SGLang's
1 s base timeout), so whether a request hits storage does not depend on thread timing.
Every wait is bounded; each server's process group is killed when it is done.
"""
from __future__ import annotations

import json
import random
import re
import time
import urllib.request
from pathlib import Path

import pytest

from server_helpers import Server, running
from sglang_dsv41.runtime import hicache_gil
from sglang_dsv41.runtime.requirements import PAGE_SIZE, STORAGE_PAGE_SIZE
from test_runtime_hicache_server import LONG, NEW, OTHER, _assert_equal_to_cold, _prompt

pytestmark = pytest.mark.slow

DEVICE_TOKENS, HOST_RATIO = 512, 2
#: enough other prompts (each 1 + OTHER tokens) to overflow the device pool and the host tier
EVICT_ALL = 12
WRITE_WAIT_S = 180


def _args(page_size: int | None = PAGE_SIZE, swa_ratio: float = 0.25) -> list[str]:
    """The servers' flags; `page_size=None` leaves the page size to the plugin's default."""
    page = [] if page_size is None else ["--page-size", str(page_size)]
    return [*page, "--max-total-tokens", str(DEVICE_TOKENS), "--swa-full-tokens-ratio", str(swa_ratio),
            "--enable-hierarchical-cache", "--enable-metrics", "--language-model-only", "--hicache-write-policy", "write_through",
            "--hicache-io-backend", "direct", "--hicache-ratio", str(HOST_RATIO),
            "--hicache-storage-backend", "file", "--hicache-storage-prefetch-policy", "timeout",
            "--hicache-storage-backend-extra-config", json.dumps({"prefetch_threshold": 16})]


def _server(checkpoint: Path, store: Path, log: Path, args: list[str] | None = None) -> Server:
    # the opt-in switch interval (runtime/hicache_gil.py)
    return Server(checkpoint, log, _args() if args is None else args,
                  env={"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(store), hicache_gil.ENV: str(hicache_gil.TRIAL_MS)})


def _run(server: Server, ids: list[int]) -> dict:
    out = server.post("/generate", {"input_ids": ids, "return_logprob": True, "top_logprobs_num": 2,
                                    "sampling_params": {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}})
    assert len(out["output_ids"]) == NEW
    return out


def _details(out: dict) -> dict:
    return out["meta_info"].get("cached_tokens_details") or {}


def _pages(store: Path) -> tuple[set[str], set[str]]:
    """(KV page files, SWA page files) in the storage directory."""
    names = {p.name for p in store.iterdir() if p.suffix == ".bin"}
    return {n for n in names if ".swa_" not in n}, {n for n in names if ".swa_" in n}


def _wait_for_pages(store: Path, before: set[str], kv_pages: int) -> None:
    """Block until at least `kv_pages` new KV page files and some new SWA page files are written."""
    deadline = time.monotonic() + WRITE_WAIT_S
    while time.monotonic() < deadline:
        kv, swa = _pages(store)
        if len(kv - before) >= kv_pages and swa - before:
            return
        time.sleep(1)
    raise TimeoutError(f"storage holds {len(kv - before)} new KV pages after {WRITE_WAIT_S} s")


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hicache_l3")


@pytest.fixture(scope="module")
def cold_a(tiny_checkpoint: Path, store: Path, tmp_path_factory: pytest.TempPathFactory):
    """Server A: the long prompt's cold run, its pages written to storage; A stopped."""
    long = _prompt(random.Random(11), LONG)
    with running(_server(tiny_checkpoint, store, tmp_path_factory.mktemp("a") / "server.log")) as a:
        before = set().union(*_pages(store))
        cold = _run(a, long)
        assert cold["meta_info"]["cached_tokens"] == 0
        _wait_for_pages(store, before, len(long) // PAGE_SIZE)
    return long, cold


@pytest.fixture(scope="module")
def server_b(cold_a, tiny_checkpoint: Path, store: Path, tmp_path_factory: pytest.TempPathFactory):
    with running(_server(tiny_checkpoint, store, tmp_path_factory.mktemp("b") / "server.log")) as b:
        yield b


def test_storage_pages_hold_every_mirrored_component(cold_a, store: Path, tiny_checkpoint: Path) -> None:
    """Each KV page file is one page of global latent + index-key rows, each SWA page file one
    page of every layer's SWA rows (runtime/hicache_host.py "flat pages")."""
    from sglang_dsv41.config import DeepseekV41Config
    from sglang_dsv41.runtime.kv_layout import CompressedRowLayout
    cfg = DeepseekV41Config.from_file(tiny_checkpoint).text
    lay = CompressedRowLayout.from_config(cfg)
    kv, swa = _pages(store)
    assert kv and swa
    assert {(store / n).stat().st_size for n in kv} == {PAGE_SIZE * (lay.latent_row_stride + lay.key_row_stride)}
    assert {(store / n).stat().st_size for n in swa} == {PAGE_SIZE * cfg.num_hidden_layers * cfg.head_dim * 2}


def _prefetch_lines(log: str) -> list[tuple[int, int, int]]:
    """(KV pages, KV bytes, other pools' pages) of each prefetch timeline line (runtime/hicache_prefetch.py)
    whose every step ran: queued, queried, read in one batch of KV pages, ended by the scheduler."""
    pattern = (r"sglang-dsv41 HiCache: prefetch req=\S+; pages kv=(\d+) \((\d+) B\) other=(\d+); queue [\d.]+ ms, "
               r"query [\d.]+ ms; to read [\d.]+ ms, read [\d.]+ ms \(kv [\d.]+ ms in 1 batches, \d+ us/page\); "
               r"to done [\d.]+ ms, total [\d.]+ ms")
    return [tuple(map(int, m.groups())) for m in re.finditer(pattern, log)]


def _kv_page_bytes(checkpoint: Path, page: int) -> int:
    from sglang_dsv41.config import DeepseekV41Config
    from sglang_dsv41.runtime.kv_layout import CompressedRowLayout
    lay = CompressedRowLayout.from_config(DeepseekV41Config.from_file(checkpoint).text)
    return page * (lay.latent_row_stride + lay.key_row_stride)


def test_a_new_server_reloads_the_prefix_from_storage(cold_a, server_b: Server, tiny_checkpoint: Path) -> None:
    long, cold = cold_a
    warm = _run(server_b, long)
    d = _details(warm)
    assert d.get("storage", 0) >= LONG - 2 and warm["meta_info"]["cached_tokens"] == d["storage"], warm["meta_info"]
    assert d.get("storage_backend") == "HiCacheFile"
    assert warm["output_ids"] == cold["output_ids"]
    _assert_equal_to_cold(warm, cold)
    # the prefetch's timeline: every KV page it brought, read in one batch, and the SWA window's pages
    pages = d["storage"] // PAGE_SIZE
    lines = _prefetch_lines(server_b.log_tail(10_000_000))
    assert (pages, pages * _kv_page_bytes(tiny_checkpoint, PAGE_SIZE)) in [ln[:2] for ln in lines if ln[2] >= 1], lines


def test_a_prefix_evicted_from_device_and_host_comes_back_from_storage(server_b: Server) -> None:
    rng = random.Random(12)
    long = _prompt(rng, LONG)
    cold = _run(server_b, long)
    assert cold["meta_info"]["cached_tokens"] == 0
    for _ in range(EVICT_ALL):                      # 13 × 121 tokens > 512 device + 1,024 host slots
        _run(server_b, _prompt(rng, OTHER))
    warm = _run(server_b, long)
    d = _details(warm)
    assert d.get("storage", 0) >= LONG - 2 and d.get("host", 0) == 0, warm["meta_info"]
    _assert_equal_to_cold(warm, cold)


def test_storage_hits_are_in_the_metrics(server_b: Server) -> None:
    with urllib.request.urlopen(server_b.url("/metrics"), timeout=60) as r:
        text = r.read().decode()
    storage = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("sglang:cached_tokens_total{") and 'cache_source="storage_HiCacheFile"' in line]
    assert storage and sum(storage) >= 2 * (LONG - 2), storage
    log = server_b.log_tail(10_000_000)
    assert server_b.proc.poll() is None and "Traceback" not in log
    # the storage threads' switch interval (runtime/hicache_gil.py), set in the scheduler process (not the launcher)
    m = re.search(r"storage file; scheduler process \(pid (\d+)\) switch interval [\d.]+ -> ([\d.]+) ms", log)
    assert m and int(m.group(1)) != server_b.proc.pid and float(m.group(2)) == pytest.approx(hicache_gil.TRIAL_MS), log[-3000:]


def _metrics(server: Server) -> str:
    with urllib.request.urlopen(server.url("/metrics"), timeout=60) as r:
        return r.read().decode()


def _sum(text: str, name: str, label: str = "") -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and label in line)


def _failures(server: Server) -> dict[str, float]:
    text = _metrics(server)
    return {op: _sum(text, "sglang_dsv41:hicache_storage_failures_total", f'op="{op}"')
            for op in ("query", "read", "write")}


def _flush(server: Server) -> None:
    """Empty the device and host tiers (storage stays); SGLang flushes only when idle."""
    import urllib.error

    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(urllib.request.Request(server.url("/flush_cache?timeout=30"), data=b"",
                                                               method="POST"), timeout=60) as r:
                if r.status == 200:
                    return
        except urllib.error.HTTPError as e:           # 400 while a request is still in the scheduler
            e.close()
        assert time.monotonic() < deadline, server.log_tail()
        time.sleep(1)


def _host_used_after_rerun(server: Server, ids: list[int]) -> float:
    """Host-tier tokens in use, as SGLang samples them at the prefill of `ids` re-sent (a device hit)."""
    assert _run(server, ids)["meta_info"]["cached_tokens"] >= len(ids) - 2
    return _sum(_metrics(server), "sglang:hicache_host_used_tokens")


def _wait_for(cond, what: str, server: Server, timeout_s: float = WRITE_WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"{what} not seen after {timeout_s} s\n{server.log_tail()}"
        time.sleep(1)


def test_broken_or_unreachable_storage_costs_a_cold_prefill(cold_a, server_b: Server, store: Path) -> None:
    """Issue 14: "a storage backend that is down or full gives a logged warning and a cold prefill,
    never a crash or a wrong answer" (module docstring; docs/hicache.md "Storage faults")."""
    rng = random.Random(13)
    p, x, q = (_prompt(rng, LONG) for _ in range(3))
    before = set().union(*_pages(store))
    cold_p = _run(server_b, p)
    _wait_for_pages(store, before, LONG // PAGE_SIZE)
    broken = set().union(*_pages(store)) - before
    for name in broken:                                       # a short read on every page of p
        (store / name).write_bytes(b"")
    failed0 = _failures(server_b)

    _flush(server_b)                                          # reference: a fault-free cold run
    _run(server_b, x)
    host_ref = _host_used_after_rerun(server_b, x)

    _flush(server_b)                                          # p misses device and host, hits storage
    warm_p = _run(server_b, p)
    assert warm_p["meta_info"]["cached_tokens"] == 0 and not _details(warm_p).get("storage"), warm_p["meta_info"]
    _assert_equal_to_cold(warm_p, cold_p)
    assert _failures(server_b)["read"] > failed0["read"]
    assert _host_used_after_rerun(server_b, p) == host_ref    # the failed prefetch's host slots are back

    gone = store.with_name(store.name + "-gone")              # storage down: the directory is a file now
    store.rename(gone)
    store.write_bytes(b"")
    try:
        out_q = _run(server_b, q)                             # its storage query raises, its write fails
        assert out_q["meta_info"]["cached_tokens"] == 0
        _wait_for(lambda: _failures(server_b)["write"] > failed0["write"], "a failed storage write", server_b)
        assert _failures(server_b)["query"] > failed0["query"]
        assert _run(server_b, q)["output_ids"] == out_q["output_ids"]
    finally:
        store.unlink()
        gone.rename(store)

    long, cold = cold_a                                       # storage back, same threads: reloads again
    warm = _run(server_b, long)
    assert _details(warm).get("storage", 0) >= LONG - 2, warm["meta_info"]
    _assert_equal_to_cold(warm, cold)
    log = server_b.log_tail(10_000_000)
    for op in ("query", "read", "write"):
        assert re.search(rf"sglang-dsv41 HiCache: storage {op} failed on the file backend", log), op
    assert server_b.proc.poll() is None and "Traceback" not in log


#: the page-64 test's prompt: 1 + 300 tokens, 4 full storage pages and a partial one
PAGE64_PROMPT = 300


def _settled(store: Path, quiet_s: float = 2.0, cap_s: float = WRITE_WAIT_S) -> None:
    """Block until no page file was added to `store` for `quiet_s` (the write-through backups are done)."""
    deadline, last, since = time.monotonic() + cap_s, -1, time.monotonic()
    while time.monotonic() < deadline:
        n = len(set().union(*_pages(store)))
        if n != last:
            last, since = n, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return
        time.sleep(0.2)
    raise TimeoutError(f"storage still growing after {cap_s} s ({last} page files)")


def test_the_default_storage_page_64_reloads_from_storage(server_b: Server, tiny_checkpoint: Path,
                                                         tmp_path_factory: pytest.TempPathFactory) -> None:
    """No `--page-size` with a storage backend: page 64 (module docstring)."""
    store64 = tmp_path_factory.mktemp("hicache_l3_page64")
    ids = _prompt(random.Random(14), PAGE64_PROMPT)
    full = (len(ids) - 1) // STORAGE_PAGE_SIZE * STORAGE_PAGE_SIZE        # the last partial page is not cached
    args = _args(page_size=None, swa_ratio=1.0)
    assert "--page-size" not in args

    with running(_server(tiny_checkpoint, store64, tmp_path_factory.mktemp("page64") / "server.log", args)) as a:
        assert a.get("/get_server_info")["page_size"] == STORAGE_PAGE_SIZE
        cold = _run(a, ids)
        assert cold["meta_info"]["cached_tokens"] == 0
        _wait_for_pages(store64, set(), full // STORAGE_PAGE_SIZE)
        _settled(store64)
        kv, swa = _pages(store64)
        assert len(kv) == full // STORAGE_PAGE_SIZE and swa, (kv, swa)
        _flush(a)                                             # device and host empty: only storage can hit
        warm = _run(a, ids)
        log = a.log_tail(10_000_000)
        assert a.proc.poll() is None and "Traceback" not in log
    pages = full // STORAGE_PAGE_SIZE                         # one batch of KV pages, and the SWA window's page
    assert (pages, pages * _kv_page_bytes(tiny_checkpoint, STORAGE_PAGE_SIZE), 1) in _prefetch_lines(log), log[-3000:]
    d = _details(warm)
    assert warm["meta_info"]["cached_tokens"] == d.get("storage") == full and not d.get("host"), warm["meta_info"]
    assert d.get("storage_backend") == "HiCacheFile"
    assert warm["output_ids"] == cold["output_ids"]
    _assert_equal_to_cold(warm, cold)

    ref = _run(server_b, ids)                                   # the page-2 server, same prompt, cold
    assert ref["meta_info"]["cached_tokens"] == 0
    assert cold["output_ids"] == ref["output_ids"]
    _assert_equal_to_cold(cold, ref)

"""End to end on CPU: `--enable-hierarchical-cache` serves the tiny V4.1 checkpoint through SGLang's
real HiCache paths with our host pools (docs/hicache.md; issue 14).

One server for the module (`hicache_server`: the one-module ``hicache`` group of
tests/shared_servers.py; `sglang-dsv41 serve`, i.e. `python -m sglang.launch_server` with the
plugin), with a device pool small enough that a few prompts push a long prompt out of it
(`--max-total-tokens 512`; SWA pool 128 tokens) and a larger host tier, with
`--hicache-write-policy write_through` (write_back is refused, docs/hicache.md) and
`--hicache-io-backend direct --hicache-size 1` (under `HICACHE_E2E_SETTING=kernel_ratio`:
`--hicache-io-backend kernel --hicache-ratio 4`); CI runs the first (scripts/gpu/hicache.sh runs
both on a GPU).

* a long prompt, then enough other prompts to evict it from the device, then the long prompt
  again: SGLang reports the prefix as cached tokens from the host (`cached_tokens_details.host`),
  and greedy tokens and logprobs equal the cold run's (up to the numerics contract, `TIE`);
* a session of 20 turns, each extending the previous turn's prompt and reply, keeps hitting the host
  after evictions (the SWA-tombstone shape of SGLang#35129: a hit needs the window's SWA rows on
  device or host; it passes because both host pools hold the same number of slots);
* right after a reload, at most one window of SWA rows (page-rounded, `swa_restore_bound`) plus the
  new token's page is in use on the device, not the prefix (the oversized load-back shape of
  SGLang#31771), and the server stays up;
* 8 prompts evicted to the host come back in 16 concurrent requests, two per prefix
  (the LOAD_BACK-under-concurrency shape of SGLang#32331): each hits the host or the device copy
  the other loaded, and equals its cold run.

Every wait is bounded; the server's process group is killed at the end.
"""
from __future__ import annotations

import os
import random
import re
from pathlib import Path

import pytest

from server_helpers import Server, concurrently
from sglang_dsv41.runtime.hicache_swa_bound import swa_restore_bound
from sglang_dsv41.runtime.requirements import PAGE_SIZE as PAGE
from test_runtime_numerics_contract import LOGIT_BOUND

pytestmark = pytest.mark.slow

SETTING = os.environ.get("HICACHE_E2E_SETTING", "direct_size")
FLAGS = {
    "direct_size": ["--hicache-write-policy", "write_through", "--hicache-io-backend", "direct",
                    "--hicache-size", "1"],
    "kernel_ratio": ["--hicache-write-policy", "write_through", "--hicache-io-backend", "kernel",
                     "--hicache-ratio", "4"],
}
DEVICE_TOKENS = 512
SWA_WINDOW = 8                        # the tiny checkpoint's sliding window
SWA_RATIO = 0.25                      # SWA device pool 128 tokens
LONG, OTHER, OTHERS, NEW = 120, 120, 6, 8
#: concurrent reloads: CONC prompts of CONC_LEN tokens, each sent twice at once (the issue's 16
#: requests, 8 prefixes; together more than the device pool holds, so load-backs evict each other)
CONC, CONC_LEN = 8, 48
#: turns of the multi-turn session (the issue's 20)
TURNS = 20
#: the CPU path's numerics contract: greedy tokens agree up to a near tie of the cold run's top-2
#: (gap < 2·LOGIT_BOUND), logprobs within 2·LOGIT_BOUND (tests/test_runtime_numerics_contract.py)
TIE = 2 * LOGIT_BOUND
PREFILL_LINE = re.compile(r"#cached-token: (\d+), .*swa token usage: ([0-9.]+)")


def hicache_server(checkpoint: Path, log: Path) -> Server:
    """This module's server (launched by `shared_servers`, group ``hicache``, so it can start ahead)."""
    args = ["--max-total-tokens", str(DEVICE_TOKENS), "--swa-full-tokens-ratio", str(SWA_RATIO),
            "--enable-hierarchical-cache", "--enable-metrics", "--language-model-only", *FLAGS[SETTING]]
    return Server(checkpoint, log, args)


@pytest.fixture(scope="module")
def server(shared_servers) -> Server:
    return shared_servers.get("hicache")


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [0] + [rng.randrange(3, 990) for _ in range(n)]


def _run(server: Server, ids: list[int], n: int = NEW) -> dict:
    out = server.post("/generate", {"input_ids": ids, "return_logprob": True, "top_logprobs_num": 2,
                                    "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}})
    assert len(out["output_ids"]) == n
    return out


def _host_hit(out: dict) -> int:
    details = out["meta_info"].get("cached_tokens_details") or {}
    return int(details.get("host", 0))


def _assert_equal_to_cold(warm: dict, cold: dict) -> None:
    """Greedy tokens equal and logprobs within TIE, step by step, up to the cold run's first near
    tie (where the contract lets the two runs pick different tokens)."""
    for step, (w, c, top) in enumerate(zip(warm["meta_info"]["output_token_logprobs"],
                                          cold["meta_info"]["output_token_logprobs"],
                                          cold["meta_info"]["output_top_logprobs"])):
        assert w[1] == c[1] and w[0] == pytest.approx(c[0], abs=TIE), (step, warm["output_ids"], cold["output_ids"])
        if top[0][0] - top[1][0] < TIE:
            return


def _warm_prefill(server: Server, cached: int) -> float:
    """SWA token usage SGLang logged for the last prefill that reported `cached` cached tokens."""
    hits = [float(m.group(2)) for m in PREFILL_LINE.finditer(server.log_tail(10_000_000)) if int(m.group(1)) == cached]
    assert hits, f"no prefill with {cached} cached tokens in the log"
    return hits[-1]


def test_server_runs_our_host_stack(server: Server) -> None:
    log = server.log_tail(10_000_000)
    assert "sglang-dsv41 HiCache: host pools full" in log
    assert "pools=sglang-dsv41 global KV rows + SWA rows" in log
    full, swa = re.search(r"host pools full (\d+) slots x \d+ B, SWA (\d+) slots", log).groups()
    assert full == swa and int(full) > DEVICE_TOKENS                    # equal slot counts, a real host tier
    info = server.get("/get_server_info")
    assert info["enable_hierarchical_cache"] is True and info["hicache_write_policy"] == "write_through"


def test_prefix_evicted_to_host_reloads_and_equals_the_cold_run(server: Server) -> None:
    rng = random.Random(1)
    long = _prompt(rng, LONG)
    cold = _run(server, long)
    for _ in range(OTHERS):                      # 7 × 129 tokens > the 512-token device pool
        _run(server, _prompt(rng, OTHER))
    warm = _run(server, long)
    assert _host_hit(warm) >= LONG - 2 and warm["meta_info"]["cached_tokens"] == _host_hit(warm), warm["meta_info"]
    _assert_equal_to_cold(warm, cold)


def test_a_session_keeps_hitting_across_evictions(server: Server) -> None:
    """SGLang#35129's shape (0 cached tokens every turn: SWA tombstones veto the hit). Turn t's
    prompt = turn t−1's prompt + its reply + new tokens; other traffic between turns evicts the
    session from the device. Every turn after the first hits the host for its previous turn."""
    rng = random.Random(2)
    prompt = _prompt(rng, 40)
    turns = []
    for _ in range(TURNS):
        out = _run(server, prompt)
        turns.append((out["meta_info"]["cached_tokens"], _host_hit(out), len(prompt)))
        for _ in range(3):
            _run(server, _prompt(rng, OTHER))
        prompt = prompt + out["output_ids"] + [rng.randrange(3, 990) for _ in range(10)]
    for (cached, _, _), (_, _, previous) in zip(turns[1:], turns):
        assert cached >= previous - PAGE, turns                  # the whole previous prompt hits
    assert all(host > 0 for _, host, _ in turns[1:]), turns      # ... from the host tier


def test_reload_restores_about_one_window_of_swa_rows(server: Server) -> None:
    """SGLang#31771's shape (load-back restoring more SWA than the window exhausts the small SWA
    pool): right after a 120-token prefix is reloaded from the host, the SWA rows in use are about
    one window (W + pages for the new tokens), not the prefix; and the server stays up."""
    rng = random.Random(3)
    long = _prompt(rng, LONG)
    cold = _run(server, long)
    for _ in range(OTHERS):
        _run(server, _prompt(rng, OTHER))
    warm = _run(server, long)
    assert _host_hit(warm) >= LONG - 2
    _assert_equal_to_cold(warm, cold)
    swa_pool = int(DEVICE_TOKENS * SWA_RATIO)
    in_use = _warm_prefill(server, warm["meta_info"]["cached_tokens"]) * swa_pool
    # restored rows ≤ the window in whole pages (runtime/hicache_swa_bound.py), + the new token's page;
    # SGLang logs the usage with 2 decimals (± 0.005 of the pool)
    assert in_use <= swa_restore_bound(SWA_WINDOW, PAGE) + PAGE + 0.01 * swa_pool, in_use
    assert server.proc.poll() is None and "Traceback" not in server.log_tail(10_000_000)


def test_concurrent_reloads_from_the_host_equal_their_cold_runs(server: Server) -> None:
    """SGLang#32331's shape (UnifiedRadixCache LOAD_BACK raising under high concurrency): CONC
    prompts are evicted to the host, then all of them are sent twice at the same time; every
    request hits its whole prefix (from the host, or from the device copy its twin loaded), at
    least one per prefix from the host, and equals its cold run; the server stays up."""
    rng = random.Random(4)
    prompts = [_prompt(rng, CONC_LEN) for _ in range(CONC)]
    colds = [_run(server, p) for p in prompts]
    for _ in range(OTHERS):                      # 6 × 121 tokens > the 512-token device pool
        _run(server, _prompt(rng, OTHER))
    warms = concurrently([lambda p=p: _run(server, p) for p in prompts for _ in range(2)])
    assert not [w for w in warms if not isinstance(w, dict)], warms
    for i, cold in enumerate(colds):
        pair = warms[2 * i: 2 * i + 2]
        assert all(w["meta_info"]["cached_tokens"] >= CONC_LEN - PAGE for w in pair), [w["meta_info"] for w in pair]
        assert max(_host_hit(w) for w in pair) >= CONC_LEN - PAGE, [w["meta_info"] for w in pair]
        for w in pair:
            _assert_equal_to_cold(w, cold)
    assert server.proc.poll() is None and "Traceback" not in server.log_tail(10_000_000)


def test_host_tier_hits_are_in_the_metrics(server: Server) -> None:
    """Issue 20 item 4, HiCache tier hits: SGLang's `sglang:cached_tokens_total` counts the cached
    prompt tokens by source; after the reloads above its `host` series is positive, and the host
    tier's size is exported (docs/observability.md)."""
    import urllib.request

    with urllib.request.urlopen(server.url("/metrics"), timeout=60) as r:
        text = r.read().decode()
    host = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("sglang:cached_tokens_total{") and 'cache_source="host"' in line]
    assert host and sum(host) >= LONG - 2, [line for line in text.splitlines() if "cached_tokens_total" in line]
    assert "sglang:hicache_host_total_tokens" in text

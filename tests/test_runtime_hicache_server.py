"""End to end on CPU: `--enable-hierarchical-cache` serves the tiny V4.1 checkpoint through SGLang's
real HiCache paths with our host pools (docs/hicache.md; issue 14).

One server for the module (`sglang-dsv41 serve`, i.e. `python -m sglang.launch_server` with the
plugin), with a device pool small enough that a few prompts push a long prompt out of it
(`--max-total-tokens 512`; SWA pool 128 tokens) and a host tier of 4× that. The server runs
`--hicache-write-policy write_back --hicache-io-backend direct --hicache-size` (and, under
`HICACHE_E2E_POLICY=write_through`, `write_through --hicache-io-backend kernel --hicache-ratio 4`),
so both sizing flags, both io backends and both write policies are covered across the two settings;
CI runs one (the GPU script scripts/gpu/hicache.sh runs both).

* a long prompt, then enough other prompts to evict it from the device, then the long prompt
  again: SGLang reports cached tokens that came from the host (`cached_tokens_details.host` > 0),
  and the greedy tokens equal the cold run's (logprobs within the CPU path's batch noise);
* a session of turns, each extending the previous turn's prompt and reply, keeps hitting after
  evictions (the SWA-tombstone shape of SGLang#35129: a hit needs the window's SWA rows on device
  or host; here every turn after the first reports cached tokens);
* a reloaded prefix never restores more SWA rows than the device SWA pool holds, and the server
  stays up (the oversized load-back shape of SGLang#31771 would exhaust or reject it).

Every wait is bounded; the server's process group is killed at the end.
"""
from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from server_helpers import Server, running

pytestmark = pytest.mark.slow

POLICY = os.environ.get("HICACHE_E2E_POLICY", "write_back")
FLAGS = {
    "write_back": ["--hicache-write-policy", "write_back", "--hicache-io-backend", "direct",
                   "--hicache-size", "0.004"],
    "write_through": ["--hicache-write-policy", "write_through", "--hicache-io-backend", "kernel",
                      "--hicache-ratio", "4"],
}
DEVICE_TOKENS = 512
LONG, OTHER, OTHERS, NEW = 120, 120, 6, 8
LOGPROB_ATOL = 0.05


@pytest.fixture(scope="module")
def server(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory):
    args = ["--max-total-tokens", str(DEVICE_TOKENS), "--swa-full-tokens-ratio", "0.25",
            "--enable-hierarchical-cache", *FLAGS[POLICY]]
    with running(Server(tiny_checkpoint, tmp_path_factory.mktemp("hicache") / "server.log", args)) as srv:
        yield srv


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [0] + [rng.randrange(3, 990) for _ in range(n)]


def _run(server: Server, ids: list[int], n: int = NEW) -> dict:
    out = server.generate(ids, n, logprob=True)
    assert len(out["output_ids"]) == n
    return out


def _host_hit(out: dict) -> int:
    details = out["meta_info"].get("cached_tokens_details") or {}
    return int(details.get("host", 0))


def _logprobs(out: dict) -> list[float]:
    return [t[0] for t in out["meta_info"]["output_token_logprobs"]]


def test_server_runs_our_host_stack(server: Server) -> None:
    log = server.log_tail(200_000)
    assert "sglang-dsv41 HiCache: host pools full" in log
    assert "pools=sglang-dsv41 global KV rows + SWA rows" in log
    info = server.get("/get_server_info")
    assert info["enable_hierarchical_cache"] is True and info["hicache_write_policy"] == POLICY


def test_prefix_evicted_to_host_reloads_and_equals_the_cold_run(server: Server) -> None:
    rng = random.Random(1)
    long = _prompt(rng, LONG)
    cold = _run(server, long)
    for _ in range(OTHERS):                      # 6 × 129 tokens > the 512-token device pool
        _run(server, _prompt(rng, OTHER))
    warm = _run(server, long)
    cached = warm["meta_info"]["cached_tokens"]
    assert _host_hit(warm) > 0 and cached >= _host_hit(warm), warm["meta_info"]
    assert cached >= LONG // 2, warm["meta_info"]
    assert warm["output_ids"] == cold["output_ids"]
    assert _logprobs(warm) == pytest.approx(_logprobs(cold), abs=LOGPROB_ATOL)


def test_a_session_keeps_hitting_across_evictions(server: Server) -> None:
    """Turn t's prompt = turn t−1's prompt + its reply + new user tokens; other traffic between
    turns evicts the session from the device. Every turn after the first reports cached tokens."""
    rng = random.Random(2)
    prompt = _prompt(rng, 40)
    cached = []
    for turn in range(5):
        out = _run(server, prompt)
        cached.append(out["meta_info"]["cached_tokens"])
        for _ in range(3):
            _run(server, _prompt(rng, OTHER))
        prompt = prompt + out["output_ids"] + [rng.randrange(3, 990) for _ in range(10)]
    assert all(c > 0 for c in cached[1:]), cached


def test_reload_restores_no_more_swa_than_the_device_pool_holds(server: Server) -> None:
    """Two long prompts reloaded back to back after eviction: each reload fits the SWA pool and is
    answered (no rejection or crash), hits from the host, and equals its cold run."""
    rng = random.Random(3)
    longs = [_prompt(rng, LONG) for _ in range(2)]
    colds = [_run(server, p) for p in longs]
    for _ in range(OTHERS):
        _run(server, _prompt(rng, OTHER))
    for p, cold in zip(longs, colds):
        warm = _run(server, p)
        assert warm["output_ids"] == cold["output_ids"]
    assert server.proc.poll() is None
    assert "Traceback" not in server.log_tail(200_000)

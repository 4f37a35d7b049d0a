"""Prefill CUDA graphs served on one CUDA GPU (docs/prefill_graphs.md; runtime/prefill_graph.py): the
tiny checkpoint with the CUDA default (`--cuda-graph-backend-prefill full`, buckets up to 256 tokens)
against the same server with `--disable-prefill-cuda-graph`. Both start at once (module fixture),
text-only, context 2048, SGLang's default chunk size (so its `full` runner has chunk / 512 request
slots: 16 at 8,192).

The graph server's buckets add 512 and 1,024 tokens to the default ones (`BUCKETS`): graphs of that size
capture the BF16 prefill workspace path (`attention_prefill.applies` under the static bounds).

Checked: the graph server captured its prefill graphs and replays them (its log; the
`sglang_dsv41:extend_forwards_total{path="graph"}` counter grows); greedy output == the eager
server's for 24 new tokens at batch 1 (prompts of 9–200 tokens: buckets 16 to 256) and for a batch
of 8 short prompts in one replay (≤ 256 tokens together), and after a cached prefix (a 20-token
extend replayed over a 300-token prefix: its Engram history comes from the prefix, staged into the
graph's buffer), and for prompts of 600 and 1,000 tokens (the 1,024 bucket, the workspace path), with the
chosen tokens' logprobs within `LOGPROB_BOUND`.

Skipped without CUDA (conftest). scripts/gpu/prefill_graph_server.sh runs this file.
"""
from __future__ import annotations

import re
import time
import urllib.request

import pytest
import torch

from server_helpers import Server

pytestmark = pytest.mark.gpu
NEW_TOKENS = 24
STARTUP_S = 240
COMMON = ["--context-length", "2048", "--language-model-only", "--mem-fraction-static", "0.3",
          "--max-running-requests", "8", "--enable-metrics"]
GREEDY = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
#: |Δ log p| of a chosen token between a replayed and an eager extend (padding changes GEMM row tiers)
LOGPROB_BOUND = 0.1


def _prompts(lengths) -> list[list[int]]:
    g = torch.Generator().manual_seed(21 + len(lengths))
    return [[0] + torch.randint(3, 990, (int(n),), generator=g).tolist() for n in lengths]


SINGLE = (8, 60, 100, 150, 199)
BATCH = (4, 9, 15, 20, 27, 33, 38, 40)             # 194 tokens with the leading id: one replay of 8 requests
#: the graph server's buckets: the default ones and two of ≥ PREFILL_MIN_QUERIES tokens, whose graphs capture
#: the BF16 prefill workspace (16 request slots × 2,048 context columns fit its size rule)
BUCKETS = (4, 8, 16, 32, 64, 128, 256, 512, 1024)
LONG = (600, 1000)                                  # prompts replayed in the 1,024 bucket


class Pair:
    def __init__(self, checkpoint, log_dir) -> None:
        self.graph = Server(checkpoint, log_dir / "graph.log", [*COMMON, "--cuda-graph-bs-prefill", *map(str, BUCKETS)])
        self.eager = Server(checkpoint, log_dir / "eager.log", [*COMMON, "--disable-prefill-cuda-graph"])
        deadline = time.monotonic() + STARTUP_S
        for srv in (self.graph, self.eager):
            srv.wait_ready(max(deadline - time.monotonic(), 1.0))

    def stop(self) -> None:
        self.graph.stop()
        self.eager.stop()


@pytest.fixture(scope="module")
def pair(tiny_checkpoint, tmp_path_factory):
    p = Pair(tiny_checkpoint, tmp_path_factory.mktemp("prefill_graph_servers"))
    try:
        yield p
    finally:
        p.stop()


def extend_counts(srv: Server) -> dict[str, float]:
    with urllib.request.urlopen(srv.url("/metrics"), timeout=30) as r:
        text = r.read().decode()
    out = {"graph": 0.0, "eager": 0.0}
    for path, value in re.findall(r'^sglang_dsv41:extend_forwards_total\{[^}]*path="(\w+)"[^}]*\} ([0-9.eE+-]+)$',
                                  text, re.M):
        out[path] += float(value)
    return out


def _generate(srv: Server, prompts: list[list[int]]) -> list[dict]:
    out = srv.post("/generate", {"input_ids": prompts, "sampling_params": GREEDY, "return_logprob": True})
    return out if isinstance(out, list) else [out]


def _compare(got: list[dict], want: list[dict]) -> float:
    worst = 0.0
    for g, w in zip(got, want, strict=True):
        assert g["output_ids"] == w["output_ids"]
        lg = [t[0] for t in g["meta_info"]["output_token_logprobs"]]
        lw = [t[0] for t in w["meta_info"]["output_token_logprobs"]]
        worst = max(worst, max(abs(a - b) for a, b in zip(lg, lw)))
    assert worst <= LOGPROB_BOUND, worst
    return worst


def test_the_graph_server_captured_and_the_eager_server_did_not(pair) -> None:
    assert re.search(r"Capture target prefill CUDA graph end", pair.graph.log_tail(10**7))
    assert not re.search(r"Capture target prefill CUDA graph begin", pair.eager.log_tail(10**7))


def test_greedy_equals_the_eager_server_at_batch_1_and_8(pair) -> None:
    before = extend_counts(pair.graph)
    worst = 0.0
    for p in _prompts(SINGLE):
        worst = max(worst, _compare(_generate(pair.graph, [p]), _generate(pair.eager, [p])))
    single = extend_counts(pair.graph)
    batch = _prompts(BATCH)
    worst = max(worst, _compare(_generate(pair.graph, batch), _generate(pair.eager, batch)))
    after = extend_counts(pair.graph)
    print(f"\nmax |Δ log p| {worst:.4f}; graph server extends {before} -> {single} -> {after}")
    assert single["graph"] - before["graph"] == len(SINGLE)
    assert after["graph"] > single["graph"]
    assert "first prefill CUDA-graph replay" in pair.graph.log_tail(10**7)
    assert extend_counts(pair.eager)["graph"] == 0


def test_an_extend_over_a_cached_prefix_equals_the_eager_server(pair) -> None:
    g = torch.Generator().manual_seed(5)
    prefix = [0] + torch.randint(3, 990, (300,), generator=g).tolist()
    tail = torch.randint(3, 990, (20,), generator=g).tolist()
    for srv in (pair.graph, pair.eager):
        _generate(srv, [prefix])
    before = extend_counts(pair.graph)
    got, want = _generate(pair.graph, [prefix + tail]), _generate(pair.eager, [prefix + tail])
    assert got[0]["meta_info"]["cached_tokens"] >= 256 and want[0]["meta_info"]["cached_tokens"] >= 256
    _compare(got, want)
    assert extend_counts(pair.graph)["graph"] > before["graph"]


def test_prompts_of_512_tokens_and_more_replay_with_the_workspace(pair) -> None:
    """Buckets of ≥ PREFILL_MIN_QUERIES tokens: the graph holds the prefill workspace path (the eager server runs
    the same path for these prompts), and greedy output equals the eager server's."""
    before = extend_counts(pair.graph)
    for p in _prompts(LONG):
        _compare(_generate(pair.graph, [p]), _generate(pair.eager, [p]))
    assert extend_counts(pair.graph)["graph"] - before["graph"] == len(LONG)

"""End to end: `sglang-dsv41 serve` on the tiny checkpoint vs its oracle (issue 3 items 4 and 5;
spec cpu.md §3). On CPU the oracle is `ReferenceModel`; on CUDA see "On CUDA" below.

The shared ``chunked`` server (tests/shared_servers.py), started exactly as a user would (`python -m sglang_dsv41.cli serve`,
which prepares the CPU environment itself), with `--chunked-prefill-size 12 --enable-mixed-chunk`
and the runtime's `--page-size 2` (SGLang needs the chunk size to be a multiple of the page size,
so chunks and prefix hits start at even positions; decode steps end requests at odd and even
positions, leaving ratio-2 pairs pending between steps): every prompt (≥ 40 tokens, so the SWA
window 8, index_topk 4 and the candidate span 12 all bind, and SGLang's SWA pool frees slots
outside the window) is prefilled in chunks of ≤ 12 tokens mixed with other requests' decode
tokens, so "equal to the reference's one-shot prefill" covers chunked == one-shot and batching.
The server computes on the fp32 CPU path (`runtime/backend.py` `torch`), held to the numerics
contract (tests/test_runtime_numerics_contract.py: logits within `LOGIT_BOUND` of the reference's):
the reference, teacher-forced on the server's own greedy tokens, ranks each of them within
2·LOGIT_BOUND of its top-1 (`within_contract`: the server's greedy is the reference's up to a near
tie the contract allows), and the logprobs of those tokens agree with the reference's fp64
log-softmax within `LOGPROB_ATOL` = 2·LOGIT_BOUND. Every wait is bounded; the server's process
group is killed.

On CUDA the server attends and selects through the Triton kernels (`runtime/attention_ops.py`)
in the serving default, which is not batch invariant (split-KV attention plans and W8A8 row tiers
depend on the batch size; bit-for-bit batch invariance is `--enable-deterministic-inference`'s,
tests/test_runtime_forward_gpu.py), so the oracle is the serving forward in this process
(`KernelPathOracle`: each request alone, prefilled in one batch, then one decode batch per token)
and the assertions are the CPU ones against it: greedy within 2·LOGIT_BOUND of the oracle's top-1,
logprobs within `LOGPROB_ATOL`, radix hits and concurrent shared prefixes within the contract.
"""
from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from runtime_scenarios import greedy_generate, one_shot_logits, runtime_engine
from server_helpers import REQUEST_TIMEOUT_S, Server, concurrently
from sglang_dsv41.reference.model import ReferenceModel
from test_runtime_numerics_contract import LOGIT_BOUND
from sglang_dsv41.runtime.requirements import PAGE_SIZE

pytestmark = pytest.mark.slow

CHUNK = 12
NEW_TOKENS = 16
LOGPROB_ATOL = 2 * LOGIT_BOUND


@pytest.fixture(scope="module")
def server(shared_servers) -> Server:
    """The shared ``chunked`` server (tests/shared_servers.py: ``--max-total-tokens 4096
    --chunked-prefill-size 12 --enable-mixed-chunk --max-running-requests 8``)."""
    return shared_servers.get("chunked")


class KernelPathOracle:
    """The server's CUDA forward (Triton kernel path) in this process, one request at a time;
    `generate` / `new_request` + `forward(...).logits` as `ReferenceModel` offers them."""

    def __init__(self, checkpoint: Path) -> None:
        self.device = torch.device("cuda")
        torch.backends.cuda.matmul.allow_tf32 = False
        self.engine = runtime_engine(checkpoint, self.device, deterministic=False)   # what the server builds

    def generate(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        return greedy_generate(self.engine, self.device, prompt, max_new_tokens)

    def new_request(self) -> None:
        return None

    def forward(self, state: None, tokens: list[int]):
        return SimpleNamespace(logits=one_shot_logits(self.engine, self.device, tokens))


@pytest.fixture(scope="module")
def reference(tiny_checkpoint: Path) -> ReferenceModel | KernelPathOracle:
    """The oracle: `ReferenceModel` on CPU, the kernel path in this process on CUDA (module doc)."""
    if torch.cuda.is_available():
        return KernelPathOracle(tiny_checkpoint)
    return ReferenceModel.from_checkpoint(tiny_checkpoint)


def _prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [0] + torch.randint(3, 990, (n - 1,), generator=g).tolist()


def _concurrently(server: Server, prompts: list[list[int]], logprob: bool = False) -> list[dict[str, Any]]:
    results = concurrently([lambda p=p: server.generate(p, NEW_TOKENS, logprob=logprob) for p in prompts])
    for r in results:
        if not isinstance(r, dict):
            raise AssertionError(f"request failed: {r!r}\n{server.log_tail()}")
    return results


def within_contract(reference, prompt: list[int], tokens: list[int]) -> bool:
    """Every token is the oracle's top-1 (teacher-forced on `tokens`) up to a logit margin of 2·LOGIT_BOUND."""
    logits = reference.forward(reference.new_request(), prompt + tokens[:-1]).logits[len(prompt) - 1:].double()
    margin = logits.max(dim=-1).values - logits[torch.arange(len(tokens)), torch.tensor(tokens)]
    return bool((margin <= 2 * LOGIT_BOUND).all())


def _reference_logprobs(reference: ReferenceModel, prompt: list[int], tokens: list[int]) -> list[float]:
    """fp64 log-softmax of each generated token, teacher-forced in one forward."""
    logits = reference.forward(reference.new_request(), prompt + tokens[:-1]).logits[len(prompt) - 1:]
    logp = torch.log_softmax(logits.double(), dim=-1)
    return logp[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()


def test_server_is_configured_as_requested(server: Server) -> None:
    with urllib.request.urlopen(server.url("/get_server_info"), timeout=60) as r:
        info = json.loads(r.read())
    on_gpu = torch.cuda.is_available()
    assert info["chunked_prefill_size"] == CHUNK and info["device"] == ("cuda" if on_gpu else "cpu")
    assert info["attention_backend"] == ("dsv41" if on_gpu else "torch_native")
    assert info["sleep_on_idle"] is (not on_gpu)
    assert info["page_size"] == 2 and info["swa_full_tokens_ratio"] == 0.1    # runtime/requirements.py
    if on_gpu:                                    # decode CUDA graphs (runtime/graph_backend.py) captured
        assert info["disable_cuda_graph"] is False
        log = server.log_tail(10**7)
        assert "Capturing batches" in log and re.search(r"Capture .*end", log), log[-3000:]
        assert "CUDA-graph decode up to batch size" in log


def test_sglang_built_the_v41_pool(server: Server) -> None:
    """SGLang itself sized and built our pool (runtime/kv_pool.py) at start-up: global KV of
    192 B/token (tiny: a 112-B latent row + an 80-B index-key row, 16-B aligned), a SWA component
    of L = 8 layers of 96 bf16 sized by --swa-full-tokens-ratio 0.1 (4096 → 408 tokens), page size 2, reported in SGLang's own
    allocation log lines; the forward's caches are the pool's."""
    server.generate(_prompt(1, 12), n=1)                  # at least one forward has used the caches
    log = server.log_tail(10**7)
    assert "sglang-dsv41 KV pool sizing: global KV 192 B/token = latent row 112 B + index-key row 80 B" in log, \
        log[-3000:]
    assert re.search(r"Full \(global KV latent \+ index-key rows\) KV Cache is allocated\. dtype: torch\.uint8, "
                     r"#tokens: 4096", log)
    assert re.search(r"SWA KV Cache is allocated\. dtype: torch\.bfloat16, #tokens: 408", log)
    assert re.search(r"DeepseekV41KVPool: global KV 192 B/token = latent rows 112 B \(108 B packed FP4\) \+ "
                     r"index-key rows 80 B \(68 B packed FP4\), 4096 full slots; "
                     r"SWA 1536 B/token \(8 layers x 192 B\), 408 SWA slots; pair ring 2 slots", log)
    assert re.search(r"sglang-dsv41 caches: global KV 192 B/token .*4098 full slots.*410 SWA slots", log)


def test_greedy_within_the_contract_and_prefix_cache_hits(server: Server, reference: ReferenceModel) -> None:
    prompts = [_prompt(10, 41), _prompt(11, 47), _prompt(12, 52)]
    results = _concurrently(server, prompts, logprob=True)
    for prompt, res in zip(prompts, results):
        tokens = res["output_ids"]
        assert len(tokens) == NEW_TOKENS and within_contract(reference, prompt, tokens)
        got_lp = [lp for lp, _, _ in res["meta_info"]["output_token_logprobs"]]
        assert max(abs(a - b) for a, b in zip(got_lp, _reference_logprobs(reference, prompt, tokens))) < LOGPROB_ATOL
    again = server.generate(prompts[0], NEW_TOKENS)
    assert again["meta_info"]["cached_tokens"] >= len(prompts[0]) - 1   # radix prefix cache hit
    assert again["output_ids"] == results[0]["output_ids"]


def test_concurrent_requests_sharing_a_cached_prefix_equal_their_cold_runs(server: Server,
                                                                           reference: ReferenceModel) -> None:
    shared = _prompt(20, 31)                          # odd length: the hit stops at the page boundary 30
    server.generate(shared, n=1)                      # puts the prefix into the radix cache
    tails = [_prompt(21, 12)[1:], _prompt(22, 16)[1:]]
    prompts = [shared + t for t in tails]
    results = _concurrently(server, prompts)
    for prompt, res in zip(prompts, results):
        assert res["meta_info"]["cached_tokens"] >= len(shared) - len(shared) % PAGE_SIZE   # page-aligned hit
        assert len(res["output_ids"]) == NEW_TOKENS and within_contract(reference, prompt, res["output_ids"])


def test_chat_completions_stream(server: Server) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Say something about rivers."}],
            "max_tokens": 8, "temperature": 0, "stream": True}
    req = urllib.request.Request(server.url("/v1/chat/completions"), data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    chunks, done = [], False
    with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            payload = line[len("data:"):].strip()
            if payload == "[DONE]":
                done = True
                break
            chunks.append(json.loads(payload))
    assert done and chunks
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    whole = server.post("/v1/chat/completions", {**body, "stream": False})
    assert whole["choices"][0]["message"]["content"] == streamed
    assert whole["usage"]["completion_tokens"] == 8

"""End to end on CPU: plain ``python -m sglang.launch_server --model-path <tiny> --device cpu`` with
no model flag serves V4.1 correctly (issue 13 item 3) and refuses, before any scheduler starts,
flags the runtime cannot serve: the plugin's declared defaults
(`sglang_dsv41/overrides.py`) are what SGLang resolved, greedy tokens are the reference's top-1
up to the numerics contract's margin (`test_runtime_server.within_contract`), a
repeated prompt hits the prefix cache, and a chat reply carries its trace in
``reasoning_content`` and its answer in ``content`` (the default reasoning parser).

The environment is exactly what ``sglang-dsv41 serve --dry-run`` prints for this checkpoint (the
CPU engine switch, the libcuda stand-in on ``LD_LIBRARY_PATH``, offline hub), on top of the test's
own environment; the only flag besides the two above is ``--port`` (a free one). The shared ``plain``
server (tests/shared_servers.py); every wait and request is bounded; its process group is killed at the end.

The chat case needs a reply that closes its trace after a few tokens. The tiny model is random,
so the test steers it through the public API only: a ``logit_bias`` on ``</think>`` chosen from
the reference's logits on the server's own prompt ids so that the reference's greedy reply reasons
for k ≥ 1 tokens, closes the trace, then answers; the margin between the chosen bias and the
logits it separates is at least `BIAS_GAP`, far above the server's logit error against the
reference (the numerics contract: within `LOGIT_BOUND`, tests/test_runtime_numerics_contract.py).
"""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from server_helpers import Server, free_port
from sglang_dsv41.reference.model import ReferenceModel
from sglang_dsv41.runtime.requirements import CURRENT_RUNTIME, PAGE_SIZE

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
THINK_END = "</think>"
NEW_TOKENS = 6
TRACE_STEPS = 8          # the reasoning steps searched for a place to close the trace
ANSWER_TOKENS = 4
BIAS_GAP = 0.5


def dry_run_environment(checkpoint: Path) -> tuple[dict[str, str], list[str]]:
    """(variables, command) of `sglang-dsv41 serve --dry-run --device cpu --model-path <checkpoint>`."""
    out = subprocess.run([sys.executable, "-m", "sglang_dsv41.cli", "serve", "--dry-run", "--device", "cpu",
                          "--model-path", str(checkpoint)], capture_output=True, text=True, timeout=300, check=True)
    words = shlex.split(out.stdout.strip())
    split = next(i for i, w in enumerate(words) if "=" not in w)
    return dict(w.split("=", 1) for w in words[:split]), words[split:]


class PlainServer(Server):
    """`Server`'s waits, requests and stop, for a plain `python -m sglang.launch_server` command."""

    def __init__(self, argv_tail: list[str], env: dict[str, str], log: Path) -> None:
        self.port = free_port()
        self.log_path = log
        self.device = "cpu"
        self.argv = [sys.executable, "-m", "sglang.launch_server", *argv_tail, "--port", str(self.port)]
        self._log = open(log, "w")
        self.proc = subprocess.Popen(self.argv, env={**os.environ, **env}, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)


@pytest.fixture(scope="module")
def prepared(tiny_checkpoint: Path) -> dict[str, str]:
    env, command = dry_run_environment(tiny_checkpoint)
    assert set(env) == {"SGLANG_USE_CPU_ENGINE", "LD_LIBRARY_PATH", "HF_HUB_OFFLINE"}
    assert command[1:] == ["-m", "sglang.launch_server", "--model-path", str(tiny_checkpoint.resolve()),
                           "--host", "127.0.0.1", "--port", "30000", "--device", "cpu"]    # no model flag
    return env


@pytest.fixture(scope="module")
def server(prepared: dict[str, str], shared_servers) -> PlainServer:
    """The shared ``plain`` server (tests/shared_servers.py): `PlainServer` with the model path,
    ``--device cpu`` and the `prepared` environment."""
    return shared_servers.get("plain")


@pytest.fixture(scope="module")
def reference(tiny_checkpoint: Path) -> ReferenceModel:
    return ReferenceModel.from_checkpoint(tiny_checkpoint)


def test_plain_launch_refuses_what_the_runtime_cannot_serve_at_start_up(tiny_checkpoint: Path,
                                                                        prepared: dict[str, str]) -> None:
    """Before any scheduler starts: the process exits with one line per refused flag."""
    run = subprocess.run([sys.executable, "-m", "sglang.launch_server", "--model-path", str(tiny_checkpoint),
                          "--device", "cpu", "--port", str(free_port()), "--page-size", "3",
                          "--kv-cache-dtype", "fp8_e4m3"],
                         env={**os.environ, **prepared}, capture_output=True, text=True, timeout=300)
    assert run.returncode != 0
    assert "ServerArgsRefused: sglang-dsv41: DeepSeek-V4.1 cannot be served with these server arguments:" in run.stderr
    assert "\n  --page-size 3: " in run.stderr and "\n  --kv-cache-dtype fp8_e4m3: " in run.stderr
    assert "Scheduler" not in run.stderr and "Uvicorn" not in run.stderr


def test_sglang_resolved_the_declared_defaults(server: PlainServer) -> None:
    info = server.get("/get_server_info")
    for name, value in CURRENT_RUNTIME.defaults("cpu").items():
        assert info[name] == value, name
    assert info["page_size"] == PAGE_SIZE and info["reasoning_parser"] == "deepseek-v41"


def test_greedy_within_the_contract_and_a_repeat_hits_the_prefix_cache(server: PlainServer,
                                                                       reference: ReferenceModel) -> None:
    from test_runtime_server import within_contract

    g = torch.Generator().manual_seed(7)
    prompt = [0] + torch.randint(3, 990, (22,), generator=g).tolist()
    first = server.generate(prompt, NEW_TOKENS)
    assert len(first["output_ids"]) == NEW_TOKENS and within_contract(reference, prompt, first["output_ids"])
    again = server.generate(prompt, NEW_TOKENS)
    assert again["meta_info"]["cached_tokens"] > 0
    assert again["meta_info"]["cached_tokens"] >= len(prompt) - PAGE_SIZE        # page-aligned hit
    assert again["output_ids"] == first["output_ids"]


def _biased_greedy(reference: ReferenceModel, prompt: list[int], n: int, token: int, bias: float) -> list[int]:
    """The reference's greedy reply with `bias` added to `token`'s logit (what logit_bias does)."""
    state = reference.new_request()
    logits = reference.forward(state, prompt).logits[-1]
    out: list[int] = []
    for _ in range(n):
        biased = logits.double().clone()
        biased[token] += bias
        out.append(int(biased.argmax()))
        logits = reference.forward(state, [out[-1]]).logits[-1]
    return out


def _closing_bias(reference: ReferenceModel, prompt: list[int], token: int) -> tuple[int, float]:
    """(k, bias): with `bias` on `token` the reference's greedy reply emits `token` first at step
    k ≥ 1 and something else right after it; the bias is at least BIAS_GAP away from each logit
    gap it separates (module doc)."""
    path = reference.generate(prompt, TRACE_STEPS)
    logits = reference.forward(reference.new_request(), prompt + path[:-1]).logits[len(prompt) - 1:].double()
    gaps = (logits.max(dim=-1).values - logits[:, token]).tolist()
    for k in range(1, TRACE_STEPS):
        after = reference.forward(reference.new_request(), prompt + path[:k] + [token]).logits[-1].double()
        below = min(*gaps[:k], float(after.max() - after[token]))   # the bias must stay under these
        if below - gaps[k] >= 2 * BIAS_GAP:
            return k, (below + gaps[k]) / 2
    raise AssertionError(f"no step closes the trace with a bias margin of {BIAS_GAP}: gaps {gaps}")


def test_chat_reply_carries_the_trace_in_reasoning_content_and_the_answer_in_content(
        server: PlainServer, reference: ReferenceModel, tiny_checkpoint: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(tiny_checkpoint / "tokenizer.json"))
    think_end = tokenizer.convert_tokens_to_ids(THINK_END)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "What is 17*19?"}], "temperature": 0}
    probe = server.post(CHAT, {**body, "max_tokens": 1, "return_prompt_token_ids": True})   # thinking on: card default
    prompt = probe["choices"][0]["prompt_token_ids"]
    k, bias = _closing_bias(reference, prompt, think_end)
    want = _biased_greedy(reference, prompt, k + 1 + ANSWER_TOKENS, think_end, bias)
    assert want[k] == think_end and think_end not in want[:k] and want[k + 1] != think_end
    reply = server.post(CHAT, {**body, "max_tokens": len(want), "logit_bias": {str(think_end): bias}})
    message = reply["choices"][0]["message"]
    assert message["reasoning_content"] == tokenizer.decode(want[:k]).strip(), message
    assert message["content"] == tokenizer.decode(want[k + 1:]), message
    assert message["content"] and reply["usage"]["completion_tokens"] == len(want)

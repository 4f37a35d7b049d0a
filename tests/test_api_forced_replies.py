"""What a client sees for specific replies, through a real server (issue 20 items 2 and 5;
docs/api.md "Reasoning and tool calls together", "Thinking and reasoning effort").

The tiny checkpoint's model is random, so each request forces its reply token by token with the
`forced_tokens.ForcedTokens` logit processor (``--enable-custom-logit-processor``, with
``--disable-overlap-schedule`` so that it knows the step); everything
after the sampler — detokenizer, reasoning and DSML parsers, SSE streaming, finish reasons — is
the real server's. One `sglang-dsv41 serve` for the module (`forced_server`; the one-module
``forced`` group of tests/shared_servers.py, stopped after the module's last test), with the parsers of the plugin's
defaults and ``SGLANG_DSV41_EFFORT_TABLE=deepseek-api`` (the DeepSeek-API effort table option).

CPU cost: the tiny model decodes a few tokens per second per batch on 2 shared cores, so every
forced request of `FORCED` is sent at once (`replies` fixture: one decode batch) and the tests
read their results.
"""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest

from forced_tokens import forced
from server_helpers import REQUEST_TIMEOUT_S, Server

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
DSML = "｜DSML｜"
USER = [{"role": "user", "content": "Weather?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "required": ["unit"],
                                          "properties": {"unit": {"type": "string"}}}}}
CALL = (f'\n\n<{DSML} calls>\n<{DSML} invoke name="get_weather">\n'
        f'<{DSML} parameter name="unit" string="true">C</{DSML} parameter>\n'
        f'</{DSML} invoke>\n</{DSML} calls>')
WANT_CALL = [{"name": "get_weather", "arguments": {"unit": "C"}}]


def forced_server(checkpoint: Path, log: Path) -> Server:
    """This module's server (launched by `shared_servers`, group ``forced``, so it can start ahead)."""
    tests_dir = str(Path(__file__).parent)
    env = {"PYTHONPATH": os.pathsep.join(p for p in (tests_dir, os.environ.get("PYTHONPATH")) if p),
           "SGLANG_DSV41_EFFORT_TABLE": "deepseek-api"}
    return Server(checkpoint, log, ["--max-total-tokens", "16384", "--max-running-requests", "32",
                                    "--enable-custom-logit-processor", "--disable-overlap-schedule"], env=env)


@pytest.fixture(scope="module")
def server(shared_servers) -> Server:
    return shared_servers.get("forced")


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint: Path):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(tiny_checkpoint))


def reply_ids(tokenizer, text: str) -> list[int]:
    """The reply as the model would emit it: DSML and think markers are single special tokens."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    for marker in (DSML, "</think>"):
        assert text.count(marker) == ids.count(tokenizer.convert_tokens_to_ids(marker))
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    return ids


def ask(server: Server, tokenizer, text: str, *, stream: bool, max_tokens: int = 200,
        **extra: Any) -> dict[str, Any]:
    """One chat request whose reply is forced to ``text`` (then EOS): the choice, streamed
    replies folded into the non-streamed shape."""
    eos = tokenizer.convert_tokens_to_ids("<｜end▁of▁sentence｜>")
    body = {"model": "tiny", "messages": USER, "max_tokens": max_tokens, "temperature": 0,
            **forced(reply_ids(tokenizer, text), eos), **extra}
    if stream:
        return fold(server.stream(CHAT, body))
    status, answer = server.post_status(CHAT, body)
    assert status == 200, f"{status}: {answer}\n{server.log_tail()}"
    choice = answer["choices"][0]
    message = choice["message"]
    return {"reasoning_content": message.get("reasoning_content") or "",
            "content": message.get("content") or "",
            "tool_calls": [{"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}
                           for c in message.get("tool_calls") or []],
            "finish_reason": choice["finish_reason"], "raw": json.dumps(answer)}


def fold(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    reasoning = content = ""
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in chunks:
        for choice in chunk["choices"]:
            delta = choice.get("delta") or {}
            reasoning += delta.get("reasoning_content") or ""
            content += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                slot = calls.setdefault(call["index"], {"name": "", "arguments": ""})
                slot["name"] += call["function"].get("name") or ""
                slot["arguments"] += call["function"].get("arguments") or ""
            finish = choice.get("finish_reason") or finish
    return {"reasoning_content": reasoning, "content": content,
            "tool_calls": [{"name": calls[i]["name"], "arguments": json.loads(calls[i]["arguments"])}
                           for i in sorted(calls)],
            "finish_reason": finish, "raw": json.dumps(chunks)}


def without_raw(reply: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in reply.items() if k != "raw"}


TRACE = "Let me think about seventeen times nineteen step by step.</think>323"
BUDGET = 6
NO_THINKING = {"chat_template_kwargs": {"thinking": False}}
TOOLS = {"tools": [WEATHER]}
# name: (forced reply, request fields, max_tokens); each is sent streamed and not
FORCED: dict[str, tuple[str, dict[str, Any], int]] = {
    "trace-then-call": ("I need the weather.</think>" + CALL, TOOLS, 200),
    "call-inside-trace": ("I need the weather." + CALL, TOOLS, 200),
    "bare-no-tools-thinking-off": (f"The answer{DSML} is 323.{DSML}", NO_THINKING, 200),
    "bare-no-tools-thinking-on": (f"Hmm{DSML} fine.</think>323{DSML}", {}, 200),
    "bare-tools-thinking-on": (f"Hmm{DSML}</think>{DSML}" + CALL, TOOLS, 200),
    "budget-spent-in-trace": (TRACE, {}, BUDGET),
}


@pytest.fixture(scope="module")
def replies(server: Server, tokenizer):
    """Every `FORCED` request, streamed and not, sent at once; ``replies(name, stream)`` is the
    folded reply (re-raises a request's failure with the server log)."""
    results: dict[tuple[str, bool], Any] = {}

    def one(name: str, stream: bool) -> None:
        text, extra, max_tokens = FORCED[name]
        try:
            results[name, stream] = ask(server, tokenizer, text, stream=stream, max_tokens=max_tokens, **extra)
        except Exception as exc:  # re-raised by the test that reads it
            results[name, stream] = exc

    threads = [threading.Thread(target=one, args=(name, stream)) for name in FORCED for stream in (False, True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=REQUEST_TIMEOUT_S + 30)

    def reply(name: str, stream: bool) -> dict[str, Any]:
        got = results.get((name, stream))
        if not isinstance(got, dict):
            raise AssertionError(f"{name} (stream={stream}) failed: {got!r}\n{server.log_tail()}")
        return got

    return reply


# --- reasoning and tool calls together ----------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_trace_then_tool_call(replies, stream: bool) -> None:
    """Card default (thinking on) with tools: the trace, ``</think>``, a DSML call →
    reasoning_content + tool_calls, empty content, finish_reason tool_calls; the stream's deltas
    reassemble to exactly the non-streamed reply."""
    reply = replies("trace-then-call", stream)
    assert without_raw(reply) == {"reasoning_content": "I need the weather.", "content": "",
                                  "tool_calls": WANT_CALL, "finish_reason": "tool_calls"}
    assert DSML not in reply["raw"] and "</think>" not in reply["raw"]


@pytest.mark.parametrize("stream", [False, True])
def test_tool_call_opened_inside_the_trace(replies, stream: bool) -> None:
    """vllm#45862: the call opens before ``</think>``; the trace is kept, the call parsed."""
    reply = replies("call-inside-trace", stream)
    assert reply["reasoning_content"].strip() == "I need the weather."
    assert (reply["content"], reply["tool_calls"], reply["finish_reason"]) == ("", WANT_CALL, "tool_calls")


@pytest.mark.parametrize("name", ["trace-then-call", "call-inside-trace", "budget-spent-in-trace"])
def test_streamed_equals_non_streamed(replies, name: str) -> None:
    assert without_raw(replies(name, True)) == without_raw(replies(name, False))


# --- a bare ｜DSML｜ token never reaches the client ------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("name,want", [
    ("bare-no-tools-thinking-off", ("", "The answer is 323.", [])),
    ("bare-no-tools-thinking-on", ("Hmm fine.", "323", [])),
    ("bare-tools-thinking-on", ("Hmm", "", WANT_CALL)),
])
def test_bare_dsml_token_is_not_content(replies, stream: bool, name: str, want: tuple) -> None:
    reply = replies(name, stream)
    assert (reply["reasoning_content"], reply["content"], reply["tool_calls"]) == want
    assert DSML not in reply["raw"]


# --- max_tokens spent inside the trace -------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_spent_in_the_trace(replies, tokenizer, stream: bool) -> None:
    """The card's do-nothing request (thinking on by default) with a budget smaller than the
    trace: finish_reason length, the budget's tokens all in reasoning_content, empty content."""
    ids = reply_ids(tokenizer, TRACE)
    assert ids.index(tokenizer.convert_tokens_to_ids("</think>")) > BUDGET
    assert without_raw(replies("budget-spent-in-trace", stream)) == {
        "reasoning_content": tokenizer.decode(ids[:BUDGET]), "content": "", "tool_calls": [],
        "finish_reason": "length"}


# --- the DeepSeek-API effort table (SGLANG_DSV41_EFFORT_TABLE=deepseek-api) ------------------------
@pytest.mark.parametrize("effort,budget", [("low", 50), ("high", 75), ("max", 100), (60, 60)])
def test_deepseek_api_effort_table(server: Server, tokenizer, effort: Any, budget: int) -> None:
    body = {"model": "tiny", "messages": USER, "max_tokens": 1, "reasoning_effort": effort,
            "return_prompt_token_ids": True}
    status, answer = server.post_status(CHAT, body)
    assert status == 200, answer
    prompt = tokenizer.decode(answer["choices"][0]["prompt_token_ids"], skip_special_tokens=False)
    assert f"Reasoning Effort: {budget} (range 1-100" in prompt


def test_deepseek_api_table_has_no_xhigh(server: Server) -> None:
    status, err = server.post_status(CHAT, {"model": "tiny", "messages": USER, "max_tokens": 1,
                                            "reasoning_effort": "xhigh"})
    assert status == 400
    assert "'xhigh'" in err["message"] and "'low', 'high', 'max'" in err["message"]

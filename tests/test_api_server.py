"""The DeepSeek-V4.1 chat API through a real server with the model (issue 4; docs/api.md
"Verified end to end").

The shared ``api`` `sglang-dsv41 serve` on the tiny checkpoint (tests/shared_servers.py), launched with
``--reasoning-parser deepseek-v41 --tool-call-parser deepseek-v41`` (CPU in CI; on a CUDA machine
the same tests serve from the GPU). The tiny model's output is random, so the tests assert
structure, never content, and steer the model only through the public API:

* ``logit_bias`` −100 on ``</think>`` and ``｜DSML｜`` keeps a trace open (the card example is then
  all reasoning, whatever the device's numerics pick); +100 on ``</think>`` closes the trace at once
  (thinking-mode grammars must start right after it);
* tool schemas use enums, so the DSML grammar admits finitely many replies — the random model must
  finish a call within ``max_tokens``; ``--constrained-json-disable-any-whitespace`` bounds a
  ``response_format`` reply the same way (xgrammar otherwise lets it emit whitespace for hundreds
  of tokens).

CPU cost: the constrained and streaming requests are sent together (`constrained` fixture) so
they decode in one batch (~1 min on 2 cores); every other request generates ≤ 8 tokens. Every wait
and request is bounded; the server's process group is killed at the end.
"""
from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any, Callable

import deepseek_recipe as dr
import pytest

from server_helpers import REQUEST_TIMEOUT_S, Server
from sglang_dsv41.api.effort import CARD_TABLE, resolve_reasoning
from sglang_dsv41.api.encoding import SPECIAL_TOKENS, encode_chat, render_chat
from sglang_dsv41.api.prompt_tokens import PromptTokenEncoder

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
PARSER = "deepseek-v41"
THINK_END = "</think>"
DSML = "｜DSML｜"
BOS = SPECIAL_TOKENS.token(dr.SpecialToken.Bos)
CARD_MESSAGES = [{"role": "user", "content": "What is 17*19?"}]
MULTI_TURN = [{"role": "system", "content": "You are terse."},
              {"role": "user", "content": "What is 17*19?"},
              {"role": "assistant", "content": "323"},
              {"role": "user", "content": "And 18*19?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather now.",
    "parameters": {"type": "object", "required": ["unit"],
                   "properties": {"unit": {"type": "string", "enum": ["C", "F"]}}}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "Time now.",
    "parameters": {"type": "object", "required": ["zone"],
                   "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}}}}
TOOLS = {t["function"]["name"]: t for t in (WEATHER, CLOCK)}
ANSWER_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["unit", "ok"],
                 "properties": {"unit": {"type": "string", "enum": ["C", "F"]}, "ok": {"type": "boolean"}}}
TOOL_MAX_TOKENS = 160   # a one-call DSML reply is ~90-110 tokens of the tiny tokenizer
JSON_MAX_TOKENS = 60    # {"unit":"C","ok":false} without free whitespace is < 30 tokens


@pytest.fixture(scope="module")
def server(shared_servers) -> Server:
    """The shared ``api`` server (tests/shared_servers.py: the `PARSER` parsers,
    ``--constrained-json-disable-any-whitespace``)."""
    return shared_servers.get("api")


@pytest.fixture(scope="module")
def encoder(tiny_checkpoint: Path) -> PromptTokenEncoder:
    """Our prompt encoder over the served checkpoint's tokenizer."""
    from tokenizers import Tokenizer

    return PromptTokenEncoder(Tokenizer.from_file(str(tiny_checkpoint / "tokenizer.json")))


def _bias(encoder: PromptTokenEncoder, **per_spelling: float) -> dict[str, float]:
    spellings = {"think_end": THINK_END, "dsml": DSML}
    return {str(encoder.special_id(spellings[k])): v for k, v in per_spelling.items()}


def _chat(messages: list[dict[str, Any]], max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": messages, "max_tokens": max_tokens, "temperature": 0, **extra}


def _message(server: Server, body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(choice, whole answer) of a non-streamed 200 reply."""
    status, answer = server.post_status(CHAT, body)
    assert status == 200, f"{status}: {answer}\n{server.log_tail()}"
    return answer["choices"][0], answer


def _assemble(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """A streamed chat reply folded into the non-streamed shape (message + finish_reason)."""
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in chunks:
        for choice in chunk["choices"]:
            delta = choice.get("delta") or {}
            content += delta.get("content") or ""
            reasoning += delta.get("reasoning_content") or ""
            for call in delta.get("tool_calls") or []:
                slot = calls.setdefault(call["index"], {"name": "", "arguments": ""})
                slot["name"] += call["function"].get("name") or ""
                slot["arguments"] += call["function"].get("arguments") or ""
            finish = choice.get("finish_reason") or finish
    return {"content": content, "reasoning_content": reasoning,
            "tool_calls": [calls[i] for i in sorted(calls)], "finish_reason": finish}


def _calls(choice: dict[str, Any]) -> list[dict[str, str]]:
    return [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
            for c in choice["message"].get("tool_calls") or []]


def _assert_valid_call(call: dict[str, str], allowed: set[str]) -> None:
    """The call names a declared tool and its arguments are a JSON object that validates against
    that tool's schema (every schema here: one required enum string, nothing else)."""
    assert call["name"] in allowed
    params = TOOLS[call["name"]]["function"]["parameters"]
    args = json.loads(call["arguments"])
    assert isinstance(args, dict) and set(args) == set(params["required"])
    for key, value in args.items():
        assert value in params["properties"][key]["enum"]


def _assert_valid_answer(text: str) -> None:
    answer = json.loads(text)
    assert set(answer) == {"unit", "ok"}
    assert answer["unit"] in ("C", "F") and isinstance(answer["ok"], bool)


# --- the card example -------------------------------------------------------------------------
def test_card_example_returns_reasoning_content(server: Server, encoder: PromptTokenEncoder) -> None:
    """Card request (thinking, effort 25) with a small budget and a trace the model cannot close:
    200, the whole reply in `reasoning_content`, empty `content`, finish_reason length."""
    body = _chat(CARD_MESSAGES, 8, chat_template_kwargs={"thinking": True, "reasoning_effort": 25},
                 logit_bias=_bias(encoder, think_end=-100, dsml=-100))
    choice, answer = _message(server, body)
    message = choice["message"]
    assert choice["finish_reason"] == "length"
    assert isinstance(message["reasoning_content"], str) and message["reasoning_content"]
    assert not message["content"] and not message.get("tool_calls")
    assert answer["usage"]["completion_tokens"] == 8 == answer["usage"]["reasoning_tokens"]


# --- prompt ids -------------------------------------------------------------------------------
PROMPT_CASES = {  # id: (chat_template_kwargs, top-level reasoning_effort, equivalent kwargs)
    "thinking-effort25": ({"thinking": True, "reasoning_effort": 25}, None, None),
    "effort60": ({"reasoning_effort": 60}, None, None),
    "top-level-60": (None, 60, {"reasoning_effort": 60}),
    "thinking-off": ({"thinking": False}, None, None),
    "top-level-none": (None, "none", {"thinking": False}),
}


def _expected_ids(messages: list[dict[str, Any]], ctk: dict[str, Any], encoder: PromptTokenEncoder
                  ) -> tuple[list[int], str]:
    decision = resolve_reasoning(chat_template_kwargs=ctk, top_level_effort=None, table=CARD_TABLE,
                                 server_defaults=None)
    rendered = render_chat(messages, decision=decision)
    return encode_chat(rendered, encoder), rendered.text


@pytest.mark.parametrize("messages", [CARD_MESSAGES, MULTI_TURN], ids=["card", "multi-turn"])
def test_scheduler_receives_our_prompt_ids(server: Server, encoder: PromptTokenEncoder,
                                           messages: list[dict[str, Any]]) -> None:
    """The ids the tokenizer manager hands the scheduler (`return_prompt_token_ids`) equal
    `encode_chat(render_chat(...))`, for thinking on/off, efforts 25/60, integer and "none"
    top-level efforts; and the scheduler's own view of the same prompt sent as text to
    `/generate` (input-token logprobs from position 0) has the same ids."""
    seen: dict[str, list[int]] = {}
    for name, (ctk, top, equivalent) in PROMPT_CASES.items():
        want, text = _expected_ids(messages, equivalent or ctk, encoder)
        extra: dict[str, Any] = {"return_prompt_token_ids": True}
        if ctk is not None:
            extra["chat_template_kwargs"] = ctk
        if top is not None:
            extra["reasoning_effort"] = top
        choice, answer = _message(server, _chat(messages, 1, **extra))
        assert choice["prompt_token_ids"] == want, name
        assert answer["usage"]["prompt_tokens"] == len(want), name
        # /generate adds the tokenizer's BOS itself (add_bos_token): the text goes without ours
        assert text.startswith(BOS)
        assert _generate_input_ids(server, text[len(BOS):]) == want, name
        seen[name] = want
    assert seen["top-level-60"] == seen["effort60"] != seen["thinking-effort25"] != seen["thinking-off"]
    assert seen["top-level-none"] == seen["thinking-off"]



def _generate_input_ids(server: Server, text: str) -> list[int]:
    """The prompt ids as the scheduler saw them (input-token logprobs from position 0)."""
    raw = server.post("/generate", {"text": text, "return_logprob": True, "logprob_start_len": 0,
                                    "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
    return [tid for _, tid, _ in raw["meta_info"]["input_token_logprobs"]]


def test_generate_with_the_rendered_text_gets_a_second_bos(server: Server, encoder: PromptTokenEncoder) -> None:
    """Pins the pitfall docs/api.md warns about: the rendered prompt already starts with BOS and
    SGLang's text path adds the tokenizer's own, so the raw text is *not* the chat's prompt."""
    want, text = _expected_ids(CARD_MESSAGES, {"thinking": False}, encoder)
    assert _generate_input_ids(server, text) == [want[0]] + want


# --- rejected requests ------------------------------------------------------------------------
def test_effort_values_and_rejections_through_the_real_server(server: Server) -> None:
    """Top-level integer 60 → 200; "medium" and a thinking/enable_thinking disagreement → 400
    with the card's wording; the server keeps serving afterwards."""
    choice, _ = _message(server, _chat(CARD_MESSAGES, 2, reasoning_effort=60))
    assert choice["finish_reason"] == "length"
    status, err = server.post_status(CHAT, _chat(CARD_MESSAGES, 2, reasoning_effort="medium"))
    assert status == 400 and "'medium'" in err["message"]
    for accepted in ("'none'", "'low'", "'high'", "'xhigh'", "'max'", "integer 1-100"):
        assert accepted in err["message"]
    status, err = server.post_status(CHAT, _chat(CARD_MESSAGES, 2, chat_template_kwargs={
        "thinking": True, "enable_thinking": False}))
    assert status == 400
    assert "chat_template_kwargs.thinking" in err["message"] and "enable_thinking" in err["message"]
    choice, answer = _message(server, _chat(CARD_MESSAGES, 2, chat_template_kwargs={"thinking": False}))
    assert choice["finish_reason"] == "length" and answer["usage"]["reasoning_tokens"] == 0


# --- grammar-constrained and streamed replies, decoded together -------------------------------
def _constrained_requests(encoder: PromptTokenEncoder) -> dict[str, tuple[bool, dict[str, Any]]]:
    """name → (streamed?, body)."""
    off = {"chat_template_kwargs": {"thinking": False}}
    close_trace = {"chat_template_kwargs": {"thinking": True}, "logit_bias": _bias(encoder, think_end=100)}
    ask = [{"role": "user", "content": "Weather or time?"}]
    tools = {"tools": [WEATHER, CLOCK], "parallel_tool_calls": False}
    named = {"type": "function", "function": {"name": "get_time"}}
    answer = {"response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA}}}
    json_ask = [{"role": "user", "content": "Answer in JSON."}]
    free = _chat(MULTI_TURN, 12, logit_bias=_bias(encoder, think_end=6))
    return {
        "required": (False, _chat(ask, TOOL_MAX_TOKENS, tool_choice="required", **tools, **off)),
        "required-stream": (True, _chat(ask, TOOL_MAX_TOKENS, tool_choice="required", **tools, **off)),
        "named": (False, _chat(ask, TOOL_MAX_TOKENS, tool_choice=named, **tools, **off)),
        "named-stream": (True, _chat(ask, TOOL_MAX_TOKENS, tool_choice=named, **tools, **off)),
        "required-thinking": (False, _chat(ask, TOOL_MAX_TOKENS, tool_choice="required", **tools, **close_trace)),
        "json": (False, _chat(json_ask, JSON_MAX_TOKENS, **answer, **off)),
        "json-thinking": (False, _chat(json_ask, JSON_MAX_TOKENS, **answer, **close_trace)),
        "free": (False, free),                 # thinking on by default (card)
        "free-stream": (True, free),
    }


def _fold(choice: dict[str, Any]) -> dict[str, Any]:
    message = choice["message"]
    return {"content": message.get("content") or "", "reasoning_content": message.get("reasoning_content") or "",
            "tool_calls": _calls(choice), "finish_reason": choice["finish_reason"]}


@pytest.fixture(scope="module")
def constrained(server: Server, encoder: PromptTokenEncoder) -> Callable[[str], dict[str, Any]]:
    """Sends every request of `_constrained_requests` at once (one decode batch on the CPU) and
    returns a lookup of the folded replies (streamed ones assembled from their chunks)."""
    requests = _constrained_requests(encoder)
    results: dict[str, Any] = {}

    def one(name: str, streamed: bool, body: dict[str, Any]) -> None:
        try:
            results[name] = (_assemble(server.stream(CHAT, body)) if streamed
                             else _fold(_message(server, body)[0]))
        except Exception as e:  # re-raised by the test that reads it, with the server log
            results[name] = e

    threads = [threading.Thread(target=one, args=(name, streamed, body))
               for name, (streamed, body) in requests.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=REQUEST_TIMEOUT_S + 30)

    def reply(name: str) -> dict[str, Any]:
        got = results.get(name)
        if not isinstance(got, dict):
            raise AssertionError(f"request {name!r} failed: {got!r}\n{server.log_tail()}")
        return got

    return reply


@pytest.mark.parametrize("name", ["required", "required-stream", "named", "named-stream", "required-thinking"])
def test_tool_choice_forces_a_dsml_call(constrained: Callable[[str], dict[str, Any]], name: str) -> None:
    """The DSML grammar makes even the random model call a tool: finish_reason tool_calls, one call
    (parallel_tool_calls false) of a declared tool — the named one for a named choice — with
    arguments that validate; no markup in content. Thinking on: the call comes after the trace."""
    reply = constrained(name)
    assert reply["finish_reason"] == "tool_calls"
    assert len(reply["tool_calls"]) == 1 and reply["content"].strip() == ""
    _assert_valid_call(reply["tool_calls"][0], {"get_time"} if name.startswith("named") else set(TOOLS))
    # thinking off: nothing is routed to reasoning; thinking on: the trace was closed at once
    assert reply["reasoning_content"] == ""


@pytest.mark.parametrize("name", ["required", "named"])
def test_streamed_tool_call_equals_the_non_streamed_one(constrained: Callable[[str], dict[str, Any]],
                                                        name: str) -> None:
    assert constrained(f"{name}-stream") == constrained(name)


@pytest.mark.parametrize("name", ["json", "json-thinking"])
def test_response_format_json_schema_validates(constrained: Callable[[str], dict[str, Any]], name: str) -> None:
    """Thinking off: the reply is the JSON. Thinking on (docs: the grammar applies after
    ``</think>`` with the reasoning parser): the trace is closed at once and the content is the JSON."""
    reply = constrained(name)
    assert reply["finish_reason"] == "stop" and not reply["tool_calls"]
    assert reply["reasoning_content"] == ""
    _assert_valid_answer(reply["content"])


def test_streamed_chat_equals_non_streamed_for_greedy(constrained: Callable[[str], dict[str, Any]]) -> None:
    streamed, whole = constrained("free-stream"), constrained("free")
    assert streamed == whole
    assert whole["finish_reason"] in ("length", "stop") and (whole["reasoning_content"] or whole["content"])

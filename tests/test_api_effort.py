"""Thinking / reasoning-effort resolution (model card "Reasoning and tool calling"): every
accepted combination and every HTTP-400 case, table-driven."""
from __future__ import annotations

import pytest

from sglang_dsv41.api.effort import (
    CARD_TABLE,
    DEEPSEEK_API_TABLE,
    EFFORT_TABLE_ENV,
    ReasoningDecision,
    ReasoningRequestError,
    effort_table_from_env,
    resolve_reasoning,
    validate_server_defaults,
)


def resolve(ctk=None, top=None, defaults=None, table=CARD_TABLE) -> ReasoningDecision:
    return resolve_reasoning(chat_template_kwargs=ctk, top_level_effort=top, table=table,
                             server_defaults=defaults)


# (chat_template_kwargs, top-level reasoning_effort, server defaults) -> (thinking, effort)
ACCEPTED = [
    # both unset -> thinking ON at effort 50 (the card's do-nothing config)
    (None, None, None, (True, 50)),
    ({}, None, None, (True, 50)),
    # the card's example request
    ({"thinking": True, "reasoning_effort": 25}, None, None, (True, 25)),
    # toggles
    ({"thinking": True}, None, None, (True, 50)),
    ({"enable_thinking": True}, None, None, (True, 50)),
    ({"thinking": False}, None, None, (False, None)),
    ({"enable_thinking": False}, None, None, (False, None)),
    ({"thinking": True, "enable_thinking": True}, None, None, (True, 50)),
    ({"thinking": False, "enable_thinking": False}, None, None, (False, None)),
    ({"thinking": None}, None, None, (True, 50)),  # JSON null = not sent
    # card tiers in chat_template_kwargs
    ({"reasoning_effort": "low"}, None, None, (True, 25)),
    ({"reasoning_effort": "high"}, None, None, (True, 50)),
    ({"reasoning_effort": "xhigh"}, None, None, (True, 75)),
    ({"reasoning_effort": "max"}, None, None, (True, 100)),
    ({"reasoning_effort": "MAX"}, None, None, (True, 100)),
    # integers 1..100 (and integral floats, as JSON may carry them)
    ({"reasoning_effort": 1}, None, None, (True, 1)),
    ({"reasoning_effort": 100}, None, None, (True, 100)),
    ({"reasoning_effort": 63}, None, None, (True, 63)),
    ({"reasoning_effort": 40.0}, None, None, (True, 40)),
    # top-level OpenAI field works too
    (None, "none", None, (False, None)),
    (None, "low", None, (True, 25)),
    (None, "high", None, (True, 50)),
    (None, "xhigh", None, (True, 75)),
    (None, "max", None, (True, 100)),
    (None, 70, None, (True, 70)),
    # both sent: chat_template_kwargs wins; both carry the same toggle consistently
    ({"reasoning_effort": "max"}, "low", None, (True, 100)),
    ({"reasoning_effort": 30}, 90, None, (True, 30)),
    ({"thinking": True}, "high", None, (True, 50)),
    ({"thinking": False}, "none", None, (False, None)),
    # SGLang's protocol copies a top-level effort into both toggles (setdefault) — consistent
    ({"thinking": True, "enable_thinking": True}, "xhigh", None, (True, 75)),
    ({"thinking": False, "enable_thinking": False}, "none", None, (False, None)),
    # server defaults (--default-chat-template-kwargs) fill what the request leaves unset
    (None, None, {"thinking": False}, (False, None)),
    (None, None, {"reasoning_effort": 80}, (True, 80)),
    (None, None, {"reasoning_effort": "max"}, (True, 100)),
    ({"thinking": True}, None, {"thinking": False}, (True, 50)),
    ({"thinking": False}, None, {"reasoning_effort": 80}, (False, None)),  # no contradiction
    ({"reasoning_effort": 30}, None, {"thinking": False}, (True, 30)),  # request effort => on
    (None, "low", {"reasoning_effort": 90}, (True, 25)),
    (None, "none", {"reasoning_effort": 90}, (False, None)),
]


@pytest.mark.parametrize("ctk,top,defaults,want", ACCEPTED)
def test_accepted(ctk, top, defaults, want):
    got = resolve(ctk, top, defaults)
    assert (got.thinking, got.effort) == want


def test_request_kwargs_not_mutated():
    ctk = {"thinking": True, "reasoning_effort": "low"}
    resolve(ctk, "max", {"thinking": False})
    assert ctk == {"thinking": True, "reasoning_effort": "low"}


# (chat_template_kwargs, top-level, server defaults) -> substrings the 400 message must contain
REJECTED = [
    # both toggles sent and disagree: name both
    ({"thinking": True, "enable_thinking": False}, None,
     ["chat_template_kwargs.thinking=true", "chat_template_kwargs.enable_thinking=false", "must agree"]),
    ({"thinking": False, "enable_thinking": True}, None,
     ["chat_template_kwargs.thinking=false", "chat_template_kwargs.enable_thinking=true"]),
    # toggles must be booleans
    ({"thinking": "yes"}, None, ["chat_template_kwargs.thinking", "boolean"]),
    ({"enable_thinking": 1}, None, ["chat_template_kwargs.enable_thinking", "boolean"]),
    # minimal / medium rejected, naming the accepted values
    (None, "minimal", ["'minimal'", "not supported", "'none', 'low', 'high', 'xhigh', 'max'",
                       "integer 1-100"]),
    (None, "medium", ["'medium'", "not supported", "'none', 'low', 'high', 'xhigh', 'max'"]),
    ({"reasoning_effort": "medium"}, None,
     ["chat_template_kwargs.reasoning_effort='medium'", "'low', 'high', 'xhigh', 'max'"]),
    ({"reasoning_effort": "minimal"}, None, ["chat_template_kwargs.reasoning_effort"]),
    # out of range / wrong type, in both places
    ({"reasoning_effort": 0}, None, ["chat_template_kwargs.reasoning_effort=0", "integer 1-100"]),
    ({"reasoning_effort": 101}, None, ["=101", "integer 1-100"]),
    ({"reasoning_effort": -5}, None, ["=-5"]),
    ({"reasoning_effort": 50.5}, None, ["=50.5", "integer 1-100"]),
    ({"reasoning_effort": True}, None, ["=True (bool)", "integer 1-100"]),
    ({"reasoning_effort": "50"}, None, ["='50'", "integer 1-100"]),
    ({"reasoning_effort": "ultra"}, None, ["='ultra'"]),
    ({"reasoning_effort": [50]}, None, ["=[50]"]),
    (None, 0, ["reasoning_effort=0", "'none', 'low'"]),
    (None, 0.5, ["reasoning_effort=0.5"]),  # SGLang's [0, 0.99] float extension is not the card's
    (None, 101, ["reasoning_effort=101"]),
    (None, "ultra", ["reasoning_effort='ultra'"]),
    (None, False, ["reasoning_effort=False (bool)"]),
    # "none" only at top level (card); in chat_template_kwargs it says how to turn thinking off
    ({"reasoning_effort": "none"}, None, ["chat_template_kwargs.reasoning_effort='none'",
                                          "thinking=false"]),
    # contradictions between the toggles and the efforts
    ({"thinking": True}, "none", ["reasoning_effort='none'", "chat_template_kwargs.thinking=true"]),
    ({"enable_thinking": True}, "none", ["chat_template_kwargs.enable_thinking=true"]),
    ({"thinking": False}, "high", ["reasoning_effort='high'", "chat_template_kwargs.thinking=false"]),
    ({"thinking": False}, 60, ["reasoning_effort=60", "thinking=false"]),
    # ... including what SGLang's protocol makes of them (it setdefaults both toggles)
    ({"thinking": False, "enable_thinking": True}, "high", ["reasoning_effort='high'",
                                                            "chat_template_kwargs.thinking=false"]),
    ({"thinking": True, "enable_thinking": False}, "none", ["chat_template_kwargs.thinking=true"]),
    ({"thinking": False, "reasoning_effort": 30}, None,
     ["chat_template_kwargs.thinking=false", "chat_template_kwargs.reasoning_effort=30"]),
    ({"enable_thinking": False, "reasoning_effort": "max"}, None,
     ["chat_template_kwargs.enable_thinking=false"]),
    ({"reasoning_effort": 30}, "none", ["reasoning_effort='none'", "reasoning_effort=30"]),
]


@pytest.mark.parametrize("ctk,top,needles", REJECTED)
def test_rejected(ctk, top, needles):
    with pytest.raises(ReasoningRequestError) as info:
        resolve(ctk, top)
    assert isinstance(info.value, ValueError)  # SGLang's serving layer maps ValueError to 400
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))


# --- the DeepSeek-API table (server option) -------------------------------------------------
@pytest.mark.parametrize("value,card,api", [
    ("low", 25, 50), ("high", 50, 75), ("max", 100, 100), (42, 42, 42),
])
def test_tables_differ_as_documented(value, card, api):
    assert resolve({"reasoning_effort": value}).effort == card
    assert resolve({"reasoning_effort": value}, table=DEEPSEEK_API_TABLE).effort == api
    assert resolve(None, value, table=DEEPSEEK_API_TABLE).effort == api


def test_api_table_has_no_xhigh_and_keeps_card_default():
    with pytest.raises(ReasoningRequestError, match="'none', 'low', 'high', 'max' or an integer"):
        resolve(None, "xhigh", table=DEEPSEEK_API_TABLE)
    assert (resolve(table=DEEPSEEK_API_TABLE).thinking, resolve(table=DEEPSEEK_API_TABLE).effort) == (True, 50)


@pytest.mark.parametrize("env,want", [({}, "card"), ({EFFORT_TABLE_ENV: "card"}, "card"),
                                      ({EFFORT_TABLE_ENV: "deepseek-api"}, "deepseek-api"),
                                      ({EFFORT_TABLE_ENV: " "}, "card")])
def test_table_from_env(env, want):
    assert effort_table_from_env(env).name == want


def test_unknown_table_env_fails_loudly():
    with pytest.raises(ValueError, match="not a known effort table"):
        effort_table_from_env({EFFORT_TABLE_ENV: "recipe"})


@pytest.mark.parametrize("defaults", [{"thinking": "no"}, {"reasoning_effort": "medium"},
                                      {"reasoning_effort": 0},
                                      {"thinking": False, "reasoning_effort": 50},
                                      {"thinking": True, "enable_thinking": False}])
def test_bad_server_defaults_fail_at_startup(defaults):
    with pytest.raises(ValueError, match="--default-chat-template-kwargs") as info:
        validate_server_defaults(defaults, CARD_TABLE)
    assert not isinstance(info.value, ReasoningRequestError)


@pytest.mark.parametrize("defaults", [None, {}, {"thinking": False}, {"reasoning_effort": 75},
                                      {"other_template_kwarg": 1}])
def test_good_server_defaults(defaults):
    validate_server_defaults(defaults, CARD_TABLE)


def test_decision_invariant():
    with pytest.raises(AssertionError):
        ReasoningDecision(True, None, "x")
    with pytest.raises(AssertionError):
        ReasoningDecision(False, 50, "x")
    with pytest.raises(AssertionError):
        ReasoningDecision(True, 0, "x")

"""Thinking mode and reasoning effort: the tables and the one resolution rule (model card,
"Reasoning and tool calling"; spec `model.md` §6 and §9).

The card wins over upstream SGLang/deepseek-recipe on API behaviour, so this module owns the
whole decision and nothing downstream re-derives it.

Tables (`EffortTable`)
----------------------
* ``card`` (default): ``low``=25, ``high``=50, ``xhigh``=75, ``max``=100, or an integer 1–100.
* ``deepseek-api`` (opt-in with ``SGLANG_DSV41_EFFORT_TABLE=deepseek-api``): ``low``=50,
  ``high``=75, ``max``=100, or an integer 1–100 (the DeepSeek API has no ``xhigh``; it is
  rejected under this table).
deepseek-recipe 0.2.0's own tiers (low 50 / high 75 / xhigh 75 / max 100, unset 75, minimal and
medium accepted) match neither; see docs/api.md.

Resolution (`resolve_reasoning`), request-level inputs first, then server defaults
-------------------------------------------------------------------------------
Inputs: ``chat_template_kwargs.thinking`` / ``.enable_thinking`` (booleans),
``chat_template_kwargs.reasoning_effort`` (tier or int), top-level OpenAI ``reasoning_effort``
("none", tier or int). Every invalid value and every contradiction is a `ReasoningRequestError`
(HTTP 400) whose message names the fields involved and the accepted values:

1. ``thinking`` / ``enable_thinking`` must be booleans; if both are sent they must agree.
2. top-level ``"none"`` with a ``true`` toggle, or a top-level effort level with a ``false``
   toggle, contradict each other.
3. thinking turned off (a ``false`` toggle or top-level ``"none"``) together with
   ``chat_template_kwargs.reasoning_effort`` contradict each other.
4. ``chat_template_kwargs.reasoning_effort`` takes precedence over the top-level field when both
   carry a level (the model-specific channel is the more explicit one).
5. A request-level effort level implies thinking on.
6. Unset values fall back to the server defaults (``--default-chat-template-kwargs``), then to
   the card: thinking ON at effort 50. Server defaults never contradict a request: a request's
   ``thinking: false`` simply ignores a default effort.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Mapping

EFFORT_MIN = 1
EFFORT_MAX = 100
CARD_DEFAULT_EFFORT = 50
CARD_DEFAULT_THINKING = True

EFFORT_TABLE_ENV = "SGLANG_DSV41_EFFORT_TABLE"

# Field names as users see them in error messages.
CTK_THINKING = "chat_template_kwargs.thinking"
CTK_ENABLE_THINKING = "chat_template_kwargs.enable_thinking"
CTK_EFFORT = "chat_template_kwargs.reasoning_effort"
TOP_EFFORT = "reasoning_effort"

# OpenAI tiers that the card explicitly rejects for this model.
REJECTED_OPENAI_TIERS: tuple[str, ...] = ("minimal", "medium")


class ReasoningRequestError(ValueError):
    """A request whose thinking/effort fields are invalid or contradictory (HTTP 400).

    Subclasses `ValueError` because SGLang's serving layer maps `ValueError` to HTTP 400.
    """


@dataclass(frozen=True)
class EffortTable:
    """Named effort tiers → integer budget. Integers 1–100 are accepted under every table."""

    name: str
    tiers: Mapping[str, int]

    def accepted_text(self, *, with_none: bool) -> str:
        """Human-readable list of accepted values, used verbatim in 400 messages."""
        names = (["'none'"] if with_none else []) + [f"'{t}'" for t in self.tiers]
        return f"one of {', '.join(names)} or an integer {EFFORT_MIN}-{EFFORT_MAX}"


CARD_TABLE = EffortTable("card", {"low": 25, "high": 50, "xhigh": 75, "max": 100})
DEEPSEEK_API_TABLE = EffortTable("deepseek-api", {"low": 50, "high": 75, "max": 100})
EFFORT_TABLES: dict[str, EffortTable] = {t.name: t for t in (CARD_TABLE, DEEPSEEK_API_TABLE)}


def effort_table_from_env(environ: Mapping[str, str] | None = None) -> EffortTable:
    """The server's table: ``SGLANG_DSV41_EFFORT_TABLE`` (``card`` if unset). Unknown → ValueError."""
    env = os.environ if environ is None else environ
    name = env.get(EFFORT_TABLE_ENV, "").strip() or CARD_TABLE.name
    if name not in EFFORT_TABLES:
        raise ValueError(f"{EFFORT_TABLE_ENV}={name!r} is not a known effort table; "
                         f"use one of {sorted(EFFORT_TABLES)}")
    return EFFORT_TABLES[name]


@dataclass(frozen=True)
class ReasoningDecision:
    """The resolved mode. Invariant: ``effort`` is an int in 1..100 iff ``thinking`` is True."""

    thinking: bool
    effort: int | None
    source: str  # which input fixed the effort (or the thinking-off decision), for logs/docs

    def __post_init__(self) -> None:
        if self.thinking != (self.effort is not None):
            raise AssertionError(f"inconsistent decision {self}")
        if self.effort is not None and not EFFORT_MIN <= self.effort <= EFFORT_MAX:
            raise AssertionError(f"effort out of range in {self}")


_NONE = "none"


def _integral(value: Any) -> int | None:
    """An int (bools excluded) or an integral finite float, else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return None


def parse_effort(value: Any, *, field: str, table: EffortTable, allow_none: bool) -> int | str:
    """One effort value → its integer budget, or ``"none"`` (top-level field only).

    Raises `ReasoningRequestError` naming ``field`` and the accepted values.
    """
    accepted = table.accepted_text(with_none=allow_none)
    if isinstance(value, str):
        key = value.strip().lower()
        if allow_none and key == _NONE:
            return _NONE
        if key in table.tiers:
            return table.tiers[key]
        if key in REJECTED_OPENAI_TIERS:
            raise ReasoningRequestError(
                f"{field}={value!r} is not supported by DeepSeek-V4.1; {field} must be {accepted}")
        hint = ("; to turn thinking off send chat_template_kwargs.thinking=false or "
                "reasoning_effort='none'" if key == _NONE else "")
        raise ReasoningRequestError(f"{field}={value!r} is invalid; {field} must be {accepted}{hint}")
    number = _integral(value)
    if number is not None and EFFORT_MIN <= number <= EFFORT_MAX:
        return number
    got = f"{value!r} ({type(value).__name__})"
    raise ReasoningRequestError(f"{field}={got} is invalid; {field} must be {accepted}")


def _toggle(ctk: Mapping[str, Any], key: str, field: str) -> bool | None:
    value = ctk.get(key)
    if value is None or isinstance(value, bool):
        return value
    raise ReasoningRequestError(f"{field}={value!r} is invalid; {field} must be a boolean (true or false)")


@dataclass(frozen=True)
class RequestReasoning:
    """What one input layer (the request, or the server defaults) says; None = not said."""

    thinking: bool | None
    effort: int | None
    effort_field: str | None
    off_field: str | None


def read_request_reasoning(ctk: Mapping[str, Any] | None, top_level: Any, table: EffortTable, *,
                           where: str = "") -> RequestReasoning:
    """Validate one layer and apply rules 1-5. Raises `ReasoningRequestError`."""
    ctk = dict(ctk or {})
    t1 = _toggle(ctk, "thinking", f"{where}{CTK_THINKING}")
    t2 = _toggle(ctk, "enable_thinking", f"{where}{CTK_ENABLE_THINKING}")
    top = None if top_level is None else parse_effort(
        top_level, field=f"{where}{TOP_EFFORT}", table=table, allow_none=True)
    kw = None if ctk.get("reasoning_effort") is None else parse_effort(
        ctk["reasoning_effort"], field=f"{where}{CTK_EFFORT}", table=table, allow_none=False)

    toggles = [(f"{where}{CTK_THINKING}", t1), (f"{where}{CTK_ENABLE_THINKING}", t2)]
    # Rule 2 before rule 1's agreement check: SGLang's protocol copies a top-level effort into
    # both toggles with setdefault, so a user's own toggle that contradicts the top-level field
    # must be reported as that contradiction, not as thinking/enable_thinking disagreeing.
    if top == _NONE:
        for name, val in toggles:
            if val is True:
                raise ReasoningRequestError(
                    f"{where}{TOP_EFFORT}='none' turns thinking off but {name}=true turns it on; "
                    "send only one of them")
    elif top is not None:
        for name, val in toggles:
            if val is False:
                raise ReasoningRequestError(
                    f"{where}{TOP_EFFORT}={top_level!r} asks for thinking but {name}=false turns it "
                    "off; send only one of them")
    if t1 is not None and t2 is not None and t1 != t2:
        raise ReasoningRequestError(
            f"{where}{CTK_THINKING}={str(t1).lower()} and {where}{CTK_ENABLE_THINKING}="
            f"{str(t2).lower()} disagree; if you send both they must agree")

    toggle = t1 if t1 is not None else t2
    off_field = None
    if toggle is False:
        off_field = f"{where}{CTK_THINKING if t1 is not None else CTK_ENABLE_THINKING}=false"
    elif toggle is None and top == _NONE:
        off_field = f"{where}{TOP_EFFORT}='none'"
    if off_field is not None and kw is not None:
        raise ReasoningRequestError(
            f"{off_field} turns thinking off but {where}{CTK_EFFORT}="
            f"{ctk['reasoning_effort']!r} sets a reasoning budget; send only one of them")

    if kw is not None:
        effort, effort_field = int(kw), f"{where}{CTK_EFFORT}"
    elif top is not None and top != _NONE:
        effort, effort_field = int(top), f"{where}{TOP_EFFORT}"
    else:
        effort, effort_field = None, None

    if toggle is not None:
        thinking: bool | None = toggle
    elif top == _NONE:
        thinking = False
    elif effort is not None:
        thinking = True
    else:
        thinking = None
    return RequestReasoning(thinking, effort, effort_field, off_field)


def resolve_reasoning(*, chat_template_kwargs: Mapping[str, Any] | None, top_level_effort: Any,
                      table: EffortTable,
                      server_defaults: Mapping[str, Any] | None = None) -> ReasoningDecision:
    """Apply the module's rules 1–6. Raises `ReasoningRequestError` (→ HTTP 400)."""
    req = read_request_reasoning(chat_template_kwargs, top_level_effort, table, where="")
    dflt = (read_request_reasoning(server_defaults, None, table, where="server default ")
            if server_defaults else RequestReasoning(None, None, None, None))

    if req.thinking is not None:
        thinking, src = req.thinking, req.effort_field or req.off_field or "request"
    elif dflt.thinking is not None:
        thinking, src = dflt.thinking, dflt.effort_field or dflt.off_field or "server default"
    else:
        thinking, src = CARD_DEFAULT_THINKING, "card default"
    if not thinking:
        return ReasoningDecision(False, None, src)
    if req.effort is not None:
        return ReasoningDecision(True, req.effort, req.effort_field or "request")
    if dflt.effort is not None:
        return ReasoningDecision(True, dflt.effort, dflt.effort_field or "server default")
    return ReasoningDecision(True, CARD_DEFAULT_EFFORT, "card default")


def validate_server_defaults(server_defaults: Mapping[str, Any] | None, table: EffortTable) -> None:
    """Check ``--default-chat-template-kwargs`` at start-up, so a bad default fails the boot
    instead of turning every request into a 400. Raises ValueError."""
    try:
        resolve_reasoning(chat_template_kwargs=None, top_level_effort=None, table=table,
                          server_defaults=server_defaults)
    except ReasoningRequestError as exc:
        raise ValueError(f"invalid --default-chat-template-kwargs for DeepSeek-V4.1: {exc}") from exc

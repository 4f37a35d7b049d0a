"""Chat request → DeepSeek-V4.1 prompt (text, special ranges, token ids, images), rendered by
deepseek-recipe 0.2.0's `DeepseekV41Encoding` with the card's thinking/effort rules
(spec `model.md` §6; model card "Reasoning and tool calling").

What comes from deepseek-recipe, unchanged: the whole prompt layout — BOS, the ``<｜System｜>``
block with the effort line and the "## Tools" / "## Response Format" sections, turns, history
rules (reasoning kept only when tools are declared), DSML rendering of historic tool calls,
``<tool_result>`` blocks for tool messages, ``<think>`` / ``</think>`` after the generation header,
one image placeholder per image, and which spans are special tokens.

What this module adds, and why recipe's own request conversion (``ChatCompletionRequest.convert``)
is not used: that conversion applies recipe's effort tiers (low 50 / high 75 / unset 75) and
thinking keys, accepts ``minimal``/``medium``, rejects ``tool_choice`` required/named in thinking
mode and the ``developer`` role — all of which contradict the card or SGLang's API. So messages
are mapped to recipe's message classes here, and:

* Effort: the prompt is rendered at recipe tier ``high`` (line "Reasoning Effort: 75 …") and the
  number is replaced by the resolved budget N (`effort.resolve_reasoning`). The line must be the
  first text of the first ``<｜System｜>`` block — recipe renders it once, at the start of the
  prompt ("first turn only"); if recipe ever renders it elsewhere, `render_chat` raises instead
  of guessing.
* Images: placeholder spelling ``<｜deepseek_image｜>`` (the checkpoint tokenizer's, spec §6/§9);
  multi-part content is joined with blank lines. A text part of a message that also carries
  images must not contain that spelling (it would steal a placeholder) → 400.
* ``tool_choice``: required/named are rendered as ``auto`` (the named tool alone) and enforced by
  the DSML grammar of `tool_parser`; ``none`` renders no tools.
* quick-instruction ``task`` (launch blog "quick instruction tasks"; recipe 0.2.0 has no task
  tokens, the checkpoint tokenizer has ``<｜action｜>``, ``<｜query｜>``, ``<｜authority｜>``,
  ``<｜domain｜>``, ``<｜title｜>``, ``<｜read_url｜>``): the conversation must end with a user
  message; ``action`` appends its token after the generation header
  (``<｜Assistant｜><think><｜action｜>`` / ``…</think><｜action｜>``), every other task *replaces*
  the header by its token and is answered without thinking (`task_decision`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import deepseek_recipe as dr

from .effort import ReasoningDecision
from .prompt_tokens import PromptTokenEncoder

IMAGE_TOKEN = "<｜deepseek_image｜>"
SPECIAL_TOKENS = dr.SpecialTokens(image=IMAGE_TOKEN)
ENCODING = dr.DeepseekV41Encoding().with_special_tokens(SPECIAL_TOKENS)

_RENDER_TIER = "high"
_RENDER_TIER_VALUE = 75  # recipe 0.2.0's value for tier "high" (checked at render time)
EFFORT_LINE = "Reasoning Effort: {} (range 1-100, the higher the value, the more thorough the reasoning)"
PART_JOINER = "\n\n"
TASKS = ("action", "query", "authority", "domain", "title", "read_url")
TASK_TOKENS = {task: f"<｜{task}｜>" for task in TASKS}


class ChatEncodingError(ValueError):
    """A chat request that cannot be rendered for DeepSeek-V4.1 (HTTP 400)."""


@dataclass(frozen=True)
class ImagePart:
    """One image, in placeholder order."""

    url: str
    detail: str


@dataclass(frozen=True)
class RenderedChat:
    """A rendered prompt. Invariant: ``text[s:e]`` is one special token for each range, and the
    ``k``-th image placeholder range belongs to ``images[k]``."""

    text: str
    special_ranges: list[tuple[int, int]]
    images: list[ImagePart] = field(default_factory=list)


def _text_of(content: Any, *, role: str, allow_images: bool, index: int
             ) -> tuple[str, list[ImagePart], str | None]:
    """Message content → (text with image placeholders, images, reasoning from thinking parts)."""
    if content is None:
        return "", [], None
    if isinstance(content, str):
        return content, [], None
    if not isinstance(content, list):
        raise ChatEncodingError(f"messages[{index}].content must be a string or a list of parts")
    pieces: list[str] = []
    images: list[ImagePart] = []
    reasoning: list[str] = []
    for part in content:
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind in ("text", "input_text"):
            pieces.append(part.get("text") or "")
        elif kind in ("image_url", "input_image"):
            if not allow_images:
                raise ChatEncodingError(
                    f"messages[{index}] (role {role!r}): images are only supported in user messages")
            image = part.get("image_url") or {}
            if isinstance(image, str):
                image = {"url": image}
            images.append(ImagePart(url=image["url"], detail=image.get("detail") or "auto"))
            pieces.append(IMAGE_TOKEN)
        elif kind in ("thinking", "reasoning") and role == "assistant":
            reasoning.append(part.get("thinking") or part.get("text") or "")
        else:
            raise ChatEncodingError(
                f"messages[{index}]: content part type {kind!r} is not supported by DeepSeek-V4.1")
    if images:
        for piece in pieces:
            if piece != IMAGE_TOKEN and IMAGE_TOKEN in piece:
                raise ChatEncodingError(
                    f"messages[{index}]: a text part contains the image placeholder {IMAGE_TOKEN!r} "
                    "in a message that carries images; remove it from the text")
    return PART_JOINER.join(pieces), images, ("".join(reasoning) if reasoning else None)


def _image_source(image: ImagePart) -> dr.ImageSource:
    detail = image.detail if image.detail in ("low", "high", "original", "auto") else "auto"
    if image.url.startswith("data:"):
        return dr.DataUrlImageSource(image.url, detail)
    return dr.UrlImageSource(image.url, detail)


def _tool_definition(tool: Mapping[str, Any]) -> dr.ToolDefinition:
    fn = tool.get("function") if isinstance(tool, Mapping) else None
    if tool.get("type", "function") != "function" or not isinstance(fn, Mapping) or not fn.get("name"):
        raise ChatEncodingError(f"unsupported tool definition {tool!r}: only function tools")
    return dr.ToolDefinition(fn["name"], fn.get("description"), fn.get("parameters"),
                             fn.get("strict"))


def _tool_call(call: Mapping[str, Any], index: int) -> dr.ToolCall:
    fn = call.get("function") or {}
    args = fn.get("arguments")
    if isinstance(args, Mapping):
        args_json = json.dumps(args, ensure_ascii=False)
    else:
        try:
            parsed = json.loads(args if args is not None else "{}")
        except (TypeError, json.JSONDecodeError) as exc:
            raise ChatEncodingError(
                f"messages[{index}].tool_calls: function.arguments must be a JSON object") from exc
        if not isinstance(parsed, dict):
            raise ChatEncodingError(
                f"messages[{index}].tool_calls: function.arguments must be a JSON object")
        args_json = args
    if not fn.get("name"):
        raise ChatEncodingError(f"messages[{index}].tool_calls: function.name is required")
    return dr.ToolCall(call.get("id") or f"call_{index}", fn["name"], args_json)


def _messages(messages: Sequence[Mapping[str, Any]], *, continue_final_message: bool,
              show_tools: bool) -> tuple[list[dr.Message], list[ImagePart]]:
    out: list[dr.Message] = []
    images: list[ImagePart] = []
    last = len(messages) - 1
    for i, msg in enumerate(messages):
        role = msg.get("role")
        if role == "assistant" and i == last and not continue_final_message:
            role = "user"  # SGLang's rule for a trailing assistant message without continuation
        text, msg_images, thinking = _text_of(msg.get("content"), role=role, index=i,
                                              allow_images=role == "user")
        if role in ("system", "developer"):
            tools = [_tool_definition(t) for t in (msg.get("tools") or [])] if show_tools else []
            tools = tools or None
            out.append(dr.SystemMessage(text, tools=tools))
        elif role == "user":
            sources = [_image_source(im) for im in msg_images] or None
            out.append(dr.UserMessage(text, sources, image_token=IMAGE_TOKEN))
            images.extend(msg_images)
        elif role == "assistant":
            calls = [_tool_call(c, i) for c in (msg.get("tool_calls") or [])] or None
            reasoning = msg.get("reasoning_content") or thinking
            out.append(dr.AssistantMessage(text, reasoning_content=reasoning, tool_calls=calls,
                                           prefix=continue_final_message and i == last))
        elif role == "tool":
            out.append(dr.ToolMessage(text, tool_call_id=msg.get("tool_call_id")))
        elif role == "latest_reminder":
            out.append(dr.LatestReminderMessage(text))
        else:
            raise ChatEncodingError(f"messages[{i}]: role {role!r} is not supported by DeepSeek-V4.1 "
                                    "(use system, developer, user, assistant, tool or latest_reminder)")
    return out, images


def _response_format_kwargs(response_format: Mapping[str, Any] | None) -> dict[str, Any]:
    kind = (response_format or {}).get("type", "text")
    if kind == "json_schema":
        schema = (response_format.get("json_schema") or {})
        schema = schema.get("schema") if "schema" in schema else schema.get("schema_")
        return {"response_schema": schema}
    if kind == "json_object":
        return {"response_format": "json_object"}
    return {}  # text, structural_tag: nothing rendered (the grammar alone constrains)


def _splice_effort(rendered: dr.RenderedPrompt, effort: int) -> tuple[str, list[tuple[int, int]]]:
    """Replace recipe's tier-``high`` effort line by the line for ``effort`` (see module doc)."""
    text, ranges = rendered.prompt, [tuple(r) for r in rendered.special_ranges]
    old = EFFORT_LINE.format(_RENDER_TIER_VALUE)
    spellings = [text[s:e] for s, e in ranges[:2]]
    if spellings != [SPECIAL_TOKENS.token(dr.SpecialToken.Bos),
                     SPECIAL_TOKENS.token(dr.SpecialToken.System)] or \
            not text.startswith(old, ranges[1][1]):
        raise RuntimeError("deepseek-recipe did not render the effort line at the start of the "
                           f"first system block (expected {old!r}); the recipe format changed")
    start = ranges[1][1]
    new = EFFORT_LINE.format(effort)
    delta = len(new) - len(old)
    text = text[:start] + new + text[start + len(old):]
    return text, [(s + delta, e + delta) if s >= start else (s, e) for s, e in ranges]


def task_decision(decision: ReasoningDecision, task: str | None, *,
                  thinking_requested: bool = False) -> ReasoningDecision:
    """The reasoning mode a request with quick-instruction ``task`` is rendered and parsed in:
    unchanged for no task and ``action``; thinking off for the other tasks (their token replaces
    the generation header, so there is no trace). Thinking asked for *by the request* (a thinking
    toggle, ``thinking_requested``, or an effort, seen in ``decision.source``) together with such
    a task is a contradiction (400); a default (card or server) is simply unused."""
    if task is None or task == "action" or not decision.thinking:
        return decision
    from_default = decision.source == "card default" or decision.source.startswith("server default")
    if thinking_requested or not from_default:
        asked = decision.source if not from_default else "chat_template_kwargs.thinking=true"
        raise ChatEncodingError(f"task={task!r} is answered without thinking, but the request asks "
                                f"for thinking ({asked}); remove that field or use task='action'")
    return ReasoningDecision(False, None, f"task={task}")


def _check_task(task: Any, messages: Sequence[Mapping[str, Any]]) -> None:
    if task not in TASK_TOKENS:
        raise ChatEncodingError(f"task={task!r}: quick-instruction tasks are {list(TASKS)}")
    last = messages[-1].get("role") if messages else None
    if last != "user":
        raise ChatEncodingError(f"task={task!r} needs a conversation that ends with a user "
                                f"message; the last message has role {last!r}")


def _apply_task(text: str, ranges: list[tuple[int, int]], task: str, thinking: bool
                ) -> tuple[str, list[tuple[int, int]]]:
    """Put the task token at the generation header that recipe rendered at the end of the prompt
    (``<｜Assistant｜>`` then ``<think>`` or ``</think>``), see the module doc."""
    header = [SPECIAL_TOKENS.token(dr.SpecialToken.Assistant),
              SPECIAL_TOKENS.token(dr.SpecialToken.ThinkingStart if thinking
                                   else dr.SpecialToken.ThinkingEnd)]
    tail = ranges[-2:]
    if len(tail) != 2 or [text[s:e] for s, e in tail] != header or tail[1][1] != len(text) \
            or tail[0][1] != tail[1][0]:
        raise RuntimeError(f"deepseek-recipe did not end the prompt with the generation header "
                           f"{''.join(header)!r}; the recipe format changed")
    token = TASK_TOKENS[task]
    if task == "action":
        return text + token, ranges + [(len(text), len(text) + len(token))]
    start = tail[0][0]
    return text[:start] + token, ranges[:-2] + [(start, start + len(token))]


def render_chat(messages: Sequence[Mapping[str, Any]], *, decision: ReasoningDecision,
                tools: Sequence[Mapping[str, Any]] | None = None, tool_choice: Any = "auto",
                response_format: Mapping[str, Any] | None = None,
                continue_final_message: bool = False, task: str | None = None) -> RenderedChat:
    """Render one chat request. ``tools`` are the tools to show the model (already filtered to
    the named tool for a named choice); ``tool_choice`` is ``"auto"``, ``"required"``,
    ``"named"`` or ``"none"`` (only ``"none"`` changes the prompt: no tools at all).
    Raises `ChatEncodingError` (HTTP 400)."""
    if not messages:
        raise ChatEncodingError("messages must not be empty")
    if task is not None:
        _check_task(task, messages)
        decision = task_decision(decision, task)
    msgs, images = _messages(messages, continue_final_message=continue_final_message,
                             show_tools=tool_choice != "none")
    show_tools = tools if tool_choice != "none" else None
    try:  # recipe validates while building and rendering (ValueError on a bad combination)
        conversation = dr.Conversation(
            msgs,
            thinking_mode=decision.thinking,
            tools=[_tool_definition(t) for t in (show_tools or [])] or None,
            tool_choice="none" if tool_choice == "none" else "auto",
            reasoning_effort=_RENDER_TIER if decision.thinking else None,
            **_response_format_kwargs(response_format),
        )
        rendered = ENCODING.render_conversation(conversation)
    except ValueError as exc:
        raise ChatEncodingError(f"cannot render the conversation: {exc}") from exc
    if decision.thinking:
        text, ranges = _splice_effort(rendered, int(decision.effort))
    else:
        text, ranges = rendered.prompt, [tuple(r) for r in rendered.special_ranges]
    if task is not None:
        text, ranges = _apply_task(text, ranges, task, decision.thinking)
    n_placeholders = sum(1 for s, e in ranges if text[s:e] == IMAGE_TOKEN)
    if n_placeholders != len(images):
        raise RuntimeError(f"rendered {n_placeholders} image placeholders for {len(images)} images")
    return RenderedChat(text=text, special_ranges=ranges, images=images)


def encode_chat(rendered: RenderedChat, encoder: PromptTokenEncoder) -> list[int]:
    """Token ids of a rendered chat (special ranges → one id each, the rest plain text)."""
    return encoder.encode(rendered.text, rendered.special_ranges)

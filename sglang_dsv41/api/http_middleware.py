"""ASGI middleware that applies the card's reasoning rules to the raw ``/v1/chat/completions``
body *before* SGLang 0.5.17's pydantic model sees it (model card "Reasoning and tool calling").

Why it exists: SGLang's `ChatCompletionRequest` types the top-level ``reasoning_effort`` as
``Literal['none','minimal','low','medium','high','xhigh','max'] | float in [0, 0.99]``, so the
card's integer budgets (e.g. ``"reasoning_effort": 60``) would be rejected with pydantic's
message, whose list of "valid" values even includes the card's rejected ``minimal``/``medium``;
and its ``normalize_reasoning_inputs`` validator copies a top-level effort into *both*
``thinking`` and ``enable_thinking``, which hides what the user actually sent.

What it does, for DeepSeek-V4.1 servers only (installed by the `hooks` table):

* validates the request-level fields with `effort.read_request_reasoning` — an invalid or
  contradictory request gets HTTP 400 in SGLang's error shape, naming the fields and the
  accepted values;
* rewrites the body into a canonical form SGLang accepts unchanged: the top-level
  ``reasoning_effort`` is removed, ``chat_template_kwargs.reasoning_effort`` carries the resolved
  integer budget (if the request set one) and ``thinking`` / ``enable_thinking`` the request's
  explicit toggle (if any). Server defaults are *not* applied here (the serving hook does that),
  so the canonical form says exactly what the request said.

Bodies that are not JSON objects pass through untouched (SGLang reports those itself).
"""
from __future__ import annotations

import json
from typing import Any, Callable

from .effort import EffortTable, ReasoningRequestError, read_request_reasoning

CHAT_PATH = "/v1/chat/completions"


def canonical_chat_body(body: dict[str, Any], table: EffortTable) -> dict[str, Any]:
    """The canonical form of a chat request body (see module doc). Raises ReasoningRequestError."""
    ctk = body.get("chat_template_kwargs")
    if ctk is not None and not isinstance(ctk, dict):
        return body  # not ours to judge: SGLang's own validation rejects it with a 400
    said = read_request_reasoning(ctk, body.get("reasoning_effort"), table)
    out = dict(body)
    out.pop("reasoning_effort", None)
    new_ctk = dict(ctk or {})
    new_ctk.pop("reasoning_effort", None)
    if said.effort is not None:
        new_ctk["reasoning_effort"] = said.effort
    if said.thinking is not None:
        new_ctk["thinking"] = new_ctk["enable_thinking"] = said.thinking
    if new_ctk or ctk is not None:
        out["chat_template_kwargs"] = new_ctk
    return out


def _error_body(message: str) -> bytes:
    # the shape of SGLang's `ErrorResponse` for a 400 from the serving layer
    return json.dumps({"object": "error", "message": message, "type": "BadRequestError",
                       "param": None, "code": 400}).encode()


async def read_body(receive: Callable) -> bytes | None:
    """The whole request body of an ASGI request, or None when the client disconnected first."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


async def send_json(send: Callable, status: int, body: bytes) -> None:
    """One complete JSON response (`body` already encoded) through an ASGI ``send``."""
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def replaying(body: bytes, receive: Callable) -> Callable:
    """An ASGI ``receive`` that yields `body` once, then defers to `receive`."""
    replayed = False

    async def replay() -> dict:
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


class ChatReasoningMiddleware:
    """Pure ASGI middleware; ``table`` is read per request so tests can switch it."""

    def __init__(self, app: Any, table: Callable[[], EffortTable]):
        self.app = app
        self._table = table

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope.get("type") != "http" or scope.get("method") != "POST" or \
                scope.get("path") != CHAT_PATH:
            await self.app(scope, receive, send)
            return
        raw = await read_body(receive)
        if raw is None:
            await self.app(scope, receive, send)  # disconnected: let the app see it
            return
        body = raw
        try:
            parsed = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            parsed = None
        if isinstance(parsed, dict):
            try:
                body = json.dumps(canonical_chat_body(parsed, self._table()),
                                  ensure_ascii=False).encode()
            except ReasoningRequestError as exc:
                await send_json(send, 400, _error_body(str(exc)))
                return
        headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        scope = dict(scope, headers=headers)
        await self.app(scope, replaying(body, receive), send)

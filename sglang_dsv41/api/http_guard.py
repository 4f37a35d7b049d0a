"""HTTP front door of a DeepSeek-V4.1 server (issue 20 items 1 and 5), installed on SGLang
0.5.17's FastAPI app by `serving.setup_http_server_hook`:

* `GenerateGuardMiddleware` runs `request_guard.check_generate_body` on the raw body of native
  ``/generate`` requests before SGLang sees them. SGLang's route starts a streamed reply before
  the tokenizer manager validates anything, so without this a bad streamed request would get a
  200 stream with an error event (and, for bad token ids, the scheduler would die); with it every
  bad ``/generate`` request is a 400 in that route's error shape ``{"error": {"message": …}}``.
  (The OpenAI routes are checked in the serving hooks, which run before their streams start.)
* `ErrorScrubMiddleware` removes server file paths (``/…/x.py:12``, ``File "…", line N``) from
  every error response (status ≥ 400) of every route: SGLang and the libraries under it put
  them into messages (e.g. xgrammar's ``/project/cpp/regex_converter.cc:75:`` in a grammar
  error). Bodies of successful responses and streams are not touched.
* `validation_error_handler` replaces SGLang's handler of request-model validation errors, whose
  message is ``str(exc)`` — it carries the server's file paths and line numbers. Ours lists
  ``field: problem`` pairs only, in the same `ErrorResponse` shape and status (400). The
  ``/v1/messages`` and ``/v1/responses`` routes keep SGLang's handler (it scrubs those itself).
"""
from __future__ import annotations

import json
import re
from typing import Any, Awaitable, Callable

from .http_middleware import read_body, replaying, send_json
from .request_guard import RequestRejected, ServingLimits, check_generate_body

GENERATE_PATH = "/generate"
_UPSTREAM_SCRUBBED = ("/v1/messages", "/v1/responses")
MAX_MESSAGE_CHARS = 1000
_SOURCE_PATH = re.compile(
    r"(?:\[\d{2}:\d{2}:\d{2}\]\s*)?(?:/[^\s\"':,()\[\]]+)+\.(?:py|pyx|cc|cpp|c|h|hpp|cu|so)"
    r"(?::\d+)?(?::\s*)?")
_TRACE_LINE = re.compile(r"\s*File \"[^\"]*\", line \d+(?:, in [^\n]*)?")


def scrub_paths(text: str) -> str:
    """``text`` without source-file paths, line numbers and traceback ``File`` lines."""
    return _SOURCE_PATH.sub("", _TRACE_LINE.sub("", text))


def _scrub_json(value: Any) -> Any:
    if isinstance(value, str):
        return scrub_paths(value)
    if isinstance(value, list):
        return [_scrub_json(v) for v in value]
    if isinstance(value, dict):
        return {k: _scrub_json(v) for k, v in value.items()}
    return value


def scrub_error_body(body: bytes) -> bytes:
    try:
        return json.dumps(_scrub_json(json.loads(body)), ensure_ascii=False).encode()
    except (ValueError, UnicodeDecodeError):
        return scrub_paths(body.decode("utf-8", errors="replace")).encode()


async def _send_json(send: Callable, status: int, payload: dict[str, Any]) -> None:
    await send_json(send, status, json.dumps(payload, ensure_ascii=False).encode())


class GenerateGuardMiddleware:
    """Pure ASGI middleware; ``limits`` is called per request (the tokenizer manager's values)."""

    def __init__(self, app: Any, limits: Callable[[], ServingLimits]):
        self.app = app
        self._limits = limits

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope.get("type") != "http" or scope.get("method") not in ("POST", "PUT") or \
                scope.get("path") != GENERATE_PATH:
            await self.app(scope, receive, send)
            return
        raw = await read_body(receive)
        if raw is None:
            await self.app(scope, receive, send)  # disconnected: let the app see it
            return
        try:
            parsed = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            parsed = None  # not JSON: SGLang's own parsing answers
        if isinstance(parsed, dict):
            try:
                check_generate_body(parsed, self._limits())
            except RequestRejected as exc:
                await _send_json(send, 400, {"error": {"message": str(exc)}})
                return
        await self.app(scope, replaying(raw, receive), send)


class ErrorScrubMiddleware:
    """Pure ASGI middleware: error responses are buffered, scrubbed (`scrub_error_body`) and
    sent with a corrected content-length; everything else passes through unchanged."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        start: dict | None = None
        chunks: list[bytes] = []

        async def scrubbing_send(message: dict) -> None:
            nonlocal start
            if message["type"] == "http.response.start" and message.get("status", 200) >= 400:
                start = message
                return
            if start is None or message["type"] != "http.response.body":
                await send(message)
                return
            chunks.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            body = scrub_error_body(b"".join(chunks))
            headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
            headers.append((b"content-length", str(len(body)).encode()))
            await send({**start, "headers": headers})
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, scrubbing_send)


def _location(loc: Any) -> str:
    """A pydantic error location as a dotted field path (``body`` and union-member tags such as
    ``function-after[…]`` dropped)."""
    return ".".join(str(p) for p in (loc or ()) if p != "body" and not
                    (isinstance(p, str) and ("[" in p or "(" in p)))


def validation_message(errors: list[dict[str, Any]]) -> str:
    """``loc: msg`` for each pydantic error (``body`` dropped from the location); no paths."""
    parts = []
    for err in errors or []:
        loc = _location(err.get("loc"))
        msg = str(err.get("msg") or "invalid value").strip()
        parts.append(f"{loc}: {msg}" if loc else msg)
    text = "; ".join(parts) or "invalid request"
    return text if len(text) <= MAX_MESSAGE_CHARS else text[:MAX_MESSAGE_CHARS] + " …"


def make_validation_error_handler(upstream: Callable[..., Awaitable[Any]] | None):
    async def validation_error_handler(request: Any, exc: Any) -> Any:
        if upstream is not None and request.url.path.startswith(_UPSTREAM_SCRUBBED):
            return await upstream(request, exc)
        from fastapi.responses import JSONResponse

        return JSONResponse(status_code=400, content={
            "object": "error", "message": validation_message(exc.errors()),
            "type": "Bad Request", "param": None, "code": 400})

    validation_error_handler.sglang_dsv41 = True
    return validation_error_handler


def install_http_guard(app: Any, limits: Callable[[], ServingLimits]) -> None:
    """Add the middleware and the validation handler to a FastAPI app that has not started."""
    from fastapi.exceptions import RequestValidationError
    from starlette.middleware import Middleware

    if app.middleware_stack is not None:
        raise RuntimeError("the HTTP app already started; the DeepSeek-V4.1 request guard must be "
                           "installed before serving")
    if not any(m.cls is GenerateGuardMiddleware for m in app.user_middleware):
        app.user_middleware.append(Middleware(GenerateGuardMiddleware, limits=limits))
    if not any(m.cls is ErrorScrubMiddleware for m in app.user_middleware):
        app.user_middleware.insert(0, Middleware(ErrorScrubMiddleware))  # outermost: sees all
    current = app.exception_handlers.get(RequestValidationError)
    if not getattr(current, "sglang_dsv41", False):
        app.exception_handlers[RequestValidationError] = make_validation_error_handler(current)

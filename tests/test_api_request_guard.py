"""Unit checks of the request guard, the error scrubber and the reported model name (issue 20
items 1 and 5); the same rules through a real server: tests/test_api_bad_input.py."""
from __future__ import annotations

import asyncio
import json

import pytest

from sglang_dsv41.api.http_guard import (
    ErrorScrubMiddleware,
    GenerateGuardMiddleware,
    scrub_paths,
    validation_message,
)
from sglang_dsv41.api.model_name import public_model_name
from sglang_dsv41.api.request_guard import (
    MAX_TOP_LOGPROBS,
    RequestRejected,
    ServingLimits,
    check_generate_body,
    check_token_ids,
    check_top_logprobs,
)

LIMITS = ServingLimits(vocab_size=1024, context_len=64, accepts_media=False)


@pytest.mark.parametrize("ids,needle", [
    ([0, -1], "input_ids[1] = -1"), ([1024], "[0, 1024)"), ([1_000_000], "image placeholders"),
    ([True], "integers"), ([1.0], "integers"), ([[1], [2, 5000]], "input_ids[1][1] = 5000"),
    ([1, [2]], "mixes"), ("12", "list of token ids"), ([3] * 64, "context length is 64"),
])
def test_token_ids_rejected(ids, needle):
    with pytest.raises(RequestRejected) as info:
        check_token_ids(ids, "input_ids", LIMITS)
    assert needle in str(info.value) and isinstance(info.value, ValueError)


def test_token_ids_accepted():
    check_token_ids([0, 1023] + [5] * 61, "input_ids", LIMITS)
    check_token_ids([[0], [1023]], "input_ids", LIMITS)
    check_token_ids([3] * 100, "input_ids", LIMITS, check_length=False)


def test_top_logprobs_limit_is_openais():
    assert MAX_TOP_LOGPROBS == 20
    check_top_logprobs(20, "top_logprobs")
    check_top_logprobs([0, 20], "top_logprobs_num")
    for bad in (21, -1, 2.0, True):
        with pytest.raises(RequestRejected, match="top_logprobs"):
            check_top_logprobs(bad, "top_logprobs")


@pytest.mark.parametrize("body,needle", [
    ({"sampling_params": {"temperature": -1}}, "temperature"),
    ({"sampling_params": {"bogus": 1}}, "bogus"),
    ({"sampling_params": [{"max_new_tokens": 1}, {"top_p": 2}]}, "sampling_params[1]: top_p"),
    ({"sampling_params": {"n": 0}}, "sampling_params.n"),
    ({"sampling_params": {"stop_regex": "(["}}, "not a valid regular expression"),
    ({"sampling_params": {"stop_regex": ["a", 3]}}, "must be a string"),
    ({"sampling_params": "hot"}, "must be an object"),
    ({"image_data": ["x"]}, "text model only"),
    ({"top_logprobs_num": 21}, "top_logprobs_num"),
])
def test_generate_body_rejected(body, needle):
    with pytest.raises(RequestRejected, match=None) as info:
        check_generate_body({"input_ids": [1, 2], **body}, LIMITS)
    assert needle in str(info.value)


def test_generate_body_accepted_and_media_on_a_multimodal_server():
    check_generate_body({"input_ids": [1, 2], "sampling_params": {"temperature": 0, "n": 2}}, LIMITS)
    import base64
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (4, 3)).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    media = ServingLimits(vocab_size=1024, context_len=64, accepts_media=True)
    check_generate_body({"text": "hi", "image_data": [url]}, media)
    # every image is loaded before queueing: a bad one is refused with its reason (docs/vision.md)
    with pytest.raises(RequestRejected, match="image 1: cannot read image file 'x'"):
        check_generate_body({"text": "hi", "image_data": [url, "x"]}, media)
    with pytest.raises(RequestRejected, match="image input only"):
        check_generate_body({"text": "hi", "audio_data": ["a.wav"]}, media)


def test_scrub_removes_paths_and_traceback_lines():
    raw = ('bad: [00:53:09] /project/cpp/regex_converter.cc:75: Unclosed\n  File '
           '"/usr/lib/python3.11/site-packages/sglang/srt/entrypoints/http_server.py", line 1702, '
           'in openai_v1_chat_completions\n see /v1/chat/completions and https://json-schema.org/x')
    out = scrub_paths(raw)
    assert ".cc" not in out and ".py" not in out and "line 1702" not in out
    assert out.startswith("bad: Unclosed") and "/v1/chat/completions" in out and "json-schema.org" in out


def test_validation_message_names_fields_only():
    errors = [{"loc": ("body", "messages", 0, "function-after[x(), Param]", "role"), "msg": "bad role"},
              {"loc": ("body", "tools", 0, "function", "name"), "msg": "Field required"}]
    assert validation_message(errors) == "messages.0.role: bad role; tools.0.function.name: Field required"


def _asgi(app, path, body: bytes, method="POST"):
    sent = []

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message):
        sent.append(message)

    asyncio.run(app({"type": "http", "method": method, "path": path, "headers": []}, receive, send))
    return sent


def test_generate_middleware_refuses_before_the_app_and_replays_good_bodies():
    seen = []

    async def app(scope, receive, send):
        seen.append((await receive())["body"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    guard = GenerateGuardMiddleware(app, limits=lambda: LIMITS)
    sent = _asgi(guard, "/generate", json.dumps({"input_ids": [-1]}).encode())
    assert sent[0]["status"] == 400 and not seen
    assert "input_ids[0] = -1" in json.loads(sent[1]["body"])["error"]["message"]
    good = json.dumps({"input_ids": [1]}).encode()
    assert _asgi(guard, "/generate", good)[0]["status"] == 200 and seen == [good]
    assert _asgi(guard, "/v1/other", b"{\"input_ids\": [-1]}")[0]["status"] == 200


def test_error_scrub_middleware_touches_error_bodies_only():
    def app_with(status, payload):
        async def app(scope, receive, send):
            body = json.dumps(payload).encode()
            await send({"type": "http.response.start", "status": status,
                        "headers": [(b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
        return ErrorScrubMiddleware(app)

    leak = {"error": {"message": 'x  File "/a/b.py", line 3, in f'}}
    sent = _asgi(app_with(400, leak), "/generate", b"")
    assert json.loads(sent[1]["body"]) == {"error": {"message": "x"}}
    assert dict(sent[0]["headers"])[b"content-length"] == str(len(sent[1]["body"])).encode()
    assert json.loads(_asgi(app_with(200, leak), "/generate", b"")[1]["body"]) == leak


@pytest.mark.parametrize("path,name", [
    ("/root/.cache/sglang-dsv41/tiny-seed0", "tiny-seed0"),
    ("/data/ckpt/DeepSeek-V4.1-Flash/", "DeepSeek-V4.1-Flash"),
    ("/hf/hub/models--deepseek-ai--DeepSeek-V4.1-Flash/snapshots/0a1b", "deepseek-ai/DeepSeek-V4.1-Flash"),
    ("deepseek-ai/DeepSeek-V4.1-Flash", "deepseek-ai/DeepSeek-V4.1-Flash"),
])
def test_public_model_name(path, name):
    assert public_model_name(path) == name


def test_tokenizer_manager_hook_refuses_ids_on_every_path_into_the_scheduler():
    """The HookRegistry BEFORE hook on `TokenizerManager._validate_one_request` (hooks.py) refuses
    out-of-vocabulary ids before SGLang's own checks — the Python Engine and batch paths have no
    HTTP guard in front of them. Other models pass through unchanged."""
    from types import SimpleNamespace

    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    from sglang_dsv41.api.register import register_api

    register_api()

    def manager(model_type):
        return SimpleNamespace(model_config=SimpleNamespace(hf_config=SimpleNamespace(model_type=model_type),
                                                            vocab_size=1024),
                               context_len=4096, mm_processor=None)

    with pytest.raises(RequestRejected, match=r"input_ids\[1\] = 2000"):
        TokenizerManager._validate_one_request(manager("deepseek_v41"), SimpleNamespace(), [0, 2000])
    with pytest.raises(AttributeError):   # not ours: SGLang's own code runs (and needs a real manager)
        TokenizerManager._validate_one_request(manager("llama"), SimpleNamespace(), [0, 2000])


def test_drain_aborts_after_the_timeout_and_the_timeout_is_validated(monkeypatch):
    """`api/shutdown.py`: a clean drain aborts nothing; requests still running at the timeout are
    aborted once; a bad SGLANG_DSV41_DRAIN_TIMEOUT_S is refused naming the variable."""
    from types import SimpleNamespace

    from sglang.srt.managers.tokenizer_manager import ServerStatus

    from sglang_dsv41.api import shutdown

    monkeypatch.setattr(shutdown, "POLL_S", 0.01)
    monkeypatch.setattr(shutdown, "ABORT_GRACE_S", 0.05)
    calls = []
    stuck = SimpleNamespace(rid_to_state={"a": 1}, server_status=ServerStatus.Up,
                            abort_request=lambda abort_all: calls.append(abort_all))
    assert asyncio.run(shutdown.drain(stuck, 0.05)) == 1 and calls == [True]
    done = SimpleNamespace(rid_to_state={}, server_status=ServerStatus.Up, abort_request=None)
    assert asyncio.run(shutdown.drain(done, 0.05)) == 0
    monkeypatch.setenv(shutdown.DRAIN_TIMEOUT_ENV, "-1")
    with pytest.raises(ValueError, match="SGLANG_DSV41_DRAIN_TIMEOUT_S"):
        shutdown.drain_timeout_s()
    monkeypatch.setenv(shutdown.DRAIN_TIMEOUT_ENV, "2.5")
    assert shutdown.drain_timeout_s() == 2.5
    monkeypatch.delenv(shutdown.DRAIN_TIMEOUT_ENV)
    assert shutdown.drain_timeout_s() == shutdown.DEFAULT_DRAIN_TIMEOUT_S


def test_text_prompts_over_the_context_are_counted_only_when_they_could_be():
    counted = []

    def count(text):
        counted.append(text)
        return len(text.split())

    limits = ServingLimits(vocab_size=1024, context_len=64, accepts_media=False, count_tokens=count)
    check_generate_body({"text": "a b c"}, limits)
    assert counted == []                          # 5 bytes: cannot be 64 tokens, not encoded
    check_generate_body({"text": "x" * 200}, limits)   # one "token" by this count
    with pytest.raises(RequestRejected, match=r"text\[1\]: the prompt has 70 tokens"):
        check_generate_body({"text": ["ok", "w " * 70]}, limits)


def test_long_id_lists_name_the_first_bad_id_and_int_subclasses_still_pass():
    """The whole-list check (`map` / `min` / `max` in C) only lets exactly-`int` lists in the
    vocabulary through; anything else gets the element-wise check and its message."""
    import enum

    class Tok(enum.IntEnum):
        A = 7

    limits = ServingLimits(vocab_size=1024, context_len=1 << 20, accepts_media=False)
    long = [3] * 40_000
    check_token_ids(long, "input_ids", limits)
    check_token_ids(tuple(long) + (Tok.A,), "input_ids", limits)        # an int subclass is an int
    for bad, needle in ((1024, "input_ids[30000] = 1024"), (-1, "input_ids[30000] = -1"),
                        (False, "input_ids[30000] = False: token ids must be integers"),
                        (2.0, "input_ids[30000] = 2.0: token ids must be integers")):
        ids = long[:30_000] + [bad] + long[:5] + [5000]
        with pytest.raises(RequestRejected, match=__import__("re").escape(needle)):
            check_token_ids(ids, "input_ids", limits)
    with pytest.raises(RequestRejected, match="mixes"):
        check_token_ids(long + [[1]], "input_ids", limits)
    with pytest.raises(RequestRejected, match=r"input_ids\[1\]\[2\] = 1024"):
        check_token_ids([[1, 2], [3, 4, 1024]], "input_ids", limits)

"""Image requests through a real `sglang-dsv41 serve` on the tiny checkpoint (issue 17; docs/vision.md).

The server runs `--chunked-prefill-size 12 --enable-mixed-chunk`, so every image span (≥ 11
tokens) is prefilled across chunks. The oracle is `ReferenceModel` (CPU) with the same decoded
image: teacher-forced on the server's greedy tokens, each is the reference's top-1 up to the
serving-path contract (`test_runtime_server.within_contract`'s margin 2·LOGIT_BOUND). Also: the
card's two verification requests on `/v1/chat/completions` (text `17*19`, and an image; data URL),
multi-image, multi-turn with images in two turns, an image request hitting the prefix cache, more images than `--limit-mm-data-per-request`, every bad input → 4xx with a message and the server still serving, and the
text-only mode (`--language-model-only`): images → 400, text served (its start-up refusal together
with `--mm-enable-dp-encoder` is checked in-process: tests/test_overrides.py, with the flag's
parsing in tests/test_hooks.py). Every wait is bounded; every server is stopped.
"""
from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from server_helpers import Server, running
from shared_servers import CHUNKED_ARGS
from sglang_dsv41.reference.model import ReferenceModel
from test_runtime_numerics_contract import LOGIT_BOUND

pytestmark = pytest.mark.slow

NEW_TOKENS = 8
SERVER_ARGS = CHUNKED_ARGS     # the shared ``chunked`` server's (the image limit last)


def make_image(seed: int, size: tuple[int, int]) -> Image.Image:
    arr = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(arr)


def png_data_url(img: Image.Image) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def server(shared_servers) -> Server:
    """The shared ``chunked`` server (tests/shared_servers.py), started with `SERVER_ARGS`."""
    return shared_servers.get("chunked")


@pytest.fixture(scope="module")
def reference(tiny_checkpoint: Path) -> ReferenceModel:
    return ReferenceModel.from_checkpoint(tiny_checkpoint)


def generate(server: Server, ids: list[int], images: list[Image.Image]) -> dict:
    return server.post("/generate", {"input_ids": ids, "image_data": [png_data_url(i) for i in images],
                                     "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0,
                                                         "ignore_eos": True}})


def within_contract(reference: ReferenceModel, prompt: list[int], images: list[Image.Image],
                    tokens: list[int]) -> bool:
    """Teacher-forced on the server's tokens, each is the reference's top-1 within 2·LOGIT_BOUND."""
    ids, spans = reference.encode_images(prompt, images)
    logits = reference.forward(reference.new_request(), ids + tokens[:-1], image_embeds=spans).logits
    logits = logits[len(ids) - 1:].double()
    margin = logits.max(dim=-1).values - logits[torch.arange(len(tokens)), torch.tensor(tokens)]
    return bool((margin <= 2 * LOGIT_BOUND).all())


def _prompt(reference: ReferenceModel, seed: int, n_text: int, n_images: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    text = torch.randint(3, 990, (n_text,), generator=g).tolist()
    cut = sorted(torch.randperm(n_text - 1, generator=g)[:n_images].add(1).tolist())
    out, last = [0], 0
    for c in cut:
        out += text[last:c] + [reference.cfg.image_token_id]
        last = c
    return out + text[last:]


def test_image_request_matches_the_reference(server: Server, reference: ReferenceModel) -> None:
    img = make_image(1, (200, 90))
    prompt = _prompt(reference, 1, 20, 1)
    res = generate(server, prompt, [img])
    tokens = res["output_ids"]
    n_span = len(reference.encode_images(prompt, [img])[0]) - len(prompt) + 1
    assert res["meta_info"]["prompt_tokens"] == len(prompt) - 1 + n_span
    assert len(tokens) == NEW_TOKENS and within_contract(reference, prompt, [img], tokens), server.log_tail()
    # the image changes the answer's input: a different image is a different request
    other = generate(server, prompt, [make_image(2, (200, 90))])
    assert other["meta_info"]["cached_tokens"] < len(prompt) - 1 + n_span - 1


def test_multi_image_request(server: Server, reference: ReferenceModel) -> None:
    images = [make_image(3, (84, 84)), make_image(4, (300, 120)), make_image(5, (60, 400))]
    prompt = _prompt(reference, 3, 24, 3)
    tokens = generate(server, prompt, images)["output_ids"]
    assert within_contract(reference, prompt, images, tokens)


def test_more_images_than_the_configured_limit_is_a_400(server: Server) -> None:
    url = png_data_url(make_image(10, (30, 30)))
    status, body = _chat(server, [*[{"type": "image_url", "image_url": {"url": url}}] * 5,
                                  {"type": "text", "text": "x"}])
    assert status == 400 and "exceeds limit 4" in str(body), body


def test_image_request_hits_the_prefix_cache(server: Server, reference: ReferenceModel) -> None:
    img = make_image(6, (150, 150))
    prompt = _prompt(reference, 6, 30, 1)
    first = generate(server, prompt, [img])
    again = generate(server, prompt, [img])
    n_ids = first["meta_info"]["prompt_tokens"]
    assert again["meta_info"]["cached_tokens"] >= n_ids - 2        # page-aligned hit through the image span
    assert again["output_ids"] == first["output_ids"]
    # a longer prompt sharing the image prefix hits the cache and stays within the contract
    longer = prompt + [17, 18, 19, 20]
    res = generate(server, longer, [img])
    assert res["meta_info"]["cached_tokens"] >= n_ids - 2
    assert within_contract(reference, longer, [img], res["output_ids"])


def _chat(server: Server, content, max_tokens: int = 8) -> tuple[int, dict]:
    return server.post_status("/v1/chat/completions", {
        "model": "tiny", "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens, "temperature": 0})


def _is_completion(res: dict, max_tokens: int) -> dict:
    """The chat-completion shape the card's client reads (the tiny model's words are random)."""
    assert res["object"] == "chat.completion" and len(res["choices"]) == 1, res
    choice = res["choices"][0]
    msg = choice["message"]
    assert msg["role"] == "assistant" and choice["finish_reason"] in ("stop", "length"), choice
    assert isinstance(msg.get("content") or "", str) and isinstance(msg.get("reasoning_content") or "", str)
    usage = res["usage"]
    assert 0 < usage["completion_tokens"] <= max_tokens and usage["prompt_tokens"] > 0, usage
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"], usage
    return usage


def test_card_verification_requests_on_chat_completions(server: Server, reference: ReferenceModel) -> None:
    """The card's "Verifying" pair on `/v1/chat/completions`: its text request (17*19, as a plain
    string; 323 is checked on the real checkpoint only) and an image request with the same text."""
    card = "What is 17*19? Return only the integer."
    status, plain = _chat(server, card)
    assert status == 200, plain
    text_usage = _is_completion(plain, 8)
    img = make_image(7, (200, 90))
    status, res = _chat(server, [{"type": "image_url", "image_url": {"url": png_data_url(img)}},
                                 {"type": "text", "text": card}])
    assert status == 200, res
    usage = _is_completion(res, 8)
    n_span = len(reference.encode_images([reference.cfg.image_token_id], [img])[0])
    # the placeholder is expanded to the image's span, which usage reports as image tokens; the
    # prompt also gains the part joiner between the image and the text
    assert usage["prompt_tokens_details"]["image_tokens"] == n_span, usage
    assert usage["prompt_tokens"] - text_usage["prompt_tokens"] >= n_span, (usage, text_usage, n_span)


def test_multi_turn_with_images_in_two_turns(server: Server, reference: ReferenceModel) -> None:
    """Turn 2 = turn 1's prompt + its reply + a new image: it hits the cache through turn 1's image
    span and stays within the contract; the same turn 2 with a different first image (same size)
    misses from that image on — the cache is keyed on image content, not on the placeholder."""
    a, b, other_a = make_image(11, (120, 100)), make_image(12, (90, 160)), make_image(13, (120, 100))
    turn1 = _prompt(reference, 11, 16, 1)
    first = generate(server, turn1, [a])
    n1 = first["meta_info"]["prompt_tokens"]
    turn2 = turn1 + first["output_ids"] + _prompt(reference, 12, 12, 1)[1:]
    second = generate(server, turn2, [a, b])
    assert second["meta_info"]["cached_tokens"] >= n1 - 2, second["meta_info"]       # through image a's span
    assert within_contract(reference, turn2, [a, b], second["output_ids"]), server.log_tail()
    start_a = turn1.index(reference.cfg.image_token_id)
    swapped = generate(server, turn2, [other_a, b])
    assert swapped["meta_info"]["cached_tokens"] <= start_a + 1, swapped["meta_info"]
    # the chat API: the second turn's prompt carries both images' spans
    url_a, url_b = png_data_url(a), png_data_url(b)
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url_a}},
                                         {"type": "text", "text": "What is this?"}]}]
    status, r1 = server.post_status("/v1/chat/completions", {"model": "tiny", "messages": msgs, "max_tokens": 4,
                                                             "temperature": 0})
    assert status == 200, r1
    msgs += [{"role": "assistant", "content": r1["choices"][0]["message"]["content"] or "ok"},
             {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url_b}},
                                          {"type": "text", "text": "And this one?"}]}]
    status, r2 = server.post_status("/v1/chat/completions", {"model": "tiny", "messages": msgs, "max_tokens": 4,
                                                             "temperature": 0})
    assert status == 200, r2
    span_b = len(reference.encode_images([reference.cfg.image_token_id], [b])[0])
    assert r2["usage"]["prompt_tokens"] > r1["usage"]["prompt_tokens"] + span_b, (r1["usage"], r2["usage"])


@pytest.mark.parametrize("url, message", [
    ("data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"x" * 40).decode(), "image"),
    ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAAB", "image"),          # truncated PNG
    ("data:image/png;base64,@@@", "base64"),
    ("/nonexistent/dir/image.png", "cannot read image file"),
    ("http://127.0.0.1:9/nothing.png", "cannot read image URL"),
])
def test_bad_image_is_a_4xx_and_the_server_stays_up(server: Server, url: str, message: str) -> None:
    status, body = _chat(server, [{"type": "image_url", "image_url": {"url": url}},
                                  {"type": "text", "text": "hi"}])
    assert 400 <= status < 500, body
    assert message in str(body), body
    status, ok = _chat(server, "still there?", max_tokens=2)
    assert status == 200, ok


def test_unsupported_format_zero_size_and_pixel_cap_are_4xx(server: Server) -> None:
    tiff = io.BytesIO()
    make_image(8, (16, 16)).save(tiff, format="TIFF")
    cases = [("data:image/tiff;base64," + base64.b64encode(tiff.getvalue()).decode(), "unsupported image format"),
             (_zero_width_png(), "image"),
             (png_data_url(Image.new("RGB", (9000, 8000))), "over the cap")]
    for url, message in cases:
        status, body = _chat(server, [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "x"}])
        assert 400 <= status < 500 and message in str(body), (status, body)
    assert _chat(server, "ok?", max_tokens=2)[0] == 200
    # streamed: refused before the stream starts (a 4xx, not a 200 stream with an error event)
    status, body = server.post_status("/v1/chat/completions", {
        "model": "tiny", "stream": True, "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": cases[0][0]}}, {"type": "text", "text": "x"}]}]})
    assert status == 400 and "unsupported image format" in str(body), (status, body)


def _zero_width_png() -> str:
    """A PNG whose header declares width 0 (PIL cannot write one; the IHDR is patched)."""
    import struct
    import zlib

    buf = io.BytesIO()
    Image.new("RGB", (1, 1)).save(buf, format="PNG")
    raw = bytearray(buf.getvalue())
    ihdr = raw.index(b"IHDR")
    raw[ihdr + 4:ihdr + 8] = struct.pack(">I", 0)
    raw[ihdr + 17:ihdr + 21] = struct.pack(">I", zlib.crc32(bytes(raw[ihdr:ihdr + 17])))
    return "data:image/png;base64," + base64.b64encode(bytes(raw)).decode()


# ---- text-only mode --------------------------------------------------------------------------------
def test_language_model_only_refuses_images_and_serves_text(tiny_checkpoint: Path, tmp_path: Path) -> None:
    args = [*SERVER_ARGS[:-2], "--language-model-only"]     # no image limit: refused on a text-only server
    with running(Server(tiny_checkpoint, tmp_path / "lm_only.log", args)) as srv:
        assert "vision tower loaded" not in srv.log_tail(200_000)
        status, body = _chat(srv, [{"type": "image_url", "image_url": {"url": png_data_url(make_image(9, (50, 50)))}},
                                   {"type": "text", "text": "hi"}])
        assert status == 400 and "only supports text" in str(body), body
        status, ok = _chat(srv, "What is 17*19? Return only the integer.", max_tokens=4)
        assert status == 200, ok

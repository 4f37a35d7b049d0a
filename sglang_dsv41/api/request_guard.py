"""Front-door checks of a generation request against what the served model can take (issue 20
item 1: no request can crash the server).

A request that reaches SGLang 0.5.17's scheduler with a token id outside the vocabulary raises
inside the scheduler loop, which takes the whole server down; an id at or above the multimodal
pad base (1,000,000, spec `model.md` §3.1 item 3) is read as an image token. Every id a client
can send is therefore checked here, before the request is queued: ids are integers in
``[0, vocab_size)`` (a text-only server has no image spans, and pad ids are only ever inserted by
SGLang itself, after these checks), a prompt is shorter than the context length, top-logprob
counts are in ``[0, MAX_TOP_LOGPROBS]`` and the sampling parameters pass SGLang's own
`SamplingParams.verify` — early enough that a streamed request is refused with a 4xx, not with
an error event inside a 200 stream.

Every rejection is a `RequestRejected` (a ValueError: SGLang answers HTTP 400) whose message names
the request field to change.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat `top_logprobs`; applied to every route
MM_FIELDS = ("image_data", "video_data", "audio_data")


class RequestRejected(ValueError):
    """A request the server refuses before queueing it (HTTP 400); the message names the field."""


@dataclass(frozen=True)
class ServingLimits:
    """What the served model accepts. ``accepts_media`` is False on a text-only server;
    ``count_tokens`` (the server tokenizer's count for a text prompt) is None without one."""

    vocab_size: int
    context_len: int
    accepts_media: bool
    count_tokens: Callable[[str], int] | None = field(default=None, compare=False)

    @classmethod
    def of(cls, tokenizer_manager: Any) -> "ServingLimits":
        tokenizer = getattr(tokenizer_manager, "tokenizer", None)
        return cls(vocab_size=int(tokenizer_manager.model_config.vocab_size),
                   context_len=int(tokenizer_manager.context_len),
                   accepts_media=getattr(tokenizer_manager, "mm_processor", None) is not None,
                   count_tokens=None if tokenizer is None else (lambda t: len(tokenizer.encode(t))))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _sequences(ids: Any, field: str) -> list[tuple[str, Sequence[Any], set[type]]]:
    """A flat id list or a batch of them → ``(field label, sequence, its element types)`` triples."""
    if not isinstance(ids, (list, tuple)):
        raise RequestRejected(f"{field} must be a list of token ids or a list of such lists")
    if ids and all(isinstance(s, (list, tuple)) for s in ids):
        return [(f"{field}[{k}]", seq, set(map(type, seq))) for k, seq in enumerate(ids)]
    types = set(map(type, ids))
    if any(issubclass(t, (list, tuple)) for t in types):
        raise RequestRejected(f"{field} mixes token ids and lists of token ids")
    return [(field, ids, types)]


def _plain_ids_in_vocab(seq: Sequence[Any], types: set[type], vocab_size: int) -> bool:
    """True when every element (of element types `types`) is exactly an `int` in [0, vocab_size),
    checked in C (`min`, `max`); False says only that the element-wise check must run."""
    return types <= {int} and (not seq or (min(seq) >= 0 and max(seq) < vocab_size))


def check_token_ids(ids: Any, field: str, limits: ServingLimits, *, check_length: bool = True) -> None:
    """Every id an integer in ``[0, vocab_size)``; each sequence shorter than the context."""
    for where, seq, types in _sequences(ids, field):
        for i, tok in ([] if _plain_ids_in_vocab(seq, types, limits.vocab_size) else enumerate(seq)):
            if not _is_int(tok):
                raise RequestRejected(f"{where}[{i}] = {tok!r}: token ids must be integers")
            if not 0 <= tok < limits.vocab_size:
                extra = (" (ids from 1,000,000 up are image placeholders, which a text request "
                         "cannot carry)" if tok >= 1_000_000 else "")
                raise RequestRejected(f"{where}[{i}] = {tok}: token ids must be in "
                                      f"[0, {limits.vocab_size}), the model's vocabulary{extra}")
        if check_length and len(seq) >= limits.context_len:
            raise RequestRejected(f"{where}: the prompt has {len(seq)} tokens; the model's context "
                                  f"length is {limits.context_len} (prompt + new tokens must fit)")


def check_text_length(text: Any, field: str, limits: ServingLimits) -> None:
    """A text prompt (or a batch of them) shorter than the context, counted by the server's
    tokenizer — only for texts of at least ``context_len - 2`` UTF-8 bytes (a byte-level BPE
    token covers at least one byte, so shorter texts fit), so ordinary prompts are not encoded
    twice. SGLang checks the length itself later, but inside the stream of a streamed request."""
    if limits.count_tokens is None:
        return
    texts = text if isinstance(text, list) else [text]
    for i, one in enumerate(texts):
        if not isinstance(one, str) or len(one.encode()) + 2 < limits.context_len:
            continue
        n = limits.count_tokens(one)
        if n >= limits.context_len:
            where = f"{field}[{i}]" if isinstance(text, list) else field
            raise RequestRejected(f"{where}: the prompt has {n} tokens; the model's context length "
                                  f"is {limits.context_len} (prompt + new tokens must fit)")


def check_top_logprobs(value: Any, field: str) -> None:
    values = value if isinstance(value, (list, tuple)) else [value]
    for v in values:
        if v is None:
            continue
        if not _is_int(v) or not 0 <= v <= MAX_TOP_LOGPROBS:
            raise RequestRejected(f"{field} = {v!r}: must be an integer in [0, {MAX_TOP_LOGPROBS}] "
                                  "(the OpenAI limit)")


def check_choice_count(value: Any, field: str) -> None:
    if value is not None and (not _is_int(value) or value < 1):
        raise RequestRejected(f"{field} = {value!r}: the number of choices must be an integer >= 1")


def check_stop_regex(value: Any, field: str) -> None:
    """Stop regexes compile (SGLang parses them with `sre_parse` while building the request; a bad
    one was an HTTP 500)."""
    for pattern in (value if isinstance(value, list) else [value]):
        if pattern is None:
            continue
        if not isinstance(pattern, str):
            raise RequestRejected(f"{field}: a stop regex must be a string, got {pattern!r}")
        try:
            re.compile(pattern)
        except re.error as exc:
            raise RequestRejected(f"{field}: {pattern!r} is not a valid regular expression ({exc})") from exc


def check_sampling_params(params: Any, field: str, limits: ServingLimits) -> None:
    """SGLang's own `SamplingParams` construction and `verify`, run before queueing."""
    from sglang.srt.sampling.sampling_params import SamplingParams

    for i, one in enumerate(params if isinstance(params, list) else [params]):
        where = field if not isinstance(params, list) else f"{field}[{i}]"
        if one is None:
            continue
        if not isinstance(one, Mapping):
            raise RequestRejected(f"{where} must be an object")
        check_choice_count(one.get("n"), f"{where}.n")
        check_stop_regex(one.get("stop_regex"), f"{where}.stop_regex")
        try:
            SamplingParams(**one).verify(limits.vocab_size)
        except TypeError as exc:
            raise RequestRejected(f"{where}: {exc}".replace("SamplingParams.__init__() ", "")) from exc
        except (ValueError, OverflowError) as exc:
            raise RequestRejected(f"{where}: {exc}") from exc


def _flat(data: Any) -> list[Any]:
    if isinstance(data, (list, tuple)):
        return [x for d in data for x in _flat(d)]
    return [] if data in (None, "") else [data]


def check_images(image_data: Any) -> None:
    """Every image of a request loads (`runtime/image_io.py`: corrupt, truncated, zero-size,
    over the pixel cap, unsupported format, unreadable file or URL → 400), checked before the
    request is queued or its stream starts; the processor loads them again (docs/vision.md)."""
    from ..runtime.image_io import load_image

    for i, item in enumerate(_flat(image_data)):
        try:
            load_image(item, where=f"image {i}")
        except ValueError as err:
            raise RequestRejected(str(err)) from err


def check_no_media(fields: Mapping[str, Any], limits: ServingLimits) -> None:
    """Text-only server: no media field. Multimodal server: images only, each loadable."""
    if limits.accepts_media:
        for name in ("video_data", "audio_data"):
            if fields.get(name) not in (None, [], ""):
                raise RequestRejected(f"{name}: DeepSeek-V4.1 takes image input only; remove the field")
        check_images(fields.get("image_data"))
        return
    for name in MM_FIELDS:
        if fields.get(name) not in (None, [], ""):
            raise RequestRejected(f"{name}: this server serves the text model only (no image, video "
                                  "or audio input); remove the field")


def check_generate_body(body: Mapping[str, Any], limits: ServingLimits) -> None:
    """The raw JSON body of SGLang's native ``/generate``."""
    if body.get("input_ids") is not None:
        check_token_ids(body["input_ids"], "input_ids", limits)
    elif body.get("text") is not None:
        check_text_length(body["text"], "text", limits)
    check_top_logprobs(body.get("top_logprobs_num"), "top_logprobs_num")
    check_sampling_params(body.get("sampling_params"), "sampling_params", limits)
    check_no_media(body, limits)


def check_adapted_request(adapted: Any, limits: ServingLimits) -> None:
    """A `GenerateReqInput` built by the OpenAI layer (completions, chat) from a client request:
    the ids it will queue (the client's, or our encoder's) and its sampling parameters."""
    if getattr(adapted, "input_ids", None) is not None:
        check_token_ids(adapted.input_ids, "prompt", limits)
    elif getattr(adapted, "text", None) is not None:
        check_text_length(adapted.text, "prompt", limits)
    check_sampling_params(getattr(adapted, "sampling_params", None), "sampling parameters", limits)
    check_no_media({name: getattr(adapted, name, None) for name in MM_FIELDS}, limits)

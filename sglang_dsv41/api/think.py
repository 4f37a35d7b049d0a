"""Split a DeepSeek-V4.1 reply into reasoning and content, incrementally (spec `model.md` §6;
anchors §3 F: vllm#48645 misrouting, vllm#45862 tool calls inside reasoning).

The prompt decides where a reply starts: thinking mode ends the prompt with ``<think>`` (the
reply starts *inside* reasoning), non-thinking mode ends it with ``</think>`` (the reply is
content). So the splitter must be told the mode; it never guesses it from the reply.

Rules:

* thinking on: reasoning runs until the first ``</think>`` (dropped) or the first DSML tag
  (``<｜DSML｜…``, kept: it starts the content, where the tool parser finds the call). A leading
  ``<think>`` the model repeats is dropped, and so are newlines opening the reasoning (recipe's
  ``ThinkingInitialStage.ReasoningStart`` does the same). A reply that ends inside reasoning
  (e.g. ``finish_reason=length``) is all reasoning — that is what the model produced.
* thinking off: everything is content, except an explicit ``<think>…</think>`` block at the very
  start of the reply (reasoning) and a repeated leading ``</think>`` (dropped). A reply without
  any tag is never routed to reasoning.
* continuing a prefilled assistant message (``continue_final_message``) in thinking mode starts in
  reasoning only when the prefill has no content yet (recipe renders ``<think>{reasoning}`` then),
  otherwise in content (``…</think>{content}``).

Chunking-invariant: any split of the reply into chunks gives the same concatenated reasoning and
content, because every decision waits until the text disambiguates it (partial markers held).
With ``stream_reasoning=False`` reasoning is released in one piece when it ends.
"""
from __future__ import annotations

THINK_START = "<think>"
THINK_END = "</think>"
DSML_OPEN = "<｜DSML｜"


def _held_prefix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of one of ``markers``."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best


class ThinkSplitter:
    """`feed` text chunks → (reasoning, content) deltas; `finish` once at the end."""

    def __init__(self, *, thinking: bool, stream_reasoning: bool = True,
                 continue_content: bool = False):
        self.thinking = thinking
        self._stream_reasoning = stream_reasoning
        self._state = "reasoning" if thinking and not continue_content else (
            "content" if thinking else "start")
        self._at_reasoning_start = self._state == "reasoning" and not continue_content
        self._buf = ""
        self._held_reasoning = ""
        self._finished = False

    @property
    def in_reasoning(self) -> bool:
        return self._state == "reasoning"

    def feed(self, text: str) -> tuple[str, str]:
        if self._finished:
            raise RuntimeError("ThinkSplitter.feed after finish")
        self._buf += text
        reasoning: list[str] = []
        content: list[str] = []
        progressing = True
        while progressing and self._buf:
            progressing = self._step(reasoning, content)
        return self._release("".join(reasoning)), "".join(content)

    def finish(self) -> tuple[str, str]:
        if self._finished:
            return "", ""
        self._finished = True
        rest, self._buf = self._buf, ""
        reasoning, content = "", ""
        if self._state == "reasoning":
            reasoning = rest if not self._at_reasoning_start else rest.lstrip("\n")
        else:
            content = rest
        held, self._held_reasoning = self._held_reasoning + reasoning, ""
        return held, content

    def _release(self, reasoning: str) -> str:
        if self._stream_reasoning:
            return reasoning
        self._held_reasoning += reasoning
        if self._state == "reasoning":
            return ""
        held, self._held_reasoning = self._held_reasoning, ""
        return held

    def _step(self, reasoning: list[str], content: list[str]) -> bool:
        buf = self._buf
        if self._state == "content":
            content.append(buf)
            self._buf = ""
            return False
        if self._state == "start":
            for marker in (THINK_START, THINK_END):
                if buf.startswith(marker):
                    self._buf = buf[len(marker):]
                    self._state = "reasoning" if marker == THINK_START else "content"
                    self._at_reasoning_start = marker == THINK_START
                    return True
                if marker.startswith(buf):
                    return False  # could still become a leading marker
            self._state = "content"
            return True
        # reasoning
        if self._at_reasoning_start:
            stripped = buf.lstrip("\n")
            if not stripped:
                self._buf = ""
                return False
            if stripped.startswith(THINK_START):
                self._buf = stripped[len(THINK_START):]
                return True
            if THINK_START.startswith(stripped):
                self._buf = stripped
                return False
            buf = self._buf = stripped
            self._at_reasoning_start = False
        end = buf.find(THINK_END)
        tool = buf.find(DSML_OPEN)
        if end >= 0 and (tool < 0 or end < tool):
            reasoning.append(buf[:end])
            self._buf = buf[end + len(THINK_END):]
            self._state = "content"
            return True
        if tool >= 0:
            reasoning.append(buf[:tool])
            self._buf = buf[tool:]
            self._state = "content"
            return True
        keep = _held_prefix(buf, (THINK_END, DSML_OPEN))
        reasoning.append(buf[: len(buf) - keep])
        self._buf = buf[len(buf) - keep:]
        return False


def split_reasoning(text: str, *, thinking: bool, continue_content: bool = False) -> tuple[str, str]:
    """One-shot split: (reasoning, content). Same machine as streaming."""
    splitter = ThinkSplitter(thinking=thinking, continue_content=continue_content)
    r1, c1 = splitter.feed(text)
    r2, c2 = splitter.finish()
    return r1 + r2, c1 + c2

"""SGLang reasoning detector for DeepSeek-V4.1, registered as ``deepseek-v41`` / ``deepseek_v41``
(spec `runtime.md` §B "Reasoning parser": ``ReasoningParser.DetectorMap``).

The splitting rules live in `think.ThinkSplitter`; this class only adapts them to SGLang's
`BaseReasoningFormatDetector` contract. The mode comes from ``force_reasoning``, which for
DeepSeek-V4.1 requests is the resolved thinking decision (`serving.py` makes SGLang pass it:
it hooks `OpenAIServingChat._get_reasoning_from_request` and `ReasoningParser.__init__`).

DSML markup (issue 20: a bare ``｜DSML｜`` token reached ``content``): ``skip_special_tokens`` is
off for this model, so the decoded reply carries the model's special tokens. After the split,

* ``reasoning_content`` never carries DSML markup (a bare token or a stray closing tag in the
  trace is dropped; an opening tag ends the trace, `think.py`);
* ``content`` is left to the DSML tool parser when the request declares tools (and
  ``tool_choice`` is not ``none``): it turns the markup into ``tool_calls`` and drops the rest.
  Otherwise no tool parser runs, and this detector drops the markup itself — a call the request
  did not ask for is skipped (logged), as a call of an undeclared tool is. `serving.py`'s hook
  on ``ReasoningParser.__init__`` says which case applies (`set_tool_parser_runs`).
"""
from __future__ import annotations

from sglang.srt.parser.reasoning_parser import BaseReasoningFormatDetector, StreamingParseResult

from .dsml import Content, DsmlStreamParser
from .think import THINK_END, THINK_START, ThinkSplitter

PARSER_NAMES: tuple[str, ...] = ("deepseek-v41", "deepseek_v41")


class DsmlMarkupFilter:
    """One text stream without its DSML markup: `DsmlStreamParser` with no declared tool, so
    every call is skipped and every tag or bare token consumed. Chunking-invariant like it."""

    def __init__(self) -> None:
        self._parser = DsmlStreamParser(())

    @staticmethod
    def _text(events) -> str:
        return "".join(e.text for e in events if isinstance(e, Content))

    def feed(self, text: str) -> str:
        return self._text(self._parser.feed(text)) if text else ""

    def finish(self) -> str:
        return self._text(self._parser.finish())


class DeepseekV41ReasoningDetector(BaseReasoningFormatDetector):
    """``<think>…</think>`` splitting with DSML-aware early exit; see `think.py` for the rules."""

    def __init__(self, stream_reasoning: bool = True, force_reasoning: bool = False,
                 continue_final_message: bool = False, previous_content: str = "",
                 force_nonempty_content: bool = False):
        super().__init__(
            THINK_START,
            THINK_END,
            force_reasoning=force_reasoning,
            stream_reasoning=stream_reasoning,
            continue_final_message=continue_final_message,
            previous_content=previous_content or "",
            thinks_internally=True,
            reasoning_default="thinking",  # the card: thinking is on unless turned off
            force_nonempty_content=force_nonempty_content,
        )
        self._continue_content = bool(continue_final_message and previous_content)
        self._tool_parser_runs = True  # until told otherwise: content markup is the tool parser's
        self._splitter, self._reasoning_filter, self._content_filter = self._new_state()

    def set_tool_parser_runs(self, runs: bool) -> None:
        """Whether SGLang hands this request's content to the DSML tool parser (before any text)."""
        self._tool_parser_runs = runs
        self._splitter, self._reasoning_filter, self._content_filter = self._new_state()

    def _new_state(self) -> tuple[ThinkSplitter, DsmlMarkupFilter, DsmlMarkupFilter | None]:
        splitter = ThinkSplitter(thinking=bool(self.force_reasoning),
                                 stream_reasoning=self.stream_reasoning,
                                 continue_content=self._continue_content)
        return splitter, DsmlMarkupFilter(), None if self._tool_parser_runs else DsmlMarkupFilter()

    def _filtered(self, reasoning: str, content: str, *, final: bool,
                  filters: tuple[DsmlMarkupFilter, DsmlMarkupFilter | None]) -> tuple[str, str]:
        reasoning_filter, content_filter = filters
        reasoning = reasoning_filter.feed(reasoning) + (reasoning_filter.finish() if final else "")
        if content_filter is not None:
            content = content_filter.feed(content) + (content_filter.finish() if final else "")
        return reasoning, content

    def detect_and_parse(self, text: str) -> StreamingParseResult:
        splitter, *filters = self._new_state()
        r1, c1 = splitter.feed(text)
        r2, c2 = splitter.finish()
        reasoning, content = self._filtered(r1 + r2, c1 + c2, final=True, filters=tuple(filters))
        return self._maybe_apply_force_nonempty_content(
            StreamingParseResult(normal_text=content, reasoning_text=reasoning))

    def parse_streaming_increment(self, new_text: str) -> StreamingParseResult:
        reasoning, content = self._splitter.feed(new_text)
        self._in_reasoning = self._splitter.in_reasoning
        reasoning, content = self._filtered(reasoning, content, final=False,
                                            filters=(self._reasoning_filter, self._content_filter))
        return StreamingParseResult(normal_text=content, reasoning_text=reasoning)

    def finish(self) -> StreamingParseResult:
        reasoning, content = self._splitter.finish()
        reasoning, content = self._filtered(reasoning, content, final=True,
                                            filters=(self._reasoning_filter, self._content_filter))
        return StreamingParseResult(normal_text=content, reasoning_text=reasoning)

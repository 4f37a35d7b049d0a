"""SGLang reasoning detector for DeepSeek-V4.1, registered as ``deepseek-v41`` / ``deepseek_v41``
(spec `runtime.md` §B "Reasoning parser": ``ReasoningParser.DetectorMap``).

The splitting rules live in `think.ThinkSplitter`; this class only adapts them to SGLang's
`BaseReasoningFormatDetector` contract. The mode comes from ``force_reasoning``, which for
DeepSeek-V4.1 requests is the resolved thinking decision (`serving.py` makes SGLang pass it:
it hooks `OpenAIServingChat._get_reasoning_from_request` and `ReasoningParser.__init__`).
"""
from __future__ import annotations

from sglang.srt.parser.reasoning_parser import BaseReasoningFormatDetector, StreamingParseResult

from .think import THINK_END, THINK_START, ThinkSplitter

PARSER_NAMES: tuple[str, ...] = ("deepseek-v41", "deepseek_v41")


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
        self._splitter = self._new_splitter()

    def _new_splitter(self) -> ThinkSplitter:
        return ThinkSplitter(thinking=bool(self.force_reasoning),
                             stream_reasoning=self.stream_reasoning,
                             continue_content=self._continue_content)

    def detect_and_parse(self, text: str) -> StreamingParseResult:
        splitter = self._new_splitter()
        r1, c1 = splitter.feed(text)
        r2, c2 = splitter.finish()
        return self._maybe_apply_force_nonempty_content(
            StreamingParseResult(normal_text=c1 + c2, reasoning_text=r1 + r2))

    def parse_streaming_increment(self, new_text: str) -> StreamingParseResult:
        reasoning, content = self._splitter.feed(new_text)
        self._in_reasoning = self._splitter.in_reasoning
        return StreamingParseResult(normal_text=content, reasoning_text=reasoning)

    def finish(self) -> StreamingParseResult:
        reasoning, content = self._splitter.finish()
        return StreamingParseResult(normal_text=content, reasoning_text=reasoning)

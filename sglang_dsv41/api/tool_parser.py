"""SGLang tool-call detector for DeepSeek-V4.1 DSML, registered as ``deepseek-v41`` /
``deepseek_v41`` (spec `runtime.md` §A.10, §B "Tool-call parser").

Parsing is `dsml.DsmlStreamParser` (chunking-invariant, never leaks markup, never emits invalid
argument JSON); this class maps its events onto SGLang's `BaseFormatDetector` contract:

* non-streaming: ``detect_and_parse`` → content + one `ToolCallItem` per call (``tool_index`` is
  the call's position in the reply, ``parameters`` its complete argument JSON);
* streaming: the first item of a call carries its name and empty parameters, later items carry
  argument deltas; ``prev_tool_call_arr[i]["arguments"]`` always holds the call's final
  arguments and ``streamed_args_for_tool[i]`` what was sent, so SGLang's end-of-stream
  completion (`OpenAIServingChat._check_for_unstreamed_tool_args`) sends the closing part of a
  call the model left unterminated;
* constrained decoding: `get_structural_tag` returns the DSML grammar of `dsml_grammar` for
  ``required`` / named choices and strict tools (so SGLang never falls back to its JSON-array
  grammar, whose output is not DSML).
"""
from __future__ import annotations

import re
from typing import Any, List, Optional

from sglang.srt.environ import envs
from sglang.srt.function_call.base_format_detector import BaseFormatDetector
from sglang.srt.function_call.core_types import StreamingParseResult, StructureInfo, ToolCallItem

from .dsml import (
    CALLS_CLOSE,
    CALLS_OPEN,
    INVOKE_CLOSE,
    INVOKE_OPEN,
    ArgsDelta,
    CallStart,
    Content,
    DsmlStreamParser,
    parse_dsml,
)
from .dsml_grammar import dsml_structural_tag

PARSER_NAMES: tuple[str, ...] = ("deepseek-v41", "deepseek_v41")
_HAS_CALL_RE = re.compile(r"<｜DSML｜\s*(calls|tool_calls|function_calls|invoke)\b")


def _tool_names(tools: Optional[List[Any]]) -> list[str]:
    return [t.function.name for t in tools or [] if t.function.name]


class DeepseekV41DsmlDetector(BaseFormatDetector):
    """DSML tool calls of DeepSeek-V4.1 (``<｜DSML｜ calls>`` … ``</｜DSML｜ calls>``)."""

    def __init__(self) -> None:
        super().__init__()
        self.bot_token = CALLS_OPEN
        self.eot_token = CALLS_CLOSE
        self._parser: DsmlStreamParser | None = None

    def _forward_unknown(self) -> bool:
        return bool(envs.SGLANG_FORWARD_UNKNOWN_TOOLS.get())

    def has_tool_call(self, text: str) -> bool:
        return _HAS_CALL_RE.search(text) is not None

    def detect_and_parse(self, text: str, tools: List[Any]) -> StreamingParseResult:
        content, calls = parse_dsml(text, _tool_names(tools), forward_unknown=self._forward_unknown())
        return StreamingParseResult(
            normal_text=content,
            calls=[ToolCallItem(tool_index=c.index, name=c.name, parameters=c.arguments)
                   for c in calls])

    def parse_streaming_increment(self, new_text: str, tools: List[Any]) -> StreamingParseResult:
        if self._parser is None:
            self._parser = DsmlStreamParser(_tool_names(tools),
                                            forward_unknown=self._forward_unknown())
        content: list[str] = []
        items: list[ToolCallItem] = []
        for event in self._parser.feed(new_text):
            if isinstance(event, Content):
                content.append(event.text)
            elif isinstance(event, CallStart):
                self.current_tool_id = event.index
                self.prev_tool_call_arr.append({"name": event.name, "arguments": "{}"})
                self.streamed_args_for_tool.append("")
                items.append(ToolCallItem(tool_index=event.index, name=event.name, parameters=""))
            elif isinstance(event, ArgsDelta):
                self.streamed_args_for_tool[event.index] += event.text
                last = items[-1] if items else None
                if last is not None and last.name is None and last.tool_index == event.index:
                    last.parameters += event.text
                else:
                    items.append(ToolCallItem(tool_index=event.index, parameters=event.text))
        open_call = self._parser.closed_arguments()
        if open_call is not None:
            index, _emitted, final = open_call
            self.prev_tool_call_arr[index]["arguments"] = final
        for i, sent in enumerate(self.streamed_args_for_tool):
            if open_call is None or i != open_call[0]:
                self.prev_tool_call_arr[i]["arguments"] = sent
        return StreamingParseResult(normal_text="".join(content), calls=items)

    def supports_structural_tag(self) -> bool:
        return True

    def structure_info(self):
        def info(name: str) -> StructureInfo:
            return StructureInfo(begin=INVOKE_OPEN.format(name=name) + "\n", end=INVOKE_CLOSE,
                                 trigger=CALLS_OPEN)
        return info

    def get_structural_tag(self, tools=None, tool_choice="auto", thinking_mode: bool = False,
                           parallel_tool_calls: bool = True):
        return dsml_structural_tag(tools or [], tool_choice=tool_choice,
                                   parallel_tool_calls=parallel_tool_calls, reasoning=thinking_mode)

"""`register_api()`: put the DeepSeek-V4.1 chat API into SGLang 0.5.17 (spec `runtime.md` §B).

Called by the plugin entry point in every SGLang process, before argument parsing (the
``--reasoning-parser`` / ``--tool-call-parser`` choices are read from the registries when the
CLI is built). Idempotent.
"""
from __future__ import annotations

from .reasoning_parser import PARSER_NAMES as REASONING_PARSER_NAMES
from .reasoning_parser import DeepseekV41ReasoningDetector
from .tool_parser import PARSER_NAMES as TOOL_PARSER_NAMES
from .tool_parser import DeepseekV41DsmlDetector


def register_parsers() -> None:
    """Add the parsers under both spellings to SGLang's registries (clean extension points)."""
    from sglang.srt.function_call.function_call_parser import FunctionCallParser
    from sglang.srt.parser.reasoning_parser import ReasoningParser

    for name in REASONING_PARSER_NAMES:
        ReasoningParser.DetectorMap[name] = DeepseekV41ReasoningDetector
    for name in TOOL_PARSER_NAMES:
        FunctionCallParser.ToolCallParserEnum[name] = DeepseekV41DsmlDetector


def register_api() -> None:
    """Register the parsers and install (and verify) the ``api`` hooks of `sglang_dsv41.hooks`."""
    from .. import hooks

    register_parsers()
    hooks.install_hooks(("api",))

"""DSML grammar for constrained tool calls: an xgrammar structural tag that only admits
DeepSeek-V4.1's own call markup (spec `model.md` §6), used for ``tool_choice`` required / named
and for ``strict`` tools under ``auto``.

xgrammar 0.2.1 (SGLang 0.5.17's pin) ships structural tags for V3.2/V4 DSML only; their
``deepseek_xml`` parameter style hard-codes ``<｜DSML｜parameter`` without V4.1's space, so the
parameters are spelled out here from xgrammar's generic formats: each parameter is a tag whose
content is free text for ``string="true"`` and a JSON-schema value for ``string="false"``.

Invariants: the grammar accepts exactly what recipe renders for calls whose arguments follow
the tool schema (properties in schema order, optional ones may be omitted, one parameter per
line); ``required`` / named choices force at least one call (exactly the named tool), and
``parallel_tool_calls=false`` stops after the first call. Tests compile it with xgrammar and
run recipe-rendered replies through it.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from xgrammar.structural_tag import (
    AnyTextFormat,
    ConstStringFormat,
    JSONSchemaFormat,
    OptionalFormat,
    OrFormat,
    SequenceFormat,
    StructuralTag,
    TagFormat,
    TagsWithSeparatorFormat,
    TriggeredTagsFormat,
)

from .dsml import CALLS_CLOSE, CALLS_OPEN, INVOKE_CLOSE, INVOKE_OPEN, PARAM_CLOSE, PARAM_OPEN

THINK_END = "</think>"
CALLS_PREFIX = "\n\n"


def _param(name: str, schema: Any) -> Any:
    schema = schema if isinstance(schema, Mapping) else {}
    as_text = TagFormat(begin=PARAM_OPEN.format(name=name, string="true"),
                        content=AnyTextFormat(), end=PARAM_CLOSE)
    as_json = TagFormat(begin=PARAM_OPEN.format(name=name, string="false"),
                        content=JSONSchemaFormat(json_schema=dict(schema) or True), end=PARAM_CLOSE)
    kind = schema.get("type")
    kinds = set(kind) if isinstance(kind, list) else ({kind} if kind else set())
    if kinds == {"string"}:
        enum = schema.get("enum")
        if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
            as_text = TagFormat(begin=as_text.begin, end=PARAM_CLOSE,
                                content=OrFormat(elements=[ConstStringFormat(value=v) for v in enum]))
        return as_text
    if not kinds or "string" in kinds:
        return OrFormat(elements=[as_text, as_json])
    return as_json


def _invoke(function: Mapping[str, Any]) -> TagFormat:
    params = function.get("parameters") or {}
    props = params.get("properties") or {}
    required = set(params.get("required") or [])
    elements = []
    for name, schema in props.items():
        line = SequenceFormat(elements=[_param(name, schema), ConstStringFormat(value="\n")])
        elements.append(line if name in required else OptionalFormat(content=line))
    # recipe renders an invoke without arguments as "<open>\n\n</close>"
    no_args = ConstStringFormat(value="\n")
    if not elements:
        content: Any = no_args
    elif required:
        content = SequenceFormat(elements=elements)
    else:
        content = OrFormat(elements=[no_args, SequenceFormat(elements=elements)])
    return TagFormat(begin=INVOKE_OPEN.format(name=function["name"]) + "\n", content=content,
                     end=INVOKE_CLOSE + "\n")


def _function(tool: Any) -> Mapping[str, Any]:
    dumped = tool.model_dump() if hasattr(tool, "model_dump") else tool
    return dumped["function"]


def dsml_structural_tag(tools: Sequence[Any], *, tool_choice: Any, parallel_tool_calls: bool,
                        reasoning: bool) -> StructuralTag:
    """Structural tag for ``tool_choice`` ``"auto"`` (free text, calls optional), ``"required"``
    or a named choice (``{"function": {"name": ...}}`` or an object with ``.function.name``).

    ``reasoning``: prefix free text up to ``</think>`` (only when SGLang's reasoning grammar does
    not own the reasoning part). Raises ValueError for a named tool that is not declared.
    """
    functions = [_function(t) for t in tools]
    named = None
    if not isinstance(tool_choice, str):
        fn = tool_choice.get("function") if isinstance(tool_choice, Mapping) else tool_choice.function
        named = fn.get("name") if isinstance(fn, Mapping) else fn.name
        functions = [f for f in functions if f["name"] == named]
        if not functions:
            raise ValueError(f"tool_choice names {named!r}, which is not among the declared tools")
    if not functions:
        raise ValueError("a DSML tool grammar needs at least one declared tool")
    calls = TagFormat(
        begin=CALLS_OPEN + "\n",
        content=TagsWithSeparatorFormat(tags=[_invoke(f) for f in functions], separator="",
                                        at_least_one=True,
                                        stop_after_first=not parallel_tool_calls or named is not None),
        end=CALLS_CLOSE)
    if tool_choice == "auto":
        body: Any = TriggeredTagsFormat(triggers=[CALLS_OPEN], tags=[calls],
                                        stop_after_first=True)
    else:
        body = SequenceFormat(elements=[ConstStringFormat(value=CALLS_PREFIX), calls])
    if reasoning:
        body = SequenceFormat(elements=[TagFormat(begin="", content=AnyTextFormat(), end=THINK_END),
                                        body])
    return StructuralTag(format=body)

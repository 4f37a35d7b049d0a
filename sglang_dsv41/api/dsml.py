"""DSML tool-call markup of DeepSeek-V4.1: spellings and an incremental, chunking-invariant parser
(spec `model.md` §6 "Tools"; anchors §3 F — the failure shapes users report).

Format (as deepseek-recipe 0.2.0 renders it; note the space after ``｜DSML｜``)::

    \\n\\n<｜DSML｜ calls>
    <｜DSML｜ invoke name="get_weather">
    <｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>
    <｜DSML｜ parameter name="days" string="false">3</｜DSML｜ parameter>
    </｜DSML｜ invoke>
    </｜DSML｜ calls>

``string="true"`` values are raw text; ``string="false"`` values are JSON.

Why not deepseek-recipe's ``StreamProcessor``: on this format it emits arguments that are not
valid JSON (a malformed ``string="false"`` value is spliced in verbatim, an unterminated invoke
never gets its closing brace), drops text that follows the calls block, forwards calls to tools
that were never declared, and reports results as its own chunk JSON with its own call ids. This
parser fixes those shapes and maps 1:1 onto SGLang's detector contract; tests check it against
recipe's renderer (round trips) and against ``StreamProcessor`` on well-formed replies.

Invariants (tested, including a hypothesis property over random chunkings):

* Chunking-invariant: feeding a reply in any chunks (1 character included) and calling `finish`
  yields the same calls, the same final arguments and the same content as feeding it at once.
* Arguments are always a valid JSON object; the concatenation of a call's argument deltas is a
  prefix of its final arguments (equal once the invoke is closed or `finish` ran), and
  `closed_arguments` gives the final arguments at any point.
* DSML markup never reaches content or arguments: every ``<｜DSML｜…>`` / ``</｜DSML｜…>`` tag is
  consumed, including stray or unknown ones, and so is a bare ``｜DSML｜`` token (the model's
  special token without its ``<``: the tiny model emits it); a string value ends at the first
  DSML tag.
* Robust shapes: a bare ``invoke`` without ``calls``; a section or invoke left unterminated (end
  of stream closes it); a malformed sibling (bad JSON in a ``string="false"`` value becomes that
  raw text as a JSON string; an ``invoke`` tag without a name is skipped) never costs the other
  calls; text after ``</｜DSML｜ calls>`` stays content.
* Undeclared tool names are skipped (logged) unless ``forward_unknown`` (SGLang's
  ``SGLANG_FORWARD_UNKNOWN_TOOLS`` convention).
* Content whitespace right before a calls section is dropped; whitespace at the very end of the
  reply is only emitted by `finish` (SGLang's streaming path has no finish call for tool parsers).
"""
from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from typing import Iterable, Union

logger = logging.getLogger(__name__)

DSML_TOKEN = "｜DSML｜"
CALLS_OPEN = f"<{DSML_TOKEN} calls>"
CALLS_CLOSE = f"</{DSML_TOKEN} calls>"
INVOKE_OPEN = f'<{DSML_TOKEN} invoke name="{{name}}">'
INVOKE_CLOSE = f"</{DSML_TOKEN} invoke>"
PARAM_OPEN = f'<{DSML_TOKEN} parameter name="{{name}}" string="{{string}}">'
PARAM_CLOSE = f"</{DSML_TOKEN} parameter>"
BARE_INVOKE_PREFIX = f"<{DSML_TOKEN} invoke"
_TAG_PREFIXES = (f"<{DSML_TOKEN}", f"</{DSML_TOKEN}")
# what the scanner stops at: a tag, or the bare special token (dropped wherever it stands)
_MARKERS = (*_TAG_PREFIXES, DSML_TOKEN)
# section names of V3.2 / V4 accepted as aliases of V4.1's "calls"
_SECTION_NAMES = ("calls", "tool_calls", "function_calls")
_TAG_RE = re.compile(r"<(/?)" + DSML_TOKEN + r"\s*([A-Za-z_]+)(.*)>\Z", re.S)
_ATTR_RE = re.compile(r'([A-Za-z_]+)\s*=\s*"([^"]*)"')


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    name: str


@dataclass(frozen=True)
class ArgsDelta:
    index: int
    text: str


@dataclass(frozen=True)
class CallEnd:
    index: int
    name: str
    arguments: str


Event = Union[Content, CallStart, ArgsDelta, CallEnd]


def render_call(name: str, arguments: dict) -> str:
    """One invoke in recipe's layout (used by tests and docs; recipe is the reference)."""
    lines = [INVOKE_OPEN.format(name=name)]
    for key, value in arguments.items():
        is_str = isinstance(value, str)
        body = value if is_str else json.dumps(value, ensure_ascii=False)
        lines.append(PARAM_OPEN.format(name=key, string=str(is_str).lower()) + body + PARAM_CLOSE)
    lines.append(INVOKE_CLOSE)
    return "\n".join(lines)


def _partial_prefix_len(text: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a DSML marker."""
    best = 0
    for prefix in _MARKERS:
        for n in range(min(len(prefix) - 1, len(text)), 0, -1):
            if text.endswith(prefix[:n]):
                best = max(best, n)
                break
    return best


def _find_tag_start(text: str) -> int:
    hits = [i for i in (text.find(p) for p in _MARKERS) if i >= 0]
    return min(hits) if hits else -1


def _escape(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)[1:-1]


class _Call:
    """Argument JSON of one invoke as it is being emitted."""

    def __init__(self, index: int, name: str):
        self.index, self.name = index, name
        self.emitted = ""          # argument JSON already emitted as deltas
        self.param: str | None = None  # name of the open parameter
        self.param_is_string = False
        self.raw = ""              # buffered value of an open non-string parameter

    def _key(self, name: str) -> str:
        return ("{" if not self.emitted else ", ") + json.dumps(name, ensure_ascii=False) + ": "

    @staticmethod
    def _json_value(raw: str) -> tuple[str, bool]:
        """(JSON text, was valid JSON); invalid JSON is kept as a JSON string of the raw text."""
        try:
            return json.dumps(json.loads(raw), ensure_ascii=False), True
        except (json.JSONDecodeError, ValueError):
            return json.dumps(raw, ensure_ascii=False), False

    def open_param(self, name: str, is_string: bool) -> str:
        self.param, self.param_is_string, self.raw = name, is_string, ""
        if is_string:
            return self._key(name) + '"'
        return ""

    def value(self, text: str) -> str:
        if self.param_is_string:
            return _escape(text)
        self.raw += text
        return ""

    def close_param(self) -> str:
        if self.param is None:
            return ""
        name, self.param = self.param, None
        if self.param_is_string:
            return '"'
        value, valid = self._json_value(self.raw)
        if not valid:
            logger.warning("DSML parameter %r of %r is not valid JSON; passing it as a string",
                           name, self.name)
        return self._key(name) + value

    def closing_suffix(self, pending_value: str = "") -> str:
        """What `finish` would still append: the open parameter and the closing brace."""
        tail = ""
        if self.param is not None:
            if self.param_is_string:
                tail = _escape(pending_value) + '"'
            else:
                tail = self._key(self.param) + self._json_value(self.raw + pending_value)[0]
        if not self.emitted and not tail:
            return "{}"
        return tail + "}"


class DsmlStreamParser:
    """Incremental DSML parser: `feed` chunks, then `finish` once. See the module invariants."""

    def __init__(self, tool_names: Iterable[str] | None = None, *, forward_unknown: bool = False):
        self._tools = None if tool_names is None else set(tool_names)
        self._forward_unknown = forward_unknown
        self._buf = ""
        self._state = "content"    # content | section | invoke | param
        self._implicit_section = False
        self._skipping = False     # inside an invoke that is being skipped
        self._skip_param = False   # inside a parameter without a name
        self._section_ws = ""      # whitespace after a bare invoke, content if text follows
        self._pending_ws = ""      # trailing content whitespace held back
        self._call: _Call | None = None
        self._n_calls = 0
        self._finished = False

    # -- public -------------------------------------------------------------------------------
    def feed(self, text: str) -> list[Event]:
        if self._finished:
            raise RuntimeError("DsmlStreamParser.feed after finish")
        self._buf += text
        out: list[Event] = []
        progressing = True
        while progressing:
            progressing = self._step(out)
        return out

    def finish(self) -> list[Event]:
        if self._finished:
            return []
        self._finished = True
        out: list[Event] = []
        rest, self._buf = self._buf, ""
        if rest and not rest.startswith(_TAG_PREFIXES):  # a held-back "<" that was just text
            self._text(rest, out)
        if self._state == "param":
            self._close_param(out)
        if self._state == "invoke":
            self._close_invoke(out)
        if self._pending_ws:
            out.append(Content(self._pending_ws))
            self._pending_ws = ""
        return out

    def closed_arguments(self) -> tuple[int, str, str] | None:
        """(index, emitted, final) for the open call: ``final`` is what `finish` would make of it."""
        call = self._call
        if call is None or self._skipping:
            return None
        if self._skip_param:
            return call.index, call.emitted, call.emitted + ("}" if call.emitted else "{}")
        pending = self._buf if self._state == "param" and not self._buf.startswith(_TAG_PREFIXES) else ""
        return call.index, call.emitted, call.emitted + call.closing_suffix(pending)

    # -- scanning -----------------------------------------------------------------------------
    def _step(self, out: list[Event]) -> bool:
        buf = self._buf
        if not buf:
            return False
        start = _find_tag_start(buf)
        if start < 0:
            keep = _partial_prefix_len(buf)
            text, self._buf = buf[: len(buf) - keep], buf[len(buf) - keep:]
            if text:
                self._text(text, out)
            return False
        if start > 0:
            self._buf = buf[start:]
            self._text(buf[:start], out)
            return True
        if buf.startswith(DSML_TOKEN):  # a bare marker, outside any tag: never text
            logger.debug("dropping a bare %s token in state %s", DSML_TOKEN, self._state)
            self._buf = buf[len(DSML_TOKEN):]
            return True
        end = buf.find(">")
        if end < 0:
            return False  # incomplete tag: wait for more text
        self._buf = buf[end + 1:]
        self._tag(buf[: end + 1], out)
        return True

    def _text(self, text: str, out: list[Event]) -> None:
        state = self._state
        if state == "param":
            if not (self._skipping or self._skip_param):
                self._emit_args(self._call.value(text), out)
        elif state == "content":
            self._content(text, out)
        elif state == "section" and self._implicit_section:
            if not text.strip():
                self._section_ws += text
                return
            self._state, self._implicit_section = "content", False
            text, self._section_ws = self._section_ws + text, ""
            self._content(text, out)
        elif text.strip():
            logger.debug("dropping non-DSML text inside tool-call markup: %r", text)

    def _content(self, text: str, out: list[Event]) -> None:
        stripped = text.rstrip()
        if not stripped:
            self._pending_ws += text
            return
        out.append(Content(self._pending_ws + stripped))
        self._pending_ws = text[len(stripped):]

    # -- tags ---------------------------------------------------------------------------------
    def _tag(self, tag: str, out: list[Event]) -> None:
        match = _TAG_RE.match(tag)
        if match is None:
            logger.debug("dropping malformed DSML tag %r", tag)
            return
        self._section_ws = ""
        closing, kind, rest = match.group(1) == "/", match.group(2), match.group(3)
        attrs = dict(_ATTR_RE.findall(rest))
        kind = "calls" if kind in _SECTION_NAMES else kind
        state = self._state
        if state == "param":
            if not (closing and kind == "parameter"):
                self._close_param(out)
                self._tag(tag, out)  # a tag inside a value ends the value; re-handle it
                return
            self._close_param(out)
            return
        if kind == "calls":
            if closing:
                if state == "invoke":
                    self._close_invoke(out)
                if self._state != "content":
                    self._state, self._implicit_section = "content", False
            elif state == "content":
                self._pending_ws = ""
                self._state, self._implicit_section = "section", False
            return
        if kind == "invoke":
            if closing:
                if state == "invoke":
                    self._close_invoke(out)
                return
            if state == "invoke":
                self._close_invoke(out)
            elif state == "content":
                self._pending_ws = ""
                self._state, self._implicit_section = "section", True
            self._open_invoke(attrs.get("name"), out)
            return
        if kind == "parameter" and not closing and self._state == "invoke":
            name = attrs.get("name")
            if not name:
                logger.warning("dropping DSML parameter without a name: %r", tag)
                self._state, self._skip_param = "param", True
                return
            self._state, self._skip_param = "param", False
            if not self._skipping:
                is_string = attrs.get("string", "false").strip().lower() == "true"
                self._emit_args(self._call.open_param(name, is_string), out)
            return
        logger.debug("dropping stray DSML tag %r in state %s", tag, state)

    def _open_invoke(self, name: str | None, out: list[Event]) -> None:
        self._state = "invoke"
        known = name and (self._tools is None or name in self._tools)
        if not name or (not known and not self._forward_unknown):
            logger.warning("skipping DSML invoke of %s", f"undeclared tool {name!r}" if name
                           else "a tool without a name")
            self._skipping, self._call = True, None
            return
        self._skipping = False
        self._call = _Call(self._n_calls, name)
        self._n_calls += 1
        out.append(CallStart(self._call.index, name))

    def _close_param(self, out: list[Event]) -> None:
        self._state = "invoke"
        if self._skip_param:
            self._skip_param = False
            return
        if not self._skipping and self._call is not None:
            self._emit_args(self._call.close_param(), out)

    def _close_invoke(self, out: list[Event]) -> None:
        self._state = "section"
        call, self._call = self._call, None
        if self._skipping or call is None:
            self._skipping = False
            return
        self._emit_args(call.closing_suffix(), out, call)
        out.append(CallEnd(call.index, call.name, call.emitted))

    def _emit_args(self, text: str, out: list[Event], call: _Call | None = None) -> None:
        call = call or self._call
        if text and call is not None:
            call.emitted += text
            out.append(ArgsDelta(call.index, text))


def parse_dsml(text: str, tool_names: Iterable[str] | None = None, *,
               forward_unknown: bool = False) -> tuple[str, list[CallEnd]]:
    """One-shot parse: (content, completed calls). Same machine as streaming."""
    parser = DsmlStreamParser(tool_names, forward_unknown=forward_unknown)
    events = parser.feed(text) + parser.finish()
    content = "".join(e.text for e in events if isinstance(e, Content))
    return content, [e for e in events if isinstance(e, CallEnd)]

"""DSML tool-call parsing (spec `model.md` §6; anchors §3 F): the reported failure shapes,
chunking invariance (hypothesis), no markup leaks, render→parse round trips through
deepseek-recipe's renderer, agreement with recipe's StreamProcessor, and the DSML grammar."""
from __future__ import annotations

import json

import deepseek_recipe as dr
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang_dsv41.api.dsml import (
    ArgsDelta,
    CallEnd,
    CallStart,
    Content,
    DsmlStreamParser,
    parse_dsml,
    render_call,
)

TOOLS = ["get_weather", "search", "noargs"]
OPEN, CLOSE = "<｜DSML｜ calls>", "</｜DSML｜ calls>"


def inv(name: str, *params: str, close: bool = True) -> str:
    return f'<｜DSML｜ invoke name="{name}">\n' + "".join(p + "\n" for p in params) + (
        "</｜DSML｜ invoke>" if close else "")


def par(name: str, value: str, string: bool = True) -> str:
    return f'<｜DSML｜ parameter name="{name}" string="{str(string).lower()}">{value}</｜DSML｜ parameter>'


CITY = par("city", "Paris")
DAYS = par("days", "3", string=False)

# reply -> (content, [(name, arguments)])
SHAPES = {
    "plain": ("Just text, no tools.", "Just text, no tools.", []),
    "one call": (f"Sure.\n\n{OPEN}\n{inv('get_weather', CITY, DAYS)}\n{CLOSE}",
                 "Sure.", [("get_weather", {"city": "Paris", "days": 3})]),
    "two calls": (f"\n\n{OPEN}\n{inv('get_weather', CITY)}\n{inv('search', par('q', 'x y'))}\n{CLOSE}",
                  "", [("get_weather", {"city": "Paris"}), ("search", {"q": "x y"})]),
    "no arguments": (f"{OPEN}\n{inv('noargs')}\n{CLOSE}", "", [("noargs", {})]),
    "recipe empty invoke": (f'{OPEN}\n<｜DSML｜ invoke name="noargs">\n\n</｜DSML｜ invoke>\n{CLOSE}',
                            "", [("noargs", {})]),
    # sglang#40236: bare invoke / unterminated section / malformed sibling
    "bare invoke": (inv("get_weather", CITY), "", [("get_weather", {"city": "Paris"})]),
    "bare invoke then text": (inv("get_weather", CITY) + "\nDone.", "\nDone.",
                              [("get_weather", {"city": "Paris"})]),
    "two bare invokes": (inv("get_weather", CITY) + "\n" + inv("noargs"), "",
                         [("get_weather", {"city": "Paris"}), ("noargs", {})]),
    "unterminated section": (f"x\n\n{OPEN}\n{inv('get_weather', CITY)}\n", "x",
                             [("get_weather", {"city": "Paris"})]),
    "unterminated invoke": (f"{OPEN}\n{inv('get_weather', CITY, close=False)}", "",
                            [("get_weather", {"city": "Paris"})]),
    "truncated string value": (f'{OPEN}\n<｜DSML｜ invoke name="get_weather">\n'
                               '<｜DSML｜ parameter name="city" string="true">Par', "",
                               [("get_weather", {"city": "Par"})]),
    "truncated json value": (f'{OPEN}\n{inv("get_weather", CITY, close=False)}'
                             '<｜DSML｜ parameter name="opts" string="false">{"a": [1', "",
                             [("get_weather", {"city": "Paris", "opts": '{"a": [1'})]),
    "truncated inside a tag": (f"ok{OPEN}\n{inv('get_weather', CITY, close=False)}<｜DSML｜ param",
                               "ok", [("get_weather", {"city": "Paris"})]),
    "malformed json sibling": (f"{OPEN}\n{inv('get_weather', CITY)}\n"
                               f"{inv('search', par('q', '{bad', string=False))}\n{CLOSE}", "",
                               [("get_weather", {"city": "Paris"}), ("search", {"q": "{bad"})]),
    "nameless invoke sibling": (f'{OPEN}\n<｜DSML｜ invoke>\n{CITY}\n</｜DSML｜ invoke>\n'
                                f"{inv('noargs')}\n{CLOSE}", "", [("noargs", {})]),
    "nameless parameter": (f'{OPEN}\n{inv("get_weather", "<｜DSML｜ parameter>zz</｜DSML｜ parameter>", CITY)}\n{CLOSE}',
                           "", [("get_weather", {"city": "Paris"})]),
    "undeclared tool skipped": (f"{OPEN}\n{inv('rm_rf', par('path', '/'))}\n{inv('noargs')}\n{CLOSE}",
                                "", [("noargs", {})]),
    "text after calls": (f"{OPEN}\n{inv('noargs')}\n{CLOSE}\n\nAnything else?", "\n\nAnything else?",
                         [("noargs", {})]),
    "garbage inside section": (f"{OPEN}\nblah {inv('noargs')} blah\n{CLOSE}", "", [("noargs", {})]),
    "stray close tags": (f"a</｜DSML｜ parameter>b</｜DSML｜ invoke>c{CLOSE}d", "abcd", []),
    "unknown dsml tag": ("a<｜DSML｜ something x=\"1\">b", "ab", []),
    "value cut by a tag": (f"{OPEN}\n" + '<｜DSML｜ invoke name="search">\n'
                           '<｜DSML｜ parameter name="q" string="true">abc</｜DSML｜ invoke>', "",
                           [("search", {"q": "abc"})]),
    "v4 section name": (f"<｜DSML｜ tool_calls>\n{inv('noargs')}\n</｜DSML｜ tool_calls>", "",
                        [("noargs", {})]),
    "string looks like json": (f"{OPEN}\n{inv('search', par('q', '[1, 2]'))}\n{CLOSE}", "",
                               [("search", {"q": "[1, 2]"})]),
    "json types": (OPEN + "\n" + inv("search", par("a", "true", False), par("b", "null", False),
                                     par("c", " 1.5 ", False),
                                     par("d", '\n{"x": [1, {"y": "z"}]}', False)) + "\n" + CLOSE,
                   "", [("search", {"a": True, "b": None, "c": 1.5, "d": {"x": [1, {"y": "z"}]}})]),
    "lookalikes in content": ("use <｜DS and </ and < and ｜DSM freely", "use <｜DS and </ and < and ｜DSM freely", []),
    # issue 20: the special token without its "<" (the tiny model emits it) is never text
    "bare token in content": ("a ｜DSML｜b｜DSML｜", "a b", []),
    "bare token in a value": (f"{OPEN}\n{inv('search', par('q', 'x｜DSML｜y'))}\n{CLOSE}", "",
                              [("search", {"q": "xy"})]),
    "bare token before a call": (f"ok ｜DSML｜\n\n{OPEN}\n{inv('noargs')}\n{CLOSE}", "ok",
                                 [("noargs", {})]),
    "trailing partial": ("ends with <｜DSM", "ends with <｜DSM", []),
}


def run_stream(text: str, chunks: list[str] | None = None, tools=TOOLS, forward_unknown=False):
    parser = DsmlStreamParser(tools, forward_unknown=forward_unknown)
    events = []
    for chunk in (chunks if chunks is not None else list(text)):
        events += parser.feed(chunk)
    events += parser.finish()
    return events


def summarize(events):
    content = "".join(e.text for e in events if isinstance(e, Content))
    calls = [(e.name, json.loads(e.arguments)) for e in events if isinstance(e, CallEnd)]
    return content, calls


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_failure_shapes_one_shot(name):
    text, content, calls = SHAPES[name]
    got_content, got_calls = parse_dsml(text, TOOLS)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_failure_shapes_one_char_chunks(name):
    text, content, calls = SHAPES[name]
    events = run_stream(text)
    assert summarize(events) == (content, calls)
    check_event_invariants(events)


def test_undeclared_tool_forwarded_when_asked():
    text = f"{OPEN}\n{inv('rm_rf', par('path', '/'))}\n{CLOSE}"
    _, calls = parse_dsml(text, TOOLS, forward_unknown=True)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("rm_rf", {"path": "/"})]


def check_event_invariants(events):
    """Streamed deltas build the final arguments; no markup anywhere; indices are 0, 1, ..."""
    starts = [e for e in events if isinstance(e, CallStart)]
    assert [e.index for e in starts] == list(range(len(starts)))
    for call in (e for e in events if isinstance(e, CallEnd)):
        deltas = "".join(e.text for e in events if isinstance(e, ArgsDelta) and e.index == call.index)
        assert deltas == call.arguments
        assert isinstance(json.loads(call.arguments), dict)
    for e in events:
        text = getattr(e, "text", "") + getattr(e, "arguments", "")
        assert "｜DSML｜" not in text  # no tag, no bare token


def test_streaming_arguments_are_incremental():
    text = f"{OPEN}\n{inv('search', par('q', 'a long query string'))}\n{CLOSE}"
    events = run_stream(text)
    deltas = [e.text for e in events if isinstance(e, ArgsDelta)]
    assert len(deltas) > 10  # character by character, not one blob at the end
    assert "".join(deltas) == '{"q": "a long query string"}'


def test_closed_arguments_tracks_open_call():
    parser = DsmlStreamParser(TOOLS)
    parser.feed(f'{OPEN}\n<｜DSML｜ invoke name="search">\n<｜DSML｜ parameter name="q" string="true">ab<')
    index, emitted, final = parser.closed_arguments()
    assert (index, emitted, final) == (0, '{"q": "ab', '{"q": "ab<"}')
    parser.feed("｜DSML｜")  # now a tag prefix: the pending "<" is no longer value text
    assert parser.closed_arguments()[2] == '{"q": "ab"}'
    parser.feed(" parameter>\n</｜DSML｜ invoke>")
    assert parser.closed_arguments() is None


def test_feed_after_finish_is_an_error():
    parser = DsmlStreamParser(TOOLS)
    parser.finish()
    with pytest.raises(RuntimeError):
        parser.feed("x")


# --- property: any chunking parses like the one-shot parse -------------------------------------
SAFE_TEXT = st.text(alphabet=st.sampled_from(list("ab <>/\"{}[]:,\n\t=é日🙂｜DSMLpcin")), max_size=12)
PIECES = st.sampled_from([
    OPEN, CLOSE, "\n", "\n\n", inv("get_weather", CITY, DAYS), inv("noargs"), inv("nope", CITY),
    inv("search", par("q", "{bad", string=False)), '<｜DSML｜ invoke name="search">',
    par("q", "v"), "</｜DSML｜ invoke>", "</｜DSML｜ parameter>", '<｜DSML｜ parameter name="q" string="true">',
    "<｜DSML｜", "<｜DS", "<", "</", "<think>", "text ", "｜DSML｜", "｜DS",
])
REPLIES = st.lists(st.one_of(PIECES, SAFE_TEXT), max_size=12).map("".join)


@st.composite
def chunked(draw):
    text = draw(REPLIES)
    cuts = sorted(draw(st.sets(st.integers(0, len(text)), max_size=len(text))))
    bounds = [0, *cuts, len(text)]
    return text, [text[a:b] for a, b in zip(bounds, bounds[1:])]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chunked())
def test_any_chunking_equals_one_shot(case):
    text, chunks = case
    one_shot = parse_dsml(text, TOOLS)
    events = run_stream(text, chunks)
    content = "".join(e.text for e in events if isinstance(e, Content))
    calls = [e for e in events if isinstance(e, CallEnd)]
    assert (content, calls) == one_shot
    check_event_invariants(events)
    assert content == one_shot[0]


@settings(max_examples=100, deadline=None)
@given(REPLIES)
def test_one_char_chunks_equal_one_shot(text):
    events = run_stream(text)
    parser = DsmlStreamParser(TOOLS)
    whole = parser.feed(text) + parser.finish()
    assert summarize(events) == summarize(whole)


# --- render (deepseek-recipe) -> parse round trips ---------------------------------------------
JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6),
                         st.floats(allow_nan=False, allow_infinity=False, width=32),
                         st.text(max_size=8))
JSON_VALUES = st.recursive(JSON_SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=5), inner, max_size=3)), max_leaves=8)
STRING_VALUES = st.text(max_size=20).filter(lambda s: "｜DSML｜" not in s)
ARGS = st.dictionaries(st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True),
                       st.one_of(STRING_VALUES, JSON_VALUES), max_size=4)
CALLS = st.lists(st.tuples(st.sampled_from(TOOLS), ARGS), min_size=1, max_size=3)
ENCODING = dr.DeepseekV41Encoding()


def recipe_reply(calls, content="", thinking=False) -> str:
    """The assistant reply exactly as deepseek-recipe renders a historic tool-call turn."""
    message = dr.AssistantMessage(content, reasoning_content="r" if thinking else None, tool_calls=[
        dr.ToolCall(f"c{i}", name, json.dumps(args, ensure_ascii=False)) for i, (name, args) in enumerate(calls)])
    prompt = ENCODING.render_conversation(dr.Conversation(
        [dr.UserMessage("q"), message], thinking_mode=thinking,
        tools=[dr.ToolDefinition(n) for n in TOOLS])).prompt
    head = "<｜Assistant｜><think>r</think>" if thinking else "<｜Assistant｜></think>"
    start = prompt.index(head) + len(head)
    return prompt[start:prompt.index("<｜end▁of▁sentence｜>", start)]


def same_json(a, b) -> bool:
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


@settings(max_examples=150, deadline=None)
@given(CALLS, st.text(max_size=10).filter(lambda s: "｜DSML｜" not in s and "<" not in s))
def test_recipe_render_parse_round_trip(calls, content):
    reply = recipe_reply(calls, content)
    for events in (run_stream(reply), run_stream(reply, [reply])):
        got_content, got_calls = summarize(events)
        assert got_content == content.rstrip() or (not content.strip() and got_content == "")
        assert len(got_calls) == len(calls)
        for (name, args), (got_name, got_args) in zip(calls, got_calls):
            assert got_name == name and same_json(got_args, args)


def test_our_renderer_matches_recipe():
    args = {"city": "Paris", "days": 3, "opts": {"u": "c"}}
    assert render_call("get_weather", args) in recipe_reply([("get_weather", args)])


# --- agreement with deepseek-recipe's own response parser on well-formed replies ---------------
def recipe_stream_calls(reply: str) -> list[tuple[str, dict]]:
    body = {"model": "DeepSeek-V4.1-Flash", "messages": [{"role": "user", "content": "q"}],
            "stream": True, "thinking": {"type": "disabled"},
            "tools": [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
                      for n in TOOLS]}
    request = dr.ChatCompletionRequest(body).convert(dr.ConversionOptions())
    processor = dr.StreamProcessor(dr.ChatCompletionRequest.chunk_generator(request, "id", "m"),
                                   dr.ParsingOptions(parse_tool_calls=True))
    out = processor.push(dr.InferenceChunk.ready()) + processor.push(dr.InferenceChunk.text(reply, 1))
    out += processor.push(dr.InferenceChunk.finish(dr.InferenceFinishReason.Stop)) + processor.finish()
    calls: dict[int, list] = {}
    for chunk in out:
        for choice in json.loads(chunk.to_json()).get("choices", []):
            for tc in (choice.get("delta") or {}).get("tool_calls") or []:
                entry = calls.setdefault(tc["index"], [None, ""])
                entry[0] = tc["function"].get("name") or entry[0]
                entry[1] += tc["function"].get("arguments") or ""
    return [(name, json.loads(args)) for name, args in (calls[i] for i in sorted(calls))]


@settings(max_examples=60, deadline=None)
@given(CALLS)
def test_agrees_with_recipe_stream_processor(calls):
    reply = recipe_reply(calls, "Sure.")
    ours = summarize(run_stream(reply))[1]
    theirs = recipe_stream_calls(reply)
    assert len(ours) == len(theirs)
    for (n1, a1), (n2, a2) in zip(ours, theirs):
        assert n1 == n2 and same_json(a1, a2)


# --- the DSML grammar admits what recipe renders (xgrammar) ------------------------------------
GRAMMAR_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "required": ["city"], "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"},
            "unit": {"type": "string", "enum": ["c", "f"]}, "opts": {"type": "object"}}}}},
    {"type": "function", "function": {"name": "noargs", "parameters": {"type": "object", "properties": {}}}},
    {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"q": {}, "n": {"type": ["integer", "string"]}}}}},
]


@pytest.fixture(scope="module")
def grammar_check():
    import xgrammar
    from xgrammar.testing import _is_grammar_accept_string

    from sglang_dsv41.api.dsml_grammar import dsml_structural_tag

    def check(tool_choice, parallel, text, reasoning=False):
        tag = dsml_structural_tag(GRAMMAR_TOOLS, tool_choice=tool_choice,
                                  parallel_tool_calls=parallel, reasoning=reasoning)
        return _is_grammar_accept_string(xgrammar.Grammar.from_structural_tag(tag.model_dump_json()), text)
    return check


R_ONE = [("get_weather", {"city": "Paris", "days": 3, "unit": "c", "opts": {"k": [1]}})]
R_MANY = [("get_weather", {"city": "Paris"}), ("noargs", {}), ("search", {"q": "x"}), ("search", {"n": 2})]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize("choice,parallel,calls,prefix,ok", [
    ("required", True, R_ONE, "", True),
    ("required", True, R_MANY, "", True),
    ("required", False, R_MANY, "", False),       # parallel_tool_calls=false: one call only
    ("required", True, R_ONE, "Sure.", False),    # required: no free text before the calls
    ("required", True, [("get_weather", {"days": 3})], "", False),   # missing required param
    ("required", True, [("get_weather", {"city": "P", "unit": "k"})], "", False),  # enum
    ("required", True, [("get_weather", {"city": "P", "days": "three"})], "", False),  # type
    (NAMED, True, R_ONE, "", True),
    (NAMED, True, [("noargs", {})], "", False),   # named: only that tool
    ("auto", True, R_MANY, "Sure.", True),
])
def test_grammar_on_recipe_renderings(grammar_check, choice, parallel, calls, prefix, ok):
    assert grammar_check(choice, parallel, prefix + recipe_reply(calls)) is ok


def test_grammar_required_rejects_plain_text_and_allows_reasoning_prefix(grammar_check):
    assert not grammar_check("required", True, "The weather is nice.")
    assert grammar_check("auto", True, "The weather is nice.")
    assert grammar_check("required", True, "let me think</think>" + recipe_reply(R_ONE), reasoning=True)


def test_grammar_named_tool_must_exist():
    from sglang_dsv41.api.dsml_grammar import dsml_structural_tag

    with pytest.raises(ValueError, match="not among the declared tools"):
        dsml_structural_tag(GRAMMAR_TOOLS, tool_choice={"function": {"name": "zz"}},
                            parallel_tool_calls=True, reasoning=False)


def test_grammar_accepts_model_token_ids_with_dsml_special_token(tmp_path):
    """Token level, with a real HF tokenizer: ``｜DSML｜`` is one special token in the model's
    output, and xgrammar must let it through; plain text is refused under ``required``."""
    import xgrammar
    from transformers import PreTrainedTokenizerFast

    from sglang_dsv41.api.dsml_grammar import dsml_structural_tag
    from sglang_dsv41.api.prompt_tokens import PromptTokenEncoder
    from sglang_dsv41.checkpoint.tokenizer import build_tiny_tokenizer

    tok = PreTrainedTokenizerFast.from_pretrained(str(build_tiny_tokenizer(tmp_path)))
    encoder = PromptTokenEncoder(tok)
    compiler = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok)))
    tag = dsml_structural_tag(GRAMMAR_TOOLS, tool_choice="required", parallel_tool_calls=True,
                              reasoning=False)
    compiled = compiler.compile_structural_tag(tag.model_dump_json())
    reply = recipe_reply(R_ONE)
    pieces = reply.split("｜DSML｜")
    ids = [i for n, piece in enumerate(pieces) for i in
           encoder.encode_plain(piece) + ([encoder.special_id("｜DSML｜")] if n < len(pieces) - 1 else [])]
    assert ids.count(encoder.special_id("｜DSML｜")) == reply.count("｜DSML｜")
    matcher = xgrammar.GrammarMatcher(compiled)
    assert all(matcher.accept_token(t) for t in ids)
    assert matcher.accept_token(tok.eos_token_id) and matcher.is_terminated()
    refusing = xgrammar.GrammarMatcher(compiled)
    assert not refusing.accept_token(encoder.encode_plain("Sure")[0])

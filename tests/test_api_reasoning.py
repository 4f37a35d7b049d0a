"""Reasoning/content splitting of DeepSeek-V4.1 replies (spec `model.md` §6; anchors §3 F:
vllm#48645 misrouting without </think>, vllm#45862 tool calls inside reasoning)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_dsv41.api.dsml import parse_dsml
from sglang_dsv41.api.think import ThinkSplitter, split_reasoning

CALL = ('\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="f">\n<｜DSML｜ parameter name="a" '
        'string="true">1</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n</｜DSML｜ calls>')

# (reply, thinking, continue_content) -> (reasoning, content)
CASES = [
    ("Let me compute.</think>323", True, False, ("Let me compute.", "323")),
    ("\n\nLet me compute.</think>323", True, False, ("Let me compute.", "323")),  # leading newlines
    ("<think>\nr</think>c", True, False, ("r", "c")),                            # repeated <think>
    ("only reasoning, cut by max_tokens", True, False, ("only reasoning, cut by max_tokens", "")),
    ("r</think>", True, False, ("r", "")),
    ("</think>c", True, False, ("", "c")),
    ("a</think>b</think>c", True, False, ("a", "b</think>c")),                   # first one ends it
    # thinking off: a reply without tags is content, never reasoning (vllm#48645)
    ("The answer is 323.", False, False, ("", "The answer is 323.")),
    ("The answer </think> is 323.", False, False, ("", "The answer </think> is 323.")),
    ("</think>323", False, False, ("", "323")),                                  # repeated </think>
    ("<think>hmm</think>323", False, False, ("hmm", "323")),                     # explicit block
    ("<thinking is not a tag", False, False, ("", "<thinking is not a tag")),
    ("<thin", False, False, ("", "<thin")),
    ("", False, False, ("", "")),
    ("", True, False, ("", "")),
    # continuing a prefilled assistant message in thinking mode
    (" more content", True, True, ("", " more content")),
    ("more reasoning</think>content", True, False, ("more reasoning", "content")),
]


@pytest.mark.parametrize("reply,thinking,cont,want", CASES)
def test_split_table(reply, thinking, cont, want):
    assert split_reasoning(reply, thinking=thinking, continue_content=cont) == want


def test_tool_call_inside_reasoning_is_recovered():
    """vllm#45862: the model opens a calls block before closing </think>."""
    reasoning, content = split_reasoning("I should call f." + CALL, thinking=True)
    assert reasoning == "I should call f.\n\n"
    assert content == CALL.lstrip("\n")
    text, calls = parse_dsml(content, ["f"])
    assert text == "" and [(c.name, c.arguments) for c in calls] == [("f", '{"a": "1"}')]


def test_tool_call_after_reasoning():
    reasoning, content = split_reasoning("think</think>" + CALL, thinking=True)
    assert reasoning == "think" and content == CALL


def test_bare_invoke_inside_reasoning():
    bare = '<｜DSML｜ invoke name="f">\n</｜DSML｜ invoke>'
    assert split_reasoning("hmm " + bare, thinking=True) == ("hmm ", bare)


def test_stream_reasoning_false_releases_in_one_piece():
    splitter = ThinkSplitter(thinking=True, stream_reasoning=False)
    outs = [splitter.feed(c) for c in ["abc", "def</th", "ink>xyz"]]
    assert outs == [("", ""), ("", ""), ("abcdef", "xyz")]
    truncated = ThinkSplitter(thinking=True, stream_reasoning=False)
    assert truncated.feed("abc") == ("", "")
    assert truncated.finish() == ("abc", "")


def test_finish_twice_and_feed_after_finish():
    splitter = ThinkSplitter(thinking=True)
    splitter.feed("x")
    splitter.finish()
    assert splitter.finish() == ("", "")
    with pytest.raises(RuntimeError):
        splitter.feed("y")


PIECES = st.sampled_from(["<think>", "</think>", "<", "</", "</th", "<thi", "\n", "\n\n",
                          "<｜DSML｜ calls>", "<｜DSML｜", "<｜DS", "text", " ", "é🙂"])
REPLIES = st.lists(st.one_of(PIECES, st.text(max_size=6)), max_size=10).map("".join)


@st.composite
def chunked(draw):
    text = draw(REPLIES)
    cuts = sorted(draw(st.sets(st.integers(0, len(text)), max_size=len(text))))
    bounds = [0, *cuts, len(text)]
    return text, [text[a:b] for a, b in zip(bounds, bounds[1:])]


@settings(max_examples=300, deadline=None)
@given(chunked(), st.booleans(), st.booleans(), st.booleans())
def test_any_chunking_equals_one_shot(case, thinking, cont, stream_reasoning):
    text, chunks = case
    splitter = ThinkSplitter(thinking=thinking, continue_content=cont, stream_reasoning=stream_reasoning)
    reasoning = content = ""
    for chunk in chunks:
        r, c = splitter.feed(chunk)
        reasoning, content = reasoning + r, content + c
    r, c = splitter.finish()
    assert (reasoning + r, content + c) == split_reasoning(text, thinking=thinking, continue_content=cont)


@settings(max_examples=200, deadline=None)
@given(REPLIES)
def test_thinking_off_never_swallows_untagged_text(text):
    reasoning, content = split_reasoning(text, thinking=False)
    if not text.startswith("<think>"):
        assert reasoning == ""
        assert content == (text[len("</think>"):] if text.startswith("</think>") else text)


# --- the SGLang detector: no DSML markup in reasoning, nor in content without a tool parser -----
# "｜" only inside whole markers: dropping a tag between "｜DS" and "ML｜" would join them (the
# dropped-markup guarantee is about the markers the model emits, which are single tokens)
DETECTOR_PIECES = st.sampled_from(["</think>", "<think>", "｜DSML｜", "<｜DSML｜ calls>",
                                   "</｜DSML｜ calls>", '<｜DSML｜ invoke name="f">', "</｜DSML｜ invoke>",
                                   "<", "\n\n", "text", " "])
DETECTOR_REPLIES = st.lists(st.one_of(DETECTOR_PIECES, st.text(
    alphabet=st.characters(blacklist_characters="｜"), max_size=4)), max_size=10).map("".join)


def _detector(thinking: bool, tool_parser_runs: bool):
    from sglang_dsv41.api.reasoning_parser import DeepseekV41ReasoningDetector

    detector = DeepseekV41ReasoningDetector(force_reasoning=thinking)
    detector.set_tool_parser_runs(tool_parser_runs)
    return detector


@pytest.mark.parametrize("thinking,tools,reply,want", [
    (False, False, "The answer｜DSML｜ is 323.｜DSML｜", ("", "The answer is 323.")),
    (True, False, "Hmm｜DSML｜ ok</think>323", ("Hmm ok", "323")),
    (True, False, "Hmm｜DSML｜ still thinking", ("Hmm still thinking", "")),
    (True, False, "I call f." + CALL, ("I call f.\n\n", "")),           # undeclared call: skipped
    (False, False, "a</｜DSML｜ invoke>b\n\n<｜DSML｜ calls>\n</｜DSML｜ calls> c", ("", "ab c")),
    # a tool parser reads the content: markup stays for it (bare tokens are its business too)
    (True, True, "r｜DSML｜</think>x" + CALL, ("r", "x" + CALL)),
    (False, True, "x｜DSML｜y", ("", "x｜DSML｜y")),
])
def test_detector_drops_dsml_markup(thinking, tools, reply, want):
    result = _detector(thinking, tools).detect_and_parse(reply)
    assert (result.reasoning_text, result.normal_text) == want


@settings(max_examples=300, deadline=None)
@given(DETECTOR_REPLIES, st.data(), st.booleans(), st.booleans())
def test_detector_any_chunking_equals_one_shot(text, data, thinking, tools):
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=len(text))))
    bounds = [0, *cuts, len(text)]
    detector = _detector(thinking, tools)
    reasoning = content = ""
    for a, b in zip(bounds, bounds[1:]):
        out = detector.parse_streaming_increment(text[a:b])
        reasoning, content = reasoning + out.reasoning_text, content + out.normal_text
    end = detector.finish()
    whole = _detector(thinking, tools).detect_and_parse(text)
    assert (reasoning + end.reasoning_text, content + end.normal_text) == (whole.reasoning_text,
                                                                          whole.normal_text)
    assert "｜DSML｜" not in whole.reasoning_text
    if not tools:
        assert "｜DSML｜" not in whole.normal_text

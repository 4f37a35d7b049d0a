"""The tiny tokenizer: ids of the special tokens, round trips, determinism, recipe compatibility."""
from __future__ import annotations

from pathlib import Path

import pytest

from sglang_dsv41.checkpoint import tokenizer as T

TEXTS = [
    "Hello, world! The quick brown fox.",
    "numbers 0 7 42 1234567 3.14159 -8e-3",
    "def f(x):\n    return x ** 2  # code\n\ttab",
    "café naïve 日本語 Ελληνικά 🙂🚀 \u00a0nbsp",
    "",
    "   leading and trailing spaces   ",
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return T.build_tiny_tokenizer(tmp_path_factory.mktemp("tiny_tok"))


def test_files_and_determinism(tok_dir: Path, tmp_path: Path):
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (tok_dir / name).is_file()
    again = T.build_tiny_tokenizer(tmp_path / "again")  # BPE retrained from scratch
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (tok_dir / name).read_bytes() == (again / name).read_bytes(), name


def test_special_ids_with_tokenizers_library(tok_dir: Path):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    assert tok.get_vocab_size(with_added_tokens=True) == 1024
    want = {
        0: "<｜begin▁of▁sentence｜>", 1: "<｜end▁of▁sentence｜>", 2: "<｜▁pad▁｜>",
        999: "<｜mask｜>", 1000: "<｜deepseek_image｜>",
    }
    for i, s in want.items():
        assert tok.id_to_token(i) == s
        assert tok.token_to_id(s) == i
    chat = ["<｜System｜>", "<｜User｜>", "<｜Assistant｜>", "<｜latest_reminder｜>", "<think>", "</think>", "｜DSML｜"]
    for s in chat:
        i = tok.token_to_id(s)
        assert i is not None and 1001 <= i <= 1023, s
        # a special spelling in text encodes to exactly its id (added vocabulary)
        assert tok.encode(s, add_special_tokens=False).ids == [i]
    added = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    assert set(want.values()) | set(chat) <= added
    # ids are contiguous: 0..1023 all map to a token
    assert all(tok.id_to_token(i) is not None for i in range(1024))
    # regular vocabulary fills 3..998 (not special)
    assert all(i not in tok.get_added_tokens_decoder() for i in range(3, 999))


@pytest.mark.parametrize("text", TEXTS)
def test_roundtrip_tokenizers(tok_dir: Path, text: str):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    enc = tok.encode(text)
    assert enc.ids[:1] == [0]  # BOS added by the post-processor, like DeepSeek's tokenizer
    assert all(0 <= i < 1024 for i in enc.ids)
    assert tok.decode(enc.ids[1:]) == text
    assert tok.decode(enc.ids, skip_special_tokens=True) == text


def test_autotokenizer_loads_and_roundtrips(tok_dir: Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    assert tok.is_fast
    assert len(tok) == 1024
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2)
    assert tok.convert_tokens_to_ids("<｜deepseek_image｜>") == 1000
    assert tok.convert_tokens_to_ids("<｜mask｜>") == 999
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
    ids = tok.encode("<｜User｜>hi<｜Assistant｜>")
    assert ids[0] == 0 and ids[1] == tok.convert_tokens_to_ids("<｜User｜>")
    # BPE actually merges: common words are single tokens
    assert len(tok.encode(" the", add_special_tokens=False)) == 1


def _conversations():
    import deepseek_recipe as d

    tool = d.ToolDefinition("get_weather", "Look up the weather",
                            {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}})
    call = d.ToolCall("call_1", "get_weather", '{"city": "Paris", "days": 2}')
    img = "<｜deepseek_image｜>"
    return [
        d.Conversation([d.UserMessage("hi")]),
        d.Conversation([d.UserMessage("hi")], thinking_mode=False),
        d.Conversation(
            [d.SystemMessage("be brief"),
             d.UserMessage(f"look {img} here", [d.BytesImageSource(b"\x89PNG")], image_token=img),
             d.AssistantMessage("calling", "need weather", [call]),
             d.ToolMessage("sunny", "call_1"),
             d.LatestReminderMessage("answer in French"),
             d.UserMessage("and tomorrow?")],
            tools=[tool], reasoning_effort="max"),
    ]


def test_recipe_renders_only_known_special_tokens(tok_dir: Path):
    import deepseek_recipe as d

    enc = d.DeepseekV41Encoding().with_special_tokens(d.SpecialTokens(image=T.IMAGE_TOKEN))
    rtok = d.Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    enc_tok = enc.with_tokenizer(rtok)
    table = {s: i for i, s in T.special_token_table().items()}
    seen: set[str] = set()
    for conv in _conversations():
        rendered = enc.render_conversation(conv)
        spans = [rendered.prompt[a:b] for a, b in rendered.special_ranges]
        seen.update(spans)
        for s in spans:
            assert s in table, f"recipe renders {s!r}, which the tiny tokenizer lacks"
        ids = enc_tok.encode(conv)
        assert ids[0] == 0
        # every rendered special span became exactly its id, in order
        assert [i for i in ids if i in table.values()] == [table[s] for s in spans]
    assert {"<｜User｜>", "<｜Assistant｜>", "<｜System｜>", "<think>", "</think>", "｜DSML｜",
            "<｜latest_reminder｜>", "<｜deepseek_image｜>", "<｜end▁of▁sentence｜>"} <= seen


def test_recipe_special_token_kinds_all_present():
    import deepseek_recipe as d

    table = set(T.special_token_table().values())
    for kind in ("Bos", "Eos", "ThinkingStart", "ThinkingEnd", "System", "User", "Assistant", "LatestReminder",
                 "Dsml", "Ref", "RefEnd", "Box", "BoxEnd", "Point", "PointEnd", "Polygon", "PolygonEnd"):
        assert getattr(d.SpecialToken, kind).default_str() in table, kind


def test_engram_compressed_vocab_size(tok_dir: Path):
    from sglang_dsv41.engram_hash import compressed_token_map

    n = T.engram_compressed_vocab_size(tok_dir)
    mapping, size = compressed_token_map(tok_dir)
    assert n == size and 1 < n < 1024 and len(mapping) == 1024


def test_general_layout_for_flash_sized_vocab():
    table = T.special_token_table(129280, 128799, 129264)
    assert sorted(table) == [0, 1, 2] + list(range(999, 129280))  # with BPE 3..998: every id exists
    assert table[128799] == T.MASK_TOKEN and table[129264] == T.IMAGE_TOKEN
    assert [table[i] for i in range(999, 999 + len(T.CHAT_SPECIAL_TOKENS))] == list(T.CHAT_SPECIAL_TOKENS)
    assert len(set(table.values())) == len(table)
    tiny = T.special_token_table()
    assert sorted(tiny) == [0, 1, 2] + list(range(999, 1024))
    assert tiny[1001] == "<｜System｜>" and tiny[1022].startswith("<｜place▁holder▁no▁")
    with pytest.raises(ValueError, match="image_token_id"):
        T.special_token_table(1024, 999, 5)
    with pytest.raises(ValueError, match="differ"):
        T.special_token_table(1024, 999, 999)

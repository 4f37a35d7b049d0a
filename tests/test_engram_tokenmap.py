"""Engram compressed token map and its normaliser (spec §3.3.1, §8 item 16)."""

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from sglang_dsv41.engram_hash import compressed_token_map, engram_normalizer, token_map_key


@pytest.mark.parametrize("text, expected", [
    ("Café", "cafe"),                      # StripAccents after NFD
    ("ÉCOLE", "ecole"),                    # Lowercase
    ("Ñandú\r\nÅngström", "nandu angstrom"),
    ("  a \t\n b  ", "a b"),               # whitespace runs collapse, then Strip
    (" ", " "),                            # a lone space survives (U+E000 sentinel)
    ("  ", " "),                           # a run of spaces becomes a lone space
    ("\n", " "),
    ("\t\t", " "),
    ("\r\n", " "),
    (" x", "x"),
    ("x ", "x"),
    ("\ufb01", "fi"),                      # NFKC ligature
    ("\uff21", "a"),                       # NFKC full-width letter
    ("\u3000", " "),                       # NFKC ideographic space → lone space
    (" \u00a0 ", " "),                     # NBSP → space, run collapses
    ("\u0301", ""),                        # bare combining accent strips to empty
    ("ß", "ß"),                            # Lowercase does not case-fold
    ("\ue000", " "),                       # a literal U+E000 ends up as a space too
])
def test_normaliser_handpicked(text, expected):
    assert engram_normalizer().normalize_str(text) == expected


def test_key_rules():
    n = engram_normalizer()
    assert token_map_key("\u0301", "x", n) == "\u0301"          # empty after normalising → raw text
    assert token_map_key("ab\ufffd", "Ã", n) == "Ã"              # U+FFFD → vocabulary string
    assert token_map_key(" Café", " Café", n) == "cafe"
    with pytest.raises(ValueError):
        token_map_key("\ufffd", None, n)


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2 style printable alphabet for byte-level BPE vocabularies."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _bl(data: bytes) -> str:
    table = _byte_to_unicode()
    return "".join(table[b] for b in data)


#: (vocabulary bytes, expected compressed id) in token-id order, after the 3 specials.
_TOKENS: list[tuple[bytes, int]] = [
    ("Café".encode(), 3),          # "cafe"
    (b"cafe", 3),
    (b"CAFE", 3),
    (b" cafe", 3),
    (b" ", 4),                     # lone space
    (b"  ", 4),
    (b"\n\n", 4),
    (b"\t", 4),
    (b"\xc3", 5),                  # partial UTF-8 → U+FFFD → raw vocabulary string "Ã"
    (b"\xa9", 6),                  # partial → raw "©"
    ("©".encode(), 6),             # decodes to "©", normalises to "©": same key as the raw one
    ("é".encode(), 7),             # "e"
    (b"E", 7),
    ("\u0301".encode(), 8),        # normalises to empty → raw text "\u0301"
    (b"ab", 9),
    (b"AB ", 9),
]


def _tiny_hf_tokenizer() -> PreTrainedTokenizerFast:
    specials = ["<bos>", "<eos>", "<pad>"]
    vocab = {s: i for i, s in enumerate(specials)}
    for data, _ in _TOKENS:
        vocab[_bl(data)] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                                 pad_token="<pad>", clean_up_tokenization_spaces=False)
    hf.add_special_tokens({"additional_special_tokens": ["<image>"]})
    return hf


def _expected() -> np.ndarray:
    return np.array([0, 1, 2] + [cid for _, cid in _TOKENS] + [10], dtype=np.int64)


def test_compressed_token_map_first_seen_order():
    hf = _tiny_hf_tokenizer()
    assert len(hf) == 3 + len(_TOKENS) + 1
    mapping, v_c = compressed_token_map(hf)
    assert mapping.dtype == np.int64 and mapping.shape == (len(hf),)
    np.testing.assert_array_equal(mapping, _expected())
    assert v_c == 11


def test_compressed_token_map_from_directory(tmp_path):
    hf = _tiny_hf_tokenizer()
    hf.save_pretrained(tmp_path)
    mapping, v_c = compressed_token_map(str(tmp_path))
    np.testing.assert_array_equal(mapping, _expected())
    assert v_c == 11


def test_compressed_token_map_rejects_bad_inputs(tmp_path):
    with pytest.raises(FileNotFoundError):
        compressed_token_map(str(tmp_path / "missing"))
    with pytest.raises(TypeError):
        compressed_token_map(object())

"""Rendered prompt → token ids, with special tokens only where the renderer put them
(spec `model.md` §6: "The encoder tokenises special-token spans with the added vocabulary and
plain text without it").

Invariant: a span in `special_ranges` becomes exactly one id (the tokenizer's id for that
spelling; unknown spelling → error), and every other character is encoded by the tokenizer's
model *without* its added vocabulary. So text a user typed that merely looks like a special
token (``<｜User｜>``, ``｜DSML｜``, ``<｜deepseek_image｜>``) stays plain text: it can neither start
a turn, nor a tool call, nor an image span.

Why not deepseek-recipe's ``DeepseekV41Encoding.encode``: it performs the same encoding, but
only for prompts it rendered itself, and the card's integer effort has to be spliced into the
rendered text first (see `encoding.py`). `tests/test_api_encoding.py` checks that both encoders
give identical ids on every prompt recipe can render on its own.
"""
from __future__ import annotations

import json
from typing import Any, Sequence

from tokenizers import Tokenizer


def backend_tokenizer(tokenizer: Any) -> Tokenizer:
    """The `tokenizers.Tokenizer` behind an HF fast tokenizer (or the object itself)."""
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if isinstance(backend, Tokenizer):
        return backend
    raise TypeError(
        f"DeepSeek-V4.1 prompt encoding needs a Hugging Face *fast* tokenizer (tokenizer.json); "
        f"got {type(tokenizer).__name__} without a `backend_tokenizer`")


class PromptTokenEncoder:
    """Encodes ``(text, special_ranges)`` pairs; built once per server tokenizer."""

    def __init__(self, tokenizer: Any):
        full = backend_tokenizer(tokenizer)
        self._full = full
        data = json.loads(full.to_str())
        data["added_tokens"] = []  # plain text never matches the added vocabulary
        self._plain = Tokenizer.from_str(json.dumps(data))
        self._special_ids: dict[str, int] = {}

    def special_id(self, spelling: str) -> int:
        """Id of a special-token spelling; KeyError naming it when the tokenizer lacks it."""
        cached = self._special_ids.get(spelling)
        if cached is not None:
            return cached
        token_id = self._full.token_to_id(spelling)
        if token_id is None:
            raise KeyError(f"the tokenizer has no token {spelling!r}, which the DeepSeek-V4.1 "
                           "prompt format needs (is this the model's tokenizer?)")
        self._special_ids[spelling] = token_id
        return token_id

    def encode_plain(self, text: str) -> list[int]:
        """Plain text → ids without the added vocabulary and without BOS/EOS."""
        if not text:
            return []
        return list(self._plain.encode(text, add_special_tokens=False).ids)

    def encode(self, text: str, special_ranges: Sequence[tuple[int, int]]) -> list[int]:
        """The prompt's ids. ``special_ranges``: ascending, disjoint (start, end) str offsets."""
        ids: list[int] = []
        cursor = 0
        for start, end in special_ranges:
            if not cursor <= start < end <= len(text):
                raise ValueError(f"special range ({start}, {end}) is not ascending/disjoint "
                                 f"within a prompt of {len(text)} characters")
            ids.extend(self.encode_plain(text[cursor:start]))
            ids.append(self.special_id(text[start:end]))
            cursor = end
        ids.extend(self.encode_plain(text[cursor:]))
        return ids

"""Engram n-gram hash layout and row-id hashing (spec §3.3.1).

Shared by the CPU reference and the GPU runtime: pure numpy / torch, no model code.

Pieces, in the order of spec §3.3.1:

* `compressed_token_map(tokenizer)` — token id → compressed id (normalised-text classes,
  first-seen order). Flash must give 99,092 classes.
* `engram_multipliers(V_c, layer_id, max_ngram)` — the odd per-shift multipliers m_{ℓ,s}.
* `engram_primes(...)` / `engram_offsets(...)` — per-column table sizes (primes) and the
  exclusive prefix-sum row offsets inside each layer's table.
* `EngramHasher` — vectorised (torch int64) row ids [T, columns] for a chunk of one or more
  requests, plus the per-request history update; chunked hashing equals one-shot hashing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

#: Token ids ≥ this are multimodal hash pads; with vision they are read as image_token_id (§3.1).
MULTIMODAL_PAD_ID_BASE = 1_000_000

#: Seed stride of the per-layer multiplier generator (spec §3.3.1).
MULTIPLIER_SEED_STRIDE = 10007

# --------------------------------------------------------------------------------------------
# Compressed token map
# --------------------------------------------------------------------------------------------

_SPACE_SENTINEL = "\ue000"


def engram_normalizer() -> Any:
    """The `tokenizers` normaliser sequence of spec §3.3.1 (exactly this order):
    NFKC → NFD → StripAccents → Lowercase → Replace(/[ \\t\\r\\n]+/ → " ") →
    Replace(/^ $/ → U+E000) → Strip → Replace(U+E000 → " ")."""
    from tokenizers import Regex, normalizers

    return normalizers.Sequence([
        normalizers.NFKC(),
        normalizers.NFD(),
        normalizers.StripAccents(),
        normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
        normalizers.Replace(Regex(r"^ $"), _SPACE_SENTINEL),
        normalizers.Strip(),
        normalizers.Replace(_SPACE_SENTINEL, " "),
    ])


def _load_fast_tokenizer(tokenizer: Any) -> Any:
    """Accept an HF fast tokenizer object or a path to a tokenizer directory."""
    if isinstance(tokenizer, (str, os.PathLike)):
        from transformers import AutoTokenizer

        path = os.fspath(tokenizer)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"tokenizer directory not found: {path}")
        tokenizer = AutoTokenizer.from_pretrained(path)
    if not getattr(tokenizer, "is_fast", False):
        raise TypeError(
            f"compressed_token_map needs an HF fast tokenizer (PreTrainedTokenizerFast), got "
            f"{type(tokenizer).__name__}")
    return tokenizer


def token_map_key(decoded: str, raw_token: str | None, normalizer: Any) -> str:
    """The class key of one token (spec §3.3.1): the raw vocabulary string when the decoded
    text contains U+FFFD, else the normalised text (the decoded text if that is empty)."""
    if "\ufffd" in decoded:
        if raw_token is None:
            raise ValueError(f"token decodes to {decoded!r} (has U+FFFD) but has no vocabulary string")
        return raw_token
    normalised = normalizer.normalize_str(decoded)
    return normalised if normalised else decoded


def compressed_token_map(tokenizer: Any) -> tuple[np.ndarray, int]:
    """Token id → compressed id for every id in 0..len(tokenizer)−1 (spec §3.3.1).

    Each id is decoded alone (`skip_special_tokens=False`); keys are assigned compressed ids
    in first-seen order of ascending token id. Returns (int64 array [len(tokenizer)], V_c).
    `tokenizer` is an HF fast tokenizer or a path to a tokenizer directory.
    """
    tok = _load_fast_tokenizer(tokenizer)
    normalizer = engram_normalizer()
    n = len(tok)
    ids = list(range(n))
    decoded = tok.batch_decode([[i] for i in ids], skip_special_tokens=False)
    raw = tok.convert_ids_to_tokens(ids)
    mapping = np.empty(n, dtype=np.int64)
    classes: dict[str, int] = {}
    for i in ids:
        key = token_map_key(decoded[i], raw[i], normalizer)
        cid = classes.get(key)
        if cid is None:
            cid = len(classes)
            classes[key] = cid
        mapping[i] = cid
    return mapping, len(classes)


# --------------------------------------------------------------------------------------------
# Multipliers
# --------------------------------------------------------------------------------------------

def engram_multiplier_bound(compressed_vocab: int) -> int:
    """bound = max(1, ⌊(2⁶³−1)/V_c⌋ // 2) (spec §3.3.1): keeps c·m < 2⁶³ for c < V_c."""
    if compressed_vocab < 1:
        raise ValueError(f"compressed vocab size must be ≥ 1, got {compressed_vocab}")
    return max(1, ((2**63 - 1) // compressed_vocab) // 2)


def engram_multipliers(compressed_vocab: int, layer_id: int, max_ngram: int) -> np.ndarray:
    """m_{ℓ,s} = 2·v_s + 1, v = default_rng(10007·ℓ).integers(0, bound, (max_ngram,), int64)
    (spec §3.3.1). Index s is the shift (s = 0 is the token itself)."""
    bound = engram_multiplier_bound(compressed_vocab)
    rng = np.random.default_rng(MULTIPLIER_SEED_STRIDE * layer_id)
    v = rng.integers(low=0, high=bound, size=(max_ngram,), dtype=np.int64)
    return v * 2 + 1


# --------------------------------------------------------------------------------------------
# Primes and table layout
# --------------------------------------------------------------------------------------------

_MR_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)


def is_prime(n: int) -> bool:
    """Deterministic Miller–Rabin, exact for n < 3.3·10²⁴ (covers every int64)."""
    if n < 2:
        return False
    for p in _MR_BASES:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d //= 2
        r += 1
    for a in _MR_BASES:
        x = pow(a, d, n)
        if x == 1 or x == n - 1:
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def engram_primes(engram_vocab_size: int, n_heads: int, max_ngram: int, n_layers: int) -> list[list[int]]:
    """Per Engram layer, the table size (a prime) of every hash column in column order
    c = (n−2)·n_heads + h (spec §3.3.1).

    One global used set; for each layer and each n-gram size n = 2..max_ngram the cursor
    restarts at engram_vocab_size−1 and the next n_heads unused primes strictly above it are
    taken.
    """
    if engram_vocab_size < 1 or n_heads < 1 or max_ngram < 2 or n_layers < 0:
        raise ValueError(
            f"bad Engram layout arguments: vocab={engram_vocab_size}, heads={n_heads}, "
            f"max_ngram={max_ngram}, layers={n_layers}")
    used: set[int] = set()
    layers: list[list[int]] = []
    for _ in range(n_layers):
        columns: list[int] = []
        for _n in range(2, max_ngram + 1):
            cursor = engram_vocab_size - 1
            for _h in range(n_heads):
                candidate = cursor + 1
                while candidate in used or not is_prime(candidate):
                    candidate += 1
                used.add(candidate)
                columns.append(candidate)
                cursor = candidate
        layers.append(columns)
    return layers


def engram_offsets(primes: Sequence[Sequence[int]]) -> list[list[int]]:
    """Per layer, the first table row of each column: exclusive prefix sum of that layer's
    primes in column order (spec §3.3.1)."""
    out: list[list[int]] = []
    for layer in primes:
        acc, offs = 0, []
        for p in layer:
            offs.append(acc)
            acc += int(p)
        out.append(offs)
    return out


def engram_table_rows(primes: Sequence[Sequence[int]]) -> list[int]:
    """Rows of each layer's table (= config `engram_num_embeddings`)."""
    return [sum(int(p) for p in layer) for layer in primes]

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


# --------------------------------------------------------------------------------------------
# Vectorised hashing
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class EngramLayerHash:
    """Hash constants of one Engram layer: column primes/offsets (column order) and the
    per-shift multipliers m_{ℓ,s}, s = 0..max_ngram−1 (spec §3.3.1)."""

    layer_id: int
    primes: torch.Tensor       # int64 [columns]
    offsets: torch.Tensor      # int64 [columns]
    multipliers: torch.Tensor  # int64 [max_ngram]


class EngramHasher:
    """Row ids [T, columns] of every Engram layer for a chunk of tokens (spec §3.3.1).

    Tokens of a chunk are grouped per request, contiguous and in position order; request b
    contributes `extend_lens[b]` tokens (one request when `extend_lens` is None). `history`
    [B, max_ngram−1] holds each request's last committed (remapped) ids before this chunk,
    oldest first; slots for positions < 0 are ignored (those look-backs are blocked).
    Hashing a sequence in any split (prefill chunks, single decode tokens) with
    `update_history` between the pieces gives the same rows as hashing it in one shot.
    """

    def __init__(self, token_map: np.ndarray | torch.Tensor, layers: Sequence[EngramLayerHash],
                 *, max_ngram: int, n_heads: int, pad_token_id: int, image_token_id: int | None):
        if isinstance(token_map, torch.Tensor):
            self.token_map = token_map.to(torch.int64)
        else:
            self.token_map = torch.from_numpy(np.asarray(token_map, dtype=np.int64))
        if self.token_map.ndim != 1 or self.token_map.numel() == 0:
            raise ValueError("token_map must be a non-empty 1-D array")
        vocab = self.token_map.numel()
        if not 0 <= pad_token_id < vocab:
            raise ValueError(f"engram pad token id {pad_token_id} outside the token map ({vocab} ids)")
        if image_token_id is not None and not 0 <= image_token_id < vocab:
            raise ValueError(
                f"image_token_id {image_token_id} outside the token map ({vocab} ids): the tokenizer "
                "must contain the image token (spec §12)")
        self.layers = tuple(layers)
        self.max_ngram = int(max_ngram)
        self.n_heads = int(n_heads)
        self.pad_token_id = int(pad_token_id)
        self.image_token_id = image_token_id
        for layer in self.layers:
            if layer.primes.numel() != self.num_columns or layer.multipliers.numel() != self.max_ngram:
                raise ValueError(f"Engram layer {layer.layer_id}: constants do not match "
                                 f"{self.num_columns} columns / max_ngram {self.max_ngram}")
        # n-gram size of each column, as the index into the cumulative hash (H_n at n−1).
        self._column_ngram_index = (torch.arange(self.num_columns, device=self.token_map.device)
                                    // self.n_heads + 1)

    @property
    def num_columns(self) -> int:
        return (self.max_ngram - 1) * self.n_heads

    @property
    def history_len(self) -> int:
        return self.max_ngram - 1

    @classmethod
    def from_config(cls, cfg: Any, token_map: np.ndarray | torch.Tensor) -> "EngramHasher":
        """Build from a `DeepseekV41Config` and the tokenizer's compressed token map. Checks the
        map against `engram_compressed_vocab_size` and the primes against
        `engram_num_embeddings`; image blocking is on only when the model has vision."""
        t = cfg.text
        tm = np.asarray(token_map, dtype=np.int64)
        v_c = int(tm.max()) + 1
        if v_c != t.engram_compressed_vocab_size:
            raise ValueError(f"token map has {v_c} compressed ids, config says "
                             f"engram_compressed_vocab_size={t.engram_compressed_vocab_size}")
        primes = engram_primes(t.engram_vocab_size, t.engram_n_heads, t.engram_max_ngram_size,
                               len(t.engram_layer_ids))
        rows = engram_table_rows(primes)
        if tuple(rows) != tuple(t.engram_num_embeddings):
            raise ValueError(f"Engram primes give table rows {rows}, config says "
                             f"engram_num_embeddings={list(t.engram_num_embeddings)}")
        layers = [
            EngramLayerHash(
                layer_id=lid,
                primes=torch.tensor(p, dtype=torch.int64),
                offsets=torch.tensor(o, dtype=torch.int64),
                multipliers=torch.from_numpy(engram_multipliers(v_c, lid, t.engram_max_ngram_size)),
            )
            for lid, p, o in zip(t.engram_layer_ids, primes, engram_offsets(primes))
        ]
        return cls(tm, layers, max_ngram=t.engram_max_ngram_size, n_heads=t.engram_n_heads,
                   pad_token_id=t.engram_pad_token_id,
                   image_token_id=cfg.image_token_id if cfg.has_vision else None)

    def to(self, device: torch.device | str) -> "EngramHasher":
        """A copy with every constant on `device`."""
        layers = [EngramLayerHash(l.layer_id, l.primes.to(device), l.offsets.to(device),
                                  l.multipliers.to(device)) for l in self.layers]
        return EngramHasher(self.token_map.to(device), layers, max_ngram=self.max_ngram,
                            n_heads=self.n_heads, pad_token_id=self.pad_token_id,
                            image_token_id=self.image_token_id)

    # ---- window ----------------------------------------------------------------------------
    def _segments(self, num_tokens: int, history: torch.Tensor, extend_lens: torch.Tensor | None,
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(history [B, K] int64, request index per token [T], first token index per request [B],
        tokens per request [B])."""
        dev = history.device
        if history.ndim == 1:
            history = history.unsqueeze(0)
        if history.ndim != 2 or history.shape[1] != self.history_len:
            raise ValueError(f"history must be [B, {self.history_len}], got {tuple(history.shape)}")
        history = history.to(torch.int64)
        if extend_lens is None:
            if history.shape[0] != 1:
                raise ValueError("extend_lens is required when history holds several requests")
            lens = torch.tensor([num_tokens], dtype=torch.int64, device=dev)
        else:
            lens = torch.as_tensor(extend_lens, dtype=torch.int64, device=dev).reshape(-1)
            if lens.numel() != history.shape[0]:
                raise ValueError(f"{lens.numel()} extend_lens for {history.shape[0]} history rows")
            if int(lens.sum()) != num_tokens or bool((lens < 0).any()):
                raise ValueError(f"extend_lens {lens.tolist()} do not partition {num_tokens} tokens")
        starts = torch.cumsum(lens, 0) - lens
        req = torch.repeat_interleave(torch.arange(lens.numel(), device=dev), lens, output_size=num_tokens)
        return history, req, starts, lens

    def _read_id(self, ids: torch.Tensor) -> torch.Tensor:
        """With vision, multimodal pad ids (≥ 1,000,000) read as image_token_id (spec §3.1)."""
        if self.image_token_id is None:
            return ids
        return torch.where(ids >= MULTIMODAL_PAD_ID_BASE, torch.full_like(ids, self.image_token_id), ids)

    def image_rows(self, token_ids: torch.Tensor) -> torch.Tensor | None:
        """Tokens the Engram gate leaves unchanged (spec §3.3.2): remapped id == image_token_id;
        None when the model has no vision."""
        if self.image_token_id is None:
            return None
        return self._read_id(token_ids.reshape(-1).to(torch.int64)) == self.image_token_id

    def window(self, token_ids: torch.Tensor, positions: torch.Tensor, history: torch.Tensor,
               extend_lens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(tok [T, M], blocked [T, M]): tok[t, s] is the s-th predecessor of token t in its
        request (s = 0 is t itself), blocked[t, s] = p_t < s, or-ed (with vision) with the
        cumulative image mask along s."""
        ids = token_ids.reshape(-1).to(torch.int64)
        pos = positions.reshape(-1).to(torch.int64)
        if pos.numel() != ids.numel():
            raise ValueError(f"{ids.numel()} token ids but {pos.numel()} positions")
        hist, req, starts, _ = self._segments(ids.numel(), history.to(ids.device), extend_lens)
        k, dev = self.history_len, ids.device
        shifts = torch.arange(self.max_ngram, device=dev)
        index = torch.arange(ids.numel(), device=dev)
        local = index - starts[req]                      # index inside the request's chunk
        back = local[:, None] - shifts[None, :]          # ≥ 0: in this chunk; −k..−1: history
        in_chunk = back >= 0
        from_chunk = ids[(index[:, None] - shifts[None, :]).clamp(min=0)]
        from_hist = hist[req[:, None], (back + k).clamp(min=0, max=k - 1)]
        tok = self._read_id(torch.where(in_chunk, from_chunk, from_hist))
        blocked = pos[:, None] < shifts[None, :]
        if self.image_token_id is not None:
            blocked = blocked | (torch.cumsum((tok == self.image_token_id).to(torch.int32), dim=1) > 0)
        return tok, blocked

    def compressed_window(self, token_ids: torch.Tensor, positions: torch.Tensor, history: torch.Tensor,
                          extend_lens: torch.Tensor | None = None, *, validate: bool = True) -> torch.Tensor:
        """c [T, M]: token_map[pad] where blocked, else token_map[tok] (spec §3.3.1).
        `validate` checks every unblocked id lies in the token map (a host sync on GPU)."""
        tok, blocked = self.window(token_ids, positions, history, extend_lens)
        tok = torch.where(blocked, torch.full_like(tok, self.pad_token_id), tok)
        if validate and tok.numel() and (int(tok.min()) < 0 or int(tok.max()) >= self.token_map.numel()):
            raise ValueError(f"Engram: token id outside the token map [0, {self.token_map.numel()}) "
                             f"(min {int(tok.min())}, max {int(tok.max())})")
        return self.token_map.to(tok.device)[tok]

    def layer_row_ids(self, compressed: torch.Tensor, layer: EngramLayerHash) -> torch.Tensor:
        """Row ids [T, columns] of one layer: H₁ = P₀, H_n = H_{n−1} XOR P_{n−1},
        row_c = H_n mod prime_c + offset_c with P_s = c_s·m_{ℓ,s} (int64)."""
        products = compressed * layer.multipliers[None, :]
        hashes = [products[:, 0]]
        for s in range(1, self.max_ngram):
            hashes.append(torch.bitwise_xor(hashes[-1], products[:, s]))
        cumulative = torch.stack(hashes, dim=1)           # [T, M]: column n−1 holds H_n
        per_column = cumulative[:, self._column_ngram_index]
        return torch.remainder(per_column, layer.primes[None, :]) + layer.offsets[None, :]

    def row_ids(self, token_ids: torch.Tensor, positions: torch.Tensor, history: torch.Tensor,
                extend_lens: torch.Tensor | None = None, *, validate: bool = True) -> list[torch.Tensor]:
        """Row ids [T, columns] for every Engram layer, in `engram_layer_ids` order."""
        c = self.compressed_window(token_ids, positions, history, extend_lens, validate=validate)
        return [self.layer_row_ids(c, layer) for layer in self.layers]

    def new_history(self, batch_size: int = 1, device: torch.device | str = "cpu") -> torch.Tensor:
        """Empty history [B, K] (pad ids; every slot is blocked by position at the start)."""
        return torch.full((batch_size, self.history_len), self.pad_token_id, dtype=torch.int64, device=device)

    def update_history(self, history: torch.Tensor, token_ids: torch.Tensor,
                       extend_lens: torch.Tensor | None = None) -> torch.Tensor:
        """History after committing `token_ids` (same layout as `row_ids`): each request's
        last K ids of (old history ++ its chunk), oldest first. Returns a new tensor."""
        ids = token_ids.reshape(-1).to(torch.int64)
        squeeze = history.ndim == 1
        hist, _, starts, lens = self._segments(ids.numel(), history.to(ids.device), extend_lens)
        k, dev = self.history_len, ids.device
        ext = lens[:, None] + torch.arange(k, device=dev)[None, :]   # index into (history ++ chunk)
        from_hist = hist.gather(1, ext.clamp(max=k - 1))
        if ids.numel() == 0:
            out = from_hist
        else:
            from_chunk = ids[(starts[:, None] + ext - k).clamp(min=0, max=ids.numel() - 1)]
            out = torch.where(ext < k, from_hist, from_chunk)
        return out[0] if squeeze else out

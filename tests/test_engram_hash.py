"""Engram row-id hashing (spec §3.3.1): vectorised torch vs a slow pure-Python reading of the
spec text, blocked look-back, cumulative image blocking, chunked/decode == one-shot, batching."""

import random

import numpy as np
import pytest
import torch

from sglang_dsv41.config import DeepseekV41Config
from sglang_dsv41.engram_hash import (
    EngramHasher, engram_multipliers, engram_offsets, engram_primes,
)
from sglang_dsv41.presets import flash_config_dict, tiny_config_dict

MAX_NGRAM, HEADS, PAD, IMAGE, VOCAB = 4, 2, 2, 1000, 1024
LAYER_IDS = (1, 3)


def _token_map(seed: int = 0) -> np.ndarray:
    """A token map with collisions (several ids per class), V_c = 700."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 700, size=VOCAB).astype(np.int64)


def _hasher(image_token_id: int | None = IMAGE, seed: int = 0) -> EngramHasher:
    from sglang_dsv41.engram_hash import EngramLayerHash
    tm = _token_map(seed)
    v_c = int(tm.max()) + 1
    primes = engram_primes(61, HEADS, MAX_NGRAM, len(LAYER_IDS))
    layers = [EngramLayerHash(lid, torch.tensor(p), torch.tensor(o),
                              torch.from_numpy(engram_multipliers(v_c, lid, MAX_NGRAM)))
              for lid, p, o in zip(LAYER_IDS, primes, engram_offsets(primes))]
    return EngramHasher(tm, layers, max_ngram=MAX_NGRAM, n_heads=HEADS, pad_token_id=PAD,
                        image_token_id=image_token_id)


def slow_rows(seq: list[int], token_map: np.ndarray, layer_id: int, layer_index: int,
              image_token_id: int | None) -> list[list[int]]:
    """Spec §3.3.1, token by token, in plain Python ints (whole request from position 0)."""
    v_c = int(token_map.max()) + 1
    mult = [int(m) for m in engram_multipliers(v_c, layer_id, MAX_NGRAM)]
    primes = engram_primes(61, HEADS, MAX_NGRAM, len(LAYER_IDS))[layer_index]
    offsets = engram_offsets([primes])[0]
    out = []
    for p in range(len(seq)):
        image_seen = False
        c = []
        for s in range(MAX_NGRAM):
            blocked = p < s
            if not blocked:
                tok = seq[p - s]
                if image_token_id is not None and tok >= 1_000_000:
                    tok = image_token_id
                if image_token_id is not None and tok == image_token_id:
                    image_seen = True
                blocked = image_seen
            c.append(int(token_map[PAD]) if blocked else int(token_map[tok]))
        products = [c[s] * mult[s] for s in range(MAX_NGRAM)]
        assert all(0 <= x < 2**63 for x in products)
        h = products[0]
        row = []
        for n in range(2, MAX_NGRAM + 1):
            h ^= products[n - 1]
            for head in range(HEADS):
                col = (n - 2) * HEADS + head
                row.append(h % primes[col] + offsets[col])
        out.append(row)
    return out


def _random_seq(rng: random.Random, length: int, image_rate: float) -> list[int]:
    seq = []
    for _ in range(length):
        r = rng.random()
        if r < image_rate / 2:
            seq.append(IMAGE)
        elif r < image_rate:
            seq.append(1_000_000 + rng.randrange(10**6))   # multimodal pad id
        else:
            seq.append(rng.randrange(VOCAB))
    return seq


def _one_shot(h: EngramHasher, seq: list[int]) -> list[torch.Tensor]:
    ids = torch.tensor(seq)
    return h.row_ids(ids, torch.arange(len(seq)), h.new_history())


@pytest.mark.parametrize("seed", range(6))
def test_vectorised_matches_slow_spec(seed):
    rng = random.Random(seed)
    h = _hasher()
    seq = _random_seq(rng, rng.randrange(1, 60), image_rate=0.15 if seed % 2 else 0.0)
    rows = _one_shot(h, seq)
    for li, lid in enumerate(LAYER_IDS):
        assert rows[li].dtype == torch.int64 and rows[li].shape == (len(seq), 6)
        assert rows[li].tolist() == slow_rows(seq, h.token_map.numpy(), lid, li, IMAGE)


def test_vectorised_matches_slow_spec_flash_constants():
    """Flash-sized multipliers and primes: the int64 products use all 63 bits."""
    cfg = DeepseekV41Config.from_dict(flash_config_dict())
    rng = np.random.default_rng(5)
    tm = rng.permutation(np.arange(129280) % 99092).astype(np.int64)
    h = EngramHasher.from_config(cfg, tm)
    seq = [int(x) for x in rng.integers(0, 129280, size=40)] + [129264, 5, 6, 7]
    rows = _one_shot(h, seq)
    primes = engram_primes(16000000, 8, 4, 2)
    for li, lid in enumerate((1, 14)):
        mult = [int(m) for m in engram_multipliers(99092, lid, 4)]
        offsets = engram_offsets(primes)[li]
        for p in (0, 1, 3, 20, 43):
            c = [int(tm[2]) if (p < s or 129264 in seq[max(p - s, 0): p + 1]) else int(tm[seq[p - s]])
                 for s in range(4)]
            hsh, want = c[0] * mult[0], []
            for n in range(2, 5):
                hsh ^= c[n - 1] * mult[n - 1]
                want += [hsh % primes[li][(n - 2) * 8 + k] + offsets[(n - 2) * 8 + k] for k in range(8)]
            assert rows[li][p].tolist() == want
        assert int(rows[li].max()) < [384006168, 384016682][li]


def test_blocked_lookback_at_positions_0_to_2():
    h = _hasher(image_token_id=None)
    seq = [10, 11, 12, 13, 14]
    tok, blocked = h.window(torch.tensor(seq), torch.arange(5), h.new_history())
    assert blocked.tolist() == [
        [False, True, True, True],
        [False, False, True, True],
        [False, False, False, True],
        [False, False, False, False],
        [False, False, False, False],
    ]
    assert tok[4].tolist() == [14, 13, 12, 11]
    # Blocked look-backs hash as the pad token: position 0 == a real pad-pad-pad prefix.
    c = h.compressed_window(torch.tensor(seq), torch.arange(5), h.new_history())
    pad_c = int(h.token_map[PAD])
    assert c[0].tolist() == [int(h.token_map[10]), pad_c, pad_c, pad_c]
    assert c[2].tolist() == [int(h.token_map[12]), int(h.token_map[11]), int(h.token_map[10]), pad_c]
    # The history's contents are ignored where positions block them.
    junk = torch.tensor([[999, 998, 997]])
    for li, rows in enumerate(h.row_ids(torch.tensor(seq), torch.arange(5), junk)):
        assert torch.equal(rows, _one_shot(h, seq)[li])


def test_image_blocking_is_cumulative_along_shift():
    h = _hasher()
    seq = [10, 11, IMAGE, 13, 14, 15, 1_000_007]
    tok, blocked = h.window(torch.tensor(seq), torch.arange(7), h.new_history())
    assert blocked[2].tolist() == [True, True, True, True]      # s = 0 is the image token itself
    assert blocked[3].tolist() == [False, True, True, True]     # s = 1 hits the image; s = 2, 3 too
    assert blocked[4].tolist() == [False, False, True, True]
    assert blocked[5].tolist() == [False, False, False, True]
    assert blocked[6].tolist() == [True, True, True, True]      # multimodal pad id reads as image
    assert tok[6, 0].item() == IMAGE
    # Without vision the image id is an ordinary token (nothing blocked beyond positions).
    h_text = _hasher(image_token_id=None)
    _, blocked_text = h_text.window(torch.tensor(seq[:6]), torch.arange(6), h_text.new_history())
    assert not blocked_text[3:].any()
    with pytest.raises(ValueError):   # ids ≥ 1,000,000 are outside the token map without vision
        h_text.row_ids(torch.tensor(seq), torch.arange(7), h_text.new_history())


def _chunked(h: EngramHasher, seq: list[int], cuts: list[int]) -> list[torch.Tensor]:
    hist = h.new_history()[0]
    pieces: list[list[torch.Tensor]] = []
    bounds = [0] + cuts + [len(seq)]
    for a, b in zip(bounds[:-1], bounds[1:]):
        chunk = torch.tensor(seq[a:b], dtype=torch.int64)
        pieces.append(h.row_ids(chunk, torch.arange(a, b), hist))
        hist = h.update_history(hist, chunk)
    return [torch.cat([p[li] for p in pieces]) for li in range(len(LAYER_IDS))]


@pytest.mark.parametrize("seed", range(5))
def test_chunked_and_decode_equal_one_shot(seed):
    rng = random.Random(100 + seed)
    h = _hasher()
    seq = _random_seq(rng, 40, image_rate=0.1)
    one_shot = _one_shot(h, seq)
    random_cuts = sorted(rng.sample(range(1, 40), rng.randrange(1, 8)))
    decode_tail = list(range(33, 40))                      # prefill 33 then decode one at a time
    every_token = list(range(1, 40))
    for cuts in (random_cuts, [1], [2], [3], decode_tail, every_token):
        chunked = _chunked(h, seq, cuts)
        for li in range(len(LAYER_IDS)):
            assert torch.equal(chunked[li], one_shot[li]), cuts


def test_update_history_layout():
    h = _hasher()
    hist = torch.tensor([7, 8, 9])
    assert h.update_history(hist, torch.tensor([1])).tolist() == [8, 9, 1]
    assert h.update_history(hist, torch.tensor([1, 2])).tolist() == [9, 1, 2]
    assert h.update_history(hist, torch.tensor([1, 2, 3, 4, 5])).tolist() == [3, 4, 5]
    assert h.update_history(hist, torch.tensor([], dtype=torch.int64)).tolist() == [7, 8, 9]
    batched = h.update_history(torch.tensor([[7, 8, 9], [4, 5, 6]]), torch.tensor([1, 2, 3]),
                               torch.tensor([1, 2]))
    assert batched.tolist() == [[8, 9, 1], [6, 2, 3]]


def test_batched_requests_equal_per_request():
    """Requests never see each other's tokens; a ragged batch equals per-request calls."""
    rng = random.Random(7)
    h = _hasher()
    seqs = [_random_seq(rng, n, 0.1) for n in (12, 1, 9, 30)]
    cuts = [5, 0, 4, 29]                 # already-committed prefix length of each request
    hist = h.new_history(len(seqs))
    for b, (seq, cut) in enumerate(zip(seqs, cuts)):
        hist[b] = h.update_history(hist[b], torch.tensor(seq[:cut], dtype=torch.int64))
    ids = torch.tensor([x for seq, cut in zip(seqs, cuts) for x in seq[cut:]])
    pos = torch.tensor([p for seq, cut in zip(seqs, cuts) for p in range(cut, len(seq))])
    lens = torch.tensor([len(seq) - cut for seq, cut in zip(seqs, cuts)])
    rows = h.row_ids(ids, pos, hist, lens)
    start = 0
    for seq, cut in zip(seqs, cuts):
        full = _one_shot(h, seq)
        n = len(seq) - cut
        for li in range(len(LAYER_IDS)):
            assert torch.equal(rows[li][start:start + n], full[li][cut:])
        start += n
    new_hist = h.update_history(hist, ids, lens)
    for b, seq in enumerate(seqs):
        assert new_hist[b].tolist()[-min(3, len(seq)):] == seq[-3:][-min(3, len(seq)):]


def test_from_config_checks():
    tm = _token_map()
    v_c = int(tm.max()) + 1
    cfg = DeepseekV41Config.from_dict(tiny_config_dict(v_c))
    h = EngramHasher.from_config(cfg, tm)
    assert h.image_token_id == 1000 and h.num_columns == 6 and [l.layer_id for l in h.layers] == [1, 3]
    assert [l.offsets.tolist() for l in h.layers] == engram_offsets(engram_primes(61, 2, 4, 2))
    with pytest.raises(ValueError, match="compressed"):
        EngramHasher.from_config(DeepseekV41Config.from_dict(tiny_config_dict(v_c + 1)), tm)
    with pytest.raises(ValueError, match="image_token_id"):
        EngramHasher.from_config(cfg, tm[:1000])           # the tokenizer must hold the image id
    d = tiny_config_dict(v_c)
    d["text_config"]["engram_num_embeddings"] = [434, 607]
    with pytest.raises(ValueError, match="engram_num_embeddings"):
        EngramHasher.from_config(DeepseekV41Config.from_dict(d), tm)
    d = tiny_config_dict(v_c)
    del d["vision_config"]
    assert EngramHasher.from_config(DeepseekV41Config.from_dict(d), tm).image_token_id is None


def test_bad_shapes_raise():
    h = _hasher()
    with pytest.raises(ValueError):
        h.row_ids(torch.tensor([1, 2]), torch.arange(3), h.new_history())
    with pytest.raises(ValueError):
        h.row_ids(torch.tensor([1, 2]), torch.arange(2), torch.zeros(1, 2, dtype=torch.int64))
    with pytest.raises(ValueError):
        h.row_ids(torch.tensor([1, 2]), torch.arange(2), h.new_history(2), torch.tensor([1, 2]))
    with pytest.raises(ValueError):
        h.row_ids(torch.tensor([1, 2]), torch.arange(2), h.new_history(2))


def test_tiny_tokenizer_end_to_end(tmp_path):
    """The project's tiny tokenizer → token map → tiny config → rows inside each table."""
    from sglang_dsv41.checkpoint.tokenizer import build_tiny_tokenizer
    from sglang_dsv41.engram_hash import compressed_token_map

    tm, v_c = compressed_token_map(build_tiny_tokenizer(tmp_path))
    cfg = DeepseekV41Config.from_dict(tiny_config_dict(v_c))
    h = EngramHasher.from_config(cfg, tm)
    seq = [0, 17, 300, 5, 1000, 1000, 1_000_123, 1000, 40, 41, 42, 43, 44]
    rows = _one_shot(h, seq)
    for li, limit in enumerate(cfg.text.engram_num_embeddings):
        assert 0 <= int(rows[li].min()) and int(rows[li].max()) < limit
        # The tiny layout (V = 61, 2 heads, 4-grams, layers 1 and 3) is the one slow_rows uses.
        assert rows[li].tolist() == slow_rows(seq, tm, cfg.text.engram_layer_ids[li], li, 1000)
    assert h.image_rows(torch.tensor(seq)).tolist() == [x == 1000 or x >= 1_000_000 for x in seq]


def test_to_device_copy_and_tensor_token_map():
    h = _hasher()
    moved = h.to("cpu")
    from_tensor = EngramHasher(torch.from_numpy(_token_map()), h.layers, max_ngram=MAX_NGRAM,
                               n_heads=HEADS, pad_token_id=PAD, image_token_id=IMAGE)
    seq = _random_seq(random.Random(3), 20, 0.1)
    for other in (moved, from_tensor):
        for a, b in zip(_one_shot(h, seq), _one_shot(other, seq)):
            assert torch.equal(a, b)

"""Engram table layout and multipliers (spec §3.3.1, §7): primes, offsets, multipliers."""

import numpy as np
import pytest

from sglang_dsv41.config import DeepseekV41Config
from sglang_dsv41.engram_hash import (
    engram_multiplier_bound, engram_multipliers, engram_offsets, engram_primes, engram_table_rows,
    is_prime,
)
from sglang_dsv41.presets import flash_config_dict, slice_config_dict

FLASH_L1 = [
    [16000057, 16000079, 16000081, 16000097, 16000121, 16000129, 16000133, 16000183],
    [16000189, 16000207, 16000211, 16000253, 16000277, 16000289, 16000307, 16000321],
    [16000339, 16000381, 16000393, 16000399, 16000403, 16000409, 16000447, 16000463],
]
FLASH_L14_LAST = [16000781, 16000799, 16000813, 16000819, 16000841, 16000877, 16000879, 16000889]


def _sieve(limit: int) -> list[bool]:
    flags = [True] * (limit + 1)
    flags[0] = flags[1] = False
    for i in range(2, int(limit**0.5) + 1):
        if flags[i]:
            flags[i * i:: i] = [False] * len(flags[i * i:: i])
    return flags


def test_is_prime_matches_sieve():
    flags = _sieve(20000)
    assert [is_prime(n) for n in range(20001)] == flags
    # Carmichael numbers and a strong pseudoprime to small bases must be rejected.
    for composite in (561, 1105, 1729, 2465, 3215031751, 3825123056546413051):
        assert not is_prime(composite)
    assert is_prime(2**61 - 1) and is_prime(16000057)


def test_flash_primes_exact():
    t = flash_config_dict()["text_config"]
    primes = engram_primes(t["engram_vocab_size"], t["engram_n_heads"], t["engram_max_ngram_size"],
                           len(t["engram_layer_ids"]))
    assert len(primes) == 2 and all(len(layer) == 24 for layer in primes)
    assert primes[0] == FLASH_L1[0] + FLASH_L1[1] + FLASH_L1[2]
    l14 = primes[1]
    assert (l14[0], l14[7]) == (16000477, 16000627)
    assert (l14[8], l14[15]) == (16000667, 16000769)
    assert l14[16:] == FLASH_L14_LAST
    assert engram_table_rows(primes) == [384006168, 384016682] == t["engram_num_embeddings"]
    all_primes = primes[0] + primes[1]
    assert len(set(all_primes)) == 48 and all(p > 16000000 - 1 for p in all_primes)


def test_tiny_primes_exact():
    primes = engram_primes(61, 2, 4, 2)
    assert primes == [[61, 67, 71, 73, 79, 83], [89, 97, 101, 103, 107, 109]]
    assert engram_table_rows(primes) == [434, 606]


def test_cursor_restarts_per_ngram_size_but_skips_used():
    # Vocab 10, 1 head, 3 sizes: each size restarts at 9 and takes the next unused prime.
    assert engram_primes(10, 1, 4, 2) == [[11, 13, 17], [19, 23, 29]]
    # Taking several heads per size: strictly increasing inside a size.
    assert engram_primes(2, 3, 2, 1) == [[2, 3, 5]]


def test_offsets_are_exclusive_prefix_sums():
    primes = engram_primes(61, 2, 4, 2)
    assert engram_offsets(primes) == [[0, 61, 128, 199, 272, 351], [0, 89, 186, 287, 390, 497]]


def test_slice_config_layout_is_fast_and_consistent():
    t = slice_config_dict()["text_config"]
    primes = engram_primes(t["engram_vocab_size"], t["engram_n_heads"], t["engram_max_ngram_size"],
                           len(t["engram_layer_ids"]))
    rows = engram_table_rows(primes)
    columns = (t["engram_max_ngram_size"] - 1) * t["engram_n_heads"]
    assert all(columns * t["engram_vocab_size"] < r < 1.02 * (1 << 20) for r in rows)
    assert all(is_prime(p) and p >= t["engram_vocab_size"] for layer in primes for p in layer)


def test_flash_multipliers_exact():
    assert engram_multiplier_bound(99092) == 46_539_438_283_891
    m1 = engram_multipliers(99092, 1, 4)
    m14 = engram_multipliers(99092, 14, 4)
    assert m1.dtype == np.int64 and m1.shape == (4,)
    assert m1.tolist() == [76632096046245, 4839876093313, 35959672319349, 73987337458391]
    assert m14.tolist() == [67716810739261, 51510806800915, 30921347202721, 82619226485591]
    # Odd, and c·m cannot overflow int64 for any compressed id c < V_c.
    for m in m1.tolist() + m14.tolist():
        assert m % 2 == 1 and (99092 - 1) * m < 2**63


def test_multiplier_bound_edge_cases():
    assert engram_multiplier_bound(2**62) == 1
    assert engram_multiplier_bound(1) == (2**63 - 1) // 2
    assert engram_multipliers(2**62, 3, 4).tolist() == [1, 1, 1, 1]
    with pytest.raises(ValueError):
        engram_multiplier_bound(0)


def test_flash_config_accepts_layout():
    cfg = DeepseekV41Config.from_dict(flash_config_dict())
    t = cfg.text
    primes = engram_primes(t.engram_vocab_size, t.engram_n_heads, t.engram_max_ngram_size,
                           len(t.engram_layer_ids))
    assert tuple(engram_table_rows(primes)) == t.engram_num_embeddings
    assert len(primes[0]) == t.engram_num_columns

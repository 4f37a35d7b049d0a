"""Torch-path forward over slot caches vs the reference model (no SGLang process needed).

What is pinned (spec §3, §3.5; runtime design in docs/runtime.md):
* a packed batch of several requests with different lengths, one-shot extend then batched
  decode, gives every token the reference's logits (per request, unbatched) — bit for bit;
* chunked prefill at odd and even boundaries, mixed with another request's tokens in the same
  batch, equals the reference's one-shot prefill (ratio-2 pairs completed across chunks from the
  pair state of the earlier slot, Engram history read from earlier slots);
* a prefix shared through slots (what SGLang's radix cache does) gives the cold-run logits, and
  the request that owns those slots is not disturbed;
* cache addressing: compressed entries live at the slot of the token that completes them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from sglang_dsv41.checkpoint.loader import load_reference_weights
from sglang_dsv41.config import DeepseekV41Config
from sglang_dsv41.engram_hash import EngramHasher, _load_fast_tokenizer, compressed_token_map
from sglang_dsv41.reference.model import ReferenceModel
from sglang_dsv41.runtime.attention import entry_positions
from sglang_dsv41.runtime.batch import make_layout
from sglang_dsv41.runtime.cache import RuntimeCaches
from sglang_dsv41.runtime.forward import TorchForward

# Bit-identical on CPU: the reference's order-sensitive sums are fp64-accumulated (attention,
# index scores, router/head/mHC mixes) and its fp32 GEMMs agree across row counts here. A GPU
# comparison states its own bound (issue 3, docs/validation.md).
LOGIT_ATOL = 0.0
DECODE_STEPS = 3


@dataclass
class Slots:
    """A minimal SGLang-like slot map: req_to_token rows and a bump allocator (slot 0 = padding)."""

    rows: int = 8
    max_context: int = 128
    next_slot: int = 1
    table: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.table = torch.zeros(self.rows, self.max_context, dtype=torch.int32)

    def extend(self, row: int, start: int, n: int) -> torch.Tensor:
        slots = torch.arange(self.next_slot, self.next_slot + n, dtype=torch.int32)
        self.next_slot += n
        self.table[row, start:start + n] = slots
        return slots


def run(engine: TorchForward, caches: RuntimeCaches, slots: Slots,
        pieces: list[tuple[int, int, list[int]]]) -> list[torch.Tensor]:
    """One packed batch: each piece (row, prefix_len, token ids) gets fresh slots for its tokens;
    returns each piece's logits [len, vocab]."""
    out_slots = [slots.extend(row, prefix, len(ids)) for row, prefix, ids in pieces]
    positions = torch.cat([torch.arange(prefix, prefix + len(ids)) for _, prefix, ids in pieces])
    layout = make_layout(torch.tensor([r for r, _, _ in pieces]), torch.tensor([p for _, p, _ in pieces]),
                         torch.tensor([len(ids) for _, _, ids in pieces]), positions, torch.cat(out_slots),
                         slots.table)
    ids = torch.tensor([t for _, _, piece in pieces for t in piece])
    logits = engine.logits(engine.hidden_states(ids, layout, caches))
    return list(torch.split(logits, [len(ids) for _, _, ids in pieces]))


@pytest.fixture(scope="module")
def models(tiny_checkpoint):
    cfg = DeepseekV41Config.from_file(tiny_checkpoint)
    weights = load_reference_weights(tiny_checkpoint, cfg, vision=False, dspark=False)
    token_map, _ = compressed_token_map(_load_fast_tokenizer(tiny_checkpoint))
    reference = ReferenceModel(cfg, weights, engram_token_map=token_map)
    engine = TorchForward(cfg, weights, EngramHasher.from_config(cfg, token_map))
    return cfg, reference, engine


def _prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [0] + torch.randint(3, 990, (n - 1,), generator=g).tolist()


@pytest.fixture(scope="module")
def expected(models):
    """Reference logits of two prompts (all prompt positions) and of DECODE_STEPS greedy steps."""
    _, reference, _ = models
    out = {}
    for name, prompt in (("a", _prompt(1, 23)), ("b", _prompt(2, 30))):
        state = reference.new_request()
        logits = [reference.forward(state, prompt).logits]
        tokens = []
        for _ in range(DECODE_STEPS + 1):
            tokens.append(int(torch.argmax(logits[-1][-1])))
            logits.append(reference.forward(state, [tokens[-1]]).logits)
        out[name] = (prompt, tokens, logits, state)
    return out


def _close(actual: torch.Tensor, want: torch.Tensor) -> None:
    assert actual.shape == want.shape
    assert torch.equal(actual.argmax(-1), want.argmax(-1))
    torch.testing.assert_close(actual, want, atol=LOGIT_ATOL, rtol=0)


def test_packed_batch_extend_then_decode_equals_reference(models, expected) -> None:
    cfg, _, engine = models
    caches, slots = RuntimeCaches.allocate(cfg.text, 512), Slots()
    (pa, ta, la, _), (pb, tb, lb, _) = expected["a"], expected["b"]
    got_a, got_b = run(engine, caches, slots, [(1, 0, pa), (2, 0, pb)])
    _close(got_a, la[0])
    _close(got_b, lb[0])
    for step in range(DECODE_STEPS):
        got_a, got_b = run(engine, caches, slots, [(1, len(pa) + step, [ta[step]]), (2, len(pb) + step, [tb[step]])])
        _close(got_a, la[step + 1])
        _close(got_b, lb[step + 1])


def test_chunked_prefill_mixed_with_other_requests_equals_one_shot(models, expected) -> None:
    cfg, _, engine = models
    caches, slots = RuntimeCaches.allocate(cfg.text, 512), Slots()
    (pa, ta, la, _), (pb, _, lb, _) = expected["a"], expected["b"]
    # b in chunks 7 | 10 | 13 (odd then even starts); a's one-shot prefill and decodes share batches
    got_b = [run(engine, caches, slots, [(2, 0, pb[:7])])[0]]
    got_a, piece = run(engine, caches, slots, [(1, 0, pa), (2, 7, pb[7:17])])
    got_b.append(piece)
    piece, got_a_step = run(engine, caches, slots, [(2, 17, pb[17:]), (1, len(pa), [ta[0]])])
    got_b.append(piece)
    _close(torch.cat(got_b), lb[0])
    _close(got_a, la[0])
    _close(got_a_step, la[1])


def test_prefix_shared_through_slots_equals_cold_run(models, expected) -> None:
    cfg, reference, engine = models
    caches, slots = RuntimeCaches.allocate(cfg.text, 512), Slots()
    pa, ta, la, _ = expected["a"]
    run(engine, caches, slots, [(1, 0, pa)])
    shared = 17                                      # odd: the pair (16, 17) completes in the new request
    tail = _prompt(3, 12)[1:]
    slots.table[3, :shared] = slots.table[1, :shared]  # what a radix-cache hit hands the new request
    got_c, got_a = run(engine, caches, slots, [(3, shared, tail), (1, len(pa), [ta[0]])])
    want_c = reference.forward(reference.new_request(), pa[:shared] + tail).logits[shared:]
    _close(got_c, want_c)
    _close(got_a, la[1])                             # the owner of the shared slots is unaffected


def test_compressed_entries_live_at_the_completing_token_slot(models) -> None:
    cfg, _, engine = models
    caches, slots = RuntimeCaches.allocate(cfg.text, 64), Slots()
    prompt = _prompt(4, 9)
    run(engine, caches, slots, [(1, 0, prompt)])
    row = slots.table[1, :9].long()
    for src in cfg.text.kv_source_layer_ids:
        ratio = cfg.text.compress_ratios[src]
        n = 9 // ratio
        filled = row[entry_positions(torch.arange(n), ratio)]
        assert bool((caches.latents[src][filled].abs().sum(-1) > 0).all()), f"source {src}"
        if ratio == 2:   # even positions are never the completing token of a pair
            assert bool((caches.latents[src][row[0::2]].abs().sum(-1) == 0).all())
    assert caches.token_ids[row].tolist() == prompt


def test_planned_bytes_match_allocation(models) -> None:
    cfg, _, _ = models
    caches = RuntimeCaches.allocate(cfg.text, 8)
    assert caches.side_bytes_per_token() == RuntimeCaches.planned_side_bytes_per_token(cfg.text)
    assert caches.sglang_bytes_per_token() == cfg.text.num_hidden_layers * cfg.text.head_dim * 2


def test_retracted_request_reprefilled_after_its_slots_were_reused(models, expected) -> None:
    """Preemption: a decoding request loses its slots (freed and overwritten by another request),
    then is re-prefilled with prompt + generated tokens; it continues exactly as uninterrupted."""
    cfg, _, engine = models
    caches, slots = RuntimeCaches.allocate(cfg.text, 512), Slots()
    pa, ta, la, _ = expected["a"]
    run(engine, caches, slots, [(1, 0, pa)])
    run(engine, caches, slots, [(1, len(pa), [ta[0]])])
    slots.next_slot = 1                                   # everything freed; B reuses A's slots
    run(engine, caches, slots, [(2, 0, _prompt(5, len(pa) + 1))])
    resumed = pa + ta[:2]
    got = run(engine, caches, slots, [(1, 0, resumed)])[0]
    _close(got[-2:], torch.cat((la[1][-1:], la[2])))     # logits after ta[0] and after ta[1]

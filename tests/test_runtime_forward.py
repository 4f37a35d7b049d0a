"""Torch-path forward over the phase-2 caches vs the reference model (no SGLang process needed).

What is pinned (spec §3, §3.4.3, §3.5; contracts phase 2 §1–§4; runtime design in docs/runtime.md):
* a packed batch of several requests with different lengths (prompts ending at odd and even
  positions), one-shot extend then batched decode, gives every token the reference's logits
  (per request, unbatched) — bit for bit;
* chunked prefill with chunk boundaries at odd and even positions, mixed with another request's
  tokens in the same batch, equals the reference's one-shot prefill (a ratio-2 pair split across
  forwards completes from the request's pair state; Engram history from the host or the
  request row's ring, never from SWA slots);
* the five packed scenarios of `runtime_scenarios.py` (chunked, batched, decode, a page-aligned
  prefix hit) equal the reference's one-shot logits per request;
* a prefix shared through slots (what SGLang's radix cache does, page-aligned) gives the cold-run
  logits, and the request that owns those slots is not disturbed; preemption + re-prefill after
  the slots were reused continues exactly;
* cache contents: the packed entry of compressed position j sits at entry slot(j·r + r − 1) // r
  and decodes to the reference state's stored latent and index key bit for bit; the pair state
  of a request holds the reference's pending token exactly when its last forward ended at an
  even position;
* the clear errors: slots not in aligned groups (odd page_size), a forward starting at an odd
  position without its pending pair state, an SWA window position without a live SWA slot.
"""
from __future__ import annotations

import pytest
import torch

from runtime_scenarios import (DECODE_STEPS as SCENARIO_DECODE, SHARED_PREFIX, Slots, allocate_caches,
                               fixed_decode_tokens, full_tokens, run_batch, run_scenario, scenario_caches)
from sglang_dsv41.checkpoint.loader import load_reference_weights
from sglang_dsv41.config import DeepseekV41Config
from sglang_dsv41.engram_hash import EngramHasher, _load_fast_tokenizer, compressed_token_map
from sglang_dsv41.reference.model import ReferenceModel
from sglang_dsv41.runtime.attention import entry_positions
from sglang_dsv41.runtime.cache import RuntimeCaches
from sglang_dsv41.runtime.forward import TorchForward

# Bit-identical on CPU: the reference's order-sensitive sums are fp64-accumulated (attention,
# index scores, router/head/mHC mixes) and its fp32 GEMMs agree across row counts here. A GPU
# comparison states its own bound (issue 3, docs/validation.md).
LOGIT_ATOL = 0.0
DECODE_STEPS = 3
CPU = torch.device("cpu")


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
    """Reference logits of two prompts (a: 23 tokens, last position 22 even; b: 30 tokens, last
    position 29 odd) and of DECODE_STEPS greedy steps."""
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


def _fresh(engine: TorchForward) -> tuple[RuntimeCaches, Slots]:
    slots = Slots(CPU)
    return allocate_caches(engine, slots), slots


def _close(actual: torch.Tensor, want: torch.Tensor) -> None:
    assert actual.shape == want.shape
    assert torch.equal(actual.argmax(-1), want.argmax(-1))
    torch.testing.assert_close(actual, want, atol=LOGIT_ATOL, rtol=0)


def test_packed_batch_extend_then_decode_equals_reference(models, expected) -> None:
    _, _, engine = models
    caches, slots = _fresh(engine)
    (pa, ta, la, _), (pb, tb, lb, _) = expected["a"], expected["b"]
    got_a, got_b = run_batch(engine, caches, slots, [(1, 0, pa), (2, 0, pb)])
    _close(got_a, la[0])
    _close(got_b, lb[0])
    for step in range(DECODE_STEPS):
        got_a, got_b = run_batch(engine, caches, slots, [(1, len(pa) + step, [ta[step]]),
                                                         (2, len(pb) + step, [tb[step]])])
        _close(got_a, la[step + 1])
        _close(got_b, lb[step + 1])


@pytest.mark.parametrize("cuts", [(7, 17), (8, 14), (1, 2, 5, 6, 9)],
                         ids=["ends-even", "ends-odd", "mixed-short"])
def test_chunked_prefill_mixed_with_other_requests_equals_one_shot(models, expected, cuts) -> None:
    """b in chunks at `cuts` (ends-even: chunks end at 6, 16; ends-odd: at 7, 13; mixed: both,
    including one-token chunks); a's one-shot prefill and a decode share the batches."""
    _, _, engine = models
    caches, slots = _fresh(engine)
    (pa, ta, la, _), (pb, _, lb, _) = expected["a"], expected["b"]
    bounds = [0, *cuts, len(pb)]
    got_b, got_a, got_a_step = [], None, None
    for i, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        pieces = [(2, lo, pb[lo:hi])]
        if i == 1:
            pieces.append((1, 0, pa))
        elif i == 2:
            pieces.append((1, len(pa), [ta[0]]))
        out = run_batch(engine, caches, slots, pieces)
        got_b.append(out[0])
        if i == 1:
            got_a = out[1]
        elif i == 2:
            got_a_step = out[1]
    _close(torch.cat(got_b), lb[0])
    _close(got_a, la[0])
    _close(got_a_step, la[1])


def test_packed_scenarios_equal_reference_one_shot(models) -> None:
    _, reference, engine = models
    decode = fixed_decode_tokens()
    got = run_scenario(engine, scenario_caches(engine, CPU), CPU, decode)
    for name in SCENARIO_DECODE:
        want = reference.forward(reference.new_request(), full_tokens(name, decode)).logits
        _close(got[name], want[SHARED_PREFIX:] if name == "D" else want)


def test_prefix_shared_through_slots_equals_cold_run(models, expected) -> None:
    _, reference, engine = models
    caches, slots = _fresh(engine)
    pa, ta, la, _ = expected["a"]
    run_batch(engine, caches, slots, [(1, 0, pa)])
    shared = 16                                      # page-aligned: what a radix-cache hit hands out
    tail = _prompt(3, 12)[1:]
    slots.share(3, 1, shared)
    got_c, got_a = run_batch(engine, caches, slots, [(3, shared, tail), (1, len(pa), [ta[0]])],
                             context={3: pa[:shared], 1: pa})    # a prefix hit: the history comes from the host
    want_c = reference.forward(reference.new_request(), pa[:shared] + tail).logits[shared:]
    _close(got_c, want_c)
    _close(got_a, la[1])                             # the owner of the shared slots is unaffected


@pytest.mark.parametrize("n", [9, 10])
def test_packed_entries_and_pair_state_equal_the_reference_state(models, n: int) -> None:
    """After a prompt of n tokens: entry slot(j·r + r − 1) // r of every source decodes to the
    reference's stored latent and index key of compressed position j; the request's pair state
    holds the reference's pending token (n odd → last position even → pending) or nothing."""
    cfg, reference, engine = models
    caches, slots = _fresh(engine)
    prompt = _prompt(4, n)
    run_batch(engine, caches, slots, [(1, 0, prompt)])
    state = reference.new_request()
    reference.forward(state, prompt)
    row = slots.table[1, :n].long()
    for src in cfg.text.kv_source_layer_ids:
        ratio = cfg.text.compress_ratios[src]
        entries = row[entry_positions(torch.arange(n // ratio), ratio)] // ratio
        packed = caches.packed(src)
        assert torch.equal(packed.latents(entries), state.attention.compressed_kv[src]), f"source {src}"
        assert torch.equal(packed.keys(entries), state.attention.index_keys[src]), f"source {src}"
        if ratio == 2:
            pending = state.attention.pending[src]
            kv, score, held = caches.pending_pair(src, torch.tensor([1]), torch.tensor([n - 1]))
            if n % 2:
                assert pending is not None and int(held) == n - 1
                assert torch.equal(kv[0], pending.a) and torch.equal(score[0], pending.s)
            else:
                assert pending is None and int(held) == -1
    swa = caches.swa_slots(row)
    K = cfg.text.engram_max_ngram_size - 1
    assert caches.engram_history.ids[1].tolist() == prompt[-K:] and int(caches.engram_history.end[1]) == n
    for layer in range(cfg.text.num_hidden_layers):
        assert torch.equal(caches.swa[layer][swa].float(), state.attention.swa_kv[layer]), f"layer {layer}"


def test_retracted_request_reprefilled_after_its_slots_were_reused(models, expected) -> None:
    """Preemption: a decoding request loses its slots (freed and overwritten by another request),
    then is re-prefilled with prompt + generated tokens; it continues exactly as uninterrupted."""
    _, _, engine = models
    caches, slots = _fresh(engine)
    pa, ta, la, _ = expected["a"]
    run_batch(engine, caches, slots, [(1, 0, pa)])
    run_batch(engine, caches, slots, [(1, len(pa), [ta[0]])])
    slots.free_all()                                      # everything freed; B reuses A's slots
    run_batch(engine, caches, slots, [(2, 0, _prompt(5, len(pa) + 1))])
    resumed = pa + ta[:2]
    got = run_batch(engine, caches, slots, [(1, 0, resumed)])[0]
    _close(got[-2:], torch.cat((la[1][-1:], la[2])))     # logits after ta[0] and after ta[1]


# ---- clear errors --------------------------------------------------------------------------------

def test_odd_page_size_slots_are_refused_naming_page_size(models) -> None:
    _, _, engine = models
    slots = Slots(CPU, page_size=3)
    caches = RuntimeCaches.allocate(engine.text, slots.num_slots(), 8)
    with pytest.raises(RuntimeError, match="page_size must be a multiple of 2"):
        run_batch(engine, caches, slots, [(1, 0, _prompt(6, 5))])
    with pytest.raises(ValueError, match="page_size 3 is not a multiple"):
        RuntimeCaches.allocate(engine.text, 64, 8, page_size=3)


def test_padding_page_slots_are_refused(models) -> None:
    _, _, engine = models
    caches, slots = _fresh(engine)
    slots.next_page = 0                                   # hands out the padding page
    with pytest.raises(RuntimeError, match="padding slots 0..1"):
        run_batch(engine, caches, slots, [(1, 0, _prompt(6, 3))])


def test_odd_start_without_pending_pair_state_raises(models) -> None:
    """Position 16 of row 3 is "in the prefix" (slot allocated, never forwarded, as after a
    non-page-aligned hit): the pair (16, 17) cannot complete."""
    _, _, engine = models
    caches, slots = _fresh(engine)
    prompt = _prompt(7, 20)
    run_batch(engine, caches, slots, [(3, 0, prompt[:16])])
    slots.extend(3, 16, 1)
    with pytest.raises(RuntimeError, match="pending pair state"):
        run_batch(engine, caches, slots, [(3, 17, prompt[17:])], context={3: prompt})


def test_window_position_without_live_swa_slot_raises(models) -> None:
    _, _, engine = models
    caches, slots = _fresh(engine)
    prompt = _prompt(8, 12)
    run_batch(engine, caches, slots, [(1, 0, prompt)])
    caches.swa_slot_of[slots.table[1, 6].long()] = 0      # what SGLang does to a freed SWA slot (window 5..12)
    with pytest.raises(RuntimeError, match="no live SWA slot"):
        run_batch(engine, caches, slots, [(1, 12, [5])])

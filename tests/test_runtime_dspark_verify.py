"""The target's DSpark verify forward on CPU (`TARGET_VERIFY`; docs/dspark.md "Target verify"):
one forward over w = γ+1 tokens per request [anchor, d_0 … d_4], acceptance by the oracle's
`reference/dspark_verify.verify_greedy`, then the commit of anchor + accepted drafts — against
the reference, which verifies on a clone of its request state and re-runs only the accepted
tokens (`speculative_generate`'s exact rollback).

Exact backend: bit-identical (LOGIT_ATOL 0), as tests/test_runtime_forward.py. Checked:
* every round's verify logits == the reference's verify logits of the same block;
* emitted tokens == plain greedy decoding; accept lengths 0..γ all occur, prompts ending on odd
  and even positions (pair ring: a rejected draft's pending pair never clobbers the committed one);
* request states from chunked prefill, a prefix hit and a reused request row verify like cold ones;
* the pair ring holds every even block position's pair (any commit length) and the committed one;
* after commit the Engram history ring == a sequential run's; rejected drafts leave no state that
  a later round reads (later rounds stay bit-identical);
* the CUDA-graph form (`static_verify_layout`, with a padding request) == the eager layout;
* adaptive verification (ragged verify lengths, eager and `static_ragged_verify_layout`) through
  SGLang's own accept step: accept counts == the oracle's on the truncated block, output == greedy.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from runtime_scenarios import Slots, allocate_caches, run_batch
from sglang_dsv41.checkpoint.loader import load_reference_weights
from sglang_dsv41.config import DeepseekV41Config
from sglang_dsv41.engram_hash import EngramHasher, _load_fast_tokenizer, compressed_token_map
from sglang_dsv41.reference.dspark_verify import verify_greedy
from sglang_dsv41.reference.model import ReferenceModel
from sglang_dsv41.runtime.batch import make_layout, static_ragged_verify_layout, static_verify_layout
from sglang_dsv41.runtime.cache import RuntimeCaches
from sglang_dsv41.runtime.forward import TorchForward
from sglang_dsv41.runtime.kv_rows import pair_ring_slots

CPU = torch.device("cpu")
GAMMA = 5
W = GAMMA + 1
ROUNDS = 5
#: per round and request, the index of the first corrupted draft (GAMMA: none) — every accept length
CORRUPT = {1: [0, 2, GAMMA, 1, 4], 2: [3, GAMMA, 0, 4, 2]}


@pytest.fixture(scope="module")
def models(tiny_checkpoint):
    cfg = DeepseekV41Config.from_file(tiny_checkpoint)
    assert cfg.text.dspark_block_size == GAMMA
    weights = load_reference_weights(tiny_checkpoint, cfg, vision=False, dspark=False)
    token_map, _ = compressed_token_map(_load_fast_tokenizer(tiny_checkpoint))
    return cfg, ReferenceModel(cfg, weights, engram_token_map=token_map), TorchForward(
        cfg, weights, EngramHasher.from_config(cfg, token_map))


def _prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [0] + torch.randint(3, 990, (n - 1,), generator=g).tolist()


PROMPTS = {1: _prompt(5, 21), 2: _prompt(6, 26)}         # P = 21 (odd), 26 (even)
#: the rollback test's requests: row 2's prompt shares row 1's first 16 tokens (a prefix hit); P = 21, 26
HIT = 16
ROLLBACK = {1: PROMPTS[1], 2: PROMPTS[1][:HIT] + _prompt(7, 11)[1:]}


def _caches(engine: TorchForward, slots: Slots, width: int = W) -> RuntimeCaches:
    """The caches of a server verifying `width` = γ + 1 tokens (its pair ring: 8 slots at γ 5)."""
    return RuntimeCaches.allocate(engine.text, slots.num_slots(), slots.host.shape[0], device=CPU,
                                  page_size=slots.page_size, pair_slots=pair_ring_slots(width), verify_width=width)


def _verify(engine, caches, slots, blocks: dict[int, tuple[int, list[int]]], *, static: bool = False,
            pad: int = 0, width: int = W) -> dict[int, torch.Tensor]:
    """One verify forward: row → (P, [anchor, d_0 …]) of w or fewer tokens (adaptive verification:
    a ragged batch); slots P.. written into the table first (SGLang's verify window); `static`:
    the CUDA-graph layout, with `pad` padding requests (uniform: w tokens each; ragged: the batch
    padded by 3 tokens to its graph tier and the verify lengths the runner stages for the graph,
    SGLang's `padded_to_bucket(cap=w)`: padding rows, else the last real row, take the padding
    tokens up to w each, any rest are ghost tokens of no request)."""
    rows = list(blocks)
    lens = [len(ids) for _, ids in blocks.values()]
    ragged = any(n != width for n in lens)
    out = torch.cat([slots.extend(r, p, len(ids)) for r, (p, ids) in blocks.items()])
    positions = torch.cat([torch.arange(p, p + len(ids)) for p, ids in blocks.values()])
    ids = torch.tensor([t for _, block in blocks.values() for t in block])
    prefix = torch.tensor([p for p, _ in blocks.values()])
    if static:
        extra = 3 if ragged else pad * width
        req_rows, seq_lens = torch.tensor(rows + [0] * pad), torch.cat([prefix, torch.ones(pad, dtype=torch.long)])
        positions, out = (torch.cat([x, torch.zeros(extra, dtype=torch.long)]) for x in (positions, out))
        if ragged:
            from sglang.srt.speculative.ragged_verify import RaggedVerifyLayout

            staged = RaggedVerifyLayout.from_verify_lens(verify_lens_cpu=lens, device=CPU, grid=[sum(lens) + extra]
                                                         ).padded_to_bucket(padded_bs=len(rows) + pad, cap=width)
            layout = static_ragged_verify_layout(req_rows, seq_lens, staged.verify_lens, positions, out, slots.table, width)
        else:
            layout = static_verify_layout(req_rows, seq_lens, positions, out, slots.table, width)
        ids = torch.cat([ids, torch.zeros(extra, dtype=torch.long)])
    else:
        layout = dataclasses.replace(make_layout(torch.tensor(rows), prefix, torch.tensor(lens), positions,
                                                 out, slots.table), verify_width=width)
    logits = engine.logits(engine.hidden_states(ids, layout, caches))
    return dict(zip(rows, torch.split(logits[: sum(lens)], lens)))


def _reference_rounds(reference: ReferenceModel, prompt: list[int], corrupt: list[int], vocab: int,
                      verify: list[int] | None = None, gamma: int = GAMMA):
    """The oracle: per round (block, verify logits, outcome), verifying on a clone and re-running
    the accepted tokens; drafts = greedy continuation, first corrupted at `corrupt[r]`; `verify[r]`
    (adaptive verification): the block holds only the anchor + the first verify[r] − 1 drafts."""
    state = reference.new_request()
    anchor = int(torch.argmax(reference.forward(state, prompt).logits[-1]))
    rounds = []
    for r, cut in enumerate(corrupt):
        probe = state.clone()
        drafts, last = [], anchor
        truth = probe.clone()
        for _ in range(gamma):                       # greedy continuation of the anchor
            last = int(torch.argmax(reference.forward(truth, [last]).logits[-1]))
            drafts.append(last)
        if cut < gamma:
            drafts[cut] = (drafts[cut] + 1) % vocab
        if verify is not None:
            drafts = drafts[: verify[r] - 1]
        logits = reference.forward(probe, [anchor] + drafts).logits
        outcome = verify_greedy(drafts, logits)
        reference.forward(state, [anchor] + drafts[: outcome.accepted])
        rounds.append(([anchor] + drafts, logits, outcome))
        anchor = outcome.tokens[-1]
    return rounds


def _rollback_states(engine, caches, slots) -> None:
    """The rollback test's request states as SGLang builds them: row 1 prefilled in three chunks
    (9, 8, 4 tokens: a chunk starts at an odd position, taking its pair from the pair state); row 2
    first serves another request (prefill + a decode that leaves a pending pair and an Engram
    history in the row: what a preempted or finished request leaves), then row 1's first 16 slots
    (a page-aligned prefix hit, history from the host) + its own 10-token tail."""
    a, b, other = ROLLBACK[1], ROLLBACK[2], _prompt(8, 12)
    run_batch(engine, caches, slots, [(1, 0, a[:9]), (2, 0, other)])
    run_batch(engine, caches, slots, [(1, 9, a[9:17]), (2, 12, [5])])
    slots.share(2, 1, HIT)
    run_batch(engine, caches, slots, [(1, 17, a[17:]), (2, HIT, b[HIT:])], context={1: a[:17], 2: b[:HIT]})


def _verify_and_commit_rounds(engine, caches, slots, prompts: dict, oracle: dict, rounds: int,
                              width: int | None = None) -> tuple[dict[int, list[int]], dict[int, int]]:
    """`rounds` rounds of verify (each request's oracle block at its committed length) + Engram commit of
    the accepted tokens; each round's logits == the oracle's bit for bit and its greedy outcome equal.
    Returns the emitted tokens and the committed lengths per request row."""
    P = {r: len(prompts[r]) for r in prompts}
    emitted: dict[int, list[int]] = {r: [oracle[r][0][0][0]] for r in prompts}
    for k in range(rounds):
        kw = {} if width is None else dict(width=width)
        got = _verify(engine, caches, slots, {r: (P[r], oracle[r][k][0]) for r in prompts}, **kw)
        commit = []
        for r in prompts:
            block, want, outcome = oracle[r][k]
            assert width is None or len(block) == width
            torch.testing.assert_close(got[r], want, atol=0, rtol=0)
            mine = verify_greedy(block[1:], got[r])
            assert mine == outcome
            emitted[r] += list(mine.tokens)
            commit.append(mine.accepted + 1)
        caches.engram_history.commit_verify(torch.tensor(list(prompts)), torch.tensor([P[r] for r in prompts]),
                                            torch.tensor(commit), check=True)
        for r, c in zip(prompts, commit):
            P[r] += c
    return emitted, P


def test_verify_then_commit_equals_the_reference_rollback(models) -> None:
    """Rounds of verify + commit from request states built by chunked prefill, a prefix hit and a
    reused request row (`_rollback_states`) == the reference's cold verify-on-clone rollback."""
    cfg, reference, engine = models
    oracle = {r: _reference_rounds(reference, ROLLBACK[r], CORRUPT[r], cfg.text.vocab_size) for r in ROLLBACK}
    accepted = {r: [o.accepted for _, _, o in oracle[r]] for r in ROLLBACK}
    assert sorted(set(accepted[1]) | set(accepted[2])) == list(range(GAMMA + 1)), accepted
    slots = Slots(CPU, rows=4, max_context=64)
    caches = _caches(engine, slots)
    _rollback_states(engine, caches, slots)
    emitted, P = _verify_and_commit_rounds(engine, caches, slots, ROLLBACK, oracle, ROUNDS)
    for r in ROLLBACK:                                 # greedy speculative output == plain greedy output
        n = len(emitted[r])
        assert emitted[r] == reference.generate(ROLLBACK[r], n), r
        assert int(caches.engram_history.end[r]) == P[r]


def test_verify_of_the_servers_block_size_equals_the_reference(models) -> None:
    """`--speculative-dspark-block-size 7`, not the checkpoint's 5 (docs/dspark.md "Block size"):
    verify width 8 and a 16-slot pair ring (`pair_ring_slots(8)`); three rounds of verify + commit
    from cold prompts (P = 21 odd, 26 even) == the reference's verify-on-clone rollback bit for bit,
    accept lengths 0, 3, 6, 7 among them, output == plain greedy."""
    cfg, reference, engine = models
    g, w = 7, 8
    corrupt = {1: [0, g, 3], 2: [6, g, 5]}
    oracle = {r: _reference_rounds(reference, PROMPTS[r], corrupt[r], cfg.text.vocab_size, gamma=g) for r in PROMPTS}
    assert {0, 3, 6, g} <= {o.accepted for r in PROMPTS for _, _, o in oracle[r]}
    slots = Slots(CPU, rows=4, max_context=64)
    caches = _caches(engine, slots, width=w)
    assert caches.pair_ring_slots == 16
    run_batch(engine, caches, slots, [(r, 0, PROMPTS[r]) for r in PROMPTS])
    emitted, _ = _verify_and_commit_rounds(engine, caches, slots, PROMPTS, oracle, len(corrupt[1]), width=w)
    for r in PROMPTS:
        assert emitted[r] == reference.generate(PROMPTS[r], len(emitted[r])), r


def test_engram_ring_after_commit_equals_a_sequential_run(models) -> None:
    _, _, engine = models
    prompt, tail = PROMPTS[1], [7, 8, 9, 10, 11, 12]
    seq_slots = Slots(CPU, rows=4, max_context=64)
    seq = _caches(engine, seq_slots)
    run_batch(engine, seq, seq_slots, [(1, 0, prompt)])
    spec_slots = Slots(CPU, rows=4, max_context=64)
    spec = _caches(engine, spec_slots)
    run_batch(engine, spec, spec_slots, [(1, 0, prompt)])
    P = len(prompt)
    for c in (1, 3, 6):
        _verify(engine, spec, spec_slots, {1: (P, tail)})
        spec.engram_history.commit_verify(torch.tensor([1]), torch.tensor([P]), torch.tensor([c]), check=True)
        for t in tail[:c]:
            run_batch(engine, seq, seq_slots, [(1, P, [t])])
            P += 1
        assert torch.equal(spec.engram_history.ids[1], seq.engram_history.ids[1])
        assert int(spec.engram_history.end[1]) == int(seq.engram_history.end[1]) == P
        tail = [t + 20 for t in tail]
    with pytest.raises(RuntimeError, match="staged blocks hold 6"):
        spec.engram_history.commit_verify(torch.tensor([1]), torch.tensor([P]), torch.tensor([7]), check=True)
    with pytest.raises(RuntimeError, match="not at its prefix length"):
        spec.engram_history.commit_verify(torch.tensor([1]), torch.tensor([P + 1]), torch.tensor([1]), check=True)


def test_pair_ring_holds_every_pair_a_verify_may_commit(models) -> None:
    """The ratio-2 pair ring (`kv_rows.pair_ring_slots(γ)` = 8 slots): after one verify forward
    over P..P+5, every even position q of the block (a commit of any length may leave q's pair
    pending) holds q's pair (kv, score, position) bit for bit as a sequential run stores it, and so
    does the committed pending pair P−1 (P odd) the block must not clobber — at P = 21 and 26. The
    2-slot ring of a server without speculation would not: the check fails there."""
    _, _, engine = models
    block = {r: [3, 5, 7, 9, 11, 13] for r in PROMPTS}
    P = {r: len(PROMPTS[r]) for r in PROMPTS}
    want = [(r, q) for r in PROMPTS for q in range(P[r] - 1, P[r] + W) if q % 2 == 0]
    assert len(want) == 7 and pair_ring_slots(GAMMA) == 8

    def ring(caches: RuntimeCaches, keys) -> dict:
        return {(src, r, q): [t.clone() for t in caches.pending_pair(src, torch.tensor([r]), torch.tensor([q]))]
                for src in caches.pair_kv for r, q in keys}

    slots = Slots(CPU, rows=4, max_context=64)
    seq = _caches(engine, slots)
    run_batch(engine, seq, slots, [(r, 0, PROMPTS[r]) for r in PROMPTS])
    pairs = ring(seq, [(r, q) for r, q in want if q < P[r]])
    for k in range(W):                                          # the block token by token
        run_batch(engine, seq, slots, [(r, P[r] + k, [block[r][k]]) for r in PROMPTS])
        pairs |= ring(seq, [(r, q) for r, q in want if q == P[r] + k])
    for slots_in_ring in (8, 2):
        slots = Slots(CPU, rows=4, max_context=64)
        caches = RuntimeCaches.allocate(engine.text, slots.num_slots(), slots.host.shape[0], device=CPU,
                                        page_size=slots.page_size, pair_slots=slots_in_ring, verify_width=W)
        run_batch(engine, caches, slots, [(r, 0, PROMPTS[r]) for r in PROMPTS])
        _verify(engine, caches, slots, {r: (P[r], block[r]) for r in PROMPTS})
        held = ring(caches, want)
        same = all(all(torch.equal(a, b) for a, b in zip(held[key], pairs[key])) for key in pairs)
        assert same == (slots_in_ring == 8), slots_in_ring


def test_static_verify_layout_with_padding_equals_eager(models) -> None:
    """The CUDA-graph form of the verify batch (no host checks, padded by a request at row 0,
    slot 0) computes the same logits and the same committed state as the eager layout."""
    cfg, reference, engine = models
    block = {r: _reference_rounds(reference, PROMPTS[r], [2], cfg.text.vocab_size)[0][0] for r in PROMPTS}
    results = []
    for static in (False, True):
        slots = Slots(CPU, rows=4, max_context=64)
        caches = _caches(engine, slots)
        run_batch(engine, caches, slots, [(r, 0, PROMPTS[r]) for r in PROMPTS])
        got = _verify(engine, caches, slots, {r: (len(PROMPTS[r]), block[r]) for r in PROMPTS}, static=static,
                      pad=2 if static else 0)
        caches.engram_history.commit_verify(torch.tensor(list(PROMPTS)), torch.tensor([len(p) for p in PROMPTS.values()]),
                                            torch.tensor([3, 3]), check=True)
        after = run_batch(engine, caches, slots, [(r, len(PROMPTS[r]) + 3, [block[r][3]]) for r in PROMPTS])
        results.append((got, after, caches.engram_history.ids[1:3].clone()))
    (eager, eager_after, eager_ring), (graph, graph_after, graph_ring) = results
    for r in PROMPTS:
        torch.testing.assert_close(graph[r], eager[r], atol=0, rtol=0)
    for a, b in zip(graph_after, eager_after):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert torch.equal(graph_ring, eager_ring)


#: adaptive verification: per round and request, tokens verified (anchor + drafts; 1..W) and the
#: first corrupted draft — accepts 0..4 and every cap by the verify length occur
VERIFY = {1: [3, 1, 6, 4], 2: [6, 4, 2, 5]}
CORRUPT_RAGGED = {1: [GAMMA, 0, 2, GAMMA], 2: [3, GAMMA, GAMMA, GAMMA]}


def test_adaptive_verification_ragged_lengths_through_sglang_accept(models) -> None:
    """Adaptive verification (`SGLANG_RAGGED_VERIFY_MODE=compact`): each request verifies only
    its first v − 1 drafts. The ragged verify forward — eager and in its CUDA-graph form
    (`static_ragged_verify_layout` over the verify lengths SGLang's runner stages: padding tokens
    in a padding request or in the last real request, ghost tokens) — gives the
    reference's verify logits bit for bit; SGLang's own accept step (`accept_draft_tokens` on the
    strided logits, capped by the verify lengths) accepts exactly what `verify_greedy` accepts on
    the truncated block; after the commits the output equals plain greedy decoding."""
    from types import SimpleNamespace

    from sglang.kernels.ops.speculative.dspark.dspark_verify_window import ScatterCompactToStrided
    from sglang.srt.speculative.dspark_components.dspark_verify import accept_draft_tokens
    from sglang.srt.speculative.ragged_verify import RaggedVerifyLayout

    cfg, reference, engine = models
    oracle = {r: _reference_rounds(reference, PROMPTS[r], CORRUPT_RAGGED[r], cfg.text.vocab_size, VERIFY[r])
              for r in PROMPTS}
    accepted = sorted({o.accepted for r in PROMPTS for _, _, o in oracle[r]})
    capped = sum(o.accepted == len(b) - 1 and c >= len(b) - 1 for r in PROMPTS
                 for (b, _, o), c in zip(oracle[r], CORRUPT_RAGGED[r]))
    assert accepted == [0, 1, 2, 3, 4] and capped >= 3, (accepted, capped)
    runs = {}
    for static in (False, True):
        slots = Slots(CPU, rows=4, max_context=64)
        caches = _caches(engine, slots)
        run_batch(engine, caches, slots, [(r, 0, PROMPTS[r]) for r in PROMPTS])
        P = {r: len(PROMPTS[r]) for r in PROMPTS}
        emitted: dict[int, list[int]] = {r: [oracle[r][0][0][0]] for r in PROMPTS}
        logits_seen = []
        for k in range(len(VERIFY[1])):
            blocks = {r: oracle[r][k][0] for r in PROMPTS}
            got = _verify(engine, caches, slots, {r: (P[r], blocks[r]) for r in PROMPTS}, static=static, pad=k % 2)
            lens = [len(blocks[r]) for r in PROMPTS]
            layout = RaggedVerifyLayout.from_verify_lens(verify_lens_cpu=lens, device=CPU, grid=[sum(lens)])
            strided = ScatterCompactToStrided.execute(compact=torch.cat([got[r] for r in PROMPTS]), layout=layout,
                                                      fill_value=0.0, verify_num_draft_tokens=W)
            ids = torch.tensor([t for r in PROMPTS for t in blocks[r]])[:, None]
            candidates = ScatterCompactToStrided.execute(compact=ids, layout=layout, fill_value=0,
                                                         verify_num_draft_tokens=W)[: len(lens) * W].view(-1, W)
            correct, bonus, _ = accept_draft_tokens(
                candidates=candidates, target_logits=strided[: len(lens) * W], draft_block=SimpleNamespace(greedy_mask=None),
                sampling_info=None, draft_input=None, gamma=GAMMA, verify_num_draft_tokens=W, cutoff_layout=layout)
            for i, r in enumerate(PROMPTS):
                block, want, outcome = oracle[r][k]
                torch.testing.assert_close(got[r], want, atol=0, rtol=0)
                assert (int(correct[i]), int(bonus[i])) == (outcome.accepted, outcome.tokens[-1]), (k, r)
                emitted[r] += list(outcome.tokens)
            commit = (correct + 1).tolist()
            caches.engram_history.commit_verify(torch.tensor(list(PROMPTS)), torch.tensor([P[r] for r in PROMPTS]),
                                                torch.tensor(commit), check=True)
            for r, c in zip(PROMPTS, commit):
                P[r] += c
            logits_seen.append(got)
        runs[static] = (emitted, caches.engram_history.ids[1:3].clone(), logits_seen)
    for r in PROMPTS:
        assert runs[False][0][r] == runs[True][0][r] == reference.generate(PROMPTS[r], len(runs[False][0][r])), r
    assert torch.equal(runs[False][1], runs[True][1])


def test_verify_needs_caches_with_a_verify_width(models) -> None:
    _, _, engine = models
    slots = Slots(CPU, rows=4, max_context=64)
    caches = allocate_caches(engine, slots)
    run_batch(engine, caches, slots, [(1, 0, PROMPTS[1])])
    with pytest.raises(RuntimeError, match="without a verify width"):
        _verify(engine, caches, slots, {1: (len(PROMPTS[1]), [1, 2, 3, 4, 5, 6])})


def test_commit_hook_commits_a_v41_target_and_leaves_others_alone() -> None:
    """The AFTER hook on `DSparkWorkerV2._commit_target_mamba_states_after_verify` (target pinned by
    tests/test_hooks.py) hands the batch's rows, pre-verify lengths and commit lengths to a V4.1
    target's `commit_dspark_verify`; another target is untouched."""
    from types import SimpleNamespace

    from sglang_dsv41.runtime.dspark_hooks import commit_after_verify_hook

    calls = []
    target = SimpleNamespace(commit_dspark_verify=lambda *a: calls.append(a))
    worker = SimpleNamespace(target_worker=SimpleNamespace(model_runner=SimpleNamespace(model=target)))
    batch = SimpleNamespace(req_pool_indices=torch.tensor([3, 4]))
    pre, commit = torch.tensor([10, 21]), torch.tensor([1, 6])
    assert commit_after_verify_hook("r", worker, batch=batch, seq_lens_pre_verify=pre, seq_lens_post_verify=pre + commit,
                                    commit_lens=commit) == "r"
    assert len(calls) == 1 and calls[0][0] is batch.req_pool_indices and calls[0][1] is pre and calls[0][2] is commit
    other = SimpleNamespace(target_worker=SimpleNamespace(model_runner=SimpleNamespace(model=object())))
    assert commit_after_verify_hook(None, other, batch=batch, seq_lens_pre_verify=pre, commit_lens=commit) is None
    with pytest.raises(RuntimeError, match="SGLang's call changed"):
        commit_after_verify_hook(None, worker, batch, pre)


def test_layout_of_sglang_verify_batches() -> None:
    """`layout_from_forward_batch` of SGLang's TARGET_VERIFY batch: w = spec_info.draft_token_num
    tokens per request from seq_lens (uniform, or a ragged layout's verify_lens); the graph forms
    are the static (ragged) verify layouts; a batch without its width is refused."""
    from types import SimpleNamespace

    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from sglang_dsv41.runtime.batch import layout_from_forward_batch

    slots = Slots(CPU, rows=4, max_context=64)
    for r, n in ((1, 10), (2, 13)):
        slots.extend(r, 0, n)
    out = torch.cat([slots.extend(1, 4, W), slots.extend(2, 7, W)])
    positions = torch.cat([torch.arange(4, 4 + W), torch.arange(7, 7 + W)])

    def batch(spec, loc=out, pos=positions):
        return SimpleNamespace(forward_mode=ForwardMode.TARGET_VERIFY, req_pool_indices=torch.tensor([1, 2]),
                               seq_lens=torch.tensor([4, 7]), out_cache_loc=loc, spec_info=spec), pos

    fb, pos = batch(SimpleNamespace(draft_token_num=W, ragged_verify_layout=None))
    layout = layout_from_forward_batch(fb, pos, slots.table)
    assert layout.verify_width == W and layout.extend_lens.tolist() == [W, W] and layout.seq_lens.tolist() == [10, 13]
    graph = layout_from_forward_batch(fb, pos, slots.table, static=True)
    assert graph.static and graph.verify_width == W and torch.equal(graph.token_req, layout.token_req)
    keep = torch.tensor([0, 1, 2, W, W + 1, W + 2, W + 3])                   # verify lens 3 and 4
    fb, pos = batch(SimpleNamespace(draft_token_num=W, ragged_verify_layout=SimpleNamespace(
        verify_lens=torch.tensor([3, 4], dtype=torch.int32))), out[keep], positions[keep])
    ragged = layout_from_forward_batch(fb, pos, slots.table)
    assert ragged.extend_lens.tolist() == [3, 4] and ragged.verify_width == W
    from cuda_graph_scenarios import no_host_sync

    with no_host_sync():                                                       # adaptive verification in a graph
        static = layout_from_forward_batch(fb, pos, slots.table, static=True)
    assert static.static and static.extend_lens.tolist() == [3, 4] and static.verify_width == W
    assert torch.equal(static.token_req, ragged.token_req) and torch.equal(static.starts, ragged.starts)
    fb, pos = batch(SimpleNamespace())
    with pytest.raises(RuntimeError, match="draft_token_num"):
        layout_from_forward_batch(fb, pos, slots.table)


#: the retract test: per round, the first corrupted draft (GAMMA: none); rounds before the retract,
#: then after the re-prefill
RETRACT_BEFORE, RETRACT_AFTER = [2, 0], [GAMMA, 1]


def test_retracted_request_reprefilled_after_its_row_and_slots_were_reused(models) -> None:
    """Preemption under DSpark (SGLang's `retract_decode`): a request mid-speculation (two verify
    rounds with rejections: staged blocks, pair-ring entries and draft-row captures of rejected
    positions) is retracted — its row and its slots past the radix-cached prompt prefix go to
    another request that prefills and verifies there — then re-admitted into that dirty row as
    SGLang does (prefix hit on the cached 16 prompt tokens, re-prefill of the rest of prompt +
    outputs, Engram history from the host). After it: the re-prefill's anchor is the greedy token;
    the captures the draft's context rows are written from (`write_target_hidden_kv`) equal the
    original run's at every committed position; the next verify rounds give the reference's cold
    logits bit for bit; the output equals plain greedy decoding."""
    cfg, reference, engine = models
    prompt, other = PROMPTS[1], _prompt(9, 12)
    greedy = reference.generate(prompt, 17)
    engine.set_capture_layers(cfg.text.dspark_target_layer_ids)
    try:
        slots = Slots(CPU, rows=4, max_context=64)
        caches = _caches(engine, slots)
        captured: dict[int, list[torch.Tensor]] = {}

        def keep(n: int) -> list[torch.Tensor]:
            """The last forward's first n captured rows, each [layers, H]."""
            return [torch.stack([c[i] for c in engine.captured]) for i in range(n)]

        def rounds(P: int, emitted: list[int], cuts: list[int], oracle: bool) -> int:
            for cut in cuts:
                e = len(emitted) - 1
                drafts = list(greedy[e + 1: e + 1 + GAMMA])
                if cut < GAMMA:
                    drafts[cut] = (drafts[cut] + 1) % cfg.text.vocab_size
                block = [emitted[-1]] + drafts
                got = _verify(engine, caches, slots, {1: (P, block)})[1]
                if oracle:              # after the re-prefill (the rounds before it: the rollback test)
                    want = reference.forward(reference.new_request(), prompt + emitted[:-1] + block).logits[-W:]
                    torch.testing.assert_close(got, want, atol=0, rtol=0)
                outcome = verify_greedy(drafts, got)
                assert outcome.accepted == min(cut, GAMMA)
                c = outcome.accepted + 1
                caches.engram_history.commit_verify(torch.tensor([1]), torch.tensor([P]), torch.tensor([c]), check=True)
                for i, row in enumerate(keep(c)):          # the rows write_target_hidden_kv writes (commit_lens)
                    captured[P + i] = row
                emitted += list(outcome.tokens)
                P += c
            return P

        first = run_batch(engine, caches, slots, [(1, 0, prompt)])[0]
        captured |= dict(enumerate(keep(len(prompt))))
        emitted = [int(torch.argmax(first[-1]))]
        P = rounds(len(prompt), emitted, RETRACT_BEFORE, oracle=False)
        cached = slots.host[1, :HIT].clone()                     # the radix cache keeps the prompt's pages
        slots.next_page = int(slots.host[1, HIT]) // slots.page_size     # the rest are freed and reused
        run_batch(engine, caches, slots, [(1, 0, other)])
        _verify(engine, caches, slots, {1: (len(other), [5, 6, 7, 8, 9, 10])})
        caches.engram_history.commit_verify(torch.tensor([1]), torch.tensor([len(other)]), torch.tensor([3]), check=True)
        fill = prompt + emitted                                  # re-admitted: prompt + outputs, row 1 again
        slots.host[1, :HIT] = cached
        slots.table[1, :HIT] = cached
        again = run_batch(engine, caches, slots, [(1, HIT, fill[HIT:])], context={1: fill[:HIT]})[0]
        for p, row in enumerate(keep(P - HIT), start=HIT):
            assert torch.equal(row, captured[p]), p
        emitted.append(int(torch.argmax(again[-1])))
        P = rounds(P + 1, emitted, RETRACT_AFTER, oracle=True)
        assert emitted == greedy[: len(emitted)] and len(emitted) >= 12
        assert int(caches.engram_history.end[1]) == P
    finally:
        engine.set_capture_layers(())

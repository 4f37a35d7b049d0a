"""The runtime DSpark draft (`runtime/dspark_*.py`) against the reference (`reference/dspark.py`),
spec `model.md` §4; docs/dspark.md.

Tolerances: on the exact CPU backend (`deterministic=True`, what `--enable-deterministic-inference`
serves) every piece — context kv rows, block hidden, base logits, Markov-corrected logits, draft
tokens, confidences — is **bit-identical** to the reference, for several requests of different
committed lengths batched together (P < W, P = W, P > W). On the fp32 serving backend the draft
(greedy) tokens equal the reference's and the context rows are within 2 BF16 ulps of their row
scale; block logits are within `FP32_LOGIT_BOUND` (measured 0.11 on this fixture: one of three
blocks has a BF16 flip that the random tiny stages amplify; the draft only proposes, the target
decides). Also the SGLang-facing class: weights from the stored checkpoint, context writes with
`commit_lens`, `forward` through SGLang's forward context, heads' interfaces. The block is the
server's γ (`--speculative-dspark-block-size`), not the checkpoint's `dspark_block_size` (5):
blocks of 1, 3 and 7 rows equal the reference's stage stack on as many rows, bit for bit.
"""
from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from reference_weights import random_reference_weights, tiny_config

from sglang_dsv41.reference import dspark as ref
from sglang_dsv41.reference.ops import CacheProfile, bf16
from sglang_dsv41.runtime.dspark_draft import DSparkDraft
from sglang_dsv41.runtime.dspark_kv import DSparkContextKV

CFG = tiny_config(vision=False)
T = CFG.text
W = random_reference_weights(CFG, seed=11, vision=False)
NONE = CacheProfile.NONE
G = T.dspark_block_size
S = T.num_nextn_predict_layers
N_FEAT = len(T.dspark_target_layer_ids)
LENGTHS = (3, 8, 12, 20)          # committed lengths: < W, = W, > W (tiny sliding_window = 8)
ANCHORS = (42, 7, 500, 999)
FP32_LOGIT_BOUND = 0.25


def _draft(deterministic: bool) -> DSparkDraft:
    return DSparkDraft(CFG, {n: v for n, v in W.items() if n.startswith("mtp.")}, deterministic=deterministic)


def _features(P: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return bf16(torch.randn(P, N_FEAT, T.hidden_size, generator=g))


class Batch:
    """Several requests' contexts in a slot store (runtime) and as reference `DraftContext`s."""

    def __init__(self, draft: DSparkDraft, lengths=LENGTHS):
        self.lengths = list(lengths)
        self.store = DSparkContextKV(S, 1 + sum(lengths), T.head_dim, "cpu")
        self.req_to_token = torch.zeros(len(lengths) + 1, max(lengths) + G, dtype=torch.int64)
        self.contexts, self.rows = [], []
        slot = 1
        for b, P in enumerate(lengths):
            feats = _features(P, seed=b)
            ctx = ref.DraftContext.empty(T)
            ctx.commit_features(T, W, feats, profile=NONE, act_quant=True)
            self.contexts.append(ctx)
            slots = torch.arange(slot, slot + P)
            slot += P
            self.req_to_token[b + 1, :P] = slots          # row 0 unused, like SGLang's padding row
            rows = draft.context_rows(feats.reshape(P, N_FEAT * T.hidden_size), torch.arange(P))
            self.rows.append(rows)
            for s in range(S):
                self.store.write_rows(s, slots, rows[s])

    def run(self, draft: DSparkDraft, anchors=ANCHORS, g: int = G):
        ids = torch.tensor([t for a in anchors for t in ref.block_token_ids(replace(T, dspark_block_size=g), a)])
        positions = torch.cat([torch.arange(P, P + g) for P in self.lengths])
        req_rows = torch.arange(1, len(self.lengths) + 1)
        windows = [self.store.window(s, req_rows, self.req_to_token, torch.tensor(self.lengths), T.sliding_window)
                   for s in range(S)]
        hidden = draft.block_hidden(W["embed.weight"], ids, positions, windows)
        return hidden, draft.base_logits(hidden, W["head.weight"])


@pytest.fixture(scope="module")
def exact():
    draft = _draft(True)
    batch = Batch(draft)
    return draft, batch, *batch.run(draft)


def test_context_rows_equal_reference(exact):
    _, batch, _, _ = exact
    for b, ctx in enumerate(batch.contexts):
        for s in range(S):
            assert torch.equal(batch.rows[b][s], ctx.kv[s]), (b, s)


def test_batched_blocks_equal_reference_per_request(exact):
    _, batch, hidden, logits = exact
    for b, (ctx, anchor) in enumerate(zip(batch.contexts, ANCHORS)):
        out = ref.draft_block_forward(T, W, ctx, anchor, profile=NONE, act_quant=True)
        assert torch.equal(hidden[b * G:(b + 1) * G], out.hidden), b
        assert torch.equal(logits[b * G:(b + 1) * G], out.base_logits), b


@pytest.mark.parametrize("g", [1, 3, 7])
def test_blocks_of_the_servers_size_equal_reference(exact, g):
    """γ = rows / requests, whatever the checkpoint's dspark_block_size (5): the block the server
    drafts (`--speculative-dspark-block-size 7` crashed the H200 decode before; docs/dspark.md)."""
    draft, batch, _, _ = exact
    hidden, logits = batch.run(draft, g=g)
    assert hidden.shape == (len(LENGTHS) * g, T.hidden_size)
    for b, (ctx, anchor) in enumerate(zip(batch.contexts, ANCHORS)):
        ids = torch.tensor([anchor] + [T.dspark_noise_token_id] * (g - 1))
        out = ref.run_stages(T, W, ctx, ids, profile=NONE, act_quant=True)
        assert torch.equal(hidden[b * g:(b + 1) * g], out.hidden), b
        assert torch.equal(logits[b * g:(b + 1) * g], out.base_logits), b


def test_block_rows_see_only_their_window(exact):
    """Positions before P−W are not read; the last W are (the reference's window rule)."""
    draft, batch, hidden, _ = exact
    b, P = 3, LENGTHS[3]
    slots = batch.req_to_token[b + 1]
    for pos, changes in ((P - T.sliding_window - 1, False), (P - T.sliding_window, True), (P - 1, True)):
        saved = batch.store.kv[0][slots[pos]].clone()
        batch.store.kv[0][slots[pos]] = -saved
        moved, _ = batch.run(draft)
        batch.store.kv[0][slots[pos]] = saved
        assert torch.equal(moved[b * G:(b + 1) * G], hidden[b * G:(b + 1) * G]) is not changes, pos
        assert torch.equal(moved[: b * G], hidden[: b * G])          # other requests never see it


@pytest.mark.parametrize("greedy", [True, False])
def test_markov_sampling_and_confidence_equal_reference(exact, greedy):
    draft, batch, hidden, logits = exact
    for b, anchor in enumerate(ANCHORS):
        rows = slice(b * G, (b + 1) * G)
        g_ref, g_run = torch.Generator().manual_seed(5 + b), torch.Generator().manual_seed(5 + b)
        prop = ref.propose_drafts(T, W, hidden[rows], logits[rows], anchor, greedy=greedy, temperature=0.7,
                                  generator=None if greedy else g_ref)

        def sampler(step_logits, k):
            if greedy:
                return torch.argmax(step_logits, dim=-1)
            q = torch.softmax(step_logits / 0.7, dim=-1)
            return torch.multinomial(q[0], 1, generator=g_run)

        tokens, corrected = draft.markov_head.sample_block(logits[rows].unsqueeze(0),
                                                           first_prev_tokens=torch.tensor([anchor]),
                                                           hidden_states=None, sampler=sampler)
        assert tuple(tokens[0].tolist()) == prop.tokens
        assert torch.equal(corrected[0], prop.logits)
        prev = torch.tensor([[anchor, *prop.tokens[:-1]]])
        assert torch.equal(draft.confidence(hidden[rows].unsqueeze(0), prev)[0], prop.confidence)


def test_fp32_backend_within_tolerance(exact):
    _, ref_batch, ref_hidden, ref_logits = exact
    draft = _draft(False)
    batch = Batch(draft)
    for b in range(len(LENGTHS)):
        for s in range(S):
            scale = ref_batch.rows[b][s].abs().amax(dim=-1, keepdim=True)
            assert ((batch.rows[b][s] - ref_batch.rows[b][s]).abs() <= 2 * 2.0**-8 * scale).all()
    hidden, logits = batch.run(draft)
    assert (logits - ref_logits).abs().max() <= FP32_LOGIT_BOUND
    for b, anchor in enumerate(ANCHORS):
        rows = slice(b * G, (b + 1) * G)
        want = ref.propose_drafts(T, W, ref_hidden[rows], ref_logits[rows], anchor, greedy=True).tokens
        got, _ = draft.markov_head.sample_block(logits[rows].unsqueeze(0), first_prev_tokens=torch.tensor([anchor]),
                                                hidden_states=None, sampler=lambda x, k: torch.argmax(x, dim=-1))
        assert tuple(got[0].tolist()) == want, b


def test_bad_inputs_raise(exact):
    draft, batch, _, _ = exact
    with pytest.raises(ValueError, match="features"):
        draft.context_rows(torch.zeros(2, T.hidden_size), torch.arange(2))
    two = [(torch.zeros(2, 8, T.head_dim), torch.ones(2, 8, dtype=torch.bool))] * S
    for n in (2 * G + 1, 1):                 # not whole blocks; fewer rows than requests
        with pytest.raises(ValueError, match="not 2 blocks"):
            draft.block_hidden(W["embed.weight"], torch.zeros(n, dtype=torch.long), torch.zeros(n), two)
    with pytest.raises(ValueError, match="not 2 blocks"):
        draft.block_hidden(W["embed.weight"], torch.zeros(2 * G, dtype=torch.long), torch.zeros(2 * G + 1), two)
    with pytest.raises(ValueError, match="request counts"):
        draft.block_hidden(W["embed.weight"], torch.zeros(2 * G, dtype=torch.long), torch.zeros(2 * G),
                           two[:-1] + [(torch.zeros(3, 8, T.head_dim), torch.ones(3, 8, dtype=torch.bool))])
    with pytest.raises(ValueError, match="Markov"):
        draft.markov_head.get_prev_embeddings(torch.tensor([T.vocab_size]))
    weights = {n: v for n, v in W.items() if n.startswith("mtp.")}
    weights["mtp.0.stray.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match="no module owns"):
        DSparkDraft(CFG, weights)


# ---- weights from the stored checkpoint and the SGLang-facing class -------------------------------

@pytest.fixture(scope="module")
def stored(tiny_checkpoint):
    from sglang_dsv41.checkpoint.reader import CheckpointReader

    with CheckpointReader(tiny_checkpoint) as reader:
        return {name: reader.get(name) for name in reader.names()}


def test_dspark_weights_equal_the_reference_loader(tiny_checkpoint, stored):
    from sglang_dsv41.checkpoint.loader import load_reference_weights
    from sglang_dsv41.config import DeepseekV41Config
    from sglang_dsv41.runtime.dspark_weights import dspark_runtime_weights

    cfg = DeepseekV41Config.from_file(tiny_checkpoint)
    got = dspark_runtime_weights(stored, cfg, torch.device("cpu"), experts_mxfp4=False)
    want = {n: v for n, v in load_reference_weights(tiny_checkpoint, cfg, vision=False).items() if n.startswith("mtp.")}
    assert set(got) == set(want)
    assert all(torch.equal(got[n], want[n]) for n in want)
    missing = {n: v for n, v in stored.items() if n != "mtp.1.attn.wkv.weight"}
    with pytest.raises(Exception, match="mtp.1.attn.wkv.weight"):
        dspark_runtime_weights(missing, cfg, torch.device("cpu"), experts_mxfp4=False)


class _Holder(torch.nn.Module):
    def __init__(self, weight):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)


@pytest.fixture(scope="module")
def sglang_draft(tiny_checkpoint, stored):
    from sglang_dsv41 import plugin
    from sglang_dsv41.checkpoint.loader import load_reference_weights
    from sglang_dsv41.config import DeepseekV41Config
    from sglang_dsv41.runtime.dspark_model import DeepseekV41ForCausalLMDSpark
    from sglang_dsv41.runtime.hf_config import DeepseekV41HFConfig

    plugin.register_config()
    hf = DeepseekV41HFConfig.from_pretrained(str(tiny_checkpoint))
    model = DeepseekV41ForCausalLMDSpark(hf)
    with pytest.MonkeyPatch.context() as mp:       # --enable-deterministic-inference: the exact backend
        mp.setattr("sglang_dsv41.runtime.model.deterministic_inference", lambda: True)
        model.load_weights(stored.items())
    cfg = DeepseekV41Config.from_file(tiny_checkpoint)
    weights = load_reference_weights(tiny_checkpoint, cfg, vision=False)
    model.attach_shared_modules(embed_tokens=_Holder(weights["embed.weight"]), lm_head=_Holder(weights["head.weight"]))
    return model, cfg, weights


@pytest.mark.parametrize("g", [G, 7])
def test_sglang_class_write_forward_heads(sglang_draft, g):
    """write_target_hidden_kv (with commit_lens) into the draft pool → forward in TARGET_VERIFY layout
    through SGLang's forward context → compute_base_logits / markov / compute_confidence == the reference,
    for the checkpoint's block (5) and a server's `--speculative-dspark-block-size 7` (the H200 PD decode
    with γ 7 stopped at its first draft forward: "7 ids for 1 blocks of 5")."""
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    model, cfg, w = sglang_draft
    t = cfg.text
    t_g = replace(t, dspark_block_size=g)               # the reference's block of g rows
    lengths, anchors = (6, 13), (17, 400)
    from sglang_dsv41.runtime.dspark_pool import DeepseekV41DSparkPool

    pool = DeepseekV41DSparkPool(t, size=62, page_size=2, device="cpu")       # the draft worker's pool
    store = pool.dspark_context
    req_to_token = torch.zeros(3, 32, dtype=torch.int64)
    contexts = []
    for b, P in enumerate(lengths):
        feats = _features(P, seed=20 + b)
        ctx = ref.DraftContext.empty(t)
        ctx.commit_features(t, w, feats, profile=NONE, act_quant=True)
        contexts.append(ctx)
        req_to_token[b + 1, :P + 2] = torch.arange(1 + 30 * b, 1 + 30 * b + P + 2)
        # a verify-window write: P real rows then 2 rejected ones (commit_lens masks them)
        flat = torch.cat((feats.reshape(P, -1), torch.randn(2, N_FEAT * t.hidden_size)))
        model.write_target_hidden_kv(target_hidden=flat, pool=pool,
                                     positions=torch.arange(P + 2), cache_loc=req_to_token[b + 1, :P + 2],
                                     cache_loc_2d=req_to_token[b + 1, :P + 2].reshape(1, -1),
                                     commit_lens=torch.tensor([P]))
        assert not store.kv[0][req_to_token[b + 1, P:P + 2]].any()           # rejected rows not written
    ids = torch.tensor([x for a in anchors for x in ref.block_token_ids(t_g, a)])
    positions = torch.cat([torch.arange(P, P + g) for P in lengths])
    batch = SimpleNamespace(forward_mode=ForwardMode.TARGET_VERIFY, req_pool_indices=torch.tensor([1, 2]),
                            seq_lens=torch.tensor(lengths))
    backend = SimpleNamespace(token_to_kv_pool=pool,
                              req_to_token_pool=SimpleNamespace(req_to_token=req_to_token))
    with forward_context(ForwardContext(attn_backend=backend)):
        out = model.forward(ids, positions, batch)
    assert isinstance(out, LogitsProcessorOutput) and out.next_token_logits is None
    logits, tap = model.compute_base_logits(out.hidden_states)
    assert tap is out.hidden_states
    base = logits.view(2, g, -1)
    tokens, _ = model.markov_head.sample_block(base, first_prev_tokens=torch.tensor(anchors),
                                               hidden_states=None, sampler=lambda x, k: torch.argmax(x, dim=-1))
    conf = model.compute_confidence(anchor_tokens=torch.tensor(anchors), sampled_tokens=tokens, x_post_hc=tap)
    for b, (ctx, anchor) in enumerate(zip(contexts, anchors)):
        r = ref.draft_block_forward(t_g, w, ctx, anchor, profile=NONE, act_quant=True)
        prop = ref.propose_drafts(t_g, w, r.hidden, r.base_logits, anchor, greedy=True)
        assert torch.equal(out.hidden_states[b * g:(b + 1) * g], r.hidden)
        assert tuple(tokens[b].tolist()) == prop.tokens and len(prop.tokens) == g
        assert torch.equal(conf[b], prop.confidence)
    with pytest.raises(ValueError, match="one block of"):
        model.block_hidden(ids[:-1], positions[:-1], torch.tensor([1, 2]), torch.tensor(lengths), req_to_token, store)
    with pytest.raises(ValueError, match="confidence"):
        model.compute_confidence(anchor_tokens=torch.tensor(anchors), sampled_tokens=tokens[:, :-1], x_post_hc=tap)
    with pytest.raises(ValueError, match="P..P"):
        model.block_hidden(ids, positions + 1, torch.tensor([1, 2]), torch.tensor(lengths), req_to_token, store)
    with pytest.raises(RuntimeError, match="no DSpark context"):
        model.write_target_hidden_kv(target_hidden=flat[:1], pool=object(), positions=torch.arange(1),
                                     cache_loc=torch.tensor([1]))


def test_sglang_class_interface_and_static_mode(sglang_draft):
    model, cfg, _ = sglang_draft
    assert model.trained_block_size == cfg.text.dspark_block_size and not hasattr(model, "gamma")
    assert model.num_stages == cfg.text.num_nextn_predict_layers
    assert model.markov_head.markov_rank == cfg.text.dspark_markov_rank
    assert model.confidence_head is None and not model.enable_confidence_head   # SGLang default: static verify
    assert model.lm_head.weight.shape == (cfg.text.vocab_size, cfg.text.hidden_size)      # the attached target head
    with pytest.raises(ValueError, match="weight"):
        model.attach_shared_modules(embed_tokens=_Holder(torch.zeros(3, 3)), lm_head=_Holder(torch.zeros(3, 3)))
    names = {n for n, _ in model.named_parameters()}
    assert names and all(".mtp" not in n for n in names) and len(names) == len(set(names))
    assert not any("embed_tokens" in n or "lm_head" in n for n in names)         # target modules not owned


def test_pd_prefill_prune_keeps_context_rows_and_refuses_a_block(sglang_draft):
    """On a PD prefill SGLang calls `prune_to_ctx_kv_injection`: the context rows are still written
    (they travel to the decode, docs/pd.md), a block forward is refused."""
    from sglang_dsv41.runtime.dspark_pool import DeepseekV41DSparkPool

    model, cfg, _ = sglang_draft
    pool = DeepseekV41DSparkPool(cfg.text, size=30, page_size=2, device="cpu")
    try:
        model.prune_to_ctx_kv_injection()
        model.write_target_hidden_kv(target_hidden=_features(3, seed=5).reshape(3, -1), pool=pool,
                                     positions=torch.arange(3), cache_loc=torch.tensor([4, 5, 6]))
        assert pool.dspark_context.kv[0][4:7].abs().sum() > 0 and not pool.dspark_context.kv[0][7:].any()
        with pytest.raises(RuntimeError, match="PD prefill"):
            model.block_hidden(torch.zeros(G, dtype=torch.int64), torch.arange(3, 3 + G),
                               torch.tensor([1]), torch.tensor([3]), torch.zeros(2, 8, dtype=torch.int64),
                               pool.dspark_context)
    finally:
        model.context_only = False


def test_base_logits_go_through_the_target_head_method(sglang_draft):
    """With the target's `LMHead`, the product is its method's (the target backend holds the head
    on CUDA); same values as the draft's own product on the exact backend."""
    from sglang_dsv41.runtime.backend import ExactTorchBackend
    from sglang_dsv41.runtime.model import LMHead

    model, cfg, w = sglang_draft
    x = bf16(torch.randn(2 * G, cfg.text.hidden_size, generator=torch.Generator().manual_seed(3)))
    own, _ = model.compute_base_logits(x)
    head = LMHead(torch.nn.Parameter(w["head.weight"].clone(), requires_grad=False), cfg.text.vocab_size)
    calls = []

    class Recording(ExactTorchBackend):
        def matmul(self, a, b):
            calls.append(b is head.weight)
            return super().matmul(a, b)

    recording = Recording()
    head.quant_method.logits = lambda h: recording.matmul(h, head.weight)     # the model sets TorchForward.logits
    embed = _Holder(w["embed.weight"])
    try:
        model.attach_shared_modules(embed_tokens=embed, lm_head=head)
        via_target, _ = model.compute_base_logits(x)
    finally:
        model.attach_shared_modules(embed_tokens=embed, lm_head=_Holder(w["head.weight"]))
    assert calls == [True] and torch.equal(via_target, own)

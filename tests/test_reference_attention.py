"""Reference attention sublayer (spec §3.4, §3.5, §3.8) on the tiny config (spec §7).

Tiny roles: 0 SWA-only; 1 ratio-2 kv source + indexer; 2 ratio-2 reader reusing 1; 3 second
ratio-2 source; 4 ratio-1 source + candidate source; 5 reuses 4; 6 candidate consumer; 7 reuses 6.
Window 8, index_topk 4, candidate 3 blocks of 4, prompts of 45 tokens (all of them bind; the odd
length leaves a pending ratio-2 token).

Helpers here (weights, inputs, chunked driver) are also used by the brute-force test module.
"""
from __future__ import annotations

import math

import pytest
import torch

from sglang_dsv41 import presets
from sglang_dsv41.checkpoint.codecs import dequantize_fp8_block, quantize_fp8_block
from sglang_dsv41.checkpoint.names import Kind, tensor_inventory
from sglang_dsv41.config import DeepseekV41Config, TextConfig
from sglang_dsv41.reference import ops
from sglang_dsv41.reference.attention import (
    AttentionState,
    ChunkScratch,
    attend_with_sink,
    attention_sublayer,
    layer_inv_freq,
    project_q,
)
from sglang_dsv41.reference.indexer import (
    block_membership,
    candidate_blocks,
    index_query,
    index_scores,
    top_k_lower_index_on_ties,
)

T_PROMPT = 45
NONE, FP8, FP4 = ops.CacheProfile.NONE, ops.CacheProfile.FP8, ops.CacheProfile.FP4


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny matmuls: one thread is faster and immune to a loaded 2-core machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ---- helpers --------------------------------------------------------------------------------

def tiny_text() -> TextConfig:
    return DeepseekV41Config.from_dict(presets.tiny_config_dict(500)).text


def attention_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded random `layers.*.attn.*` weights with loader-like values (spec §2.4): FP8 weights
    round-tripped through 32×32 E4M3 tiles (wo_a too: FP8 dequantised to BF16 is exact), BF16
    weights BF16-rounded, norms 1+0.1·N BF16, sinks fp32; matrices ~ 1/sqrt(fan_in)."""
    cfg = DeepseekV41Config.from_dict(presets.tiny_config_dict(500))
    g = torch.Generator().manual_seed(seed)
    w: dict[str, torch.Tensor] = {}
    for spec in tensor_inventory(cfg, vision=False, dspark=False):
        if not (spec.name.startswith("layers.") and ".attn." in spec.name):
            continue
        if spec.name.endswith("attn_sink"):
            w[spec.name] = 0.5 * torch.randn(*spec.shape, generator=g)
        elif spec.name.endswith("norm.weight"):
            w[spec.name] = ops.bf16(1.0 + 0.1 * torch.randn(*spec.shape, generator=g))
        else:
            v = torch.randn(*spec.shape, generator=g) / math.sqrt(spec.shape[1])
            w[spec.name] = dequantize_fp8_block(*quantize_fp8_block(v)) if spec.kind is Kind.FP8 else ops.bf16(v)
    return w


def layer_inputs(t: TextConfig, n_tokens: int = T_PROMPT, seed: int = 1) -> list[torch.Tensor]:
    """One BF16-valued [T, hidden] input per layer (the sublayer input is per-layer data)."""
    g = torch.Generator().manual_seed(seed)
    return [ops.bf16(torch.randn(n_tokens, t.hidden_size, generator=g)) for _ in range(t.num_hidden_layers)]


class Run:
    """Outputs / selections / blocks of every layer over a prompt processed in `splits`."""

    def __init__(self, t, w, xs, splits, profile=NONE, act_quant=True, state=None):
        self.state = state if state is not None else AttentionState.empty(t, profile)
        roles = t.layer_roles()
        outs: list[list[torch.Tensor]] = [[] for _ in roles]
        sels: dict[int, list[torch.Tensor]] = {}
        blocks: dict[int, list[torch.Tensor]] = {}
        start = 0
        for n in splits:
            scratch = ChunkScratch()
            pos = torch.arange(self.state.length, self.state.length + n, device=xs[0].device)
            for r in roles:
                x = xs[r.layer][start:start + n]
                outs[r.layer].append(attention_sublayer(t, r, w, r.layer, x, pos, self.state, scratch,
                                                        profile, act_quant))
            for k, s in scratch.selections.items():
                sels.setdefault(k, []).append(s.indices)
            for k, b in scratch.candidate_blocks.items():
                blocks.setdefault(k, []).append(b)
            self.state.advance(n)
            start += n
        self.outputs = [torch.cat(o) for o in outs]
        self.selections = {k: torch.cat(v) for k, v in sels.items()}
        self.blocks = {k: torch.cat(v) for k, v in blocks.items()}


def row_set(row: torch.Tensor) -> set[int]:
    return {int(j) for j in row if j >= 0}


@pytest.fixture(scope="module")
def setup():
    t = tiny_text()
    w = attention_weights()
    xs = layer_inputs(t)
    return t, w, xs, Run(t, w, xs, [T_PROMPT])


# ---- chunked == one shot --------------------------------------------------------------------

def _assert_same_state(a: AttentionState, b: AttentionState) -> None:
    assert a.length == b.length
    for store in ("swa_kv", "compressed_kv", "index_keys"):
        for k in getattr(a, store):
            assert torch.equal(getattr(a, store)[k], getattr(b, store)[k]), (store, k)
    for k in a.pending:
        pa, pb = a.pending[k], b.pending[k]
        assert (pa is None) == (pb is None), k
        if pa is not None:
            assert pa.position == pb.position and torch.equal(pa.a, pb.a) and torch.equal(pa.s, pb.s)


@pytest.mark.parametrize("splits", [
    [17, 28],                 # odd split: ratio-2 pair (16, 17) straddles the chunks
    [16, 29],                 # even split
    [1] * T_PROMPT,           # token-by-token decode
    [5, 2, 30, 3, 5],
    [2, 1, 1, 39, 2],
], ids=["odd", "even", "token_by_token", "mixed", "mixed2"])
def test_chunked_equals_one_shot_every_role(setup, splits):
    t, w, xs, one = setup
    ch = Run(t, w, xs, splits)
    for layer in range(t.num_hidden_layers):
        assert torch.equal(ch.outputs[layer], one.outputs[layer]), f"layer {layer} ({t.layer_roles()[layer]})"
    assert set(ch.selections) == {1, 3, 4, 6}
    for k in one.selections:
        assert torch.equal(ch.selections[k], one.selections[k]), k
    assert torch.equal(ch.blocks[4], one.blocks[4])
    _assert_same_state(ch.state, one.state)


@pytest.mark.parametrize("profile", [FP8, FP4])
def test_chunked_equals_one_shot_quantised_profiles(setup, profile):
    t, w, xs, _ = setup
    one = Run(t, w, xs, [T_PROMPT], profile)
    ch = Run(t, w, xs, [17, 1, 27], profile)
    for layer in range(t.num_hidden_layers):
        assert torch.equal(ch.outputs[layer], one.outputs[layer]), layer
    _assert_same_state(ch.state, one.state)


def test_clone_forks_a_prefix(setup):
    t, w, xs, one = setup
    prefix = Run(t, w, [x[:21] for x in xs], [21])
    fork = prefix.state.clone()
    rest = Run(t, w, [x[21:] for x in xs], [24], state=fork)
    for layer in range(t.num_hidden_layers):
        assert torch.equal(torch.cat((prefix.outputs[layer], rest.outputs[layer])), one.outputs[layer])
    assert prefix.state.length == 21 and prefix.state.swa_kv[0].shape[0] == 21  # original untouched
    assert prefix.state.pending[1] is not None and prefix.state.pending[1].position == 20
    assert one.state.pending[1].position == 44 and one.state.compressed_kv[1].shape[0] == 22


# ---- visibility -----------------------------------------------------------------------------

def test_selection_visibility_and_sizes(setup):
    t, _, _, one = setup
    for layer, sel in one.selections.items():
        ratio = t.compress_ratios[layer]
        for p in range(T_PROMPT):
            n_vis = (p + 1) // ratio
            chosen = row_set(sel[p])
            assert len(chosen) == min(t.index_topk, n_vis), (layer, p)
            assert all(j < n_vis for j in chosen), (layer, p)
            if n_vis <= t.index_topk:  # n_t < index_topk: everything visible is selected
                assert chosen == set(range(n_vis))
    assert row_set(one.selections[1][0]) == set()   # ratio 2 before the first pair completes
    assert row_set(one.selections[4][0]) == {0}     # ratio 1 sees its own latent


def test_first_token_of_ratio2_layer_attends_only_itself(setup):
    t, w, xs, _ = setup
    roles = t.layer_roles()
    state, scratch = AttentionState.empty(t, NONE), ChunkScratch()
    pos = torch.zeros(1, dtype=torch.int64)
    out = attention_sublayer(t, roles[1], w, 1, xs[1][:1], pos, state, scratch, NONE, True)
    assert state.compressed_kv[1].shape[0] == 0 and state.pending[1].position == 0
    # no compressed key: the output equals attention over the token's own SWA kv only
    from sglang_dsv41.reference.attention import output_projection
    inv = layer_inv_freq(t, 2)
    _, q = project_q(t, w, "layers.1.attn.", xs[1][:1], pos, inv, True)
    o = attend_with_sink(q, state.swa_kv[1][None], w["layers.1.attn.attn_sink"])
    assert torch.equal(out, output_projection(t, w, "layers.1.attn.", o, pos, inv, True))


# ---- top-k tie rule and candidate blocks ------------------------------------------------------

def test_top_k_lower_index_wins_ties():
    s = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0, 3.0],
                      [0.0, -0.0, 0.0, 0.0, 5.0, 0.0],
                      [9.0, 9.0, 9.0, 9.0, 9.0, 9.0]])
    allowed = torch.tensor([[True] * 6, [True] * 6, [False, True, False, False, False, True]])
    got = top_k_lower_index_on_ties(s, allowed, 3)
    assert got.tolist() == [[1, 2, 4], [0, 1, 4], [1, 5, -1]]
    assert top_k_lower_index_on_ties(s[:, :0], allowed[:, :0], 2).tolist() == [[-1, -1]] * 3
    with pytest.raises(ValueError):
        top_k_lower_index_on_ties(torch.tensor([[float("nan"), 1.0]]), torch.tensor([[True, True]]), 1)


def test_candidate_blocks_newest_forced_max_key_and_ties():
    B = 4
    scores = torch.tensor([[5.0, 0.0, 0.0, 0.0,   1.0, 1.0, 1.0, 1.0,   1.0, 0.0, 0.0, 0.0,
                            -1.0, 9.0, 0.0, 0.0,   0.0, 0.0]])
    # n = 13: blocks 0..3 visible (block 3 has only position 12); position 13 (9.0) is invisible
    got = candidate_blocks(scores, torch.tensor([13]), B, 3)
    assert got.tolist() == [[0, 1, 3]]          # newest block 3 forced; blocks 1, 2 tie at 1 → 1
    assert candidate_blocks(scores, torch.tensor([13]), B, 10).tolist() == [[0, 1, 2, 3] + [-1] * 6]
    assert candidate_blocks(scores, torch.tensor([0]), B, 3).tolist() == [[-1, -1, -1]]
    members = block_membership(torch.tensor([[0, 3, -1]]), B, 14)
    assert members.tolist() == [[True] * 4 + [False] * 8 + [True] * 2]


def test_candidate_stage_restricts_only_beyond_the_candidate_span(setup):
    t, w, xs, one = setup
    B, C = t.candidate_block_size, t.candidate_topk_blocks
    blocks, consumer = one.blocks[4], one.selections[6]
    # the consumer's unrestricted full top-k, from its own queries against layer 4's keys
    role6 = t.layer_roles()[6]
    pos = torch.arange(T_PROMPT)
    inv = layer_inv_freq(t, 1)
    q_lora, _ = project_q(t, w, "layers.6.attn.", xs[6], pos, inv, True)
    scores = index_scores(index_query(t, w, "layers.6.attn.", xs[6], q_lora, pos, inv, True),
                          one.state.index_keys[role6.kv_source])
    visible = torch.arange(T_PROMPT)[None, :] <= pos[:, None]
    full = top_k_lower_index_on_ties(scores, visible, t.index_topk)
    differs = 0
    for p in range(T_PROMPT):
        n_vis = p + 1
        kept = row_set(blocks[p])
        assert len(kept) == min(C, -(-n_vis // B))
        assert (n_vis - 1) // B in kept                       # newest block always kept
        assert all(j // B in kept for j in row_set(consumer[p]))  # consumer stays inside the blocks
        if -(-n_vis // B) <= C:                                # ≤ 12 positions: no restriction
            assert torch.equal(consumer[p], full[p]), p
        else:
            differs += not torch.equal(consumer[p], full[p])
    assert differs > 0, "candidate stage never restricted anything (weak test data)"
    # the candidate source's own selection is the unrestricted full top-k
    assert any(any(j // B not in row_set(blocks[p]) for j in row_set(one.selections[4][p]))
               for p in range(T_PROMPT))


def test_reuse_layers_use_the_latest_indexer_selection(setup):
    t, w, xs, _ = setup
    roles = t.layer_roles()
    assert [r.selection_from for r in roles] == [None, 1, 1, 3, 4, 4, 6, 6]
    state, scratch = AttentionState.empty(t, NONE), ChunkScratch()
    pos = torch.arange(6)
    attention_sublayer(t, roles[0], w, 0, xs[0][:6], pos, state, scratch, NONE, True)
    with pytest.raises(ValueError, match="no selection of indexer layer 1"):
        attention_sublayer(t, roles[2], w, 2, xs[2][:6], pos, state, scratch, NONE, True)


# ---- sink, RoPE ------------------------------------------------------------------------------

def test_sink_minus_infinity_is_plain_softmax_and_sink_is_a_denominator_term():
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(5, 3, 16, generator=g), torch.randn(5, 7, 16, generator=g)
    valid = torch.rand(5, 7, generator=g) < 0.7
    valid[:, 0] = True
    logits = torch.einsum("thd,tsd->ths", q, k) / 4.0
    logits = logits.masked_fill(~valid[:, None, :], -torch.inf)
    plain = torch.einsum("ths,tsd->thd", torch.softmax(logits, dim=-1), k)
    got = attend_with_sink(q, k, torch.full((3,), -torch.inf), valid)
    assert torch.equal(got, ops.bf16(got))  # BF16-valued output
    assert torch.allclose(got, plain, atol=1e-2, rtol=1e-2)  # ≤ 1 BF16 ulp at these magnitudes
    sink = torch.tensor([0.0, 1.5, -2.0])
    with_sink = torch.cat((logits, sink[None, :, None].expand(5, 3, 1)), dim=-1)
    expect = torch.einsum("ths,tsd->thd", torch.softmax(with_sink, dim=-1)[..., :-1], k)
    assert torch.allclose(attend_with_sink(q, k, sink, valid), expect, atol=1e-2, rtol=1e-2)
    assert attend_with_sink(q, k, torch.full((3,), 60.0), valid).abs().max() < 1e-6


def _independent_inv_freq(d: int, base: float, orig: int | None, factor: float = 16.0) -> torch.Tensor:
    i = torch.arange(d // 2, dtype=torch.float64)
    inv = base ** (-2 * i / d)
    if orig is None:
        return inv.float()
    corr = lambda r: d * math.log(orig / (2 * math.pi * r)) / (2 * math.log(base))  # noqa: E731
    low, high = max(math.floor(corr(32)), 0), min(math.ceil(corr(1)), d - 1)
    assert (low, high) == (0, 5)  # spec §7: all three YaRN regimes used by the tiny config
    ramp = ((i - low) / (high - low)).clamp(0, 1)
    return (inv * ramp / factor + inv * (1 - ramp)).float()


def test_rope_base_or_yarn_chosen_by_ratio(setup):
    t, w, xs, one = setup
    base = _independent_inv_freq(32, 10000.0, None)
    yarn = _independent_inv_freq(32, 160000.0, 256)
    assert torch.allclose(layer_inv_freq(t, 0), base, rtol=1e-6)
    for ratio in (1, 2):
        assert torch.allclose(layer_inv_freq(t, ratio), yarn, rtol=1e-6)
    # the cached kv of layer 0 (ratio 0) and layer 1 (ratio 2) is rotated with its own table
    from sglang_dsv41.reference.attention import project_kv
    pos = torch.arange(T_PROMPT)
    for layer, good, bad in ((0, base, yarn), (1, yarn, base)):
        prefix = f"layers.{layer}.attn."
        stored = one.state.swa_kv[layer]
        normed = project_kv(t, w, prefix, xs[layer], pos, good, True)
        assert torch.equal(stored, ops.swa_cache_roundtrip(normed, pos, good, ops.CacheProfile.NONE, 32))
        assert not torch.equal(stored, ops.swa_cache_roundtrip(normed, pos, bad, ops.CacheProfile.NONE, 32))


def test_inverse_rope_undoes_rope():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(50, 4, 96, generator=g)
    pos = torch.randint(0, 4000, (50,), generator=g)
    for inv in (_independent_inv_freq(32, 10000.0, None), _independent_inv_freq(32, 160000.0, 256)):
        r = ops.apply_rope_tail(x, pos, inv)
        assert not torch.allclose(r, x, atol=1e-2)
        assert torch.equal(r[..., :64], x[..., :64])
        assert torch.allclose(ops.apply_rope_tail(r, pos, inv, inverse=True), x, atol=1e-5)


# ---- cache profiles ---------------------------------------------------------------------------

def test_cache_profiles(setup):
    t, w, xs, none = setup
    runs = {NONE: none, FP8: Run(t, w, xs, [T_PROMPT], FP8), FP4: Run(t, w, xs, [T_PROMPT], FP4)}
    rope = t.qk_rope_head_dim
    for src in t.kv_source_layer_ids:
        c_none, c_fp8, c_fp4 = (runs[p].state.compressed_kv[src] for p in (NONE, FP8, FP4))
        assert torch.equal(c_fp4, c_none)                       # FP4 layout stores the FP4 values
        assert torch.equal(c_none, ops.fp4_fake_quant_e4m3_scale(c_none))  # they are FP4 values
        assert not torch.equal(c_fp8[:, :-rope], c_none[:, :-rope])        # FP8 re-rounds the nope part
        assert torch.equal(c_fp8[:, -rope:], c_none[:, -rope:])            # ... and keeps RoPE dims
        assert torch.allclose(c_fp8, c_none, atol=0.1, rtol=0.1)
        for p in (FP8, FP4):   # index keys / selections do not depend on the cache profile
            assert torch.equal(runs[p].state.index_keys[src], none.state.index_keys[src])
    for p in (FP8, FP4):
        for k in none.selections:
            assert torch.equal(runs[p].selections[k], none.selections[k])
    for layer in range(t.num_hidden_layers):
        s_none, s_fp8, s_fp4 = (runs[p].state.swa_kv[layer] for p in (NONE, FP8, FP4))
        assert torch.equal(s_none, ops.bf16(s_none))
        assert not torch.equal(s_fp8, s_none) and not torch.equal(s_fp4, s_none) and not torch.equal(s_fp8, s_fp4)
        # FP8 ("v4") keeps RoPE dims BF16, rotated from the fp32 normed values (NONE rotates the
        # BF16-rounded ones): close, within BF16 rounding of inputs of magnitude ~1
        assert torch.equal(s_fp8[:, -rope:], ops.bf16(s_fp8[:, -rope:]))
        torch.testing.assert_close(s_fp8[:, -rope:], s_none[:, -rope:], rtol=0, atol=2.0 ** -6)
        for p in (FP8, FP4):
            out, ref = runs[p].outputs[layer], none.outputs[layer]
            assert not torch.equal(out, ref)
            assert (out - ref).norm() < 0.1 * ref.norm()


# ---- state errors -----------------------------------------------------------------------------

def test_state_misuse_raises(setup):
    t, w, xs, _ = setup
    roles = t.layer_roles()
    state, scratch = AttentionState.empty(t, NONE), ChunkScratch()
    pos = torch.arange(4)
    with pytest.raises(ValueError, match="positions"):
        attention_sublayer(t, roles[0], w, 0, xs[0][:4], pos + 1, state, scratch, NONE, True)
    with pytest.raises(ValueError, match="profile"):
        attention_sublayer(t, roles[0], w, 0, xs[0][:4], pos, state, scratch, FP8, True)
    attention_sublayer(t, roles[0], w, 0, xs[0][:4], pos, state, scratch, NONE, True)
    with pytest.raises(ValueError, match="already processed"):
        attention_sublayer(t, roles[0], w, 0, xs[0][:4], pos, state, scratch, NONE, True)
    with pytest.raises(ValueError, match="advance"):
        state.advance(4)
    with pytest.raises(ValueError, match="role is for layer"):
        attention_sublayer(t, roles[1], w, 2, xs[1][:4], pos, state, scratch, NONE, True)
    consumer_scratch = ChunkScratch()
    fresh = AttentionState.empty(t, NONE)
    for r in roles[:4]:
        attention_sublayer(t, r, w, r.layer, xs[r.layer][:4], pos, fresh, consumer_scratch, NONE, True)
    with pytest.raises(ValueError, match="candidate source 4 has not run"):
        attention_sublayer(t, roles[6], w, 6, xs[6][:4], pos, fresh, consumer_scratch, NONE, True)

"""The static (capture-safe) decode forward on CPU (`runtime/batch.py` static layouts; the
forward's padding masks in `runtime/attention.py`).

What is pinned:
* Static layout == eager layout: over three decode steps of the four `runtime_scenarios`
  requests (after their prefills), the static decode forward padded SGLang-style to a larger
  batch (row 0, seq_len 1, position 0, slot 0, stale ids) gives the live requests' logits bit
  for bit equal to the eager forward of the live requests alone, and leaves every cache
  byte outside the padding page equal — packed rows, SWA rows, the Engram history ring, and the pair state of
  every request row including the padding row 0. The padding tokens did run (they wrote the
  padding page), so the masks are what keeps row 0 and the live slots clean.
* The same with the CUDA implementations' orchestration (`KernelAttentionOps`: static-width
  entry table, chunked scores, `select_for_role`) over exact torch stand-ins of the two Triton
  kernels.
* No host sync: the static decode forward along the CUDA code path — kernel orchestration of
  attention and indexer, the CUDA MoE (`moe_ops._moe_cuda`, routed experts by a stand-in), the
  tensor-core dense backend (`dense_ops.BlockedBf16Gemm`) — runs under a trap that raises on
  every host synchronisation / data-dependent shape (`cuda_graph_scenarios.no_host_sync`); the
  trap itself is shown to catch the eager layout's checks.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from backend_helpers import TensorCoreProducts
from cuda_graph_scenarios import (PAD_SLOT, HostSync, clone_caches, decode_step, differences_outside_padding,
                                  no_host_sync, prefilled, step_tokens, suspended)
from runtime_scenarios import PAGE_SIZE
from sglang_dsv41.checkpoint.loader import load_reference_weights
from sglang_dsv41.config import DeepseekV41Config
from sglang_dsv41.engram_hash import EngramHasher, _load_fast_tokenizer, compressed_token_map
from sglang_dsv41.kernels import entry_index as kernel_entry_index
from sglang_dsv41.kernels import indexer as kernel_indexer
from sglang_dsv41.kernels import indexer_select as kernel_select
from sglang_dsv41.kernels import moe_mxfp4
from sglang_dsv41.kernels import sparse_attention as kernel_attention
from sglang_dsv41.reference.moe import routed_expert
from sglang_dsv41.reference.ops import bf16
from sglang_dsv41.runtime import attention_ops, attention_ops_torch, moe_ops
from sglang_dsv41.runtime.dense_ops import BlockedBf16Gemm
from sglang_dsv41.runtime.dense_weights import DenseWeightCache
from sglang_dsv41.runtime.forward import TorchForward
from packed_rows_codec import kernel_source_as_runtime_rows
from sglang_dsv41.runtime.kv_layout import PackedSourceRows

CPU = torch.device("cpu")
STEPS = 3


@pytest.fixture(scope="module")
def engine(tiny_checkpoint) -> TorchForward:
    cfg = DeepseekV41Config.from_file(tiny_checkpoint)
    weights = load_reference_weights(tiny_checkpoint, cfg, vision=False, dspark=False)
    token_map, _ = compressed_token_map(_load_fast_tokenizer(tiny_checkpoint))
    return TorchForward(cfg, weights, EngramHasher.from_config(cfg, token_map))


@pytest.fixture(scope="module")
def start(engine):
    return prefilled(engine, CPU)


# ---- exact torch stand-ins of the Triton kernels (run with the trap suspended) -------------------

def _packed_rows(c) -> PackedSourceRows:
    return kernel_source_as_runtime_rows(c)


def _sparse_sink_attention(calls: list[str]):
    def sparse_sink_attention(q, swa_cache, swa_slots, comp_cache, comp_slots, sink, scale, *, config):
        with suspended():
            calls.append("attend")
            packed = None if comp_cache is None else _packed_rows(comp_cache)
            return attention_ops_torch.TORCH_OPS.attend(q.float(), sink, swa_cache, swa_slots, packed,
                                                      comp_slots).to(torch.bfloat16)
    return sparse_sink_attention


def _index_scores(calls: list[str]):
    def index_scores(q, head_w, key_cache, entry_slots, token_req, n_visible, *, head_sum_exact, check_inputs,
                     tile_cache=None, grouped_queries=False, fill_invisible=True):
        """The kernel's values; `fill_invisible=False`: NaN past each query's visibility (unwritten columns)."""
        assert head_sum_exact and not check_inputs, "the runtime must not ask the indexer for input checks"
        with suspended():
            calls.append(f"scores{entry_slots.shape[1]}" + ("" if fill_invisible else "_unfilled"))
            slots = entry_slots[token_req]
            keys = _packed_rows(key_cache).keys(slots.reshape(-1)).reshape(*slots.shape, -1).double()
            dots = torch.einsum("thd,ted->the", q.double(), keys)
            scores = torch.einsum("th,the->te", head_w.double(), torch.relu(dots)).float() + 0.0
            seen = torch.arange(slots.shape[1])[None, :] < n_visible[:, None]
            scores = torch.where(seen & (slots >= 0), scores, -math.inf)
            return scores if fill_invisible else torch.where(seen, scores, math.nan)
    return index_scores


def _kernel_ops(calls: list[str]) -> attention_ops.KernelAttentionOps:
    return attention_ops.KernelAttentionOps(
        SimpleNamespace(sparse_sink_attention=_sparse_sink_attention(calls), plan_config=kernel_attention.plan_config,
                        PackedSource=kernel_attention.PackedSource),
        SimpleNamespace(index_scores=_index_scores(calls), PackedSource=kernel_indexer.PackedSource),
        deterministic=True,                           # one split: the stand-ins model the batch-invariant plan
        indexer_select=kernel_select, entry_index=kernel_entry_index)


# ---- static == eager, padding invisible ----------------------------------------------------------------

def _compare_steps(engine: TorchForward, start, batch_size: int) -> None:
    static_state, eager_caches = clone_caches(start.caches), clone_caches(start.caches)
    slots_state = type(start)(start.slots, eager_caches, dict(start.lengths))
    for step in range(STEPS):
        inputs = decode_step(slots_state, step_tokens(step), batch_size)
        table = slots_state.slots.table
        eager = engine.logits(engine.hidden_states(inputs.input_ids[:inputs.live], inputs.unpadded_layout(table),
                                                   eager_caches))
        got = engine.logits(engine.hidden_states(inputs.input_ids, inputs.static_layout(table), static_state))
        assert got.shape[0] == batch_size
        assert torch.equal(got[:inputs.live], eager), (
            f"step {step}, padded to {batch_size}: live logits differ (max |Δ| "
            f"{(got[:inputs.live] - eager).abs().max().item():.3g})")
        diffs = differences_outside_padding(eager_caches, static_state, PAGE_SIZE)
        assert not diffs, f"step {step}, padded to {batch_size}: padding tokens changed live state: {diffs}"
        if batch_size > inputs.live:     # the padding tokens did write (into the padding page only)
            assert not torch.equal(static_state.swa[0][PAD_SLOT], eager_caches.swa[0][PAD_SLOT])


@pytest.mark.parametrize("batch_size", [4, 7])
def test_static_decode_equals_eager_and_padding_writes_no_live_state(engine, start, batch_size: int) -> None:
    _compare_steps(engine, start, batch_size)


def test_static_decode_with_kernel_orchestration(engine, start, monkeypatch) -> None:
    """CUDA implementations' orchestration (stand-in kernels): same bits, static-width scores."""
    calls: list[str] = []
    monkeypatch.setattr(engine, "attention_ops", _kernel_ops(calls))
    _compare_steps(engine, start, 6)
    width = start.slots.table.shape[1]
    widths = {c.removesuffix("_unfilled") for c in calls if c.startswith("scores")}
    ratios = {r.ratio for r in engine.roles if r.runs_indexer}
    assert {f"scores{width // r}" for r in ratios} <= widths, (widths, width)   # static width present


@pytest.mark.parametrize("bounded", ["on", "off"])
def test_static_rankings_are_told_the_visible_counts(engine, start, monkeypatch, bounded: str) -> None:
    """Static layouts' rankings get each query's visible count (`select_topk(lengths=)`, SGLANG_DSV41_TOPK_BOUNDED
    on by default), eager ones none, and the logits are the eager forward's bit for bit either way
    (`_compare_steps`): the lengths change what is read, not what is chosen. Bounded static layouts ask for
    unfilled scores (here NaN past each query's visibility) and entry tables (no workspace in a decode step)."""
    monkeypatch.setenv(kernel_select.BOUNDED_ENV, bounded)             # read once, when the ops are built
    calls: list[str] = []
    ops = _kernel_ops(calls)
    monkeypatch.setattr(engine, "attention_ops", ops)
    seen, lengths, layout_static = [], [], []
    select, select_for_role, select_topk = ops.select, attention_ops.select_for_role, kernel_select.select_topk

    def spy_select(*args, **kw):
        layout_static.append(args[7].static)                  # select(be, cfg, role, w, prefix, x, q_lora, layout, …)
        return select(*args, **kw)

    def spy_role(*args, **kw):
        seen.append((layout_static[-1], kw["bounded"]))
        return select_for_role(*args, **kw)

    def spy_topk(scores, k, **kw):
        lengths.append((scores.shape[1], kw.get("lengths")))
        return select_topk(scores, k, **kw)
    fills, table = [], kernel_entry_index.entry_index_table

    def spy_table(*args, fill=True):
        fills.append((layout_static[-1], fill))
        return table(*args, fill=fill)
    monkeypatch.setattr(kernel_entry_index, "entry_index_table", spy_table)
    monkeypatch.setattr(ops, "select", spy_select)
    monkeypatch.setattr(attention_ops, "select_for_role", spy_role)
    monkeypatch.setattr(kernel_select, "select_topk", spy_topk)
    _compare_steps(engine, start, 6)
    assert {static for static, _ in seen} == {True, False}
    assert all(b == (bounded == "on" and static) for static, b in seen), seen
    told = [(w, lens) for w, lens in lengths if lens is not None]
    assert bool(told) == (bounded == "on") and all(lens.shape == (6,) and int(lens.max()) <= w for w, lens in told)
    unfilled = [c for c in calls if c.endswith("_unfilled")]              # NaN past visibility, the same logits
    assert bool(unfilled) == (bounded == "on") and len(unfilled) < len(calls)
    assert fills and all(fill == (not static or bounded == "off") for static, fill in fills), fills


def test_static_layout_shapes_and_padding_flags(start) -> None:
    inputs = decode_step(type(start)(start.slots, start.caches, dict(start.lengths)), step_tokens(9), 6)
    layout = inputs.static_layout(start.slots.table)
    assert layout.static and not layout.host_checks
    assert layout.max_seq_len == start.slots.table.shape[1]
    assert layout.live_tokens.tolist() == [True] * 4 + [False] * 2
    assert torch.equal(layout.prefix_lens, inputs.seq_lens - 1) and torch.equal(layout.token_req, torch.arange(6))


# ---- no host sync along the CUDA code path --------------------------------------------------------------

def _cuda_path_engine(engine: TorchForward, monkeypatch, calls: list[str]) -> TorchForward:
    """The engine with the CUDA implementations selected on CPU tensors: kernel orchestration,
    the CUDA MoE (routed experts by a float64 stand-in), the tensor-core dense backend."""
    cfg, t = engine.cfg, engine.text
    weights = dict(engine.weights)
    E = t.n_routed_experts
    for i in range(t.num_hidden_layers):
        p = f"layers.{i}.ffn.experts."
        stacked = SimpleNamespace(n_experts=E, **{n: torch.stack([weights[f"{p}{e}.{n}.weight"] for e in range(E)])
                                                  for n in ("w1", "w2", "w3")})
        weights[moe_ops.routed_experts_key(f"layers.{i}.")] = moe_ops.RoutedExpertsMxfp4.build(
            stacked, range(E), E, CPU)

    def routed_expert_outputs(x, topk_ids, experts, *, swiglu_limit, allow_absent=False, check_ids=True):
        assert check_ids is False and not allow_absent   # the runtime skips the id assert (its router's ids are < E)
        with suspended():                         # the stand-in's own math: exact float64
            calls.append("moe")
            xs = x.float()
            per_slot = torch.zeros(*topk_ids.shape, xs.shape[1], dtype=torch.float64)
            for e in range(experts.n_experts):
                y = routed_expert(xs, experts.w1[e], experts.w2[e], experts.w3[e], swiglu_limit).double()
                per_slot += (topk_ids == e).unsqueeze(-1) * y.unsqueeze(1)
            return per_slot, SimpleNamespace(n_tokens=topk_ids.shape[0], top_k=topk_ids.shape[1])

    def combine_routed(per_slot, plan, topk_weights, routed_scale, hidden, shared=None):
        assert shared is not None and shared.dtype == torch.float32    # the finalize in the combine's launch
        with suspended():
            summed = (topk_weights.double().unsqueeze(-1) * per_slot).sum(dim=1)
            return bf16(shared + bf16((routed_scale * summed).float()))

    monkeypatch.setattr(moe_mxfp4, "routed_expert_outputs", routed_expert_outputs)
    monkeypatch.setattr(moe_mxfp4, "combine_routed", combine_routed)
    monkeypatch.setattr(moe_ops, "_moe_cpu", moe_ops._moe_cuda)
    cuda_like = TorchForward(cfg, weights, engine.hasher, engine.numerics, engine.tp,
                             backend=TensorCoreProducts(BlockedBf16Gemm(DenseWeightCache.from_weights(weights))))
    cuda_like.attention_ops = _kernel_ops(calls)
    return cuda_like



def test_static_decode_has_no_host_sync_on_the_cuda_code_path(engine, start, monkeypatch) -> None:
    calls: list[str] = []
    cuda_like = _cuda_path_engine(engine, monkeypatch, calls)
    state = type(start)(start.slots, clone_caches(start.caches), dict(start.lengths))
    for step in range(2):
        inputs = decode_step(state, step_tokens(step), 6)
        layout = inputs.static_layout(state.slots.table)
        with no_host_sync():
            hidden = cuda_like.hidden_states(inputs.input_ids, layout, state.caches)
        assert hidden.shape == (6, engine.text.hidden_size) and bool(torch.isfinite(hidden[:inputs.live]).all())
    layers = engine.text.num_hidden_layers
    assert calls.count("attend") == 2 * layers and calls.count("moe") == 2 * layers, calls[:12]
    assert any(c.startswith("scores") for c in calls)


def test_the_trap_catches_the_eager_layout_checks(start) -> None:
    """The audit can fail: the eager layout's checks synchronise, and the trap says so."""
    state = type(start)(start.slots, clone_caches(start.caches), dict(start.lengths))
    inputs = decode_step(state, step_tokens(5), 4)
    with pytest.raises(HostSync):
        with no_host_sync():
            inputs.unpadded_layout(state.slots.table)
    with pytest.raises(HostSync, match="boolean-mask"):
        with no_host_sync():
            torch.arange(4)[torch.arange(4) > 1]

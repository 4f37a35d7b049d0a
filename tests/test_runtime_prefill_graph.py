"""The static (capture-safe) extend forward on CPU — the first step towards prefill CUDA graphs
(docs/prefill_graphs.md; `runtime/batch.static_extend_layout`, not wired into the server).

What is pinned:
* Static extend == eager extend: after the four `runtime_scenarios` prefills, an extend of three
  requests (runs of 5, 8 and 1 tokens; odd and even chunk starts) padded to a 24-token bucket
  SGLang-style (padded tail: id 0, position 0, slot 0), with or without 3 zero-length request
  slots after them (the `full` runner's sentinels: row 0, seq_len 0), gives the live tokens'
  logits bit for bit equal to the eager forward of the live tokens alone, and leaves every cache
  byte outside the padding page equal (packed rows, SWA rows, the Engram history ring, every
  row's pair state, row 0 included) — with the CPU implementations and with the CUDA
  implementations' orchestration (stand-in kernels).
* No host sync: that static extend forward along the CUDA code path runs under the host-sync trap
  (`cuda_graph_scenarios.no_host_sync`), and the eager extend layout trips it.
* The layout's addressing equals `make_layout`'s on the live tokens; padding tokens are not live.
"""
from __future__ import annotations

import pytest
import torch

from cuda_graph_scenarios import HostSync, clone_caches, differences_outside_padding, no_host_sync, prefilled
from prefill_graph_scenarios import BUCKET, PIECES, extend_step
from runtime_scenarios import PAGE_SIZE
from sglang_dsv41.checkpoint.loader import load_reference_weights
from sglang_dsv41.config import DeepseekV41Config
from sglang_dsv41.engram_hash import EngramHasher, _load_fast_tokenizer, compressed_token_map
from sglang_dsv41.runtime.batch import static_extend_layout
from sglang_dsv41.runtime.forward import TorchForward
from test_runtime_cuda_graph import _cuda_path_engine, _kernel_ops

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def engine(tiny_checkpoint) -> TorchForward:
    cfg = DeepseekV41Config.from_file(tiny_checkpoint)
    weights = load_reference_weights(tiny_checkpoint, cfg, vision=False, dspark=False)
    token_map, _ = compressed_token_map(_load_fast_tokenizer(tiny_checkpoint))
    return TorchForward(cfg, weights, EngramHasher.from_config(cfg, token_map))


@pytest.fixture(scope="module")
def start(engine):
    return prefilled(engine, CPU)


def _compare(engine: TorchForward, start, bucket: int, sentinels: int = 0) -> None:
    static_caches, eager_caches = clone_caches(start.caches), clone_caches(start.caches)
    state = type(start)(start.slots, eager_caches, dict(start.lengths))
    inputs = extend_step(state, PIECES, bucket, sentinels=sentinels)
    table = state.slots.table
    n = inputs.live
    eager = engine.logits(engine.hidden_states(inputs.input_ids[:n], inputs.unpadded_layout(table), eager_caches))
    got = engine.logits(engine.hidden_states(inputs.input_ids, inputs.static_layout(table), static_caches))
    assert got.shape[0] == bucket
    assert torch.equal(got[:n], eager), (
        f"bucket {bucket}: live logits differ (max |Δ| {(got[:n] - eager).abs().max().item():.3g})")
    diffs = differences_outside_padding(eager_caches, static_caches, PAGE_SIZE)
    assert not diffs, f"bucket {bucket}: padding tokens changed live state: {diffs}"


@pytest.mark.parametrize("bucket,sentinels", [(14, 0), (BUCKET, 0), (BUCKET, 3)])
def test_static_extend_equals_eager_and_padding_writes_no_live_state(engine, start, bucket: int,
                                                                     sentinels: int) -> None:
    _compare(engine, start, bucket, sentinels)


@pytest.mark.parametrize("sentinels", [0, 3])
def test_static_extend_with_kernel_orchestration(engine, start, monkeypatch, sentinels: int) -> None:
    calls: list[str] = []
    monkeypatch.setattr(engine, "attention_ops", _kernel_ops(calls))
    _compare(engine, start, BUCKET, sentinels)
    # the static width ran, its scores unfilled past visibility (NaN in the stand-in: bounded rankings)
    assert f"scores{start.slots.table.shape[1] // 2}_unfilled" in calls


def test_static_extend_has_no_host_sync_on_the_cuda_code_path(engine, start, monkeypatch) -> None:
    calls: list[str] = []
    cuda_like = _cuda_path_engine(engine, monkeypatch, calls)
    state = type(start)(start.slots, clone_caches(start.caches), dict(start.lengths))
    inputs = extend_step(state, PIECES, BUCKET, sentinels=3)
    layout = inputs.static_layout(state.slots.table)
    with no_host_sync():
        hidden = cuda_like.hidden_states(inputs.input_ids, layout, state.caches)
    assert hidden.shape == (BUCKET, engine.text.hidden_size) and bool(torch.isfinite(hidden[:inputs.live]).all())
    assert calls.count("attend") == engine.text.num_hidden_layers
    with pytest.raises(HostSync):                                   # the audit can fail
        with no_host_sync():
            inputs.unpadded_layout(state.slots.table)


def test_static_extend_layout_addressing(start) -> None:
    state = type(start)(start.slots, start.caches, dict(start.lengths))
    inputs = extend_step(state, PIECES, BUCKET)
    table = state.slots.table
    static, eager = inputs.static_layout(table), inputs.unpadded_layout(table)
    n = inputs.live
    assert static.static and not static.host_checks and static.max_seq_len == table.shape[1]
    for name in ("req_rows", "prefix_lens", "extend_lens", "seq_lens", "starts"):
        assert torch.equal(getattr(static, name), getattr(eager, name)), name
    for name in ("positions", "token_req", "out_slots"):
        assert torch.equal(getattr(static, name)[:n], getattr(eager, name)), name
    assert static.live_tokens.tolist() == [True] * n + [False] * (BUCKET - n)
    assert torch.equal(static.token_req[n:], torch.full((BUCKET - n,), len(PIECES) - 1))
    assert torch.equal(static.last_tokens, eager.last_tokens) and bool(static.live_requests.all())
    padded = extend_step(type(start)(start.slots, start.caches, dict(start.lengths)), PIECES, BUCKET, sentinels=2)
    assert padded.static_layout(table).live_requests.tolist() == [True] * len(PIECES) + [False] * 2
    with pytest.raises(RuntimeError, match="static extend layout"):
        static_extend_layout(inputs.req_rows, inputs.seq_lens[:1], inputs.extend_lens, inputs.positions,
                             inputs.out_slots, table)

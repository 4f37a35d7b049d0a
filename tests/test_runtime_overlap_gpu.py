"""The side stream on the GPU (`runtime/overlap.py`, SGLANG_DSV41_OVERLAP=on; GPU only).

On the serving-default CUDA forward of the tiny checkpoint (`runtime_scenarios.runtime_engine`):
1. prefill and an eager decode step with the side stream write the same caches and give the
   same logits, bit for bit, as the inline forward; every forward forks 4 calls per layer (two
   mHC coefficient calls, the query heads, the shared expert) and one per Engram layer;
2. a decode step captured in a CUDA graph with the side stream (the fork / join become graph
   edges) replays to the inline eager forward's logits and caches, bit for bit.
Same kernels on the same inputs, so any difference is a missing join (a race).
"""
from __future__ import annotations

import pytest
import torch

from cuda_graph_scenarios import clone_caches, decode_step, differences_outside_padding, prefilled, step_tokens
from runtime_scenarios import runtime_engine
from sglang_dsv41.runtime.overlap import SideStream, side_stream_for

pytestmark = [pytest.mark.gpu]
CUDA = torch.device("cuda")
GRAPH_BS = 6


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    torch.backends.cuda.matmul.allow_tf32 = False
    return runtime_engine(tiny_checkpoint, CUDA, deterministic=False)


def _counting(engine) -> list[int]:
    """Turn the side stream on, counting its forks."""
    engine.overlap = side_stream_for(CUDA, "on")
    side = engine.overlap.side
    assert isinstance(side, SideStream)
    count = [0]
    fork = side.fork

    def counted(fn, *args):
        count[0] += 1
        return fork(fn, *args)

    side.fork = counted
    return count


def test_prefill_and_eager_decode_equal_inline(engine) -> None:
    engine.overlap = side_stream_for(CUDA, "off")
    inline = prefilled(engine, CUDA)
    count = _counting(engine)
    forked = prefilled(engine, CUDA)
    torch.cuda.synchronize()
    sink = max(engine.text.compress_ratios)      # entry 0's rows: the write sink (unordered "no entry" writes)
    assert not differences_outside_padding(forked.caches, inline.caches, sink)
    per_forward = 4 * engine.text.num_hidden_layers + len(engine.text.engram_layer_ids)
    assert count[0] > 0 and count[0] % per_forward == 0, count[0]
    table = inline.slots.table
    step = decode_step(inline, step_tokens(0), GRAPH_BS)
    a, b = clone_caches(inline.caches), clone_caches(inline.caches)
    engine.overlap = side_stream_for(CUDA, "off")
    want = engine.logits(engine.hidden_states(step.input_ids, step.static_layout(table), a))
    count = _counting(engine)
    got = engine.logits(engine.hidden_states(step.input_ids, step.static_layout(table), b))
    torch.cuda.synchronize()
    assert count[0] == per_forward
    assert torch.equal(got, want)
    assert not differences_outside_padding(a, b, sink)


def test_graph_replay_with_the_side_stream_equals_inline_eager(engine) -> None:
    engine.overlap = side_stream_for(CUDA, "off")
    state = prefilled(engine, CUDA)
    table = state.slots.table
    step = decode_step(state, step_tokens(0), GRAPH_BS)
    start = clone_caches(state.caches)
    eager_caches, graph_caches = clone_caches(start), clone_caches(start)
    want = engine.logits(engine.hidden_states(step.input_ids, step.static_layout(table), eager_caches))
    _counting(engine)

    def forward(caches):
        return engine.logits(engine.hidden_states(step.input_ids, step.static_layout(table), caches))

    warm = torch.cuda.Stream()
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):
        forward(clone_caches(start))
    torch.cuda.current_stream().wait_stream(warm)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = forward(graph_caches)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)
    assert not differences_outside_padding(graph_caches, eager_caches, max(engine.text.compress_ratios))

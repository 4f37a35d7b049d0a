"""CUDA-graph capture of one decode step of the tiny-checkpoint forward (GPU only).

The forward is the one the server builds (`runtime_scenarios.runtime_engine`: MXFP4 experts,
Triton attention / indexer, tensor-core dense products). After the four `runtime_scenarios`
requests are prefilled eagerly, one decode step of batch size `GRAPH_BS` (4 live requests + 2
SGLang-style padding requests: row 0, seq_len 1, position 0, slot 0) is captured with
`torch.cuda.CUDAGraph` — layout construction included, as SGLang's runner captures the model's
forward — then replayed for `STEPS` decode steps with each step's inputs copied into the
captured buffers. Pinned:

1. replay == eager: each step's logits from the replay equal, bit for bit, the eager static
   forward of the same padded batch on an identical copy of the caches, and after each step
   both cache copies are identical byte for byte (the graph wrote exactly what eager wrote) except
   the write sink: entry 0 (rows 0..r−1 of the padding page), where the torch path's "no entry" writes
   go (`kv_layout.write_entries`; the CUDA encoder, `kernels/entry_pack.py`, writes nothing there);
2. the live requests' replayed logits against the eager forward of the live requests alone
   (unpadded, checked layout): in deterministic mode bit for bit, and the live caches match —
   padding is invisible and the CUDA forward is batch-invariant (tests/test_runtime_forward_gpu.py,
   item 2); in the serving default within the numerics contract (|Δlogit| ≤ 2 × `LOGIT_BOUND`,
   greedy tokens equal on every live row), because its attention plan (`plan_decode_config`) and
   W8A8 row tiers may depend on the batch size (padded 6 vs live 4). Whether the bits agree is printed.

Both modes of the CUDA forward are captured: deterministic (`--enable-deterministic-inference`:
W8A16 FP8 linears, one attention key split, packed prefill rows, BF16-weight rows in 128-row blocks)
and the serving default (`w8a8_fold`, `kernels/fp8_w8a8.py` with `kernels/fp8_fold.py` ≤ 16 rows; split-KV decode attention; fused top-k;
BF16-weight rows in one GEMM; the BF16 prefill workspace, which a static layout never takes).

A failed capture (a host synchronisation, a host → device copy or a data-dependent shape inside
the static forward) fails test 1 with the capture error and what to look for.
"""
from __future__ import annotations

import pytest
import torch

from cuda_graph_scenarios import clone_caches, decode_step, differences_outside_padding, prefilled, step_tokens
from runtime_scenarios import PAGE_SIZE, runtime_engine
from test_runtime_numerics_contract import LOGIT_BOUND

pytestmark = [pytest.mark.gpu]
CUDA = torch.device("cuda")
GRAPH_BS = 6
STEPS = 4


@pytest.fixture(scope="module", params=[True, False], ids=["deterministic-w8a16", "serving-default"])
def captured(tiny_checkpoint, request):
    torch.backends.cuda.matmul.allow_tf32 = False
    engine = runtime_engine(tiny_checkpoint, CUDA, deterministic=request.param)
    assert engine.attention_ops.splits == ("one" if request.param else "decode"), engine.attention_ops.description
    assert engine.attention_ops.prefill == ("packed" if request.param else "wide")   # eager prefill only
    assert engine.backend.dense.whole_rows is not request.param
    state = prefilled(engine, CUDA)
    start = clone_caches(state.caches)
    graph_caches, eager_static, eager_live = clone_caches(start), clone_caches(start), clone_caches(start)
    table = state.slots.table

    first = decode_step(state, step_tokens(0), GRAPH_BS)
    static = type(first)(**{k: getattr(first, k).clone() for k in          # the captured input buffers
                            ("input_ids", "req_rows", "seq_lens", "positions", "out_slots")}, live=first.live)

    def forward(caches):
        layout = static.static_layout(table)
        return engine.logits(engine.hidden_states(static.input_ids, layout, caches))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                 # warm-up (Triton compiles, cuBLAS handles) on a scratch copy
        for _ in range(2):
            forward(clone_caches(start))
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            out = forward(graph_caches)
    except Exception as e:   # noqa: BLE001 — re-raised with the diagnosis
        raise AssertionError(
            f"CUDA-graph capture of the static decode forward failed: {type(e).__name__}: {e}\n"
            "Look for a host sync (.item/int/bool/tolist/nonzero on a CUDA tensor), a host → device "
            "copy (torch.tensor(..., device=cuda), cpu_tensor.to(cuda)) or a data-dependent shape in the "
            "static path (tests/test_runtime_cuda_graph.py audits the CPU-visible ones)") from e
    return dict(engine=engine, state=state, table=table, graph=graph, out=out, static=static, first=first,
                graph_caches=graph_caches, eager_static=eager_static, eager_live=eager_live,
                deterministic=request.param)


def _run_steps(c):
    """Yield (step, inputs, replayed logits, eager static logits, eager live logits) per step."""
    engine, state, table = c["engine"], c["state"], c["table"]
    for step in range(STEPS):
        inputs = c["first"] if step == 0 else decode_step(state, step_tokens(step), GRAPH_BS)
        inputs.copy_into(c["static"])
        c["graph"].replay()
        replayed = c["out"].clone()
        eager = engine.logits(engine.hidden_states(inputs.input_ids, inputs.static_layout(table), c["eager_static"]))
        live = engine.logits(engine.hidden_states(inputs.input_ids[:inputs.live], inputs.unpadded_layout(table),
                                                  c["eager_live"]))
        torch.cuda.synchronize()
        yield step, inputs, replayed, eager, live


@pytest.fixture(scope="module")
def results(captured):
    sink = max(captured["engine"].text.compress_ratios)       # entry 0's rows: the write sink, in page 0
    assert PAGE_SIZE >= sink >= 1
    rows = []
    for step, inputs, replayed, eager, live in _run_steps(captured):
        rows.append(dict(step=step, live=inputs.live, replayed=replayed.cpu(), eager=eager.cpu(), live_logits=live.cpu(),
                         cache_diffs=differences_outside_padding(captured["graph_caches"], captured["eager_static"],
                                                                 sink),
                         live_cache_diffs=differences_outside_padding(captured["graph_caches"],
                                                                      captured["eager_live"], PAGE_SIZE)))
    return rows


def test_replay_equals_eager_static_forward_bit_for_bit(results) -> None:
    for r in results:
        delta = (r["replayed"] - r["eager"]).abs().max().item()
        assert torch.equal(r["replayed"], r["eager"]), f"step {r['step']}: replayed logits differ from eager (max |Δ| {delta:.3g})"
        assert not r["cache_diffs"], f"step {r['step']}: graph and eager wrote different caches: {r['cache_diffs']}"
    print(f"\n[cuda-graph] {len(results)} replayed decode steps at batch size {GRAPH_BS} == eager, caches identical")


def test_replayed_live_requests_equal_the_unpadded_eager_forward(captured, results) -> None:
    """Deterministic mode: bit for bit, live caches identical. Serving default: within the contract
    and the same greedy tokens (module doc, item 2)."""
    bit_equal = True
    for r in results:
        got, want = r["replayed"][:r["live"]], r["live_logits"]
        delta = (got - want).abs().max().item()
        bit_equal = bit_equal and torch.equal(got, want) and not r["live_cache_diffs"]
        if captured["deterministic"]:
            assert torch.equal(got, want), (f"step {r['step']}: live logits of the padded graph differ from the "
                                            f"unpadded eager forward (max |Δ| {delta:.3g}): padding leaked or the "
                                            "forward is not batch-invariant")
            assert not r["live_cache_diffs"], f"step {r['step']}: padding changed live state: {r['live_cache_diffs']}"
        else:
            assert delta <= 2 * LOGIT_BOUND, (f"step {r['step']}: live logits of the padded graph are {delta:.3g} from "
                                              f"the unpadded eager forward (> {2 * LOGIT_BOUND}): padding leaked?")
            assert torch.equal(got.argmax(dim=-1), want.argmax(dim=-1)), f"step {r['step']}: greedy tokens differ"
    print(f"\n[cuda-graph] live rows vs unpadded eager: {'bit-equal' if bit_equal else 'within the contract'}")


def test_replay_is_faster_than_eager(captured) -> None:
    """Reported (printed) for docs/performance.md; asserted only that replay is not slower."""
    engine, table, static = captured["engine"], captured["table"], captured["static"]
    scratch = clone_caches(captured["graph_caches"])
    times = {}
    for name, fn in (("replay", captured["graph"].replay),
                     ("eager", lambda: engine.logits(engine.hidden_states(static.input_ids, static.static_layout(table),
                                                                          scratch)))):
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            fn()
        end.record()
        torch.cuda.synchronize()
        times[name] = start.elapsed_time(end) / 10
    print(f"\n[cuda-graph] tiny decode step bs {GRAPH_BS}: eager {times['eager']:.2f} ms, replay {times['replay']:.2f} ms")
    assert times["replay"] <= times["eager"], times

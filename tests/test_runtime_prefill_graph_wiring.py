"""The prefill CUDA-graph wiring against SGLang 0.5.17's `full` prefill runner, on CPU
(`runtime/prefill_graph.py`, `runtime/model.py`; docs/prefill_graphs.md). The capture itself needs
CUDA: tests/test_runtime_prefill_graph_server_gpu.py serves with it on the H200.

Pinned here:
* SGLang's own probes (`resolve_language_model`, the runner's layer-model resolution,
  `compute_attention_and_moe_layers`) find the body, every decoder layer's attention, and a
  `forward` whose 4th parameter is `input_embeds`; attaching the body adds nothing to the state dict;
* the body runs the static extend layout only under SGLang's full-graph forward context, with its
  static Engram-history buffer (−1 rows); otherwise the eager layout with the staged history;
* the outer forward replays only when the runner patched the body's `forward` on the instance,
  and then first stages the history (rows past the batch −1) and waits for every layer's HiCache
  load; a batch with image rows runs eagerly even during a replay;
* the SGLang runner code these rely on is still there (a test that fails if its target moves).
"""
from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from sglang_dsv41.runtime import model as M
from sglang_dsv41.runtime.prefill_graph import PrefillGraphBody, full_graph_capture, replaying

K = 2


class Outer(nn.Module):
    """The parts of `DeepseekV41ForCausalLM` the body calls, recording them."""

    def __init__(self, torch_forward: nn.Module) -> None:
        super().__init__()
        self.torch_forward = torch_forward
        self.calls: list[dict] = []
        self.staged = torch.tensor([[7, 8], [9, 10]])

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def take_engram_history(self, forward_batch):
        return self.staged

    def hidden_states_of(self, input_ids, positions, forward_batch, image_embeds, history, static_extend=False):
        self.calls.append({"static": static_extend, "history": history})
        return torch.zeros(input_ids.shape[0], 4)


@pytest.fixture(scope="module")
def torch_forward(tiny_checkpoint):
    from sglang_dsv41.checkpoint.loader import load_reference_weights
    from sglang_dsv41.config import DeepseekV41Config
    from sglang_dsv41.engram_hash import EngramHasher, _load_fast_tokenizer, compressed_token_map
    from sglang_dsv41.runtime.forward import TorchForward

    cfg = DeepseekV41Config.from_file(tiny_checkpoint)
    weights = load_reference_weights(tiny_checkpoint, cfg, vision=False, dspark=False)
    token_map, _ = compressed_token_map(_load_fast_tokenizer(tiny_checkpoint))
    return TorchForward(cfg, weights, EngramHasher.from_config(cfg, token_map))


def _full_graph(forward_batch, full_graph: bool = True):
    from sglang.srt.model_executor.runner_backend_utils.tc_piecewise_cuda_graph.context_manager import (
        set_tc_piecewise_forward_context)

    return set_tc_piecewise_forward_context(forward_batch, [], None, [], [], full_graph=full_graph)


def test_sglang_finds_the_body_its_layers_and_input_embeds(torch_forward) -> None:
    from sglang.srt.model_executor.model_runner_components.layer_setup import compute_attention_and_moe_layers
    from sglang.srt.model_executor.runner.prefill_cuda_graph_runner import _resolve_transformer_layer_model
    from sglang.srt.model_loader.utils import resolve_language_model

    outer = Outer(torch_forward)
    names = set(outer.state_dict())
    body = PrefillGraphBody(outer, K)
    outer.model = body                                   # what the runner's set-up does (cuda_graph_setup.py)
    assert resolve_language_model(outer) is body and _resolve_transformer_layer_model(outer) is body
    found = compute_attention_and_moe_layers(body)
    assert len(found.attention_layers) == len(torch_forward.layers) == torch_forward.text.num_hidden_layers
    assert all(a is not None for a in found.attention_layers)
    assert set(outer.state_dict()) == names
    assert not list(body.parameters()) and not list(body.buffers()) and not list(body.children())
    assert list(inspect.signature(body.forward).parameters)[:4] == ["input_ids", "positions", "forward_batch",
                                                                    "input_embeds"]


def test_the_body_is_static_only_under_the_full_graph_context(torch_forward) -> None:
    outer = Outer(torch_forward)
    body = PrefillGraphBody(outer, K)
    fb = SimpleNamespace(batch_size=3)
    ids, pos = torch.zeros(8, dtype=torch.long), torch.zeros(8, dtype=torch.long)
    assert not full_graph_capture()
    body.forward(ids, pos, fb)
    with _full_graph(fb, full_graph=False):                       # SGLang's breakable / piecewise context
        body.forward(ids, pos, fb)
    with _full_graph(fb):
        assert full_graph_capture()
        body.forward(ids, pos, fb)
    eager, piecewise, captured = outer.calls
    assert not eager["static"] and eager["history"] is outer.staged
    assert not piecewise["static"]
    assert captured["static"] and captured["history"] is body.static_history(3, outer.device)
    assert captured["history"].shape == (3, K) and bool((captured["history"] == -1).all())
    with pytest.raises(RuntimeError, match="request slots"):
        body.static_history(4, outer.device)
    with _full_graph(fb):                                         # a multimodal runner's static embeds slot
        body.forward(ids, pos, fb, torch.zeros(8, 4))
    assert outer.calls[-1]["static"]


def test_staged_history_fills_the_live_rows_and_clears_the_rest(torch_forward) -> None:
    body = PrefillGraphBody(Outer(torch_forward), K)
    body.stage_history(None)                                      # nothing captured yet: nothing to stage
    buffer = body.static_history(4, torch.device("cpu"))
    buffer.fill_(5)
    body.stage_history(torch.tensor([[1, 2], [3, -1]]))
    assert buffer.tolist() == [[1, 2], [3, -1], [-1, -1], [-1, -1]]
    with pytest.raises(RuntimeError, match="without its Engram history"):
        body.stage_history(None)
    assert PrefillGraphBody(Outer(torch_forward), 0).static_history(4, torch.device("cpu")) is None


class _Caches:
    def __init__(self, layers: int) -> None:
        self.swa = [None] * layers
        self.waited: list[tuple[int, bool]] = []

    def wait_for_layer(self, layer: int, *, global_rows: bool) -> None:
        self.waited.append((layer, global_rows))


def _stub_model(torch_forward, caches: _Caches):
    """A `DeepseekV41ForCausalLM` with its forward's collaborators stubbed (no SGLang server)."""
    m = M.DeepseekV41ForCausalLM.__new__(M.DeepseekV41ForCausalLM)
    nn.Module.__init__(m)
    m.register_buffer("_device_anchor", torch.zeros(1), persistent=False)
    m.vision_tower, m._spans, m._encoder_dp, m._replayed = None, None, None, False
    m.torch_forward = SimpleNamespace(captured=None)
    m.tp = SimpleNamespace(rank=0)
    m.lm_head = None
    m.logits_processor = lambda ids, hidden, head, fb, aux_hidden_states: hidden
    m.eager_calls = []
    m.take_engram_history = lambda fb: torch.tensor([[4, 5]])
    m.hidden_states_of = lambda *a, **k: m.eager_calls.append(a) or torch.ones(a[0].shape[0], 4)
    m._caches_for = lambda pool: caches
    m.model = PrefillGraphBody(Outer(torch_forward), K)
    return m


@pytest.mark.parametrize("images", [False, True])
def test_the_outer_forward_replays_only_when_the_runner_patched_the_body(torch_forward, monkeypatch,
                                                                        images: bool) -> None:
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    rows = (torch.zeros(1, dtype=torch.long), torch.zeros(1, 4)) if images else None
    monkeypatch.setattr(M, "batch_image_rows", lambda *a: rows)
    caches = _Caches(3)
    m = _stub_model(torch_forward, caches)
    body = m.model
    body.static_history(2, torch.device("cpu")).fill_(9)
    fb = SimpleNamespace(forward_mode=SimpleNamespace(name="EXTEND"), batch_size=1, input_ids=torch.zeros(5))
    ids, pos = torch.zeros(5, dtype=torch.long), torch.zeros(5, dtype=torch.long)
    with forward_context(ForwardContext(attn_backend=SimpleNamespace(token_to_kv_pool=None))):
        m.forward(ids, pos, fb)                                   # not replaying: eager
        assert len(m.eager_calls) == 1 and not replaying(body) and not caches.waited
        replays = []
        body.forward = lambda *a, **k: replays.append(a) or torch.full((a[0].shape[0], 4), 2.0)   # the runner's patch
        assert replaying(body)
        out = m.forward(ids, pos, fb)
        original = type(body).forward.__get__(body)
        body.forward = original                                   # what the runner restores after a replay
        assert not replaying(body)
        m.take_engram_history = lambda fb: None
        m.forward(ids, pos, fb)                                   # eager again, nothing staged
    if images:                                                    # image rows: eager even while replaying
        assert len(m.eager_calls) == 3 and not replays and not caches.waited
        return
    assert len(m.eager_calls) == 2 and len(replays) == 1 and bool((out == 2.0).all())
    assert body.static_history(2, torch.device("cpu")).tolist() == [[4, 5], [-1, -1]]
    assert caches.waited == [(0, True), (1, True), (2, True)]


def test_the_sglang_runner_contract_is_still_there() -> None:
    """The runner code the wiring relies on (docs/prefill_graphs.md "What SGLang 0.5.17 offers")."""
    from sglang.srt.model_executor.runner.prefill_cuda_graph_runner import PrefillCudaGraphRunner as R
    from sglang.srt.model_executor.runner_backend_utils.tc_piecewise_cuda_graph import context_manager

    replay = inspect.getsource(R._execute_body_capture)
    assert "self.layer_model.forward = replay_layer_forward" in replay              # the instance patch
    assert "tail_batch = forward_batch if full_path else static_forward_batch" in replay   # raw batch tail
    assert "_slice_output_rows(hs, raw_num_tokens)" in replay
    load = inspect.getsource(R.load_batch)
    assert 's["extend_seq_lens"][bs:r].zero_()' in load and 's["req_pool_indices"][bs:r].zero_()' in load
    assert "[0] * (self._capture_req_slots - len(capture_seq_lens))" in inspect.getsource(R.capture_prepare)
    assert "full_graph" in inspect.signature(context_manager.set_tc_piecewise_forward_context).parameters
    assert "full_graph=self._is_full_backend" in inspect.getsource(R._prefill_forward_context)

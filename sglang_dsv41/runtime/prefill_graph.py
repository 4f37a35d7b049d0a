"""Prefill CUDA graphs through SGLang 0.5.17's `full` prefill runner (docs/prefill_graphs.md).

SGLang captures `resolve_language_model(model).forward(input_ids, positions, forward_batch,
input_embeds)` once per token bucket (`PrefillCudaGraphRunner`, backend `full`) and, at replay,
replaces that `forward` on the instance with the graph replay before calling the outer
`model.forward` eagerly for the LM head and logits (`_execute_body_capture`). `PrefillGraphBody`
is that language model for `DeepseekV41ForCausalLM`: attached as `model.model` only when the
server resolved the `full` prefill backend on CUDA (`selected`).

Invariants:
* the body owns no parameter, buffer or submodule (the runner re-assigns it as `model.model`,
  which registers it: the state dict gains nothing); `layers` is a plain list of the decoder
  layers, where SGLang's layer probe finds each layer's `.attn`;
* under the runner's full-graph context (`full_graph_capture`: capture and its warm-ups) the body
  runs the static extend layout (`batch.static_extend_layout`) over the capture batch's static
  buffers and the body's static Engram-history buffer [request slots, K]; called any other way
  it runs the eager layout;
* `replaying(body)` is true only inside the runner's replay (its instance patch, not the bound
  method it restores afterwards); the outer forward
  then stages the batch's Engram history into the static buffer (`stage_history`: rows past the
  batch −1) and waits for every HiCache layer load before calling it — a wait cannot sit inside
  a graph;
* batches with image rows never replay: the outer forward computes them eagerly (their row count
  is data-dependent).
"""
from __future__ import annotations

import weakref

import torch
from torch import Tensor, nn

#: SGLang's name of the whole-body prefill graph backend (`cuda_graph_config.Backend.FULL`)
FULL_BACKEND = "full"


def selected() -> bool:
    """Whether the server resolved the `full` prefill CUDA-graph backend (SGLang's
    `cuda_graph_config.prefill.backend`; the plugin's CUDA default at TP 1, runtime/requirements.py)."""
    from sglang.srt.server_args import get_global_server_args

    config = getattr(get_global_server_args(), "cuda_graph_config", None)
    return config is not None and config.prefill.backend == FULL_BACKEND


def full_graph_capture() -> bool:
    """True while SGLang's `full` prefill runner warms up or captures a bucket (its forward context
    with `full_graph=True`)."""
    from sglang.srt.model_executor.runner_backend_utils.tc_piecewise_cuda_graph.context_manager import (
        get_tc_piecewise_forward_context)

    context = get_tc_piecewise_forward_context()
    return context is not None and bool(context.full_graph)


def replaying(body: nn.Module) -> bool:
    """Whether the runner has replaced `body.forward` with its graph replay: an instance attribute
    that is not the class's own method (after a replay the runner puts the bound method back as an
    instance attribute, which is not a replay)."""
    patched = vars(body).get("forward")
    return patched is not None and getattr(patched, "__func__", None) is not type(body).forward


class PrefillGraphBody(nn.Module):
    """The language model SGLang's prefill runner captures: the outer model's hidden states (see
    the module doc). `outer` is held by weak reference, so it is not a submodule."""

    def __init__(self, outer: nn.Module, history_len: int) -> None:
        super().__init__()
        self._outer = weakref.ref(outer)
        self.layers = list(outer.torch_forward.layers)
        self.history_len = history_len
        self._history: Tensor | None = None

    def static_history(self, rows: int, device: torch.device) -> Tensor | None:
        """The static Engram-history buffer int64 [rows, K] (−1: no id), made at the first capture;
        None without Engram history."""
        if not self.history_len:
            return None
        if self._history is None:
            self._history = torch.full((rows, self.history_len), -1, dtype=torch.int64, device=device)
        if self._history.shape[0] != rows:
            raise RuntimeError(f"sglang-dsv41 prefill graph: captured with {self._history.shape[0]} request slots, "
                               f"now {rows}")
        return self._history

    def stage_history(self, history: Tensor | None) -> None:
        """Before a replay: the batch's host-built history into the static buffer's first rows."""
        if self._history is None:
            return
        if history is None:
            raise RuntimeError("sglang-dsv41 prefill graph: a replayed extend without its Engram history")
        b = history.shape[0]
        self._history[:b].copy_(history)
        self._history[b:].fill_(-1)

    def forward(self, input_ids: Tensor, positions: Tensor, forward_batch, input_embeds: Tensor | None = None) -> Tensor:
        """`input_embeds` is ignored: a multimodal server's runner passes its static slot at capture,
        and it never replays a live batch that has input embeddings (`can_replay_locally`)."""
        outer = self._outer()
        if full_graph_capture():
            history = self.static_history(int(forward_batch.batch_size), outer.device)
            return outer.hidden_states_of(input_ids, positions, forward_batch, None, history, static_extend=True)
        return outer.hidden_states_of(input_ids, positions, forward_batch, None,
                                      outer.take_engram_history(forward_batch))


__all__ = ["FULL_BACKEND", "PrefillGraphBody", "full_graph_capture", "replaying", "selected"]

"""SGLang attention backend `dsv41`: torch_native for eager batches, plus the CUDA-graph hooks
SGLang 0.5.17's decode graph runner calls (`model_executor/runner/decode_cuda_graph_runner.py`).

The model computes its own attention from its slot caches (`runtime/attention.py`); it never
calls the backend's `forward`. SGLang still needs a backend object: to construct one over our
V4.1 pool (torch_native does — the eager behaviour stays exactly
torch_native's), and, for CUDA graphs, to answer:

* `init_cuda_graph_state(max_bs, max_num_tokens)`: nothing to allocate — the model's per-step
  metadata (`runtime/batch.static_decode_layout`) is computed inside the captured forward from
  SGLang's own static input buffers (req_pool_indices, seq_lens, positions, out_cache_loc), so it
  is replayed with them; the sizes are recorded for the log;
* `get_cuda_graph_seq_len_fill_value()`: 1 — a padding request is a one-token decode at position
  0 (seq_len 1 = position + 1), consistent with the runner's padding of positions (0),
  req_pool_indices (0, the padding row) and out_cache_loc (0, the padding page);
* `init_forward_metadata_out_graph` / `_in_graph`: no-ops (base class) — nothing outside the
  model's forward depends on the batch;
* `supports_ragged_verify_graph`: True — under `SGLANG_RAGGED_VERIFY_MODE=compact` (DSpark
  adaptive verification) the runner captures compact verify batches per token tier and refreshes
  the layout's `verify_lens` before each replay; the model's static ragged verify layout reads it.

`register()` adds the name to SGLang's `--attention-backend` choices and its backend registry
(`attention_registry.register_attention_backend`, `server_args.add_attention_backend_choices`);
it must run in every process that parses server args or builds a model runner (the plugin load).
"""
from __future__ import annotations

import logging

BACKEND_NAME = "dsv41"
#: seq_len of a CUDA-graph padding request (see the module docstring)
SEQ_LEN_FILL_VALUE = 1

logger = logging.getLogger(__name__)


def backend_class() -> type:
    """The backend class (built lazily: importing SGLang's attention modules pulls in CUDA code)."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    class Dsv41GraphAttnBackend(TorchNativeAttnBackend):
        """torch_native + the decode CUDA-graph hooks (module docstring)."""

        #: the model builds a compact verify batch's layout inside the graph from the runner's
        #: refreshed verify_lens buffer (`batch.static_ragged_verify_layout`)
        supports_ragged_verify_graph = True

        def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
            self.cuda_graph_max_bs = int(max_bs)
            self.cuda_graph_max_num_tokens = int(max_num_tokens)
            logger.info("sglang-dsv41: CUDA-graph decode up to batch size %d (static decode layout in the "
                        "model's forward; no backend buffers)", max_bs)

        def get_cuda_graph_seq_len_fill_value(self) -> int:
            return SEQ_LEN_FILL_VALUE

    Dsv41GraphAttnBackend.__name__ = Dsv41GraphAttnBackend.__qualname__ = "Dsv41GraphAttnBackend"
    return Dsv41GraphAttnBackend


def register() -> None:
    """Make `--attention-backend dsv41` valid and resolvable in this process (idempotent)."""
    from sglang.srt import server_args
    from sglang.srt.layers.attention import attention_registry

    if BACKEND_NAME not in server_args.ATTENTION_BACKEND_CHOICES:
        server_args.add_attention_backend_choices([BACKEND_NAME])
    if BACKEND_NAME not in attention_registry.ATTENTION_BACKENDS:
        cls = backend_class()
        attention_registry.register_attention_backend(BACKEND_NAME)(lambda runner: cls(runner))

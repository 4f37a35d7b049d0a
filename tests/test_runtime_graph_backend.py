"""The `dsv41` SGLang attention backend (`runtime/graph_backend.py`) and the model's switch to the
static decode layout while SGLang captures (`runtime/model.sglang_graph_capture`) — on CPU.

Pinned: after `register()` SGLang's own argument parser accepts `--attention-backend dsv41` and
its backend registry builds our class (a torch_native subclass) from a model runner; the class
answers the decode graph runner's hooks (fill value 1 = a one-token decode at position 0, the
runner's padding; `init_cuda_graph_state` allocates nothing); `sglang_graph_capture` follows
SGLang's `model_capture_mode`; a static layout refuses non-decode batches.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang_dsv41.runtime import graph_backend
from sglang_dsv41.runtime.batch import layout_from_forward_batch
from sglang_dsv41.runtime.model import sglang_graph_capture


def test_register_makes_the_name_parse_and_resolve() -> None:
    from sglang.srt import server_args
    from sglang.srt.layers.attention import attention_registry

    graph_backend.register()
    graph_backend.register()                                  # idempotent
    assert server_args.ATTENTION_BACKEND_CHOICES.count("dsv41") == 1
    parser = __import__("argparse").ArgumentParser()
    server_args.ServerArgs.add_cli_args(parser)
    args = parser.parse_args(["--model-path", "x", "--attention-backend", "dsv41"])
    assert args.attention_backend == "dsv41"
    runner = SimpleNamespace(device="cpu", req_to_token_pool=object(), token_to_kv_pool=object())
    backend = attention_registry.ATTENTION_BACKENDS["dsv41"](runner)
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    assert isinstance(backend, TorchNativeAttnBackend) and type(backend).__name__ == "Dsv41GraphAttnBackend"
    assert backend.get_cuda_graph_seq_len_fill_value() == 1
    # SGLang's runner admits compact (adaptive-verification) verify batches into graphs only then
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
    assert backend.supports_ragged_verify_graph and not AttentionBackend.supports_ragged_verify_graph
    backend.init_cuda_graph_state(16, 16)
    assert (backend.cuda_graph_max_bs, backend.cuda_graph_max_num_tokens) == (16, 16)


def test_capture_flag_follows_sglang_model_capture_mode() -> None:
    from sglang.srt.model_executor.runner_utils.capture_mode import model_capture_mode

    assert not sglang_graph_capture()
    with model_capture_mode():
        assert sglang_graph_capture()
    assert not sglang_graph_capture()


def _batch(mode_name: str):
    mode = SimpleNamespace(name=mode_name, is_decode=lambda: mode_name == "DECODE", is_idle=lambda: False,
                           is_target_verify=lambda: False)
    return SimpleNamespace(forward_mode=mode, req_pool_indices=torch.tensor([1, 0]), seq_lens=torch.tensor([5, 1]),
                           out_cache_loc=torch.tensor([9, 0]), extend_seq_lens=torch.tensor([1, 1]))


def test_static_layout_from_a_forward_batch() -> None:
    table = torch.zeros(4, 32, dtype=torch.int32)
    layout = layout_from_forward_batch(_batch("DECODE"), torch.tensor([4, 0]), table, static=True)
    assert layout.static and layout.max_seq_len == 32 and layout.live_tokens.tolist() == [True, False]
    with pytest.raises(RuntimeError, match="static .*decode batches, got EXTEND"):
        layout_from_forward_batch(_batch("EXTEND"), torch.tensor([4, 0]), table, static=True)

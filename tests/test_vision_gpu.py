"""The vision path on one CUDA GPU (issue 17; docs/vision.md): the runtime tower on CUDA against
the reference's span rows, and a real server on the tiny checkpoint answering the card's two
verification requests (text 17*19 and an image) plus a repeated image request (same greedy
tokens, prefix hit through the image). Skipped without CUDA; run by scripts/gpu/vision_card.sh."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from server_helpers import Server, running
from sglang_dsv41.config import DeepseekV41Config
from sglang_dsv41.reference.model import ReferenceModel
from sglang_dsv41.runtime.vision import VisionTower, is_vision_tensor
from sglang_dsv41.vision_preprocess import preprocess_image
from test_runtime_vision import REL_BOUND, _image
from test_vision_server import png_data_url
from tp_harness import stored_tensors

pytestmark = pytest.mark.gpu


def _fa3_importable() -> bool:
    try:
        from sgl_kernel import flash_ops  # noqa: F401
    except ImportError:
        return False
    return True


#: session 12's H200 traceback: `ImportError: Can not import FA3 in sgl_kernel`: the `.gpu` layer
#: leaves sgl_kernel's FA3 module (`flash_ops`, 1.1 GB) out (shared/gpu/README.md), so `auto` is triton
FA3_IMPORTABLE = pytest.mark.skipif(not _fa3_importable(), reason="sgl_kernel.flash_ops (FA3) is not installed")


@pytest.mark.parametrize("attention", ["auto", "triton", "sdpa", pytest.param("fa3", marks=FA3_IMPORTABLE)])
def test_tower_on_cuda_matches_the_reference(tiny_checkpoint: Path, attention: str) -> None:
    """auto: SGLang's Triton vision attention with BF16 operands (`runtime/vision_attention.py`)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = DeepseekV41Config.from_file(tiny_checkpoint / "config.json")
    with torch.device("cuda"):
        tower = VisionTower(cfg, attention=attention)
    if attention == "auto":
        assert tower.attn.backend == "triton"
    tower.load_weights((n, v) for n, v in stored_tensors(tiny_checkpoint).items() if is_vision_tensor(n))
    reference = ReferenceModel.from_checkpoint(tiny_checkpoint)
    for size in [(84, 84), (200, 90), (1000, 1000)]:
        img = _image(sum(size), size)
        ours = tower.encode(preprocess_image(img, cfg.vision)).cpu()
        (_, ref), = reference.encode_images([cfg.image_token_id], [img])[1]
        assert ours.shape == ref.shape
        assert (ours - ref.float()).abs().max().item() <= REL_BOUND * ref.abs().max().item()


@pytest.mark.parametrize("attention", ["triton", "sdpa", pytest.param("fa3", marks=FA3_IMPORTABLE)])
def test_images_packed_into_varlen_calls_equal_per_image_calls_on_cuda(tiny_checkpoint: Path, attention: str) -> None:
    """`encode_many` (the server's path: one varlen kernel call per layer over the packed images'
    cu_seqlens) against one image per call, on the real kernels."""
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = DeepseekV41Config.from_file(tiny_checkpoint / "config.json")
    with torch.device("cuda"):
        tower = VisionTower(cfg, attention=attention)
    tower.load_weights((n, v) for n, v in stored_tensors(tiny_checkpoint).items() if is_vision_tensor(n))
    pres = [preprocess_image(_image(i, size), cfg.vision) for i, size in enumerate([(84, 84), (200, 90), (33, 500),
                                                                                   (300, 300)])]
    for one, many in zip([tower.encode(p) for p in pres], tower.encode_many(pres), strict=True):
        assert one.shape == many.shape
        assert (one - many).abs().max().item() <= REL_BOUND * one.abs().max().item()


def test_card_requests_on_the_gpu_server(tiny_checkpoint: Path, tmp_path: Path) -> None:
    url = png_data_url(_image(5, (200, 90)))
    with running(Server(tiny_checkpoint, tmp_path / "server.log", ["--max-total-tokens", "4096"])) as srv:
        text = srv.post("/v1/chat/completions", {"model": "x", "max_tokens": 16, "messages": [
            {"role": "user", "content": "What is 17*19? Return only the integer."}]})
        assert text["choices"][0]["message"] is not None
        msg = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                            {"type": "text", "text": "Describe this image."}]}]
        first = srv.post("/v1/chat/completions", {"model": "x", "max_tokens": 16, "temperature": 0, "messages": msg})
        again = srv.post("/v1/chat/completions", {"model": "x", "max_tokens": 16, "temperature": 0, "messages": msg})
        assert first["usage"]["prompt_tokens"] > text["usage"]["prompt_tokens"]
        assert first["choices"][0]["message"] == again["choices"][0]["message"]
        log = srv.log_tail(400_000)
        assert "vision tower loaded" in log
        if torch.cuda.get_device_capability()[0] == 9:
            assert "attention: SGLang VisionTritonAttention" in log

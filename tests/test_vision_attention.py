"""The ViT's GPU path (`runtime/vision_attention.py`; issue 17 "ViT on the GPU with fast kernels")
checked on CPU: the tower with BF16 operands and SGLang 0.5.17's `VisionFlash3Attention` /
`VisionTritonAttention` modules, their kernels (`flash_attn_func`, `context_attention_fwd`) replaced
by an exact torch stand-in that holds each call to the kernel's documented contract (layout
[N, heads, hd], cu_seqlens of the one image, non-causal, 1/√hd). The span rows stay within
`REL_BOUND` of the reference's. The real kernels run in tests/test_vision_gpu.py (H200);
SGLang's Triton kernel cannot be checked in the Triton interpreter: the interpreter's BF16 loads
give garbage (triton 3.6; fp32 and fp16 are right)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import sglang.srt.layers.attention.vision as sglang_vision
from sglang_dsv41.config import DeepseekV41Config
from sglang_dsv41.reference.model import ReferenceModel
from sglang_dsv41.runtime.vision import VisionTower, is_vision_tensor
from sglang_dsv41.runtime.vision_attention import ViTAttention, pick_backend
from sglang_dsv41.vision_preprocess import preprocess_image
from test_runtime_vision import REL_BOUND, _image
from tp_harness import stored_tensors

CALLS: list[dict] = []


def _varlen(q, k, v, cu: torch.Tensor, scale: float) -> torch.Tensor:
    """Exact stand-in: per cu_seqlens segment, fp32 softmax attention, output in q's dtype."""
    assert q.dtype == k.dtype == v.dtype == torch.bfloat16 and q.is_contiguous() and q.dim() == 3
    out = torch.empty_like(q)
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        o = F.scaled_dot_product_attention(*(t[s:e].float().transpose(0, 1) for t in (q, k, v)), scale=scale)
        out[s:e] = o.transpose(0, 1).to(q.dtype)
    return out


def _flash(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, window_size,
           **kw):
    assert torch.equal(cu_seqlens_q, cu_seqlens_k) and cu_seqlens_q.dtype == torch.int32
    assert max_seqlen_q == max_seqlen_k == q.shape[0] and tuple(window_size) == (-1, -1) and not kw
    CALLS.append({"kernel": "fa3", "n": q.shape[0], "scale": softmax_scale})
    return _varlen(q, k, v, cu_seqlens_q, softmax_scale)


def _context(q, k, v, o, b_start_loc, b_seq_len, max_input_len, is_causal=True, sm_scale=None):
    assert not is_causal and max_input_len == q.shape[0] and b_seq_len.tolist() == [q.shape[0]]
    CALLS.append({"kernel": "triton", "n": q.shape[0], "scale": sm_scale})
    cu = torch.cat([b_start_loc[:1], b_start_loc[:1] + b_seq_len]).cpu()
    o.copy_(_varlen(q, k, v, cu, sm_scale))


@pytest.fixture(scope="module")
def setup(tiny_checkpoint: Path):
    cfg = DeepseekV41Config.from_file(tiny_checkpoint / "config.json")
    tower = VisionTower(cfg)
    tower.load_weights((n, v) for n, v in stored_tensors(tiny_checkpoint).items() if is_vision_tensor(n))
    return cfg, tower, ReferenceModel.from_checkpoint(tiny_checkpoint)


@pytest.mark.parametrize("backend", ["fa3", "triton"])
def test_bf16_operand_path_through_sglang_vision_modules_matches_the_reference(setup, backend, monkeypatch) -> None:
    cfg, tower, reference = setup
    monkeypatch.setattr(sglang_vision, "_is_cuda", True)               # FA3's constructor checks it
    monkeypatch.setattr(sglang_vision, "flash_attn_func", _flash, raising=False)
    monkeypatch.setattr(sglang_vision, "context_attention_fwd", _context)
    monkeypatch.setattr(tower, "attn", ViTAttention(backend))
    CALLS.clear()
    for size in [(84, 84), (1000, 1000)]:
        img = _image(sum(size), size)
        pre = preprocess_image(img, cfg.vision)
        ours = tower.encode(pre)
        (_, ref), = reference.encode_images([cfg.image_token_id], [img])[1]
        assert ours.shape == ref.shape and torch.equal(ours, ours.to(torch.bfloat16).float())
        err, scale = (ours - ref.float()).abs().max().item(), ref.abs().max().item()
        assert err <= REL_BOUND * scale, (backend, size, err, scale)
        assert torch.equal(ours[0], ref[0].float()) and torch.equal(ours[-1], ref[-1].float())
    hd = cfg.vision.head_dim
    assert len(CALLS) == 2 * cfg.vision.num_hidden_layers and {c["kernel"] for c in CALLS} == {backend}
    assert all(c["scale"] == hd ** -0.5 for c in CALLS)


def test_backend_choice_by_device() -> None:
    cpu = torch.device("cpu")
    assert pick_backend("auto", cpu) == "sdpa" and pick_backend("triton", cpu) == "triton"
    with pytest.raises(ValueError, match="'fa3' needs a CUDA SM 9.x device"):
        pick_backend("fa3", cpu)
    with pytest.raises(ValueError, match="unknown ViT attention backend 'flash'"):
        pick_backend("flash", cpu)
    assert not ViTAttention("sdpa").fast and "fp32 operands" in ViTAttention("sdpa").describe()

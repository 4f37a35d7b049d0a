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
from sglang_dsv41.runtime.vision_calls import auto_backend, call_groups
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
    cu = cu_seqlens_q.tolist()
    assert torch.equal(cu_seqlens_q, cu_seqlens_k) and cu_seqlens_q.dtype == torch.int32
    assert cu[0] == 0 and cu[-1] == q.shape[0] and tuple(window_size) == (-1, -1) and not kw
    assert max_seqlen_q == max_seqlen_k == max(e - s for s, e in zip(cu, cu[1:]))
    CALLS.append({"kernel": "fa3", "n": q.shape[0], "scale": softmax_scale, "cu": cu})
    return _varlen(q, k, v, cu_seqlens_q, softmax_scale)


def _context(q, k, v, o, b_start_loc, b_seq_len, max_input_len, is_causal=True, sm_scale=None):
    """SGLang's Triton kernel reads image i at b_start_loc[i] for b_seq_len[i] rows (b_start_loc is
    the module's cu_seqlens, one entry longer)."""
    starts, lens = b_start_loc.tolist(), b_seq_len.tolist()
    assert not is_causal and max_input_len == max(lens) and starts[0] == 0 and starts[-1] == q.shape[0]
    assert lens == [e - s for s, e in zip(starts, starts[1:])]
    CALLS.append({"kernel": "triton", "n": q.shape[0], "scale": sm_scale, "cu": starts})
    o.copy_(_varlen(q, k, v, b_start_loc, sm_scale))


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


@pytest.mark.parametrize("backend", ["sdpa", "fa3", "triton"])
def test_images_packed_into_varlen_calls_equal_per_image_calls(setup, backend, monkeypatch) -> None:
    """`encode_many` packs images up to the call budget (9·32 = 288 patches at the tiny cap): the
    first three (36 + 105 + 108 patches) share one call, with one kernel call per layer over their
    cu_seqlens; the fourth (225) takes a second. Rows equal per-image `encode` within REL_BOUND."""
    cfg, tower, _ = setup
    monkeypatch.setattr(sglang_vision, "_is_cuda", True)
    monkeypatch.setattr(sglang_vision, "flash_attn_func", _flash, raising=False)
    monkeypatch.setattr(sglang_vision, "context_attention_fwd", _context)
    monkeypatch.setattr(tower, "attn", ViTAttention(backend))
    pres = [preprocess_image(_image(i, size), cfg.vision) for i, size in enumerate([(84, 84), (200, 90), (33, 500),
                                                                                   (300, 300)])]
    assert [p.grid.num_patches for p in pres] == [36, 105, 108, 225]
    single = [tower.encode(pre) for pre in pres]
    CALLS.clear()
    packed = tower.encode_many(pres)
    layers = cfg.vision.num_hidden_layers
    if backend != "sdpa":
        assert [c["cu"] for c in CALLS] == [[0, 36, 141, 249]] * layers + [[0, 225]] * layers
    for one, many in zip(single, packed, strict=True):
        assert one.shape == many.shape and torch.equal(many, many.to(torch.bfloat16).float())
        assert (one - many).abs().max().item() <= REL_BOUND * one.abs().max().item()
        assert torch.equal(one[0], many[0]) and torch.equal(one[-1], many[-1])


def test_call_groups() -> None:
    assert call_groups([36, 105, 108, 225], 288) == [[0, 1, 2], [3]]
    assert call_groups([288, 1, 287, 2], 288) == [[0], [1, 2], [3]] and call_groups([], 288) == []
    with pytest.raises(ValueError, match="image 1 has 289 ViT patches, above the 288"):
        call_groups([1, 289], 288)
    assert auto_backend("cuda") == "triton" and auto_backend("cpu") == "sdpa"


def test_backend_choice_by_device() -> None:
    cpu = torch.device("cpu")
    assert pick_backend("auto", cpu) == "sdpa" and pick_backend("triton", cpu) == "triton"
    with pytest.raises(ValueError, match="'fa3' needs a CUDA SM 9.x device"):
        pick_backend("fa3", cpu)
    with pytest.raises(ValueError, match="unknown ViT attention backend 'flash'"):
        pick_backend("flash", cpu)
    assert not ViTAttention("sdpa").fast and "fp32 operands" in ViTAttention("sdpa").describe()

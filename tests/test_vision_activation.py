"""The planner's ViT activation memory (`deploy/vision_config.vit_activation_bytes`) against the
live tensor bytes `runtime/vision.VisionTower.encode_many` really holds, counted on CPU by a
dispatch mode that adds each new output storage and subtracts it when its last tensor dies.

Per backend: ``sdpa`` as served on CPU (the math kernel: heads·L² scores per image); ``triton`` /
``fa3`` with BF16 operands through SGLang's vision modules, their kernels replaced by stand-ins that
allocate what the real ones do (Triton: nothing, writing the module's output; FA3: the output and
its heads × N fp32 log-sum-exp), so only the kernels' values are not real. One image at the cap,
and several images packed into one varlen call. The GPU figure (`torch.cuda.max_memory_allocated`)
is measured next to the planner's by `benchmarks/vision.py --vit` (scripts/gpu/vision.sh). Small
widths keep this to seconds.
"""
from __future__ import annotations

import weakref

import pytest
import torch

import sglang.srt.layers.attention.vision as sglang_vision
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from sglang_dsv41.config import DeepseekV41Config
from sglang_dsv41.deploy import plan as plan_mod
from sglang_dsv41.deploy.schema import config_from_dict, raw_config
from sglang_dsv41.deploy.vision_config import image_span_tokens, vision_activation, vit_activation_bytes
from sglang_dsv41.presets import flash_config_dict, tiny_config_dict
from sglang_dsv41.runtime.forward import fp32_default_dtype
from sglang_dsv41.runtime.vision import VisionTower
from sglang_dsv41.runtime.vision_attention import ViTAttention
from sglang_dsv41.vision_preprocess import ImageGrid, PreprocessedImage

from test_deploy_plan import ROOT


class LiveBytes(TorchDispatchMode):
    """Peak bytes of storages created under the mode and still referenced (`ignore`: tensors that
    existed before, e.g. weights, whose views must not count)."""

    def __init__(self, ignore) -> None:
        super().__init__()
        self.ignore = {t.untyped_storage().data_ptr() for t in ignore}
        self.live: dict[int, list[int]] = {}
        self.now = self.peak = 0

    def _drop(self, key: int) -> None:
        entry = self.live[key]
        entry[1] -= 1
        if entry[1] == 0:
            del self.live[key]
            self.now -= entry[0]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key in self.ignore:
                continue
            if key in self.live:
                self.live[key][1] += 1
            else:
                self.live[key] = [storage.nbytes(), 1]
                self.now += storage.nbytes()
                self.peak = max(self.peak, self.now)
            weakref.finalize(t, self._drop, key)
        return out


def _config(**vision) -> DeepseekV41Config:
    d = tiny_config_dict(1024)
    d["vision_config"].update(vision)
    return DeepseekV41Config.from_dict(d)


def _triton_kernel(q, k, v, o, *args, **kwargs) -> None:
    o.copy_(v)                                   # writes the module's output, allocates nothing


def _fa3_kernel(q, k, v, **kwargs) -> torch.Tensor:
    lse = torch.empty(q.shape[1], q.shape[0])    # noqa: F841 (allocated next to the output, as FA3 does)
    return torch.empty_like(q)


def _square(v, side: int, seed: int) -> PreprocessedImage:
    px = side * v.downsample_ratio * v.patch_size
    grid = ImageGrid(resized_width=px, resized_height=px, vit_h=3 * side, vit_w=3 * side, n_h=side, n_w=side,
                     resize_plain=False)
    patches = torch.randn(grid.num_patches, 3 * v.patch_size ** 2, generator=torch.Generator().manual_seed(seed))
    return PreprocessedImage(patches=patches.to(torch.bfloat16), grid=grid)


@pytest.mark.parametrize("backend", ["sdpa", "triton", "fa3"])
@pytest.mark.parametrize("dims", [
    dict(hidden_size=64, num_attention_heads=2, intermediate_size=64),      # attention dominates
    dict(hidden_size=64, num_attention_heads=2, intermediate_size=1024),    # the MLP dominates
], ids=["attention", "mlp"])
def test_formula_bounds_the_measured_peak_of_a_vit_call(dims, backend, monkeypatch) -> None:
    monkeypatch.setattr(sglang_vision, "_is_cuda", True)                   # FA3's constructor checks it
    monkeypatch.setattr(sglang_vision, "flash_attn_func", _fa3_kernel, raising=False)
    monkeypatch.setattr(sglang_vision, "context_attention_fwd", _triton_kernel)
    cfg = _config(num_hidden_layers=2, max_image_tokens=36, **dims)
    with fp32_default_dtype():
        tower = VisionTower(cfg)
    tower.attn = ViTAttention(backend)
    with torch.no_grad():
        for p in tower.parameters():
            p.normal_(0, 0.02)
    v, hidden = cfg.vision, cfg.text.hidden_size
    cap = _square(v, 6, 0)            # a 6 × 6 token grid: the 36-token cap, 18 × 18 patches
    assert cap.grid.num_patches == v.downsample_ratio ** 2 * v.max_image_tokens   # the call budget
    packed = [_square(v, side, side) for side in (2, 3, 4)]                       # 261 patches: one call
    for pres, kwargs in [([cap], {}),
                         (packed, dict(patches=261, longest=144, images=3, span_tokens=sum(s * (s + 1) + 2 for s in (2, 3, 4))))]:
        mode = LiveBytes([*tower.parameters(), *(pre.patches for pre in pres)])
        with mode:
            tower.encode_many(pres)
        planned = vit_activation_bytes(v, hidden, backend, **kwargs)
        longest = kwargs.get("longest", cap.grid.num_patches)
        unseen = v.num_attention_heads * longest ** 2 if backend == "sdpa" else 0  # the mask inside SDPA's softmax
        assert mode.peak <= planned <= 1.02 * mode.peak + unseen, (backend, len(pres), mode.peak, planned)
    assert image_span_tokens(v) == 44


def test_flash_figure_and_the_plan_verdict() -> None:
    flash = DeepseekV41Config.from_dict(flash_config_dict())
    v = flash.vision
    n, d, i = 9 * 1024, v.hidden_size, v.intermediate_size     # one ViT call: one image at the 1024-token cap
    base = 4 * n * d + 4 * n * v.head_dim + 8                   # residual, RoPE tables, cu_seqlens [0, n]
    for backend in ("triton", "fa3"):                           # the MLP's SwiGLU is the peak
        assert vit_activation_bytes(v, flash.text.hidden_size, backend) == base + 4 * n * d + 18 * n * i
    sdpa = vit_activation_bytes(v, flash.text.hidden_size, "sdpa")                # one image's scores
    assert sdpa == base + 28 * n * d + 4 * n * d + 9 * v.num_attention_heads * n * n
    data = raw_config(ROOT / "configs" / "h200-tp4.yaml")
    dc = config_from_dict(data, "h200-tp4")
    va = vision_activation(dc, flash, 8192)
    assert va["vit_backend"] == "triton" and va["vit_peak_bytes"] == vit_activation_bytes(v, 5120, "triton")
    assert va["images_per_batch"] == 9 and va["prefill_tokens"] == 8192 and va["vit_call_patches"] == n
    plan = plan_mod.make_plan(dc, flash)
    assert plan.vision_activation == va                         # H200: SGLang's 8K chunk
    assert plan.verdict()[0]
    squeezed = plan_mod.make_plan(dc, flash, mem_fraction=1 - 0.5 * va["total_bytes"] / (141 * 2**30))
    ok, text = squeezed.verdict()
    assert not ok and "the vision tower's activations" in text
    data["features"] = {"text_only": True}
    assert plan_mod.make_plan(config_from_dict(data, "text"), flash).vision_activation is None


def test_encoder_data_parallel_adds_the_gather_at_tp_above_one() -> None:
    tiny = DeepseekV41Config.from_dict(tiny_config_dict(1024))
    data = raw_config(ROOT / "configs" / "tiny-h200-tp2.yaml")
    va = vision_activation(config_from_dict(data, "tp2"), tiny, 2048)
    span_rows = va["images_per_batch"] * 32 * tiny.text.hidden_size * 4       # 32: the tiny cap's square span
    assert va["encoder"] == "data-parallel over 2 ranks" and va["encoder_gather_bytes"] == 2 * span_rows
    data["parallel"], data["hardware"]["gpus"] = {"tp": 1}, 1
    one = vision_activation(config_from_dict(data, "tp1"), tiny, 2048)
    assert one["encoder_gather_bytes"] == 0 and "no-op at TP 1" in one["encoder"]
    assert one["total_bytes"] == va["total_bytes"] - va["encoder_gather_bytes"]

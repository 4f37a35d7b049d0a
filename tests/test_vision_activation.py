"""The planner's ViT activation memory (`deploy/vision_config.vit_activation_bytes`) against the
live tensor bytes `runtime/vision.VisionTower.encode` really holds, counted on CPU by a dispatch
mode that adds each new output storage and subtracts it when its last tensor dies.

CPU's `scaled_dot_product_attention` is the math kernel (it materialises heads·N² scores), so the
formula is checked with `fused_attention=False`; the fused (CUDA) figure is measured on the H200
by `benchmarks/vision.py --vit-only` (scripts/gpu/vision.sh). Small widths keep this to seconds.
"""
from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from sglang_dsv41.config import DeepseekV41Config
from sglang_dsv41.deploy import plan as plan_mod
from sglang_dsv41.deploy.schema import config_from_dict, raw_config
from sglang_dsv41.deploy.vision_config import vision_activation, vit_activation_bytes
from sglang_dsv41.presets import flash_config_dict, tiny_config_dict
from sglang_dsv41.runtime.forward import fp32_default_dtype
from sglang_dsv41.runtime.vision import VisionTower
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


@pytest.mark.parametrize("dims", [
    dict(hidden_size=64, num_attention_heads=2, intermediate_size=64),      # attention scores dominate
    dict(hidden_size=64, num_attention_heads=2, intermediate_size=1024),    # the MLP dominates
], ids=["attention", "mlp"])
def test_formula_bounds_the_measured_peak_of_one_image_at_the_cap(dims) -> None:
    cfg = _config(num_hidden_layers=2, max_image_tokens=36, **dims)
    with fp32_default_dtype():
        tower = VisionTower(cfg)
    with torch.no_grad():
        for p in tower.parameters():
            p.normal_(0, 0.02)
    v = cfg.vision
    side = 6                                            # a 6 × 6 token grid: the 36-token cap, 18 × 18 patches
    px = side * v.downsample_ratio * v.patch_size
    grid = ImageGrid(resized_width=px, resized_height=px, vit_h=3 * side, vit_w=3 * side, n_h=side, n_w=side,
                     resize_plain=False)
    patches = torch.randn(grid.num_patches, 3 * v.patch_size ** 2, generator=torch.Generator().manual_seed(0))
    pre = PreprocessedImage(patches=patches.to(torch.bfloat16), grid=grid)
    assert grid.num_patches == v.downsample_ratio ** 2 * v.max_image_tokens   # the cap's largest grid
    mode = LiveBytes([*tower.parameters(), pre.patches])
    with mode:
        tower.encode(pre)
    planned = vit_activation_bytes(v, cfg.text.hidden_size, fused_attention=False)
    patches_on_device = 12 * pre.grid.num_patches * v.patch_size ** 2   # CPU: fp32 already, no copy to count
    assert mode.peak <= planned <= 1.02 * mode.peak + patches_on_device, (mode.peak, planned)


def test_flash_figure_and_the_plan_verdict() -> None:
    flash = DeepseekV41Config.from_dict(flash_config_dict())
    v = flash.vision
    n = 9 * 1024                        # patches of one image at the 1024-token cap
    mlp = 8 * n * v.hidden_size + 20 * n * v.intermediate_size
    assert vit_activation_bytes(v, flash.text.hidden_size, fused_attention=True) == \
        12 * n * 14 * 14 + 6 * n * v.head_dim + mlp           # the MLP is the peak with a fused attention
    data = raw_config(ROOT / "configs" / "h200-tp4.yaml")
    dc = config_from_dict(data, "h200-tp4")
    va = vision_activation(dc, flash, 8192, fused_attention=True)
    assert va["images_per_batch"] == 9 and va["prefill_tokens"] == 8192
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
    va = vision_activation(config_from_dict(data, "tp2"), tiny, 2048, fused_attention=True)
    span_rows = va["images_per_batch"] * 32 * tiny.text.hidden_size * 4       # 32: the tiny cap's square span
    assert va["encoder"] == "data-parallel over 2 ranks" and va["encoder_gather_bytes"] == 2 * span_rows
    data["parallel"], data["hardware"]["gpus"] = {"tp": 1}, 1
    one = vision_activation(config_from_dict(data, "tp1"), tiny, 2048, fused_attention=True)
    assert one["encoder_gather_bytes"] == 0 and "no-op at TP 1" in one["encoder"]
    assert one["total_bytes"] == va["total_bytes"] - va["encoder_gather_bytes"]

"""Vision preprocessing (spec §5.1, §7, §8 item 17): grid plan, recipe cross-check, resize/pad,
normalisation and patch order."""
from __future__ import annotations

import dataclasses
import io
import math

import deepseek_recipe as recipe
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image, ImageOps

from sglang_dsv41.config import DeepseekV41Config, VisionConfig
from sglang_dsv41.presets import flash_config_dict, tiny_config_dict
from sglang_dsv41.reference.vision_preprocess import (
    ImageGrid,
    normalize_pixels,
    patchify,
    plan_image_grid,
    preprocess_image,
    resize_and_pad,
)

FLASH_V: VisionConfig = DeepseekV41Config.from_dict(flash_config_dict()).vision  # type: ignore[assignment]
TINY_V: VisionConfig = DeepseekV41Config.from_dict(tiny_config_dict(500)).vision  # type: ignore[assignment]


def recipe_tokens(w: int, h: int) -> int:
    """deepseek-recipe 0.2.0's V4.1 token count (Flash constants are built in)."""
    return recipe.MultiModalData([recipe.ImageInfo(b"", w, h)]).image_token_adjustment() + 1


def recipe_resized_size(img: Image.Image) -> tuple[int, int]:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    info = recipe.OpenCvImagePreprocessor().preprocess(buf.getvalue(), recipe.PreprocessOptions("high", 10**6, 512))
    return info.width, info.height


def upscaled_area_below_min(w: int, h: int, v: VisionConfig) -> bool:
    """True where the spec's truncating min_pixels up-scale, after rounding up to patches, still
    has fewer than min_pixels pixels — the one region where recipe 0.2.0 plans differently."""
    if w * h >= v.min_pixels:
        return False
    s = math.sqrt(v.min_pixels / (w * h))
    p = v.patch_size
    return math.ceil(int(w * s) / p) * p * math.ceil(int(h * s) / p) * p < v.min_pixels


def check_grid_invariants(g: ImageGrid, v: VisionConfig) -> None:
    p, k = v.patch_size, v.downsample_ratio
    assert g.resized_width % p == 0 and g.resized_height % p == 0
    assert g.vit_w == g.resized_width // p >= 1 and g.vit_h == g.resized_height // p >= 1
    assert g.n_w == -(-g.vit_w // k) and g.n_h == -(-g.vit_h // k)
    assert g.num_tokens == g.n_h * (g.n_w + 1) + 2 <= v.max_image_tokens


# ---- grid plan: the spec's examples -----------------------------------------------------------

@pytest.mark.parametrize(
    "size, resized, grid_hw, tokens",
    [
        ((100, 100), (546, 546), (13, 13), 184),
        ((1920, 1080), (1708, 966), (23, 41), 968),
        ((4000, 3000), (1512, 1134), (27, 36), 1001),
    ],
)
def test_flash_examples(size, resized, grid_hw, tokens):
    g = plan_image_grid(*size, FLASH_V)
    assert (g.resized_width, g.resized_height) == resized
    assert (g.n_h, g.n_w) == grid_hw
    assert g.num_tokens == tokens
    check_grid_invariants(g, FLASH_V)


def test_tiny_min_pixels_image_is_eight_tokens():
    g = plan_image_grid(84, 84, TINY_V)
    assert (g.resized_width, g.resized_height, g.vit_h, g.vit_w, g.n_h, g.n_w) == (84, 84, 6, 6, 2, 2)
    assert g.num_tokens == 8


def test_tiny_large_image_takes_resize_path():
    uncapped = plan_image_grid(420, 420, dataclasses.replace(TINY_V, max_image_tokens=10**6))
    assert (uncapped.vit_h, uncapped.vit_w, uncapped.num_tokens) == (30, 30, 112)  # over the 32 budget
    g = plan_image_grid(420, 420, TINY_V)
    # r = 1: w* = sqrt(30 + 1/4) − 1/2 = 5, β = 5·42/420 ⇒ 210×210 px, 15×15 patches, 5×5 grid.
    assert (g.resized_width, g.resized_height, g.n_h, g.n_w) == (210, 210, 5, 5)
    assert g.num_tokens == 32


def test_tiny_upscale_truncates():
    # 50×30 < 7056 px: s = sqrt(7056/1500) ⇒ int(108.44) × int(65.06) = 108×65 ⇒ 112×70 px.
    g = plan_image_grid(50, 30, TINY_V)
    assert (g.resized_width, g.resized_height) == (112, 70)
    assert (g.n_h, g.n_w, g.num_tokens) == (2, 3, 10)


@pytest.mark.parametrize("size, resized", [((1, 5000), (42, 15 * 42)), ((5000, 1), (29 * 42, 42))])
def test_tiny_degenerate_aspect_ratios(size, resized):
    # w* < 1 ⇒ one feature column of ⌊30/2⌋ rows; h* < 1 ⇒ one row of 30 − 1 features.
    g = plan_image_grid(*size, TINY_V)
    assert (g.resized_width, g.resized_height) == resized
    assert g.num_tokens == 32


def test_rejects_empty_image():
    with pytest.raises(ValueError):
        plan_image_grid(0, 10, TINY_V)


@settings(max_examples=300, deadline=None)
@given(w=st.integers(1, 20000), h=st.integers(1, 20000), flash=st.booleans())
def test_grid_invariants_random_sizes(w, h, flash):
    v = FLASH_V if flash else TINY_V
    check_grid_invariants(plan_image_grid(w, h, v), v)


# ---- cross-check with deepseek-recipe 0.2.0 (Flash constants only) ----------------------------

@settings(max_examples=400, deadline=None)
@given(w=st.integers(1, 40000), h=st.integers(1, 40000))
def test_token_count_matches_recipe(w, h):
    if upscaled_area_below_min(w, h, FLASH_V):
        return  # documented divergence, pinned in test_recipe_divergence_region
    assert plan_image_grid(w, h, FLASH_V).num_tokens == recipe_tokens(w, h)


def test_token_count_matches_recipe_small_sizes_exhaustive():
    mismatches = [
        (w, h) for w in range(1, 70) for h in range(1, 70)
        if not upscaled_area_below_min(w, h, FLASH_V) and plan_image_grid(w, h, FLASH_V).num_tokens != recipe_tokens(w, h)
    ]
    assert mismatches == []


def test_recipe_divergence_region():
    """1×41: spec step 2 gives int(84.96)×int(3483.4) = 84×3483 → 84×3486 px (83×2 grid, 251
    tokens) although 84·3486 < min_pixels; recipe 0.2.0 grows the long side until the area
    reaches min_pixels (84×3528, 254 tokens). We follow the spec (upstream SGLang)."""
    assert upscaled_area_below_min(1, 41, FLASH_V)
    g = plan_image_grid(1, 41, FLASH_V)
    assert (g.resized_width, g.resized_height, g.num_tokens) == (84, 3486, 251)
    assert recipe_tokens(1, 41) == 254


@pytest.mark.parametrize("size", [(100, 100), (1920, 1080), (4000, 3000), (300, 20), (777, 555), (20, 900)])
def test_resized_size_matches_recipe_preprocessor(size):
    img = Image.new("RGB", size, (200, 30, 60))
    g = plan_image_grid(*size, FLASH_V)
    assert (g.resized_width, g.resized_height) == recipe_resized_size(img)


# ---- resize, normalise, patchify --------------------------------------------------------------

def _bf16_norm(v: float) -> torch.Tensor:
    return torch.tensor((v / 255.0 - 0.5) / 0.5, dtype=torch.float32).to(torch.bfloat16)


def test_normalize_endpoints_and_dtype():
    arr = np.array([[[0, 127, 255]]], dtype=np.uint8)
    out = normalize_pixels(Image.fromarray(arr))
    assert out.dtype == torch.bfloat16 and out.shape == (3, 1, 1)
    assert out[0, 0, 0].item() == -1.0 and out[2, 0, 0].item() == 1.0
    assert out[1, 0, 0] == _bf16_norm(127)


def test_patchify_order_explicit():
    c, p, gh, gw = 3, 14, 2, 3
    y, x = torch.meshgrid(torch.arange(gh * p), torch.arange(gw * p), indexing="ij")
    pix = torch.stack([ch * 1_000_000 + y * 1000 + x for ch in range(c)]).to(torch.float64)
    patches = patchify(pix, p)
    assert patches.shape == (gh * gw, c * p * p)
    for idx in range(gh * gw):
        pr, pc = divmod(idx, gw)  # row-major patch order
        for ch in range(c):
            for r in range(p):
                for col in range(p):
                    val = patches[idx, ch * p * p + r * p + col].item()
                    assert val == ch * 1_000_000 + (pr * p + r) * 1000 + (pc * p + col)


def test_preprocess_keeps_positions_when_no_resize():
    # 84×84 is exactly the tiny plan: no resampling; pixel values encode (row, col).
    yy, xx = np.mgrid[0:84, 0:84]
    arr = np.stack([xx * 3, yy * 3, (xx + 2 * yy) % 256], axis=-1).astype(np.uint8)
    pre = preprocess_image(Image.fromarray(arr), TINY_V)
    assert pre.grid.num_tokens == 8
    assert pre.patches.dtype == torch.bfloat16 and pre.patches.shape == (36, 3 * 14 * 14)
    expected = normalize_pixels(Image.fromarray(arr)).to(torch.float32)
    got = pre.patches.to(torch.float32).reshape(6, 6, 3, 14, 14)
    for pr in range(6):
        for pc in range(6):
            assert torch.equal(got[pr, pc], expected[:, pr * 14:(pr + 1) * 14, pc * 14:(pc + 1) * 14])
    # spot value: R at pixel (row 20, col 30) is 90
    assert got[1, 2, 0, 6, 2] == _bf16_norm(90).float()


def test_pad_is_centred_gray_127():
    # 100×84 → 112×84 plan: content stays 100×84 (already fits the height), 6 gray columns each side.
    img = Image.new("RGB", (100, 84), (255, 0, 0))
    g = plan_image_grid(100, 84, TINY_V)
    assert (g.resized_width, g.resized_height) == (112, 84)
    out = np.asarray(resize_and_pad(img, g))
    assert out.shape == (84, 112, 3)
    assert (out[:, :6] == 127).all() and (out[:, -6:] == 127).all()
    assert (out[:, 6:-6] == (255, 0, 0)).all()
    ref = np.asarray(ImageOps.pad(img, (112, 84), method=Image.Resampling.BICUBIC, color=(127, 127, 127)))
    assert np.array_equal(out, ref)


def test_preprocess_converts_to_rgb():
    img = Image.new("L", (84, 84), 255)
    pre = preprocess_image(img, TINY_V)
    assert pre.patches.shape == (36, 588)
    assert bool((pre.patches == 1.0).all())

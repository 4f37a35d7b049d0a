"""Vision preprocessing (spec §5.1, §7, §8 item 17): grid plan, recipe cross-check, resize/pad,
normalisation and patch order."""
from __future__ import annotations

import dataclasses
import io

import deepseek_recipe as recipe
import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from PIL import Image, ImageOps

from sglang_dsv41.config import DeepseekV41Config, VisionConfig
from sglang_dsv41.presets import flash_config_dict, tiny_config_dict
from sglang_dsv41.vision_preprocess import (
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


def replan(g: ImageGrid, v: VisionConfig) -> ImageGrid:
    """The spec plan of a plan's own output size."""
    return plan_image_grid(g.resized_width, g.resized_height, v)


def spec_plan_is_fixed_point(w: int, h: int, v: VisionConfig) -> bool:
    """False exactly where recipe 0.2.0 plans differently from the spec: the spec's single-pass
    plan, planned again, changes. That needs a planned area below min_pixels (a plan output is
    patch-aligned and within the token budget, so only step 2 can act) whose truncating up-scale
    grows a side: after the min_pixels up-scale (e.g. 1×41) or after a step-5 down-scale of a tall
    thin image whose float64 width lands on 28 px (e.g. 158×26913)."""
    g = plan_image_grid(w, h, v)
    again = replan(g, v)
    return (again.resized_width, again.resized_height) == (g.resized_width, g.resized_height)


def replan_until_fixed(w: int, h: int, v: VisionConfig, max_rounds: int = 64) -> ImageGrid:
    """recipe 0.2.0's rule: iterate the spec plan until its size stops changing."""
    g = plan_image_grid(w, h, v)
    for _ in range(max_rounds):
        again = replan(g, v)
        if (again.resized_width, again.resized_height) == (g.resized_width, g.resized_height):
            return g
        g = again
    raise AssertionError(f"{w}x{h}: re-planning did not converge in {max_rounds} rounds")


def check_against_recipe(w: int, h: int) -> None:
    """Spec plan == recipe wherever the spec plan is a fixed point; elsewhere (documented
    divergence) our plan is under min_pixels and the recipe equals the iterated spec plan."""
    ours = plan_image_grid(w, h, FLASH_V)
    theirs = recipe_tokens(w, h)
    if spec_plan_is_fixed_point(w, h, FLASH_V):
        assert ours.num_tokens == theirs, (w, h)
    else:
        assert ours.resized_width * ours.resized_height < FLASH_V.min_pixels, (w, h)
        assert replan_until_fixed(w, h, FLASH_V).num_tokens == theirs, (w, h)


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
@example(w=158, h=26913)  # step-5 down-scale to 28×7154 < min_pixels (recipe re-plans: 42×8708)
@example(w=1, h=41)  # min_pixels up-scale to 84×3486 < min_pixels (recipe re-plans: 84×3528)
@example(w=100, h=179)  # 406×728 < min_pixels, yet re-planning keeps it: spec == recipe
@given(w=st.integers(1, 40000), h=st.integers(1, 40000))
def test_token_count_matches_recipe(w, h):
    check_against_recipe(w, h)


def test_token_count_matches_recipe_small_sizes_exhaustive():
    for w in range(1, 70):
        for h in range(1, 70):
            check_against_recipe(w, h)


@pytest.mark.parametrize("w", [79, 158, 165])
def test_token_count_matches_recipe_tall_thin_sweep(w):
    # The widths where 42/w·w rounds below 42 in float64; both orientations, across the
    # max_image_tokens boundary (w* crosses 2) up to 40000 px.
    for h in range(10000, 40001, 97):
        check_against_recipe(w, h)
        check_against_recipe(h, w)


def test_divergence_predicate_is_not_just_area():
    # 100×179 plans to 406×728 = 295568 < min_pixels, but the up-scale (s ≈ 1.0006) grows no side.
    g = plan_image_grid(100, 179, FLASH_V)
    assert (g.resized_width, g.resized_height) == (406, 728)
    assert g.resized_width * g.resized_height < FLASH_V.min_pixels
    assert spec_plan_is_fixed_point(100, 179, FLASH_V)
    assert g.num_tokens == recipe_tokens(100, 179)


def test_recipe_divergence_region():
    """1×41: spec step 2 gives int(84.96)×int(3483.4) = 84×3483 → 84×3486 px (83×2 grid, 251
    tokens) although 84·3486 < min_pixels; recipe 0.2.0 re-plans until the size is a fixed point
    (84×3528, 254 tokens). We follow the spec (upstream SGLang's single pass)."""
    assert not spec_plan_is_fixed_point(1, 41, FLASH_V)
    g = plan_image_grid(1, 41, FLASH_V)
    assert (g.resized_width, g.resized_height, g.num_tokens) == (84, 3486, 251)
    fixed = replan_until_fixed(1, 41, FLASH_V)
    assert (fixed.resized_width, fixed.resized_height, fixed.num_tokens) == (84, 3528, 254)
    assert recipe_tokens(1, 41) == 254
    assert recipe_resized_size(Image.new("RGB", (1, 41), (9, 9, 9))) == (84, 3528)


def test_recipe_divergence_after_budget_downscale():
    """158×26913 (Hypothesis's find): 3207 tokens unscaled ⇒ step 5, r = 26913/158,
    w* = 1.99998… ⇒ ⌊w*⌋ = 1, β = 42/158, and in float64 158·β = 41.999… ⇒ W' = 28 (2 patches),
    H' = ⌊26913·β/14⌋·14 = 7154 ⇒ ViT 511×2, LLM grid 171×1, 344 tokens; 28·7154 < min_pixels.
    recipe 0.2.0 re-plans: up-scale to 42×8708 (622×3 patches, 208×1 grid, 418 tokens)."""
    assert not spec_plan_is_fixed_point(158, 26913, FLASH_V)
    g = plan_image_grid(158, 26913, FLASH_V)
    assert (g.resized_width, g.resized_height, g.vit_h, g.vit_w, g.n_h, g.n_w) == (28, 7154, 511, 2, 171, 1)
    assert g.num_tokens == 344
    fixed = replan_until_fixed(158, 26913, FLASH_V)
    assert (fixed.resized_width, fixed.resized_height, fixed.num_tokens) == (42, 8708, 418)
    assert recipe_tokens(158, 26913) == 418
    assert recipe_resized_size(Image.new("RGB", (158, 26913), (9, 9, 9))) == (42, 8708)
    # The recipe shares the float64 28-px width: the exact-arithmetic width 42 would give
    # 42×7154 (≥ min_pixels, already a fixed point) and 344 tokens, not its 418.
    exact = plan_image_grid(42, 7154, FLASH_V)
    assert (exact.resized_width, exact.resized_height, exact.num_tokens) == (42, 7154, 344)
    assert 42 * 7154 >= FLASH_V.min_pixels


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

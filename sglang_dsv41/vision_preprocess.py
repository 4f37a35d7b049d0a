"""Image preprocessing for the V4.1 vision tower: grid plan, resize + pad, normalise, patchify.

Shared by the reference (`reference/vision.py`) and the runtime (`runtime/vision.py`); pure functions.

Spec: `shared/spec/model.md` §5.1 (and §7 for the tiny vision config, §8 item 17).

Invariants
----------
* `plan_image_grid` is a pure function of the original (width, height) and the
  `VisionConfig`; its resized width/height are multiples of `patch_size`, and its
  `num_tokens = n_h·(n_w + 1) + 2` (start marker, one newline per row, end marker) never
  exceeds `max_image_tokens` — an input for which the spec's resize rule would still exceed it
  raises `ImageGridError` instead of returning an over-budget plan.
* `preprocess_image` resizes with PIL `ImageOps.pad` (bicubic, centred, gray 127 padding),
  normalises `(x/255 − 0.5)/0.5` in fp32, rounds **once** to BF16, and returns the patches in
  row-major patch order, each flattened (channel, row, col) → `3·p·p` values.

Why our own planner instead of deepseek-recipe 0.2.0
---------------------------------------------------
The recipe wheel computes the same plan, but only for the released Flash constants and only
behind opaque entry points: `MultiModalData([ImageInfo(b"", W, H)]).image_token_adjustment()`
yields the token count, and `OpenCvImagePreprocessor().preprocess(...)` yields the resized
width/height (with OpenCV resampling, a non-PIL pad and lossy WebP output, so its pixels are not
the ones upstream SGLang feeds the ViT). Neither takes `min_pixels`, `max_image_tokens`,
`patch_size` or `downsample_ratio`, so it cannot plan the tiny config (min_pixels 7056, 32
tokens). We therefore implement §5.1 from the spec and use the recipe as the oracle for the Flash
config in `tests/test_vision_preprocess.py` (token counts over random sizes, resized dims on a
few).

Where the recipe disagrees (we follow the spec)
-----------------------------------------------
The spec plans in **one pass** (steps 1–5, then "recompute the grid"). Recipe 0.2.0 instead
re-plans its own output until it stops changing: its size is the fixed point of iterating this
single-pass plan (verified on ~780k Flash sizes, both orientations, 1..40000 px: token counts
equal in every case, resized dims equal wherever its WebP side clamp of 16380 px does not apply).
A re-plan changes a plan only when the planned area is below `min_pixels` and the
truncating up-scale grows a side, which the single pass leaves in two places:

* the min_pixels up-scale itself (int truncation, extreme aspect ratios such as 1×41: spec
  84×3486 / 251 tokens, recipe 84×3528 / 254);
* the step-5 down-scale of very tall thin images when it lands under `min_pixels` — in float64
  `W·(⌊w*⌋·cell/W)` can fall just below the cell width (158·(42/158) = 41.999…), so the width
  rounds down to 28 px: 158×26913 gives 28×7154 (spec, 344 tokens) vs recipe 42×8708 (418).
  The recipe's own results confirm this float behaviour: the exact-arithmetic 42×7154 would
  already be a fixed point (area ≥ min_pixels) with 344 tokens, not 418.

The spec transcribes upstream SGLang's single-pass `plan_image_grid`, so we keep its plans
(spec §5.1 is the truth here); the tests pin the divergence predicate and the recipe's rule.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image, ImageOps

from .config import VisionConfig

PAD_GRAY = 127  # spec §5.1: ImageOps.pad fill colour (127, 127, 127)


class ImageGridError(ValueError):
    """An image size for which no grid within `max_image_tokens` can be planned."""


@dataclass(frozen=True)
class ImageGrid:
    """The grid planned for one image (spec §5.1).

    `resized_width`/`resized_height`: pixels after resize + pad (multiples of the patch size);
    `vit_h`/`vit_w`: ViT patch grid; `n_h`/`n_w`: LLM feature grid after the
    `downsample_ratio`² unfold (ceil division: the ViT grid is zero-padded bottom/right).
    """

    resized_width: int
    resized_height: int
    vit_h: int
    vit_w: int
    n_h: int
    n_w: int
    resize_plain: bool = False  # True only when max_wh_ratio forces a plain (non-pad) resize

    @property
    def num_tokens(self) -> int:
        """Span length: start + n_h·(n_w features + newline) + end."""
        return self.n_h * (self.n_w + 1) + 2

    @property
    def num_patches(self) -> int:
        return self.vit_h * self.vit_w


@dataclass(frozen=True)
class PreprocessedImage:
    """`patches`: BF16 [vit_h·vit_w, 3·p·p], row-major patch order, (channel, row, col) inside."""

    patches: torch.Tensor
    grid: ImageGrid


def _grid_for(width_px: int, height_px: int, vcfg: VisionConfig, resize_plain: bool) -> ImageGrid:
    p, k = vcfg.patch_size, vcfg.downsample_ratio
    vit_w, vit_h = width_px // p, height_px // p
    return ImageGrid(
        resized_width=width_px,
        resized_height=height_px,
        vit_h=vit_h,
        vit_w=vit_w,
        n_h=math.ceil(vit_h / k),
        n_w=math.ceil(vit_w / k),
        resize_plain=resize_plain,
    )


def plan_image_grid(width: int, height: int, vcfg: VisionConfig) -> ImageGrid:
    """Plan resize + grids for an original `width`×`height` image (spec §5.1 steps 1–5).

    1. `max_wh_ratio` (when set) caps the width at `height·ratio` and selects a plain resize;
    2. images under `min_pixels` are scaled up by sqrt(min_pixels/(W·H)), truncating to int;
    3. both sides are rounded **up** to multiples of the patch size;
    4. the LLM grid is the ViT grid divided by `downsample_ratio`, rounded up;
    5. over `max_image_tokens`, the largest aspect-preserving grid that fits is solved for
       (cell = patch·downsample pixels), degenerate one-row / one-column shapes handled, and the
       grid recomputed from the rounded-down pixel size.

    One pass only, in float64 and in the spec's order (β = ⌊w*⌋·cell/W, then ⌊W·β/p⌋·p), so the
    result may have fewer than `min_pixels` pixels and re-planning it may change it; deepseek-recipe
    0.2.0 iterates to that fixed point instead (see the module docstring; e.g. 158×26913:
    here 28×7154 / 344 tokens, recipe 42×8708 / 418).
    """
    if width < 1 or height < 1:
        raise ImageGridError(f"image size {width}x{height}: both sides must be ≥ 1 pixel")
    p, k, max_tokens = vcfg.patch_size, vcfg.downsample_ratio, vcfg.max_image_tokens
    w: float = width
    h: float = height
    resize_plain = False
    if vcfg.max_wh_ratio is not None and w >= h * vcfg.max_wh_ratio:
        # Spec §5.1: "if W > H·ratio: W = H·ratio"; the plain-resize switch uses W ≥ ratio·H.
        # (Whether upstream truncates H·ratio to int is UNCONFIRMED; the value stays float here,
        # and no released config sets max_wh_ratio.)
        resize_plain = True
        w = h * vcfg.max_wh_ratio
    if 0 < w * h < vcfg.min_pixels:
        s = math.sqrt(vcfg.min_pixels / (w * h))
        w, h = int(w * s), int(h * s)
        if w < 1 or h < 1:
            raise ImageGridError(
                f"image size {width}x{height}: min_pixels up-scaling gives {w}x{h}; aspect ratio too extreme"
            )
    grid = _grid_for(math.ceil(w / p) * p, math.ceil(h / p) * p, vcfg, resize_plain)
    if grid.num_tokens <= max_tokens:
        return grid

    cell = p * k
    budget = max_tokens - 2  # tokens left after the start/end markers
    r = h / w
    w_star = math.sqrt(budget / r + 0.25) - 0.5
    h_star = w_star * r
    if w_star < 1:  # one feature column: n_h·2 ≤ budget
        out_h, out_w = (budget // 2) * cell, cell
    elif h_star < 1:  # one feature row: n_w + 1 ≤ budget
        out_h, out_w = cell, (budget - 1) * cell
    else:
        beta = min(math.floor(w_star) * cell / w, math.floor(h_star) * cell / h)
        out_h = math.floor(h * beta / p) * p
        out_w = math.floor(w * beta / p) * p
    grid = _grid_for(out_w, out_h, vcfg, resize_plain)
    if grid.vit_h < 1 or grid.vit_w < 1 or grid.num_tokens > max_tokens:
        raise ImageGridError(
            f"image size {width}x{height}: resize plan {out_w}x{out_h} gives {grid.num_tokens} tokens "
            f"(max_image_tokens {max_tokens})"
        )
    return grid


def resize_and_pad(image: Image.Image, grid: ImageGrid) -> Image.Image:
    """RGB image of exactly `grid.resized_width`×`grid.resized_height` (spec §5.1).

    Default: `ImageOps.pad` with bicubic resampling, centred, gray (127,127,127) fill; when the
    plan selected a plain resize (max_wh_ratio), a bicubic `resize` without padding.
    """
    rgb = image.convert("RGB")
    size = (grid.resized_width, grid.resized_height)
    if grid.resize_plain:
        return rgb.resize(size, resample=Image.Resampling.BICUBIC)
    return ImageOps.pad(rgb, size, method=Image.Resampling.BICUBIC, color=(PAD_GRAY,) * 3)


def normalize_pixels(rgb: Image.Image) -> torch.Tensor:
    """[3, H, W] BF16 of (x/255 − 0.5)/0.5, computed in fp32 and rounded once (spec §8 item 17)."""
    arr = np.asarray(rgb, dtype=np.uint8)
    if arr.ndim != 3 or arr.shape[2] != 3:
        raise ValueError(f"expected an RGB image array [H, W, 3], got shape {arr.shape}")
    x = torch.from_numpy(arr.copy()).permute(2, 0, 1).to(torch.float32)
    return ((x / 255.0 - 0.5) / 0.5).to(torch.bfloat16)


def patchify(pixels: torch.Tensor, patch_size: int) -> torch.Tensor:
    """[C, H, W] → [(H/p)·(W/p), C·p·p]: patches row-major, each flattened (channel, row, col)."""
    c, hh, ww = pixels.shape
    p = patch_size
    if hh % p or ww % p:
        raise ValueError(f"pixel size {ww}x{hh} is not a multiple of the patch size {p}")
    x = pixels.reshape(c, hh // p, p, ww // p, p)  # c, gh, row, gw, col
    x = x.permute(1, 3, 0, 2, 4)  # gh, gw, c, row, col
    return x.reshape((hh // p) * (ww // p), c * p * p).contiguous()


def preprocess_image(image: Image.Image, vcfg: VisionConfig) -> PreprocessedImage:
    """Plan, resize + pad, normalise to BF16 and patchify one image (spec §5.1)."""
    grid = plan_image_grid(image.width, image.height, vcfg)
    pixels = normalize_pixels(resize_and_pad(image, grid))
    return PreprocessedImage(patches=patchify(pixels, vcfg.patch_size), grid=grid)

"""How the ViT groups images into varlen calls, and which attention backend ``auto`` picks
(issue 17; docs/vision.md "ViT activation memory"). Torch-free, so the planner
(`deploy/vision_config.py`) sizes the same calls the runtime (`runtime/vision.py`) runs.

Invariants
----------
* `call_patch_budget(vcfg)` = `CALL_CAP_IMAGES` · k² · max_image_tokens ViT patches: no varlen call
  of the tower holds more, and no preprocessed image has more than k² · max_image_tokens (its grid
  has at most max_image_tokens cells of k × k patches), so one image always fits one call.
* `call_groups(patches, budget)` packs images in order: a call takes the next image while the sum
  stays within `budget`; an image above `budget` is a `ValueError`. Every image is in exactly one
  call, in the input order.
* `auto_backend(device_type)`: ``triton`` on CUDA, ``sdpa`` elsewhere (`vision_attention.pick_backend`).
"""
from __future__ import annotations

from typing import Any

#: images at the token cap whose patches one ViT call may hold (1: the call's peak is one cap image's)
CALL_CAP_IMAGES = 1
#: backends whose attention core is varlen over cu_seqlens (no heads × L × L score matrix)
VARLEN_BACKENDS = ("triton", "fa3")


def call_patch_budget(vcfg: Any) -> int:
    """The most ViT patches one call of the tower holds (module invariants)."""
    return CALL_CAP_IMAGES * vcfg.downsample_ratio ** 2 * vcfg.max_image_tokens


def call_groups(patches: list[int], budget: int) -> list[list[int]]:
    """Indices of the images of each call, in order (module invariants)."""
    groups: list[list[int]] = []
    used = budget + 1
    for i, n in enumerate(patches):
        if n > budget:
            raise ValueError(f"image {i} has {n} ViT patches, above the {budget} one call of the tower holds")
        if used + n > budget:
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += n
    return groups


def auto_backend(device_type: str) -> str:
    """The ViT attention backend ``auto`` picks on a device of this type."""
    return "triton" if device_type == "cuda" else "sdpa"

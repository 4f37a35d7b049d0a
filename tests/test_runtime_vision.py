"""The runtime vision tower (`runtime/vision.py`) against the reference's (`reference/vision.py`)
on the tiny checkpoint: parameters loaded through their weight_loaders, span rows within a bound,
load errors named. Issue 17 item 1."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tp_harness import stored_tensors
from sglang_dsv41.checkpoint.reader import CheckpointFormatError
from sglang_dsv41.config import DeepseekV41Config
from sglang_dsv41.reference.model import ReferenceModel
from sglang_dsv41.runtime.vision import VisionTower, is_vision_tensor
from sglang_dsv41.vision_preprocess import preprocess_image

#: |runtime − reference| bound on span rows, relative to the rows' max magnitude: the two differ
#: only in RMSNorm precision (fp32 vs float64) and the attention product, i.e. BF16 ulp flips
#: (2^-8 relative) that propagate through 2 tiny ViT blocks and the aligner.
REL_BOUND = 2 ** -5


def _image(seed: int, size: tuple[int, int]) -> Image.Image:
    arr = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(arr)


@pytest.fixture(scope="module")
def stored(tiny_checkpoint: Path) -> dict[str, torch.Tensor]:
    return stored_tensors(tiny_checkpoint)


@pytest.fixture(scope="module")
def tower(tiny_checkpoint: Path, stored) -> VisionTower:
    cfg = DeepseekV41Config.from_file(tiny_checkpoint / "config.json")
    t = VisionTower(cfg)
    t.load_weights((n, v) for n, v in stored.items() if is_vision_tensor(n))
    return t


@pytest.fixture(scope="module")
def reference(tiny_checkpoint: Path) -> ReferenceModel:
    return ReferenceModel.from_checkpoint(tiny_checkpoint)


def test_parameters_are_the_checkpoint_vision_tensors(tower: VisionTower, stored) -> None:
    names = {n for n, _ in tower.named_parameters()}
    assert names == {n for n in stored if is_vision_tensor(n)}
    assert tower.get_parameter("vision.blocks.0.attn.wqkv.weight").dtype == torch.float32


@pytest.mark.parametrize("size", [(84, 84), (200, 90), (33, 500), (1000, 1000)])
def test_span_rows_match_the_reference(tower: VisionTower, reference: ReferenceModel, size) -> None:
    img = _image(sum(size), size)
    pre = preprocess_image(img, tower.vcfg)
    ours = tower.encode(pre)
    prompt = [5, reference.cfg.image_token_id, 6]
    _, spans = reference.encode_images(prompt, [img])
    (offset, ref_rows), = spans
    assert offset == 1 and ours.shape == ref_rows.shape == (pre.grid.num_tokens, reference.cfg.text.hidden_size)
    assert torch.equal(ours, ours.to(torch.bfloat16).float())                    # BF16-valued
    scale = ref_rows.abs().max().item()
    err = (ours - ref_rows.float()).abs().max().item()
    assert err <= REL_BOUND * scale, (err, scale)
    # the markers are exact
    assert torch.equal(ours[0], ref_rows[0].float()) and torch.equal(ours[-1], ref_rows[-1].float())


def test_load_errors_are_named(tiny_checkpoint: Path, stored) -> None:
    cfg = DeepseekV41Config.from_file(tiny_checkpoint / "config.json")
    vision = {n: v for n, v in stored.items() if is_vision_tensor(n)}
    t = VisionTower(cfg)
    partial = {n: v for n, v in vision.items() if n != "aligner.w2.bias"}
    with pytest.raises(CheckpointFormatError, match="missing 1 vision tensor.*aligner.w2.bias"):
        t.load_weights(partial.items())
    with pytest.raises(CheckpointFormatError, match="unexpected vision tensor vision.blocks.9"):
        VisionTower(cfg).load_weights([*vision.items(), ("vision.blocks.9.norm1.weight", vision["vision.norm.weight"])])
    bad = dict(vision, **{"aligner.w1.bias": vision["aligner.w1.bias"][:-1]})
    with pytest.raises(CheckpointFormatError, match="aligner.w1.bias"):
        VisionTower(cfg).load_weights(bad.items())

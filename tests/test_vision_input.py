"""Image input without a server: loading and refusing bad images (`runtime/image_io.py`), the
placeholder expansion (`runtime/mm_processor.py`) and the per-chunk image rows of a batch
(`runtime/vision_batch.py`). Issue 17 items 1 and 3."""
from __future__ import annotations

import base64
import io
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from sglang_dsv41.runtime import image_io
from sglang_dsv41.runtime.image_io import load_image
from sglang_dsv41.runtime.mm_processor import GRID_KEY, expand_placeholders
from sglang_dsv41.runtime.vision_batch import SpanCache, batch_image_rows, owners
from sglang_dsv41.vision_preprocess import ImageGrid


def png_bytes(w: int, h: int, fmt: str = "PNG") -> bytes:
    arr = np.random.default_rng(w * 7 + h).integers(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format=fmt)
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def test_loads_data_url_file_and_bytes(tmp_path) -> None:
    raw = png_bytes(40, 30)
    (tmp_path / "a.png").write_bytes(raw)
    for src in (data_url(raw), str(tmp_path / "a.png"), f"file://{tmp_path / 'a.png'}", raw,
                SimpleNamespace(url=data_url(raw))):
        img = load_image(src)
        assert img.size == (40, 30) and img.mode == "RGB"
    assert load_image(data_url(png_bytes(20, 20, "JPEG"), "image/jpeg")).size == (20, 20)


@pytest.mark.parametrize("src, message", [
    (data_url(png_bytes(40, 30)[:60]), "corrupt or truncated|cannot decode|not a readable image"),
    (data_url(b"\x89PNG\r\n\x1a\n" + b"garbage" * 20), "cannot decode|not a readable image"),
    (data_url(b"just some text, not an image"), "not a readable image"),
    ("data:image/png;base64,@@@notbase64", "not valid base64"),
    ("data:image/png;base64,", "empty image data"),
    ("/nonexistent/image.png", "cannot read image file"),
    ("http://127.0.0.1:1/x.png", "cannot read image URL"),
])
def test_bad_images_are_value_errors(src, message) -> None:
    with pytest.raises(ValueError, match=message):
        load_image(src)


def test_unsupported_format_and_pixel_cap(monkeypatch) -> None:
    buf = io.BytesIO()
    Image.fromarray(np.zeros((8, 8, 3), dtype=np.uint8)).save(buf, format="TIFF")
    with pytest.raises(ValueError, match="unsupported image format TIFF"):
        load_image(buf.getvalue())
    monkeypatch.setattr(image_io, "MAX_IMAGE_PIXELS", 100)
    with pytest.raises(ValueError, match="over the cap of 100 pixels"):
        load_image(png_bytes(20, 20))


def test_zero_size_image_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 1 pixel"):
        load_image(Image.new("RGB", (0, 5)))


def _grid(n_h: int, n_w: int) -> ImageGrid:
    return ImageGrid(resized_width=42 * n_w, resized_height=42 * n_h, vit_h=3 * n_h, vit_w=3 * n_w, n_h=n_h, n_w=n_w)


def test_expand_placeholders() -> None:
    g1, g2 = _grid(1, 2), _grid(2, 1)             # 1·3 + 2 = 5 and 2·2 + 2 = 6 tokens
    ids, spans = expand_placeholders([7, 99, 8, 99], [g1, g2], 99)
    assert ids == [7, 99, 99, 99, 99, 99, 8] + [99] * 6
    assert spans == [(1, 5), (7, 12)]
    with pytest.raises(ValueError, match="2 image placeholder.*1 image"):
        expand_placeholders([99, 99], [g1], 99)


class _FakeTower:
    device = torch.device("cpu")

    def __init__(self) -> None:
        self.calls = 0

    def encode(self, pre) -> torch.Tensor:
        self.calls += 1
        return torch.arange(pre.grid.num_tokens, dtype=torch.float32)[:, None].expand(-1, 4) + 100 * pre.grid.n_h

    def encode_many(self, pres) -> list[torch.Tensor]:
        return [self.encode(pre) for pre in pres]


def test_batch_rows_follow_chunks_and_prefix_hits() -> None:
    g = _grid(1, 2)                                   # 5 tokens at absolute 2..6
    item = SimpleNamespace(hash=123, offsets=[(2, 6)], feature=torch.zeros(6, 588),
                           model_specific_data={GRID_KEY: dict(vars(g))})
    tower, cache = _FakeTower(), SpanCache()
    mm = SimpleNamespace(mm_items=[item])

    def batch(prefixes, extends, mms):
        return SimpleNamespace(mm_inputs=mms, forward_mode=SimpleNamespace(name="EXTEND"),
                               extend_prefix_lens_cpu=prefixes, extend_seq_lens_cpu=extends)

    # request 0: text; request 1 chunk covers absolute 4..8 (rows 2..4 of the span)
    pos, rows = batch_image_rows(batch([0, 4], [3, 5], [None, mm]), tower, cache)
    assert pos.tolist() == [3, 4, 5] and rows[:, 0].tolist() == [102.0, 103.0, 104.0]
    # the next chunk of the same image hits the cache; a chunk past the span gives nothing
    pos, rows = batch_image_rows(batch([0], [4], [mm]), tower, cache)
    assert pos.tolist() == [2, 3] and rows[:, 0].tolist() == [100.0, 101.0] and tower.calls == 1
    assert batch_image_rows(batch([8], [4], [mm]), tower, cache) is None
    assert batch_image_rows(batch([0], [4], [None]), tower, cache) is None
    with pytest.raises(RuntimeError, match="language-model-only"):
        batch_image_rows(batch([0], [4], [mm]), None, cache)


def test_encoder_owners_balance_patches_deterministically() -> None:
    """`--mm-enable-dp-encoder`'s split: most patches first, to the least-loaded rank (ties: lower)."""
    assert owners([9, 1, 27, 4, 2], 2) == [1, 1, 0, 1, 1]
    assert owners([5, 5, 5, 5], 4) == [0, 1, 2, 3] and owners([], 2) == [] and owners([3], 8) == [0]

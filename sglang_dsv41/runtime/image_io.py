"""Load one request image, refusing bad input with a `ValueError` that names the problem (SGLang
answers 400; the server stays up). Issue 17 item 3.

Accepted sources: a ``data:image/...;base64,`` URL, an ``http(s)://`` URL (fetched with a
timeout), a local path or ``file://`` URL, raw bytes, a PIL image, or an object with ``url``
(SGLang's `ImageData`). Accepted formats: `FORMATS`. Refused: undecodable, truncated or corrupt
data; a side of 0 pixels; more than `MAX_IMAGE_PIXELS` pixels (checked from the header, before
decoding); any other format; a source that cannot be read.
"""
from __future__ import annotations

import base64
import binascii
import io
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from PIL import Image, UnidentifiedImageError

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
#: pixel cap of one image before resizing (64 Mpx: e.g. 8192×8192)
MAX_IMAGE_PIXELS = 8192 * 8192
#: cap on the bytes read for one image (encoded)
MAX_IMAGE_BYTES = 64 * 2**20
URL_TIMEOUT_S = 20


def _read_bytes(source: Any, where: str) -> bytes:
    if isinstance(source, (bytes, bytearray)):
        return bytes(source)
    if not isinstance(source, str):
        raise ValueError(f"{where}: unsupported image value of type {type(source).__name__}")
    if source.startswith("data:"):
        header, sep, payload = source.partition(",")
        if not sep or ";base64" not in header:
            raise ValueError(f"{where}: a data URL must be data:image/<format>;base64,<data>")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as err:
            raise ValueError(f"{where}: the data URL is not valid base64 ({err})") from err
    if source.startswith(("http://", "https://")):
        try:
            with urllib.request.urlopen(source, timeout=URL_TIMEOUT_S) as r:
                data = r.read(MAX_IMAGE_BYTES + 1)
        except (urllib.error.URLError, OSError, ValueError) as err:
            raise ValueError(f"{where}: cannot read image URL {source[:200]!r}: {err}") from err
        if len(data) > MAX_IMAGE_BYTES:
            raise ValueError(f"{where}: image URL {source[:200]!r} is larger than {MAX_IMAGE_BYTES} bytes")
        return data
    path = Path(source[len("file://"):] if source.startswith("file://") else source)
    try:
        if path.stat().st_size > MAX_IMAGE_BYTES:
            raise ValueError(f"{where}: image file {str(path)[:200]!r} is larger than {MAX_IMAGE_BYTES} bytes")
        return path.read_bytes()
    except OSError as err:
        raise ValueError(f"{where}: cannot read image file {str(path)[:200]!r}: {err.strerror or err}") from err


def load_image(source: Any, where: str = "image") -> Image.Image:
    """The decoded RGB image of `source` (module doc); `ValueError` on bad input."""
    source = getattr(source, "url", source)
    if isinstance(source, Image.Image):
        img = source
    else:
        data = _read_bytes(source, where)
        if not data:
            raise ValueError(f"{where}: empty image data")
        try:
            img = Image.open(io.BytesIO(data), formats=None)
        except UnidentifiedImageError as err:
            raise ValueError(f"{where}: not a readable image (corrupt data or an unsupported format; "
                             f"accepted: {', '.join(FORMATS)})") from err
        except (OSError, Image.DecompressionBombError) as err:
            raise ValueError(f"{where}: cannot decode the image: {err}") from err
        if img.format not in FORMATS:
            raise ValueError(f"{where}: unsupported image format {img.format}; accepted: {', '.join(FORMATS)}")
    w, h = img.size
    if w < 1 or h < 1:
        raise ValueError(f"{where}: image size {w}x{h}: both sides must be at least 1 pixel")
    if w * h > MAX_IMAGE_PIXELS:
        raise ValueError(f"{where}: image size {w}x{h} is over the cap of {MAX_IMAGE_PIXELS} pixels")
    try:                                        # the cap is below PIL's own decompression-bomb limit
        img.load()
        return img.convert("RGB")
    except (OSError, SyntaxError, ValueError) as err:
        raise ValueError(f"{where}: corrupt or truncated image data: {err}") from err

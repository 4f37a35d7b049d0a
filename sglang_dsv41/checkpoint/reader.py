"""Lazy, header-first access to a (sharded) safetensors checkpoint (spec `model.md` §2).

`CheckpointReader(path)` accepts a directory holding `model.safetensors.index.json` (HF index
format: `weight_map` name → shard file) or a single `model.safetensors`, or the path of one
`.safetensors` file.

Invariants
----------
* Names, dtypes, shapes and byte sizes come from the safetensors **headers only** (the first
  8 + N bytes of each file), parsed here without torch — so listing a 511 GB checkpoint reads a
  few MB. Each header is checked against its file's size (truncated shards are reported).
* Tensor data is read one tensor at a time through `safetensors.safe_open` (memory-mapped);
  whole shards are never loaded.
* Every inconsistency raises `CheckpointFormatError` naming the tensor and the file: a shard
  named by the index that does not exist, a name in the index absent from its shard, a header
  whose byte span disagrees with its dtype/shape.
* dtypes are safetensors strings (`BF16`, `F32`, `F8_E4M3`, `F8_E8M0`, `U8`, `I8`, `F4`, …).
  For `F4` the header shape counts FP4 *elements* (two per byte), while the tensor returned by
  `get` is torch's `float4_e2m1fn_x2` with the last dimension halved.
"""
from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from torch import Tensor

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

#: bytes per element of each safetensors dtype (F4 packs two elements per byte).
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8,
    "F4": 4, "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32,
    "I64": 64, "U64": 64, "F64": 64, "C64": 64,
}


class CheckpointFormatError(ValueError):
    """The checkpoint's files disagree with each other or with the safetensors format."""


@dataclass(frozen=True)
class HeaderEntry:
    """One tensor as described by its shard's header."""

    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int  # byte offsets inside the data section
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def read_safetensors_header(file: Path) -> tuple[dict[str, HeaderEntry], dict[str, str]]:
    """Parse one file's header: (name → entry, `__metadata__`). Checks spans against the file size."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            raw_len = f.read(8)
            if len(raw_len) < 8:
                raise CheckpointFormatError(f"{file}: too short to be a safetensors file ({size} bytes)")
            (n,) = struct.unpack("<Q", raw_len)
            if n > size - 8 or n > 100 * (1 << 20):
                raise CheckpointFormatError(f"{file}: header length {n} is impossible for a {size}-byte file")
            header = json.loads(f.read(n))
    except FileNotFoundError:
        raise CheckpointFormatError(f"shard file {file} does not exist") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointFormatError(f"{file}: header is not valid JSON ({e})") from None
    data_size = size - 8 - n
    meta = header.pop("__metadata__", None) or {}
    entries: dict[str, HeaderEntry] = {}
    for name, info in header.items():
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(int(x) for x in info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointFormatError(f"{file}: malformed header entry for {name!r}: {info!r}") from None
        if dtype not in DTYPE_BITS:
            raise CheckpointFormatError(f"{file}: tensor {name!r} has unknown dtype {dtype!r}")
        want = math.prod(shape) * DTYPE_BITS[dtype] // 8
        if end - begin != want:
            raise CheckpointFormatError(f"{file}: tensor {name!r} spans {end - begin} bytes but {dtype} {list(shape)} "
                                        f"needs {want}")
        if end > data_size:
            raise CheckpointFormatError(f"{file}: tensor {name!r} ends at byte {end} of a {data_size}-byte data "
                                        "section (truncated file?)")
        entries[name] = HeaderEntry(name, file, dtype, shape, int(begin), int(end))
    return entries, dict(meta)


class CheckpointReader:
    """Header-first reader over a sharded (`model.safetensors.index.json`) or single-file checkpoint."""

    def __init__(self, path: str | Path) -> None:
        p = Path(path)
        self.path = p
        self.index_total_size: int | None = None
        if p.is_file() and p.suffix == ".safetensors":
            self.root, self._weight_map = p.parent, None
            self._files = [p]
        elif (p / INDEX_FILE).is_file():
            self.root = p
            try:
                index = json.loads((p / INDEX_FILE).read_text())
                weight_map = index["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointFormatError(f"{p / INDEX_FILE}: not a safetensors index ({e!r})") from None
            total = (index.get("metadata") or {}).get("total_size")
            self.index_total_size = None if total is None else int(total)
            self._weight_map = {str(k): p / str(v) for k, v in weight_map.items()}
            self._files = sorted(set(self._weight_map.values()))
            missing = [f.name for f in self._files if not f.is_file()]
            if missing:
                raise CheckpointFormatError(f"{p / INDEX_FILE} names {len(missing)} shard file(s) that do not exist: "
                                            f"{', '.join(missing[:8])}{' …' if len(missing) > 8 else ''}")
        elif (p / SINGLE_FILE).is_file():
            self.root, self._weight_map = p, None
            self._files = [p / SINGLE_FILE]
        elif p.is_dir():
            raise CheckpointFormatError(f"{p}: neither {INDEX_FILE} nor {SINGLE_FILE} found")
        else:
            raise CheckpointFormatError(f"{p}: no such checkpoint directory or .safetensors file")
        self._headers: dict[Path, dict[str, HeaderEntry]] = {}
        self._handles: dict[Path, Any] = {}
        if self._weight_map is None:
            self._weight_map = {name: self._files[0] for name in self.header(self._files[0])}

    # ---- headers --------------------------------------------------------------------------
    @property
    def files(self) -> list[Path]:
        """The shard files, sorted."""
        return list(self._files)

    def header(self, file: Path) -> dict[str, HeaderEntry]:
        """name → entry of one shard (parsed once, cached)."""
        if file not in self._headers:
            self._headers[file] = read_safetensors_header(file)[0]
        return self._headers[file]

    def names(self) -> list[str]:
        """Tensor names as listed by the index (or the single file), sorted."""
        assert self._weight_map is not None
        return sorted(self._weight_map)

    def __contains__(self, name: object) -> bool:
        assert self._weight_map is not None
        return name in self._weight_map

    def __len__(self) -> int:
        assert self._weight_map is not None
        return len(self._weight_map)

    def file_of(self, name: str) -> Path:
        assert self._weight_map is not None
        try:
            return self._weight_map[name]
        except KeyError:
            raise KeyError(f"tensor {name!r} is not in the checkpoint at {self.path}") from None

    def entry(self, name: str) -> HeaderEntry:
        file = self.file_of(name)
        entry = self.header(file).get(name)
        if entry is None:
            raise CheckpointFormatError(f"tensor {name!r} is listed in {INDEX_FILE} under {file.name} "
                                        f"but {file.name} does not contain it")
        return entry

    def dtype(self, name: str) -> str:
        """safetensors dtype string from the header."""
        return self.entry(name).dtype

    def shape(self, name: str) -> tuple[int, ...]:
        """Header shape (for `F4`: in FP4 elements, i.e. twice the packed byte width)."""
        return self.entry(name).shape

    # ---- data -----------------------------------------------------------------------------
    def _handle(self, file: Path) -> Any:
        if file not in self._handles:
            from safetensors import safe_open

            self._handles[file] = safe_open(str(file), framework="pt", device="cpu")
        return self._handles[file]

    def get(self, name: str) -> Tensor:
        """One tensor, read from its shard (memory-mapped; the shard is not loaded)."""
        entry = self.entry(name)
        return self._handle(entry.file).get_tensor(name)

    def __iter__(self) -> Iterator[tuple[str, Tensor]]:
        """(name, tensor) for every tensor, shard by shard, one tensor in memory at a time."""
        assert self._weight_map is not None
        for file in self._files:
            for name in sorted(n for n, f in self._weight_map.items() if f == file):
                yield name, self.get(name)

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

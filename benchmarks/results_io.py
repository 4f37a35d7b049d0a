"""The CUDA-only benchmarks' common ends: refuse without a GPU, write the result JSON and say where."""
from __future__ import annotations

import json
from pathlib import Path

import torch


def require_cuda(name: str) -> None:
    """SystemExit("<name>: needs a CUDA device") on a machine without CUDA."""
    if not torch.cuda.is_available():
        raise SystemExit(f"{name}: needs a CUDA device")


def write_result(out: Path, filename: str, result: dict) -> Path:
    """`result` as indented JSON at out/filename (out made); prints and returns the path."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / filename
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    return path

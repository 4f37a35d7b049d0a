"""Equality of runtime weight values for tests: tensors bit for bit, stored Engram tables by their
stored bytes (`runtime.engram_table.StoredEngramTable`)."""
from __future__ import annotations

import torch

from sglang_dsv41.runtime.engram_table import StoredEngramTable


def same_value(a: object, b: object) -> bool:
    if isinstance(a, StoredEngramTable) or isinstance(b, StoredEngramTable):
        return isinstance(a, StoredEngramTable) and a.equal(b)
    return torch.equal(a, b)


def logical(value: object) -> torch.Tensor:
    """The fp32 logical tensor of a runtime value (a stored Engram table dequantised whole)."""
    return value.dequantized() if isinstance(value, StoredEngramTable) else value

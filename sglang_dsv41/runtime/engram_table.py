"""Engram tables kept in their stored form, rows dequantised on lookup (spec `model.md` §2.3, §3.3.1).

An Engram table is E4M3 [rows, d] with one UE8M0 scale per 32 values of a row; its logical value
is `codecs.dequantize_engram_rows` (E4M3 · 2^s in fp32, rounded once to BF16). The reference loads
the whole table dequantised (fp32: 4 bytes per value). At Flash widths the tables are 183 GiB as
stored, so a dequantised copy (≈ 4× that) cannot fit any deployment; the runtime therefore keeps
the stored bytes (1 + 1/32 bytes per value) and dequantises only the rows a batch looks up.

Invariant: `table[ids]` equals `logical_table[ids]` bit for bit — the dequantisation is per
row and per 32-value group, so dequantising gathered rows gives the same values as gathering
dequantised rows (tests/test_runtime_engram_table.py). A lookup by CUDA ids is one launch of
`kernels.engram_gather` (the same bits, `gathers_in_kernel`); CPU ids take torch's gathers and elementwise math.
Neither synchronises with the host, so lookups run inside CUDA graphs.

`StoredEngramTable` provides what the table's readers use of a tensor (`shape`, `ndim`,
`device`, indexing by an id tensor, `new_zeros`): `reference.engram.engram_embedding`,
`TensorParallel.engram_rows` and the static decode forward read it unchanged.

Placement (runtime.md §A.7): this class holds the bytes on the runtime device (`placement ==
"device"`); `runtime/engram_host.py`'s `HostEngramTable` subclass keeps them in pinned host
memory read through UVA (`placement == "host"`) with the same lookup bits.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from ..checkpoint.codecs import dequantize_engram_rows, scale_bytes

F32 = torch.float32


def gathers_in_kernel(ids: Tensor) -> bool:
    """Whether a device table's lookup by `ids` runs `kernels.engram_gather` (one launch, the torch path's bits):
    CUDA ids."""
    return ids.is_cuda


@dataclass(frozen=True)
class StoredEngramTable:
    """One layer's (or one TP shard's) Engram table: `values` E4M3 [rows, d], `scales` the
    stored UE8M0 bytes [rows, d/32] of the same rows."""

    values: Tensor
    scales: Tensor

    def __post_init__(self) -> None:
        if self.values.dtype != torch.float8_e4m3fn or self.values.dim() != 2:
            raise TypeError(f"Engram table values must be 2-D float8_e4m3fn, got {self.values.dtype} "
                            f"{tuple(self.values.shape)}")
        rows, d = self.values.shape
        if d % 32 or tuple(self.scales.shape) != (rows, d // 32):
            raise ValueError(f"Engram table scales {tuple(self.scales.shape)} do not match values {(rows, d)} "
                             "(one UE8M0 byte per 32 values of a row)")
        if self.scales.device != self.values.device:
            raise ValueError(f"Engram table values on {self.values.device}, scales on {self.scales.device}")

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    @property
    def ndim(self) -> int:
        return 2

    @property
    def device(self) -> torch.device:
        """Where lookups land and `new_zeros` allocates: here the device holding the bytes."""
        return self.values.device

    @property
    def placement(self) -> str:
        """"device": the stored bytes live on `device` (runtime.md §A.7 placement 1)."""
        return "device"

    @property
    def nbytes(self) -> int:
        return self.values.numel() * self.values.element_size() + self.scales.numel() * self.scales.element_size()

    def __getitem__(self, ids: Tensor | slice) -> Tensor | "StoredEngramTable":
        """An id tensor (int64/int32 in [0, rows)): fp32 rows [*ids.shape, d] of the logical
        (dequantised) table. A slice of rows: those rows, still stored (a TP shard's view, same
        class and placement)."""
        if isinstance(ids, slice):
            return replace(self, values=self.values[ids], scales=self.scales[ids])
        if not isinstance(ids, Tensor) or ids.dtype not in (torch.int64, torch.int32):
            raise TypeError("StoredEngramTable is indexed by an integer id tensor or a slice of rows")
        flat = ids.reshape(-1).to(torch.int64)
        d = self.values.shape[1]
        if gathers_in_kernel(flat):
            from ..kernels.engram_gather import engram_gather

            return engram_gather(self.values, self.scales, flat).reshape(*ids.shape, d)
        # gather the raw bytes (uint8 indexing exists on every device), then dequantise those rows
        values = self.values.view(torch.uint8)[flat].view(torch.float8_e4m3fn)
        scales = scale_bytes(self.scales)[flat]
        rows = dequantize_engram_rows(values, scales).to(F32)
        return rows.reshape(*ids.shape, d)

    def new_zeros(self, *shape: int) -> Tensor:
        """fp32 zeros on the table's device (what `Tensor.new_zeros` of the logical table gives)."""
        return torch.zeros(*shape, dtype=F32, device=self.device)

    def dequantized(self) -> Tensor:
        """The whole logical table (fp32) — for tests and small tables only."""
        return dequantize_engram_rows(self.values, self.scales).to(F32)

    def equal(self, other: object) -> bool:
        """Same stored bytes (values and scales), whatever the placements — `torch.equal` for stored
        tables (compared on this table's storage device)."""
        if not isinstance(other, StoredEngramTable):
            return False
        here = self.values.device
        return torch.equal(self.values.view(torch.uint8), other.values.view(torch.uint8).to(here)) and \
            torch.equal(scale_bytes(self.scales), scale_bytes(other.scales).to(here))

    def to(self, device: torch.device | str) -> "StoredEngramTable":
        """A copy of the stored bytes on `device`, device placement."""
        return StoredEngramTable(self.values.to(device), self.scales.to(device))


__all__ = ["StoredEngramTable", "gathers_in_kernel"]

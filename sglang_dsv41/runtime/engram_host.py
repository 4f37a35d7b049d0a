"""Engram tables in pinned host memory, read by the GPU through UVA — per_rank layout
(spec runtime.md §A.7 "Host table"; model.md §2.3, §3.3.2).

At Flash widths the two tables are 183 GiB as stored; the card's H200 TP4 and every TP2 recipe
keep them in host memory. Each TP rank holds only its own block of rows (`ShardPlan.rows_of`, as
with device placement) and the lookup keeps its masked lookup + exact all-reduce
(`TensorParallel.engram_rows`). Upstream's `shared` layout (one memfd mapping for the TP group) is
not implemented: `engram_placement_from_env` refuses it.

* `HostBuffer(nbytes)`: anonymous `mmap` memory, transparent huge pages requested with
  `madvise(MADV_HUGEPAGE)` before the copy-in and `MADV_COLLAPSE` after it (`huge_pages_requested`
  / `huge_pages_collapsed` record whether the kernel accepted each; whether pages actually are
  huge is the kernel's choice: `AnonHugePages` in /proc/self/smaps), the usable range starting on
  a 2 MiB boundary. `register_with_cuda()`
  page-locks it with `cudaHostRegister(..., cudaHostRegisterPortable | cudaHostRegisterMapped)`
  (flags 1 | 2: every CUDA context may use it, and it is mapped into the device address space);
  it is unregistered when the buffer is collected (or `close()`d). The memory itself is unmapped
  when the last tensor over it dies (`torch.frombuffer` keeps the mapping alive).
* `UvaRows`: what Triton is handed for a host table — `data_ptr()` (the host address), `dtype`
  (uint8), `shape`. Verified on this CPU machine against the installed Triton 3.6: its argument
  specialiser accepts such an object as a `*u8` pointer (`mangle_type`, with the 16-byte
  alignment specialisation when the address allows), and its CUDA launcher (read in
  `triton/backends/nvidia/driver.py`, `getPointer`) calls `data_ptr()`, translates the address with
  `cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_DEVICE_POINTER)` and passes the translated pointer —
  an address inside a mapped registration translates, an unregistered host address fails there
  ("cannot be accessed from Triton"). Only a GPU can show that the registration succeeds, that
  interior addresses translate, that the kernel reads the right bytes and what it costs
  (tests/test_runtime_engram_host.py, `gpu` tests).
* `HostEngramTable`: a `StoredEngramTable` whose `values`/`scales` are CPU tensors over
  `HostBuffer`s, plus `compute_device`. Readers use it like the device table: `shape`, `ndim`,
  `nbytes` (host bytes), slicing (a view of the same pinned rows), `new_zeros` — and `device` is
  the **compute** device (where lookups land), so the TP lookup's masks, `torch.where`, the
  all-reduce and `new_zeros` all stay on the GPU. `table[ids]`: ids on CUDA → the Triton gather
  reading the host rows through UVA (`kernels/engram_gather.py`; no host sync, capturable);
  ids on the CPU → the torch path of `StoredEngramTable` on the host bytes. Either way the bits
  of `dequantize_engram_rows` (invariant of `engram_table.py`).

Unmeasured: UVA read bandwidth of the lookup on the H200 over PCIe, the effect of huge pages on
it (upstream reports ≈10× slower lookups without them), sorted reads (`sorted_reads`), and the time
`cudaHostRegister` takes for a 47 GiB shard.
"""
from __future__ import annotations

import logging
import mmap
import os
import weakref
from dataclasses import dataclass, field
from typing import Literal, Mapping

import torch
from torch import Tensor

from .engram_table import StoredEngramTable

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
MADV_COLLAPSE_LINUX = 25          # include/uapi/asm-generic/mman-common.h
#: cudaHostRegister flags (CUDA runtime API): portable to every context, mapped into the device space
CUDA_HOST_REGISTER_PORTABLE = 0x01
CUDA_HOST_REGISTER_MAPPED = 0x02

ENABLE_ENV = "SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE"
LAYOUT_ENV = "SGLANG_DSV41_ENGRAM_HOST_TABLE_LAYOUT"
SUPPORTED_LAYOUT = "per_rank"
EngramPlacement = Literal["device", "host"]


def engram_placement_from_env(environ: Mapping[str, str] | None = None) -> EngramPlacement:
    """The Engram table placement the launcher asked for (upstream 0.5.23's variables, runtime.md
    §A.7/§A.11): `SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE` unset/""/0/false → "device"; 1/true →
    "host", whose layout `SGLANG_DSV41_ENGRAM_HOST_TABLE_LAYOUT` must be unset or `per_rank` (the
    only layout this runtime implements: `shared` or anything else raises naming the value). Any
    other enable value raises. The layout is read only when the host table is enabled."""
    env = os.environ if environ is None else environ
    enabled = env.get(ENABLE_ENV, "").strip().lower()
    if enabled in ("", "0", "false"):
        return "device"
    if enabled not in ("1", "true"):
        raise ValueError(f"{ENABLE_ENV}={env[ENABLE_ENV]!r}: expected 1 (host table) or 0 / unset (device)")
    layout = env.get(LAYOUT_ENV, "").strip() or SUPPORTED_LAYOUT
    if layout != SUPPORTED_LAYOUT:
        raise ValueError(f"{LAYOUT_ENV}={layout!r} is not supported: this runtime implements only "
                         f"{LAYOUT_ENV}={SUPPORTED_LAYOUT} (each TP rank pins its own Engram rows)")
    return "host"


def _cuda_unregister(address: int) -> None:
    """Finalizer of a registered `HostBuffer` (must not hold the buffer)."""
    err = int(torch.cuda.cudart().cudaHostUnregister(address))
    if err:
        logger.warning("sglang-dsv41: cudaHostUnregister(0x%x) failed with cudaError %d", address, err)


class HostBuffer:
    """`nbytes` of anonymous mmap host memory as a uint8 CPU tensor (`tensor`), starting on a
    2 MiB boundary, with transparent huge pages requested (module doc)."""

    def __init__(self, nbytes: int) -> None:
        if nbytes < 0:
            raise ValueError(f"HostBuffer: nbytes must be ≥ 0, got {nbytes}")
        length = -(-max(nbytes, 1) // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE     # room to align the start
        mapping = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                            prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.huge_pages_requested, self.huge_page_note = _request_huge_pages(mapping)
        self.huge_pages_collapsed: bool | None = None               # set by `collapse_huge_pages`
        self._mapping = mapping                                     # never closed: see module doc
        whole = torch.frombuffer(mapping, dtype=torch.uint8)        # keeps `mapping` alive
        start = (-whole.data_ptr()) % HUGE_PAGE
        self.tensor: Tensor = whole[start:start + nbytes]
        self._start = start
        self.nbytes = nbytes
        self.registered = False
        self._finalizer: weakref.finalize | None = None

    def collapse_huge_pages(self) -> bool:
        """After the copy-in: ask the kernel to collapse the used range into huge pages
        (Linux ≥ 6.1 `madvise(MADV_COLLAPSE)`, what upstream's per_rank layout adds; Python 3.11's
        mmap has no constant for it, the value is Linux's 25). Records and returns whether the
        kernel accepted; a refusal (older kernel, THP off) is noted in `huge_page_note`."""
        try:
            used = -(-self.nbytes // HUGE_PAGE) * HUGE_PAGE                    # not the alignment slack
            self._mapping.madvise(getattr(mmap, "MADV_COLLAPSE", MADV_COLLAPSE_LINUX), self._start, used)
            self.huge_pages_collapsed = True
        except OSError as err:
            self.huge_pages_collapsed = False
            self.huge_page_note += f"; madvise(MADV_COLLAPSE) refused: {err}"
        return self.huge_pages_collapsed

    def register_with_cuda(self) -> None:
        """Page-lock and map the buffer for every CUDA device (portable | mapped); raises with the
        CUDA error on failure. A 0-byte buffer has nothing to register."""
        if self.registered:
            return
        if self.nbytes:
            address = self.tensor.data_ptr()
            err = int(torch.cuda.cudart().cudaHostRegister(address, self.nbytes,
                                                            CUDA_HOST_REGISTER_PORTABLE | CUDA_HOST_REGISTER_MAPPED))
            if err:
                raise RuntimeError(f"sglang-dsv41: cudaHostRegister of {self.nbytes} bytes of Engram host table "
                                   f"failed with cudaError {err}")
            self._finalizer = weakref.finalize(self, _cuda_unregister, address)
        self.registered = True

    def close(self) -> None:
        """Unregister from CUDA now (the memory stays valid for CPU tensors still over it)."""
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None
        self.registered = False


def _request_huge_pages(mapping: mmap.mmap) -> tuple[bool, str]:
    """(accepted, note) of madvise(MADV_HUGEPAGE) on the whole mapping."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None:
        return False, "MADV_HUGEPAGE is not available on this platform"
    try:
        mapping.madvise(advice)
    except OSError as err:
        return False, f"madvise(MADV_HUGEPAGE) refused: {err}"
    return True, "madvise(MADV_HUGEPAGE) accepted"


@dataclass(frozen=True)
class UvaRows:
    """A 2-D uint8 row-major block of registered host memory as a Triton pointer argument
    (`kernels.engram_gather.RowMajorBytes`; module doc: what Triton requires of it)."""

    host: Tensor                     # the CPU tensor over the registered memory (kept alive)
    dtype: torch.dtype = field(default=torch.uint8, init=False)

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.host.shape[0]), int(self.host.shape[1]))

    def data_ptr(self) -> int:
        return self.host.data_ptr()


@dataclass(frozen=True, eq=False)
class HostEngramTable(StoredEngramTable):
    """A TP shard of one Engram table in host memory (module doc). `values`/`scales`: CPU
    tensors over `buffers`; `compute_device`: where lookups land (`device`); `sorted_reads`: read
    host rows in ascending order (`kernels.engram_gather`, benefit unmeasured)."""

    compute_device: torch.device = torch.device("cpu")
    buffers: tuple[HostBuffer, ...] = ()
    sorted_reads: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.values.device.type != "cpu":
            raise ValueError(f"HostEngramTable bytes must be in host memory, got {self.values.device}")
        if self.compute_device.type == "cuda" and not self.pinned:
            raise ValueError("HostEngramTable on a CUDA runtime needs its buffers registered with CUDA")

    @classmethod
    def copy_of(cls, values: Tensor, scales: Tensor, compute_device: torch.device | str, *,
                sorted_reads: bool = False) -> "HostEngramTable":
        """The rows `values` (E4M3 [rows, d]) / `scales` (UE8M0 [rows, d/32]) copied into fresh
        `HostBuffer`s, registered with CUDA when `compute_device` is CUDA (not on a CPU runtime:
        there is nothing to pin for)."""
        compute_device = torch.device(compute_device)
        if compute_device.type not in ("cpu", "cuda"):
            raise ValueError(f"Engram host tables serve CPU or CUDA runtimes, got {compute_device}")
        if compute_device.type == "cuda" and compute_device.index is None:      # the device tensors' spelling
            compute_device = torch.device("cuda", torch.cuda.current_device())
        StoredEngramTable(values, scales)                              # same shape / dtype checks
        held = []
        for src in (values, scales):
            buf = HostBuffer(src.numel() * src.element_size())
            buf.tensor.copy_(src.contiguous().view(torch.uint8).reshape(-1))
            if buf.huge_pages_requested and buf.nbytes:
                buf.collapse_huge_pages()
            if compute_device.type == "cuda":
                buf.register_with_cuda()
            held.append((buf, buf.tensor.view(src.dtype).view(src.shape)))
        (vbuf, vhost), (sbuf, shost) = held
        return cls(vhost, shost, compute_device=compute_device, buffers=(vbuf, sbuf), sorted_reads=sorted_reads)

    @property
    def device(self) -> torch.device:
        """The compute device: lookups land there and `new_zeros` allocates there (the bytes stay
        in host memory: `storage_device`)."""
        return self.compute_device

    @property
    def storage_device(self) -> torch.device:
        return self.values.device

    @property
    def placement(self) -> str:
        """"host": the stored bytes live in (pinned, on CUDA) host memory (runtime.md §A.7)."""
        return "host"

    @property
    def pinned(self) -> bool:
        """Every buffer is registered with CUDA (readable by kernels through UVA)."""
        return bool(self.buffers) and all(b.registered for b in self.buffers)

    @property
    def huge_pages_requested(self) -> bool:
        return bool(self.buffers) and all(b.huge_pages_requested for b in self.buffers)

    def __getitem__(self, ids: Tensor | slice) -> Tensor | StoredEngramTable:
        """A slice: a view of the same host rows (same buffers). An id tensor on CUDA: fp32 rows
        [*ids.shape, d] on that device, gathered from host memory by the Triton kernel through
        UVA; on the CPU: the torch path on the host bytes. Same bits either way."""
        if not isinstance(ids, Tensor) or ids.device.type == "cpu":
            return super().__getitem__(ids)
        if ids.dtype not in (torch.int64, torch.int32):
            raise TypeError("HostEngramTable is indexed by an integer id tensor or a slice of rows")
        if ids.device.type != "cuda":
            raise ValueError(f"HostEngramTable lookups run on CPU or CUDA ids, got {ids.device}")
        if not self.pinned:
            raise RuntimeError("HostEngramTable: CUDA lookups need the host buffers registered with CUDA "
                               "(build the table with a CUDA compute_device)")
        from ..kernels.engram_gather import engram_gather

        rows = engram_gather(UvaRows(self.values.view(torch.uint8)), UvaRows(self.scales.view(torch.uint8)), ids,
                             sorted_reads=self.sorted_reads)
        return rows.reshape(*ids.shape, self.values.shape[1])


__all__ = ["CUDA_HOST_REGISTER_MAPPED", "CUDA_HOST_REGISTER_PORTABLE", "ENABLE_ENV", "EngramPlacement", "HUGE_PAGE",
           "MADV_COLLAPSE_LINUX", "HostBuffer", "HostEngramTable", "LAYOUT_ENV", "SUPPORTED_LAYOUT", "UvaRows", "engram_placement_from_env"]

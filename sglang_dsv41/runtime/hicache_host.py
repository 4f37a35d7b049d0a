"""`ComponentHostPool`: the HiCache host (L2) mirror of one component of the V4.1 pool
(docs/hicache.md; spec integration.md §1.3; `runtime/kv_pool.py` for the device side).

A component (`kv_pool._RowsComponent`) holds `buffers[i]` = [S + page, width_i] slot-major rows of
any dtype and width (every row a multiple of 16 B), grouped into pool layers: one buffer per layer
(SWA: layer l = buffers[l]) or several buffers in its one layer (FULL: the global rows, one
buffer today, latents + index keys after the two-buffer split). The host pool mirrors each buffer
as a host tensor [S_host, width_i] of the same dtype, indexed by host slot (SGLang's host index):

* layout: always "layer_first" (one host tensor per device buffer), whatever
  `--hicache-mem-layout` says — buffers of different widths share no page-first stride; the
  controller's index handling for "layer_first" is what this pool expects for both io backends;
* io: on CUDA, `--hicache-io-backend kernel` runs sgl_kernel's token-row copy kernels (row bytes
  are multiples of 16, so their `item_size % 8` check holds), `direct` runs torch index copies;
  on CPU both are torch index copies (the only copy there is);
* per-layer load: pool layer k loads exactly the buffers of layer k, so SGLang's layer counter
  (`SWAKVPool._wait_for_layer`, called by `DeepseekV41KVPool.wait_for_model_layer`) is honest;
* flat pages (L3, e.g. `--hicache-storage-backend file`): page p = the bytes of host slots
  [p, p + page) of every buffer, in buffer order, as one uint8 vector.

Sizing, free lists and double-free checks are SGLang's (`HostKVCache`).
"""
from __future__ import annotations

import logging
from typing import Sequence

import torch
from torch import Tensor

from sglang.srt.mem_cache.pool_host.base import HostKVCache
from sglang.srt.mem_cache.pool_host.common import ALLOC_MEMORY_FUNCS

logger = logging.getLogger(__name__)
#: The only host layout of this pool (module docstring).
HOST_LAYOUT = "layer_first"
IO_BACKENDS = ("kernel", "direct")


def buffers_by_layer(component) -> list[list[int]]:
    """Buffer indices of each pool layer of `component`: one buffer per layer, or all buffers in
    a one-layer component."""
    n, layers = len(component.buffers), component.layer_num
    if n == layers:
        return [[i] for i in range(n)]
    if layers == 1:
        return [list(range(n))]
    raise ValueError(f"sglang-dsv41 HiCache: component {component.allocation_label!r} has {n} buffers "
                     f"for {layers} layers (expected one per layer, or all in one layer)")


class ComponentHostPool(HostKVCache):
    """Host mirror of one pool component (module docstring). `host_size_gb` > 0 sizes it in GB
    (`--hicache-size`, already split between components), else `ratio` × device slots."""

    def __init__(self, component, *, ratio: float, host_size_gb: float, page_size: int,
                 allocator_type: str = "default", label: str = "kv") -> None:
        self.buffers_of_layer = buffers_by_layer(component)
        self.row_bytes = [b[0].nbytes for b in component.buffers]
        self.dtypes = [b.dtype for b in component.buffers]
        self.widths = [b.shape[1] for b in component.buffers]
        on_cuda = torch.device(component.device).type == "cuda"
        super().__init__(component, ratio, host_size_gb, page_size, HOST_LAYOUT, pin_memory=on_cuda,
                         device="cpu", allocator_type=allocator_type, pool_label=label)
        self.dtype = torch.uint8                      # flat pages are bytes (module docstring)
        self.page_bytes = sum(self.row_bytes) * self.page_size
        self._ptrs: dict[str, Tensor] = {}
        # 1-D byte views of the host tensors: one slice per buffer is one page's rows (flat pages)
        self._flat_bytes = [h.view(torch.uint8).reshape(-1) for h in self.kv_buffer]
        # [slots, row bytes] byte views of the host tensors: rows of many pages in one indexed copy
        self._row_bytes = [h.view(torch.uint8) for h in self.kv_buffer]

    # ---- HostKVCache's abstract API -----------------------------------------------------------
    def get_size_per_token(self) -> int:
        return sum(self.row_bytes)

    def get_ksize_per_token(self) -> int:
        return self.get_size_per_token()

    def init_kv_buffer(self) -> list[Tensor]:
        alloc = ALLOC_MEMORY_FUNCS[torch.device(self.device_pool.device).type]
        return [alloc((self.size, w), dtype=d, device="cpu", pin_memory=self.pin_memory, allocator=self.allocator)
                for w, d in zip(self.widths, self.dtypes)]

    def get_hybrid_pool_buffer(self) -> list[Tensor]:
        return self.kv_buffer

    # ---- transfers -------------------------------------------------------------------------------
    def _check(self, io_backend: str, host_indices: Tensor, device_indices: Tensor) -> bool:
        if io_backend not in IO_BACKENDS:
            raise ValueError(f"sglang-dsv41 HiCache: --hicache-io-backend {io_backend!r} is not supported by the "
                             f"V4.1 host pool (use one of {IO_BACKENDS})")
        if host_indices.numel() != device_indices.numel():
            raise ValueError(f"sglang-dsv41 HiCache {self.pool_label}: {host_indices.numel()} host slots for "
                             f"{device_indices.numel()} device slots")
        return host_indices.numel() > 0

    def _use_kernel(self, io_backend: str, device_buffer: Tensor) -> bool:
        return io_backend == "kernel" and device_buffer.is_cuda

    def load_to_device_per_layer(self, device_pool, host_indices, device_indices, layer_id, io_backend) -> None:
        """Host → device for the buffers of pool layer `layer_id` of this component."""
        if not self._check(io_backend, host_indices, device_indices):
            return
        for i in self.buffers_of_layer[layer_id]:
            dev, host = device_pool.buffers[i], self.kv_buffer[i]
            if self._use_kernel(io_backend, dev):
                from sgl_kernel.kvcacheio import transfer_kv_per_layer_mla

                transfer_kv_per_layer_mla(src=host, dst=dev, src_indices=host_indices.to(dev.device, torch.int64),
                                          dst_indices=device_indices.to(torch.int64), item_size=self.row_bytes[i])
            else:
                dev[device_indices.to(dev.device)] = host[host_indices.cpu()].to(dev.device, non_blocking=True)

    def backup_from_device_all_layer(self, device_pool, host_indices, device_indices, io_backend) -> None:
        """Device → host for every buffer of this component."""
        if not self._check(io_backend, host_indices, device_indices):
            return
        dev0 = device_pool.buffers[0]
        if self._use_kernel(io_backend, dev0):
            from sgl_kernel.kvcacheio import transfer_kv_all_layer_mla

            src_idx = device_indices.to(dev0.device, torch.int64)
            dst_idx = host_indices.to(dev0.device, torch.int64)
            for row_bytes, group in self._groups_by_row_bytes():
                transfer_kv_all_layer_mla(src_layers=self._pointer_table("dev", device_pool.buffers, group),
                                          dst_layers=self._pointer_table("host", self.kv_buffer, group),
                                          src_indices=src_idx, dst_indices=dst_idx, item_size=row_bytes,
                                          num_layers=len(group))
            return
        host_idx = host_indices.cpu()
        for dev, host in zip(device_pool.buffers, self.kv_buffer):
            host[host_idx] = dev[device_indices.to(dev.device)].cpu()

    def _groups_by_row_bytes(self) -> list[tuple[int, tuple[int, ...]]]:
        groups: dict[int, list[int]] = {}
        for i, b in enumerate(self.row_bytes):
            groups.setdefault(b, []).append(i)
        return [(b, tuple(g)) for b, g in groups.items()]

    def _pointer_table(self, side: str, buffers: Sequence[Tensor], group: tuple[int, ...]) -> Tensor:
        """uint64 data pointers of `buffers[group]` on the device (the kernels' layer tables)."""
        key = f"{side}:{group}"
        if key not in self._ptrs:
            device = self.device_pool.buffers[0].device
            self._ptrs[key] = torch.tensor([buffers[i].data_ptr() for i in group], dtype=torch.uint64, device=device)
        return self._ptrs[key]

    # ---- flat pages (L3) ------------------------------------------------------------------------
    def _page_spans(self, index) -> list[tuple[Tensor, int, int]]:
        """(byte view, first byte, byte count) of the page at host slot `index` in each buffer."""
        start = int(index)
        if start % self.page_size:
            raise ValueError(f"sglang-dsv41 HiCache {self.pool_label}: host slot {start} does not start a page "
                             f"of {self.page_size}")
        if not 0 <= start <= self.size - self.page_size:
            raise ValueError(f"sglang-dsv41 HiCache {self.pool_label}: host slot {start} is outside the pool")
        return [(f, start * rb, rb * self.page_size) for f, rb in zip(self._flat_bytes, self.row_bytes)]

    def get_data_page(self, index, flat: bool = True) -> Tensor:
        """The page at host slot `index`: each buffer's `page` rows, buffer after buffer, as bytes
        (a new tensor: one slice per buffer, one concatenation)."""
        page = torch.cat([f[b: b + n] for f, b, n in self._page_spans(index)])
        return page if flat else page.reshape(self.page_size, -1)

    def get_dummy_flat_data_page(self) -> Tensor:
        return torch.zeros(self.page_bytes, dtype=torch.uint8)

    def set_from_flat_data_page(self, index, data_page: Tensor) -> None:
        """Write a page `get_data_page` made back into the host slots of the page at `index`."""
        spans = self._page_spans(index)
        flat = data_page.reshape(-1).view(torch.uint8)
        if flat.numel() != self.page_bytes:
            raise ValueError(f"sglang-dsv41 HiCache {self.pool_label}: a page is {self.page_bytes} B, got "
                             f"{flat.numel()} B")
        offset = 0
        for f, b, n in spans:
            f[b: b + n].copy_(flat[offset: offset + n])
            offset += n

    def flat_page_batch(self, pages: int) -> Tensor:
        """Staging for `pages` flat pages read from storage: row i is one flat page (uninitialised;
        what `get_dummy_flat_data_page` is for one page)."""
        return torch.empty(pages, self.page_bytes, dtype=torch.uint8)

    def set_from_flat_data_pages(self, host_indices: Tensor, pages: Tensor) -> None:
        """`set_from_flat_data_page` for k pages at once: row i of `pages` [k, page_bytes] goes to the
        page of host slots `host_indices[i·page : (i+1)·page]` (each a page-aligned run of consecutive
        slots, as SGLang's host allocator hands them out), one indexed copy per buffer."""
        k, page = pages.shape[0], self.page_size
        if tuple(pages.shape) != (k, self.page_bytes) or pages.dtype != torch.uint8:
            raise ValueError(f"sglang-dsv41 HiCache {self.pool_label}: flat pages are [k, {self.page_bytes}] uint8, "
                             f"got {list(pages.shape)} {pages.dtype}")
        rows = host_indices.to("cpu", torch.int64)
        runs = rows.view(k, page) if rows.numel() == k * page else None
        if runs is None or bool((runs[:, 0] % page).any()) or \
                not torch.equal(runs - runs[:, :1], torch.arange(page).expand(k, page)):
            raise ValueError(f"sglang-dsv41 HiCache {self.pool_label}: {rows.numel()} host slots are not {k} "
                             f"page-aligned runs of {page}")
        if bool((runs[:, 0] > self.size - page).any()):
            raise ValueError(f"sglang-dsv41 HiCache {self.pool_label}: a host slot is outside the pool")
        offset = 0
        for dst, rb in zip(self._row_bytes, self.row_bytes):
            dst.index_copy_(0, rows, pages[:, offset: offset + rb * page].reshape(k * page, rb))
            offset += rb * page

    def destroy(self) -> None:
        self._flat_bytes = []                         # no view outlives the host tensors
        self._row_bytes = []
        super().destroy()

    def get_page_buffer_meta(self, indices):
        raise NotImplementedError("sglang-dsv41 HiCache: zero-copy page buffers (Mooncake, 3FS, NIXL) are not "
                                  "supported by the V4.1 host pool; use --hicache-storage-backend file")

    def is_stride_page_aligned(self, page_size_bytes: int = 4096) -> bool:
        return False

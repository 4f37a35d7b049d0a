"""Accelerator catalog used by the deployment schema and the memory planner.

Each entry states what the planner needs about one kind of device: its vendor and
architecture (which KV layouts and Engram host paths exist there, spec `runtime.md` §A.3,
§A.7), the memory one GPU offers to a process, and how many GPUs one node or tray holds.

Invariant: these are *defaults*. Every figure can be overridden per config
(`hardware.gpu_mem_gib`, `hardware.gpus_per_node`) or per run (`plan --gpu-mem`), and the
planner prints the value it used, so a wrong catalog entry is visible, never silent.
Memory figures are the capacity the driver reports (GiB, 2^30 bytes), not the marketing
number in GB; where only the marketing number is known the note says so.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Vendor = Literal["nvidia", "amd", "cpu"]


@dataclass(frozen=True)
class GpuKind:
    name: str
    vendor: Vendor
    arch: str  # sm90 / sm100 / sm103 / gfx950 / gfx942 / cpu
    mem_gib: float  # per GPU, as the driver reports it (GiB)
    gpus_per_node: int  # GPUs one host (node or tray) holds
    nvlink_c2c: bool  # CPU-GPU coherent link (ATS): host Engram reads need no sorted-row path
    note: str

    @property
    def supports_v41_kv_layout(self) -> bool:
        """`v41` / `v41_fp4` KV layouts exist only on SM100/SM103 (FlashMLA) or gfx950 (AITER),
        spec `runtime.md` §A.3 ("Which layout is chosen")."""
        return self.arch in ("sm100", "sm103", "gfx950")

    @property
    def is_rocm(self) -> bool:
        return self.vendor == "amd"

    @property
    def is_cpu(self) -> bool:
        return self.vendor == "cpu"


GPU_KINDS: dict[str, GpuKind] = {
    k.name: k
    for k in (
        GpuKind("H200", "nvidia", "sm90", 139.8, 8, False,
                "141 GB HBM3e; torch total_memory 150,109,880,320 B = 139.8 GiB (measured on the H200 device machine)"),
        GpuKind("B200", "nvidia", "sm100", 179.1, 8, False, "180 GB HBM3e (183,359 MiB as the driver reports it)"),
        GpuKind("B300", "nvidia", "sm103", 268.6, 8, False, "288 GB HBM3e (275,040 MiB as the driver reports it)"),
        GpuKind("GB200", "nvidia", "sm100", 184.0, 4, True,
                "186 GB per GPU on an NVL4 tray; four GPUs per tray (the card's 768 GB per tray is nominal)"),
        GpuKind("GB300", "nvidia", "sm103", 268.6, 4, True, "288 GB HBM3e per GPU, four GPUs per tray"),
        GpuKind("MI355X", "amd", "gfx950", 288.0, 8, False, "288 GiB HBM3E (the card: 'a 288 GiB card')"),
        GpuKind("MI325X", "amd", "gfx942", 256.0, 8, False, "256 GiB HBM3E (the card: 'a 256 GB card')"),
        GpuKind("CPU", "cpu", "cpu", 0.0, 0, False, "no accelerator: SGLang's CPU engine (spec cpu.md §3)"),
    )
}


def gpu_kind(name: str) -> GpuKind:
    try:
        return GPU_KINDS[name]
    except KeyError:
        raise ValueError(f"unknown GPU kind {name!r}; known: {', '.join(GPU_KINDS)}") from None

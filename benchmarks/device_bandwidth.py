"""The roofline every benchmark reports against: the device's own copy bandwidth.

Measured in the same run as the kernel (`dst.copy_(src)` of 2 GiB BF16, bytes read + written,
`triton.testing.do_bench` median), so ratios are taken on one machine at one moment.
"""
from __future__ import annotations

import torch
import triton.testing


def copy_bandwidth_gbs(device: torch.device, nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read + written."""
    src = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    return 2 * nbytes / (ms * 1e-3) / 1e9

"""GPU machine: build FlashInfer's SM90 CUTLASS fused-MoE module (nvcc JIT, what
`cutlass_fused_moe` loads on first use) and write MARKER with the build seconds when it finished.

    python3 scripts/gpu/flashinfer_moe_jit.py MARKER
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

if __name__ == "__main__":
    t0 = time.perf_counter()
    from flashinfer.fused_moe.core import get_cutlass_fused_moe_module

    get_cutlass_fused_moe_module("90")
    Path(sys.argv[1]).write_text(f"{time.perf_counter() - t0:.0f}\n")
    print(f"flashinfer fused_moe_90 built in {time.perf_counter() - t0:.0f} s")

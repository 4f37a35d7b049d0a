"""Print the machine facts CPU test results depend on (run by `.ci/run` before the tests).

Float results computed by BLAS differ between hosts: OpenBLAS (numpy, so the Triton interpreter's
`tl.dot`) and MKL (torch) pick their kernels per CPU and per shape. The tests must not depend on
that (docs/validation.md, "Host-independent tests"), and when one does, these lines say on which
machine it failed.
"""
from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

BLAS_VARIABLES = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS",
                  "MKL_NUM_THREADS", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR", "ATEN_CPU_CAPABILITY")
SIMD_FLAGS = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512_bf16", "amx_tile")


def cpu_model_and_flags() -> tuple[str, list[str]]:
    """The CPU model name and which of SIMD_FLAGS it has (from /proc/cpuinfo on Linux)."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        return platform.processor() or platform.machine(), []
    model, flags = "unknown", set()
    for line in cpuinfo.read_text().splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and model == "unknown":
            model = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = set(value.split())
    return model, [f for f in SIMD_FLAGS if f in flags]


def blas_lines() -> list[str]:
    """One line per BLAS / OpenMP library loaded by numpy and torch (threadpoolctl's view)."""
    import numpy  # noqa: F401  (load its OpenBLAS)
    import torch

    lines = [f"numpy {numpy.__version__}; torch {torch.__version__}, CPU capability "
             f"{torch.backends.cpu.get_cpu_capability()}, MKL {torch.backends.mkl.is_available()}, "
             f"intra-op threads {torch.get_num_threads()}"]
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return lines + ["threadpoolctl not installed: BLAS kernel choice not shown"]
    for lib in threadpool_info():
        lines.append(f"{lib.get('internal_api')} {lib.get('version')}: architecture "
                     f"{lib.get('architecture', '-')}, threads {lib.get('num_threads')}, "
                     f"{Path(lib.get('filepath', '')).name}")
    return lines


def main() -> int:
    model, flags = cpu_model_and_flags()
    print(f"machine: {model}; {os.cpu_count()} cores; SIMD {' '.join(flags) or '(none listed)'}")
    print(f"python {sys.version.split()[0]} on {platform.platform()}")
    for line in blas_lines():
        print(line)
    given = [f"{v}={os.environ[v]}" for v in BLAS_VARIABLES if v in os.environ]
    print(f"BLAS variables: {' '.join(given) or '(none set)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

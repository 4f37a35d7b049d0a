"""The environment SGLang 0.5.17 needs to serve on a machine without a GPU (spec `cpu.md` §3).

* `SGLANG_USE_CPU_ENGINE=1` — mandatory; without it `--device cpu` takes a generic platform path
  that imports vllm.
* A stand-in `libcuda.so.1` on `LD_LIBRARY_PATH` — the PyPI sgl-kernel wheel is a CUDA build whose
  `common_ops` library links `libcuda.so.1`, and `mem_cache/memory_pool.py` imports it at module
  load. The stand-in exports the four driver entry points that are looked up (the only undefined
  one is `cuPointerGetAttribute`) and each returns `CUDA_ERROR_NO_DEVICE`, so
  `torch.cuda.is_available()` stays False. It is compiled once with gcc into a cache directory
  (`~/.cache/sglang-dsv41/cuda-stub/`) and rebuilt when its source changes.
* `HF_HUB_OFFLINE=1` — local checkpoints only; nothing is fetched.

Tensor parallel on CPU (`--tp-size N > 1`, one process per rank over gloo) needs two more:

* `SGLANG_CPU_OMP_THREADS_BIND` — one core range per rank ("0-3|4-7"); without it SGLang 0.5.17
  asserts that the TP size is at most the number of NUMA nodes;
* `SGLANG_NCCL_SO_PATH` pointing at a library that does not exist — torch here is a CUDA build, so
  SGLang would otherwise load libnccl and build a PyNccl communicator for the CPU TP group, which
  fails ("Expected a cuda device, but got: cpu"); with no library PyNccl reports itself disabled
  and the gloo group carries the collectives.

PD disaggregation on CPU (`--disaggregation-mode`, Mooncake over TCP; spec cpu.md §5, docs/pd.md)
needs `MC_FORCE_TCP=1` and `MOONCAKE_PROTOCOL=tcp` (no RDMA device discovery), `SGLANG_HOST_IP`
(default 127.0.0.1: otherwise SGLang advertises the NIC address) and
`SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX=0` (its early send records a CUDA event: the
prefill scheduler dies on its first prefix hit). Values already set are kept.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

#: CUresult 100 = CUDA_ERROR_NO_DEVICE.
CUDA_STUB_SOURCE = """\
/* sglang-dsv41: no-device stand-in for libcuda.so.1 (CPU serving; spec cpu.md section 3). */
typedef int CUresult;
#define CUDA_ERROR_NO_DEVICE 100
CUresult cuInit(unsigned int flags) { (void)flags; return CUDA_ERROR_NO_DEVICE; }
CUresult cuDriverGetVersion(int *version) { if (version) *version = 0; return CUDA_ERROR_NO_DEVICE; }
CUresult cuDeviceGetCount(int *count) { if (count) *count = 0; return CUDA_ERROR_NO_DEVICE; }
CUresult cuPointerGetAttribute(void *data, int attribute, unsigned long long ptr) {
    (void)data; (void)attribute; (void)ptr; return CUDA_ERROR_NO_DEVICE;
}
"""
STUB_NAME = "libcuda.so.1"


def cache_root() -> Path:
    """`$XDG_CACHE_HOME/sglang-dsv41` (default `~/.cache/sglang-dsv41`)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "sglang-dsv41"


def ensure_cuda_stub(directory: Path | None = None) -> Path:
    """Directory holding a compiled stand-in `libcuda.so.1` (built with gcc if missing or stale)."""
    directory = Path(directory) if directory is not None else cache_root() / "cuda-stub"
    digest = hashlib.sha256(CUDA_STUB_SOURCE.encode()).hexdigest()[:16]
    lib, stamp = directory / STUB_NAME, directory / "source.sha256"
    if lib.is_file() and stamp.is_file() and stamp.read_text().strip() == digest:
        return directory
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        raise RuntimeError("serving on CPU needs a C compiler (gcc) to build the libcuda.so.1 stand-in "
                           "that SGLang's sgl-kernel wheel links against (spec cpu.md §3)")
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        src, out = Path(tmp) / "cudastub.c", Path(tmp) / STUB_NAME
        src.write_text(CUDA_STUB_SOURCE)
        run = subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-o", str(out), str(src),
                              f"-Wl,-soname,{STUB_NAME}"], capture_output=True, text=True)
        if run.returncode != 0:
            raise RuntimeError(f"building the libcuda.so.1 stand-in failed:\n{run.stderr}")
        os.replace(out, lib)                     # atomic: concurrent builders never see half a file
    stamp.write_text(digest + "\n")
    return directory


#: `SGLANG_NCCL_SO_PATH` on CPU at TP > 1: a path that never holds a library (see the module doc).
NO_NCCL_LIBRARY = "/nonexistent/sglang-dsv41-cpu-has-no-nccl/libnccl.so.2"


def omp_thread_binding(tp_size: int, cores: int | None = None) -> str:
    """`SGLANG_CPU_OMP_THREADS_BIND` for `tp_size` ranks: the cores split into contiguous ranges,
    one per rank ("0|1" for 2 ranks on 2 cores, "0-3|4-7" for 2 ranks on 8)."""
    cores = (os.cpu_count() or 1) if cores is None else cores
    if tp_size < 1 or tp_size > cores:
        raise ValueError(f"--tp-size {tp_size} on CPU needs at least one core per rank ({cores} cores here)")
    per_rank = cores // tp_size
    ranges = []
    for rank in range(tp_size):
        first, last = rank * per_rank, rank * per_rank + per_rank - 1
        ranges.append(str(first) if first == last else f"{first}-{last}")
    return "|".join(ranges)


#: What PD over Mooncake needs on CPU (module doc); `setdefault`ed.
PD_CPU_ENVIRONMENT = {"MC_FORCE_TCP": "1", "MOONCAKE_PROTOCOL": "tcp", "SGLANG_HOST_IP": "127.0.0.1",
                      "SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX": "0"}


def cpu_environment(base: dict[str, str] | None = None, stub_dir: Path | None = None,
                    tp_size: int = 1, pd: bool = False) -> dict[str, str]:
    """`base` (default: os.environ) plus what SGLang's CPU engine needs for `tp_size` ranks, and for
    PD disaggregation when `pd` (see the module doc)."""
    env = dict(os.environ if base is None else base)
    if pd:
        for k, v in PD_CPU_ENVIRONMENT.items():
            env.setdefault(k, v)
    if tp_size > 1:
        env["SGLANG_CPU_OMP_THREADS_BIND"] = omp_thread_binding(tp_size)
        env["SGLANG_NCCL_SO_PATH"] = NO_NCCL_LIBRARY
    stub = str(ensure_cuda_stub(stub_dir))
    paths = [p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p and p != stub]
    env["LD_LIBRARY_PATH"] = os.pathsep.join([stub, *paths])
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    env["HF_HUB_OFFLINE"] = "1"
    return env

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


def cpu_environment(base: dict[str, str] | None = None, stub_dir: Path | None = None) -> dict[str, str]:
    """`base` (default: os.environ) plus what SGLang's CPU engine needs (see the module doc)."""
    env = dict(os.environ if base is None else base)
    stub = str(ensure_cuda_stub(stub_dir))
    paths = [p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p and p != stub]
    env["LD_LIBRARY_PATH"] = os.pathsep.join([stub, *paths])
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    env["HF_HUB_OFFLINE"] = "1"
    return env

"""JIT kernel caches of SGLang 0.5.17's DeepSeek-V4 path: one directory for all of them, packed into parts
that fit the GPU machine's transfer limits and restored on a fresh machine (helper of sglang_v4_baseline.py).

Why: a fresh GPU machine starts with empty caches and the V4 decode-graph capture JIT-compiles dozens of
kernels (2026-11-30: > 171 s inside the first capture, no log line). Every JIT system below writes each
compiled kernel to disk as soon as it is built (atomic rename / prebuilt .so), so a directory filled by a
warm-up that was killed part-way keeps every kernel it finished: warm-ups resume where the last stopped.

Which caches (read from the installed sources, CPU machine, 2026-11-30):
| cache | env var (default) | what | key |
| SGLang `load_jit` (sglang/kernels/jit/utils/compile.py) | TVM_FFI_CACHE_DIR (~/.cache/tvm-ffi) | nvcc-built tvm-ffi modules: V4 attention, compress, elementwise, fp8 wo_a, moe, topk | source hash + arch + tvm-ffi version; a prebuilt `<module>.so` is loaded directly |
| TileLang 0.1.11 (tilelang/cache/kernel_cache.py) | TILELANG_CACHE_DIR (~/.tilelang/cache), TILELANG_TMP_DIR (CACHE/tmp) | mHC kernels (sglang/kernels/ops/layernorm/mhc.py: Sinkhorn pre-mix) | TIR script + version + sha256 of libtilelang/libtvm (machine-independent) |
| DeepGEMM 0.1.5.post1 | SGLANG_DG_CACHE_DIR (~/.cache/deep_gemm); SGLang *overwrites* DG_JIT_CACHE_DIR with it (srt/layers/deep_gemm_wrapper/compile_utils.py) | FP8 GEMMs, fp8_einsum (wo_a), MQA logits / metadata (indexer), tf32 HC pre-norm | kernel source + flags + library version; one `kernel.cu` + `kernel.cubin` per kernel |
| Triton 3.6 | TRITON_CACHE_DIR (~/.triton/cache) | V4 rope, fused compress, indexer FP4, metadata, KV quant kernels | source + constexprs + int divisibility (batch size can matter) |
| torch inductor | TORCHINDUCTOR_CACHE_DIR | only if a path torch.compiles (prefill piecewise graphs are disabled here) | |
| flashinfer | FLASHINFER_WORKSPACE_BASE (~) | only if a flashinfer JIT kernel is reached (sampling is `pytorch`) | |
| CUDA driver PTX cache | CUDA_CACHE_PATH (~/.nv/ComputeCache) | any PTX-only kernel JIT-ed by the driver | |
| anything else under XDG | XDG_CACHE_HOME (~/.cache) | caches that follow XDG | |

Transfer limits this is shaped by (/work/.library/device/README.md): files back from $OUT at most 8,
16 MiB each, 64 MiB together; a call carries at most 64 MiB (the runtime's base part is 49.3 MiB and
its extra part 41.7 MiB). Hence parts of `PART_MIB` (14) MiB, at most `MAX_PARTS` (4), a manifest with
their sha256, and staging: parts carried by several calls gather in `STAGING` until all are there.

Standard library only (it runs before the runtime is unpacked):
    python3 benchmarks/sglang_jit_cache.py env DIR                 # the variables, shell syntax
    python3 benchmarks/sglang_jit_cache.py restore DIR .gpu_jit     # stage carried parts; extract when complete
    python3 benchmarks/sglang_jit_cache.py pack DIR OUTDIR          # parts + manifest (inventory of DIR)
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import shutil
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

PREFIX = "sglang_jit"
MANIFEST = f"{PREFIX}.manifest.json"
PART_MIB, MAX_PARTS = 14, 4          # 4 x 14 MiB + the checkout fit one call's 64 MiB carry
STAGING = Path("/tmp/sglang-jit-parts")
# subdirectory of the cache dir -> the variables pointed at it
CACHE_VARS: dict[str, tuple[str, ...]] = {
    "tvm_ffi": ("TVM_FFI_CACHE_DIR",),
    "tilelang": ("TILELANG_CACHE_DIR",),
    "deep_gemm": ("SGLANG_DG_CACHE_DIR", "DG_JIT_CACHE_DIR"),
    "triton": ("TRITON_CACHE_DIR",),
    "inductor": ("TORCHINDUCTOR_CACHE_DIR",),
    "flashinfer": ("FLASHINFER_WORKSPACE_BASE",),
    "cuda": ("CUDA_CACHE_PATH",),
    "xdg": ("XDG_CACHE_HOME",),
}
SCRATCH = "scratch"                      # TileLang's temp files: inside DIR (same filesystem), never packed
SKIP_SUFFIXES = (".o", ".lock")          # tvm-ffi object files (the prebuilt .so is what loads), lock files
SKIP_DIRS = (".staging", "tmp", SCRATCH)  # half-written entries (TileLang staging, DeepGEMM tmp)


def jit_cache_env(cache_dir: Path) -> dict[str, str]:
    """Every JIT cache variable pointed into `cache_dir` (absolute), one subdirectory per system."""
    root = Path(cache_dir).resolve()
    env = {var: str(root / sub) for sub, names in CACHE_VARS.items() for var in names}
    env["TILELANG_TMP_DIR"] = str(root / SCRATCH / "tilelang_tmp")
    return env


def _packable(rel: Path) -> bool:
    return not (set(rel.parts) & set(SKIP_DIRS)) and not rel.name.endswith(SKIP_SUFFIXES)


def inventory(cache_dir: Path) -> dict[str, Any]:
    """Files and bytes per cache (packable files only); the total."""
    root = Path(cache_dir)
    by: dict[str, dict[str, int]] = {sub: {"files": 0, "bytes": 0} for sub in CACHE_VARS}
    if root.is_dir():
        for p in sorted(root.rglob("*")):
            rel = p.relative_to(root)
            if p.is_file() and not p.is_symlink() and _packable(rel) and rel.parts[0] in by:
                by[rel.parts[0]]["files"] += 1
                by[rel.parts[0]]["bytes"] += p.stat().st_size
    return {"by_cache": by, "files": sum(v["files"] for v in by.values()),
            "bytes": sum(v["bytes"] for v in by.values())}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def pack(cache_dir: Path, out_dir: Path, extra: dict[str, Any] | None = None, part_mib: int = PART_MIB,
         max_parts: int = MAX_PARTS) -> dict[str, Any]:
    """tar.gz of the packable files of `cache_dir`, split into parts of `part_mib` MiB in `out_dir`, and the
    manifest (parts with sha256, inventory, `extra` e.g. the warm-up stages). Raises if more than
    `max_parts` parts would be needed (they could not all come back from one call)."""
    root, out_dir = Path(cache_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob(f"{PREFIX}.tgz.part*"):
        old.unlink()
    t0 = time.perf_counter()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=6) as tar:
        for p in sorted(root.rglob("*")) if root.is_dir() else []:
            rel = p.relative_to(root)
            if p.is_file() and not p.is_symlink() and _packable(rel):
                tar.add(p, arcname=rel.as_posix(), recursive=False)
    data, size = buf.getvalue(), part_mib << 20
    n_parts = max(1, -(-len(data) // size))
    if n_parts > max_parts:
        raise RuntimeError(f"JIT cache packs to {len(data) / 2**20:.1f} MiB = {n_parts} parts of {part_mib} MiB, "
                           f"more than {max_parts} (the $OUT limit): raise --jit-part-mib or prune {root}")
    parts = []
    for i in range(n_parts):
        path = out_dir / f"{PREFIX}.tgz.part{i:02d}"
        path.write_bytes(data[i * size:(i + 1) * size])
        parts.append({"name": path.name, "bytes": path.stat().st_size, "sha256": _sha256(path)})
    manifest = {"id": hashlib.sha256("".join(p["sha256"] for p in parts).encode()).hexdigest()[:16],
                "created": time.strftime("%Y-%m-%d %H:%M:%S"), "parts": parts, "packed_bytes": len(data),
                "pack_s": time.perf_counter() - t0, **inventory(root), **(extra or {})}
    (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return manifest


def restore(cache_dir: Path, sources: list[Path], staging: Path = STAGING) -> dict[str, Any]:
    """Gather `MANIFEST` and its parts from `sources` (e.g. the carried .gpu_jit/) into `staging`
    (kept while the machine stays warm, so several calls can each carry some parts); when every part is
    there with its sha256, extract into `cache_dir` (existing files are kept: a warm cache only grows)
    once per manifest id. Returns what happened; never raises for missing parts (they are listed)."""
    staging, root = Path(staging), Path(cache_dir)
    staging.mkdir(parents=True, exist_ok=True)
    for src in sources:
        src = Path(src)
        if not src.is_dir():
            continue
        if (src / MANIFEST).is_file():
            new = json.loads((src / MANIFEST).read_text())
            old = json.loads((staging / MANIFEST).read_text()) if (staging / MANIFEST).is_file() else {}
            if new.get("id") != old.get("id"):
                for stale in staging.glob(f"{PREFIX}.tgz.part*"):
                    stale.unlink()
                shutil.copy2(src / MANIFEST, staging / MANIFEST)
        for part in src.glob(f"{PREFIX}.tgz.part*"):
            if not (staging / part.name).exists():
                shutil.copy2(part, staging / part.name)
    if not (staging / MANIFEST).is_file():
        return {"restored": False, "reason": "no manifest carried or staged", "missing": []}
    manifest = json.loads((staging / MANIFEST).read_text())
    missing = [p["name"] for p in manifest["parts"]
               if not (staging / p["name"]).is_file() or _sha256(staging / p["name"]) != p["sha256"]]
    info: dict[str, Any] = {"id": manifest["id"], "missing": missing}
    stamp = root / f".restored-{manifest['id']}"
    if missing:
        return {**info, "restored": False, "reason": f"{len(missing)} of {len(manifest['parts'])} parts missing"}
    if stamp.exists():
        return {**info, "restored": True, "reason": "already restored on this machine", "files_new": 0}
    t0 = time.perf_counter()
    data = b"".join((staging / p["name"]).read_bytes() for p in manifest["parts"])
    root.mkdir(parents=True, exist_ok=True)
    new = 0
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        for member in tar.getmembers():
            if member.isfile() and not (root / member.name).exists():
                tar.extract(member, root, filter="data")
                new += 1
    stamp.write_text(json.dumps({"files_new": new}))
    return {**info, "restored": True, "files_new": new, "restore_s": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("env").add_argument("dir", type=Path)
    r = sub.add_parser("restore")
    r.add_argument("dir", type=Path)
    r.add_argument("sources", type=Path, nargs="+")
    p = sub.add_parser("pack")
    p.add_argument("dir", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--part-mib", type=int, default=PART_MIB)
    args = ap.parse_args(argv)
    if args.cmd == "env":
        print("\n".join(f"export {k}={v}" for k, v in jit_cache_env(args.dir).items()))
        return 0
    if args.cmd == "restore":
        info = restore(args.dir, args.sources)
        print(json.dumps(info))
        return 0 if info["restored"] else 3
    info = pack(args.dir, args.out, part_mib=args.part_mib)
    print(json.dumps({k: info[k] for k in ("id", "files", "bytes", "packed_bytes")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

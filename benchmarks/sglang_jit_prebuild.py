"""Pre-build SGLang 0.5.17's tvm-ffi JIT modules (`load_jit`) of the DeepSeek-V4-Flash server in parallel.

Why (docs/sglang_v4_jit.md): on a fresh H200 the V4 server builds ~20-30 tvm-ffi modules one after
the other, lazily, inside its first decode CUDA-graph capture (Marlin-MoE alone ~200 s of nvcc). tvm-ffi
builds each module under a FileLock in `$TVM_FFI_CACHE_DIR/<module>__arch_9.0a__tvmffi_<ver>/` and
`load_jit` loads a `<module>.so` found there without compiling, so a side process started right before
the server can build the same modules on the other cores: the server then finds the `.so` or waits on
the lock of the one being built.

What is built: `TARGETS` below, one per module, each by calling SGLang's own builder function (the
`@cache_once` `_jit_*` function that calls `load_jit`) with the template arguments the V4-Flash server
passes (read from the 0.5.17 source for: `--load-format dummy`, `--moe-runner-backend marlin` with MXFP4
experts, FP8 block linears through DeepGEMM on SM90, attention backend dsv4, page size 256 (SGLang's V4
override), SWA pool page 256, c4 pool page 64, c128 pool page 2, fp32 compressor state, default
`SGLANG_OPT_*` switches, TP 1, no MTP, no FP4 indexer). The shapes come from
`sglang_v4_baseline.v4_config_dict`. Not tvm-ffi (so not here): DeepGEMM, TileLang (mHC), Triton,
FlashInfer (RMSNorm goes to sgl_kernel -> FlashInfer), FlashMLA (AOT).

How: each target is built in its own `python ... --worker NAME` subprocess (`--jobs` at once, largest
expected cost first: Marlin first), with the server's cache env (`sglang_jit_cache.jit_cache_env`),
the JIT arch forced to sm_90a (`override_jit_cuda_arch(9, 0)`, so no GPU is needed) and
`CUDA_VISIBLE_DEVICES=""` (16 workers must not open CUDA contexts on the GPU the server is loading).
The worker builds with `tvm_ffi.cpp.build_inline` in place of `load_inline` (same arguments, same
directory, same lock) and never loads the `.so`. A target whose builder is gone (SGLang moved it) is an
error in the summary. `--dry-run` (one process, no compiler) lists each target with the module name and
build directory the server would look up, whether its `.so` is already there, and the cache
directories no target accounts for (run it after a server run: those are modules this list misses).

    python benchmarks/sglang_jit_prebuild.py --jobs 16 --cache-dir /tmp/sglang_jit [--summary OUT.json]
    python benchmarks/sglang_jit_prebuild.py --cache-dir /tmp/sglang_jit --dry-run [--only NAME ...]

Exit status: 0 when every selected target is built (or was already), 1 when any failed.

What was verified where, and what not: docs/sglang_v4_jit.md, "The prebuild tool".
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sglang_jit_cache  # noqa: E402  (standard library only)
from sglang_v4_baseline import v4_config_dict  # noqa: E402  (imports SGLang only when run)

ARCH = (9, 0)                      # H200: sm_90a (SGLang appends "a" for 9.x)
PAGE_SIZE = 256                    # SGLang forces page_size 256 for V4 on CUDA (arg_groups/overrides.py)
WORKER_TIMEOUT_S = 900


@dataclass(frozen=True)
class Target:
    name: str
    module: str                    # python module of the builder
    func: str                      # the builder (the function that calls load_jit)
    args: tuple                    # its arguments; torch dtypes as "torch.<name>" strings
    est_s: int                     # expected cold nvcc seconds (order only)
    why: str                       # where the server calls it

    def resolved_args(self) -> tuple:
        import torch
        return tuple(getattr(torch, a[6:]) if isinstance(a, str) and a.startswith("torch.") else a
                     for a in self.args)


def targets(cfg: dict[str, Any] | None = None) -> list[Target]:
    """The tvm-ffi modules of SGLang 0.5.17's V4 server at the widths of `cfg` (V4-Flash, 4 layers)."""
    cfg = cfg or v4_config_dict(4)
    hd, rope, idx_hd = cfg["head_dim"], cfg["qk_rope_head_dim"], cfg["index_head_dim"]
    ratios = sorted({r for r in cfg["compress_ratios"] if r})            # (4, 128)
    bf16, fp32, fp8 = "torch.bfloat16", "torch.float32", "torch.float8_e4m3fn"
    group = cfg["quantization_config"]["weight_block_size"][1]          # 128
    ew, cp = "sglang.kernels.ops.attention.dsv4.elementwise", "sglang.kernels.ops.attention.dsv4.compress"
    ptgq = "sglang.kernels.ops.quantization.per_token_group_quant"
    t = [
        # routed experts, MXFP4 Marlin: _jit_moe_wna16_marlin_module(a.dtype, is_ep, has_bias); EP 1, no bias
        Target("moe_wna16_marlin", "sglang.kernels.ops.moe.moe_wna16_marlin", "_jit_moe_wna16_marlin_module",
               (bf16, False, False), 200, "fused_marlin_moe.py moe_wna16_marlin_gemm (both GEMMs)"),
        # attention: q rmsnorm-self + RoPE (models/deepseek_v4.py _compute_q_b)
        Target("dsv4_main_q_norm_rope", ew, "_jit_main_q_norm_rope_module", (bf16, hd, rope), 15,
               "fused_q_norm_rope"),
        # kv norm + RoPE + FlashMLA SWA store; SWA pool page = page_size 256 (kv_cache_configurator._build_dsv4_kv_pool)
        Target("dsv4_main_k_norm_rope_flashmla", ew, "_jit_main_k_norm_rope_flashmla_module",
               (bf16, hd, rope, PAGE_SIZE), 15, "set_swa_key_buffer_radix_fused_norm_rope"),
        Target("dsv4_fused_rope", ew, "_jit_fused_rope_module", (), 10, "fused_rope_inplace (inverse RoPE of o)"),
        Target("dsv4_q_indexer_rope_hadamard_quant", ew, "_jit_main_q_indexer_rope_hadamard_quant_module",
               (bf16,), 15, "C4Indexer.compute_q (FP8 indexer)"),
        Target("dsv4_compress_plan", cp, "_jit_compress_plan_module", (), 10, "Compressor{Decode,Prefill}Plan"),
    ]
    # compressors (layers/attention/dsv4/compressor_v2.py forward_unified): kv_score = linear_bf16_fp32 -> fp32,
    # state buffer fp32 (SGLANG_DSV4_COMPRESS_STATE_DTYPE default), output fp32; (head_dim, ratio, store page)
    comps = [(hd, r, PAGE_SIZE // r) for r in ratios] + [(idx_hd, 4, PAGE_SIZE // 4)]   # + c4 indexer
    for head, ratio, page in comps:
        kind = "indexer" if head == idx_hd else "attn"
        t.append(Target(f"dsv4_compress_{ratio}_{kind}_d{head}", cp, "_jit_compress_module",
                        (head, fp32, fp32, fp32, ratio), 20, "compress_forward"))
        t.append(Target(f"dsv4_fused_norm_rope_v2_{kind}_d{head}_p{page}", cp, "_jit_compress_norm_rope_module",
                        (fp32, head, rope, page, False), 20, "compress_norm_rope_store"))
    t += [
        Target("dsv4_indexer_metadata", "sglang.kernels.ops.attention.dsv4.attn", "_jit_metadata_module", (), 10,
               "get_paged_mqa_logits_metadata (SGLANG_OPT_USE_JIT_INDEXER_METADATA)"),
        Target("dsv4_topk_v2", "sglang.kernels.ops.attention.dsv4.topk", "_jit_topk_v2_module", (), 16,
               "plan_topk_v2 / topk_transform_512_v2 (decode)"),
        Target(f"dsv4_topk_v1_{cfg['index_topk']}", "sglang.kernels.ops.attention.dsv4.topk", "_jit_topk_v1_module",
               (cfg["index_topk"],), 10, "topk_transform_512 (extend: raw indices for sparse prefill)"),
        Target("dsv4_mask_topk", "sglang.kernels.ops.attention.dsv4.moe", "_jit_mask_topk_module", (), 10,
               "mask_topk_ids (padded CUDA-graph rows)"),
        Target("dsv4_silu_and_mul_clamp", "sglang.kernels.ops.attention.dsv4.moe", "_jit_silu_and_mul_clamp_module",
               (bf16,), 10, "shared expert DeepseekV2MLP with swiglu_limit"),
        # shared-expert fast path, taken only if its FP8 weights are stored as uint8 (guard, cheap)
        Target("dsv4_silu_mul_quant_contig", "sglang.kernels.ops.attention.dsv4.moe",
               "_jit_silu_mul_quant_contig_module", (group, False, False, True), 10,
               "silu_and_mul_contig_post_quant (guard)"),
        # FP8 block linears on SM90 (fp8_utils deepgemm path): column-major fp32 scales, TMA-aligned
        Target("per_token_group_quant_colmajor", ptgq, "_jit_module",
               (bf16, fp8, group, False, False, True, False, False, True), 12, "sglang_per_token_group_quant_fp8"),
        # wo_a on SM90 (models/deepseek_v4.py, SGLANG_OPT_FP8_WO_A_GEMM): row-major fp32 scales
        Target("per_token_group_quant_rowmajor", ptgq, "_jit_module",
               (bf16, fp8, group, False, True, True, False, False, True), 12, "wo_a act quant"),
        # MoEGate: tokens <= 16, hidden % 1024 == 0, 256 experts -> (num_experts, hidden, pdl, out fp32)
        Target("dsv3_router_gemm", "sglang.kernels.ops.gemm.dsv3_router_gemm", "dsv3_router_gemm_module",
               (cfg["n_routed_experts"], cfg["hidden_size"], True, True), 15, "MoEGate (decode bs <= 16)"),
        Target("moe_align_single_token", "sglang.kernels.ops.moe.moe_align_single_token",
               "_jit_align_single_token_module", (), 10, "fused_marlin_moe (M == 1)"),
        Target("moe_topk_sum", "sglang.kernels.ops.moe.moe_topk_sum", "_jit_topk_sum_module", (), 10,
               "fused_marlin_moe MXFP4 top-k sum"),
        Target("clamp_position", "sglang.kernels.ops.attention.clamp_position", "_jit_clamp_position_module",
               ("torch.int64",), 8, "ForwardBatch decode positions (seq_lens int64)"),
        # found by the dry run after session 36's server: the MXFP4 experts' load-time repack for Marlin
        Target("gptq_marlin_repack", "sglang.kernels.ops.quantization.gptq_marlin_repack",
               "_jit_gptq_marlin_repack_module", (), 15, "prepare_moe_mxfp4_layer_for_marlin (at load)"),
    ]
    return sorted(t, key=lambda x: -x.est_s)


def _builder(target: Target) -> Callable[..., Any]:
    mod = importlib.import_module(target.module)
    fn = getattr(mod, target.func, None)
    if not callable(fn):
        raise AttributeError(f"{target.module}.{target.func} not found in the installed sglang")
    return fn


class _Capture:
    """Replace tvm-ffi's loaders: `build` compiles without loading (worker), else only records names."""

    def __init__(self, build: bool):
        self.build, self.seen = build, []

    def __enter__(self):
        import tvm_ffi
        import tvm_ffi.cpp
        self._saved = (tvm_ffi.load_module, tvm_ffi.cpp.load_inline, tvm_ffi.cpp.load)
        cap = self

        def load_module(path, *a, **k):          # load_jit found `<dir>/<module>.so`: already built
            cap.seen.append({"so": str(path), "cached": True})
            return str(path)

        def recording(build):                   # tvm_ffi.cpp.load_inline / load → record, build, never load
            def load(name, **kw):
                kw.pop("keep_module_alive", None)
                rec = {"module": name, "build_dir": kw.get("build_directory"), "cached": False}
                cap.seen.append(rec)
                if cap.build:
                    rec["so"] = build(name, **kw)
                return rec.get("so")
            return load

        tvm_ffi.load_module = load_module
        tvm_ffi.cpp.load_inline = recording(tvm_ffi.cpp.build_inline)
        tvm_ffi.cpp.load = recording(tvm_ffi.cpp.build)
        return self

    def __exit__(self, *exc):
        import tvm_ffi
        import tvm_ffi.cpp
        tvm_ffi.load_module, tvm_ffi.cpp.load_inline, tvm_ffi.cpp.load = self._saved
        return False


def run_target(target: Target, build: bool) -> dict[str, Any]:
    """Call the target's builder under the sm_90a override; the module name / build dir it resolved to."""
    from sglang.kernels.jit.utils import is_arch_support_pdl, override_jit_cuda_arch
    out: dict[str, Any] = {"name": target.name, "builder": f"{target.module}.{target.func}",
                           "args": [str(a) for a in target.args]}
    t0 = time.perf_counter()
    cap = _Capture(build)
    try:
        fn = _builder(target)
        with override_jit_cuda_arch(*ARCH), cap:
            if not is_arch_support_pdl():
                raise RuntimeError("is_arch_support_pdl() is False under the sm_90a override (cached before it?)")
            fn(*target.resolved_args())
        if not cap.seen:
            raise RuntimeError("builder returned without calling load_jit (memoized earlier in this process?)")
        rec = cap.seen[-1]
        so = rec.get("so")
        if rec.get("cached"):
            rec["build_dir"], rec["module"] = str(Path(so).parent), Path(so).stem
        out.update(module=rec["module"], build_dir=rec["build_dir"], cached=rec["cached"],
                   so_exists=bool(so) and Path(so).is_file(),
                   status="cached" if rec["cached"] else ("ok" if build else "absent"))
        if build and not out["so_exists"]:
            out["status"], out["error"] = "error", f"no .so after the build: {so}"
    except Exception as e:  # noqa: BLE001  (every failure is reported, none is fatal for the others)
        out.update(status="error", error=f"{type(e).__name__}: {e}"[-2000:])
        if cap.seen and cap.seen[-1].get("build_dir"):
            out.update(module=cap.seen[-1]["module"], build_dir=cap.seen[-1]["build_dir"])
    out["seconds"] = round(time.perf_counter() - t0, 2)
    return out


def _select(names: list[str] | None) -> list[Target]:
    all_t = targets()
    if not names:
        return all_t
    known = {t.name for t in all_t}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"unknown target(s) {unknown}; known: {sorted(known)}")
    return [t for t in all_t if t.name in names]


def _other_dirs(cache_dir: Path, results: list[dict[str, Any]]) -> list[str]:
    tvm = Path(sglang_jit_cache.jit_cache_env(cache_dir)["TVM_FFI_CACHE_DIR"])
    mine = {Path(r["build_dir"]).name for r in results if r.get("build_dir")}
    return sorted(p.name for p in tvm.iterdir() if p.is_dir() and p.name not in mine) if tvm.is_dir() else []


def _worker_env(cache_dir: Path, keep_gpu: bool) -> dict[str, str]:
    env = {**os.environ, **sglang_jit_cache.jit_cache_env(cache_dir), "PYTHONUNBUFFERED": "1"}
    if not keep_gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def build_all(sel: list[Target], cache_dir: Path, jobs: int, keep_gpu: bool, timeout_s: int,
              log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    env = _worker_env(cache_dir, keep_gpu)
    Path(env["TVM_FFI_CACHE_DIR"]).mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()

    def one(t: Target) -> dict[str, Any]:
        t0 = time.perf_counter()
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", t.name, "--cache-dir", str(cache_dir)]
        try:
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
            lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
            r = json.loads(lines[-1]) if lines else {
                "name": t.name, "status": "error", "error": f"worker rc={p.returncode}: {p.stderr[-1500:]}"}
        except subprocess.TimeoutExpired:
            r = {"name": t.name, "status": "timeout", "error": f"worker killed after {timeout_s} s"}
        r["wall_s"] = round(time.perf_counter() - t0, 1)
        r["done_at_s"] = round(time.perf_counter() - t_start, 1)
        r["est_s"] = t.est_s
        return r

    results = []
    with ThreadPoolExecutor(max_workers=max(1, min(jobs, len(sel)))) as ex:
        futs = [ex.submit(one, t) for t in sel]      # submitted in descending est_s: Marlin starts first
        for f in as_completed(futs):
            r = f.result()
            results.append(r)
            log(f"[prebuild +{r['done_at_s']:7.1f} s] {r['name']:<42} {r['status']:<7} {r['wall_s']:7.1f} s"
                + (f"  {r.get('error', '')[:300]}" if r["status"] in ("error", "timeout") else ""))
    order = {t.name: i for i, t in enumerate(sel)}
    return sorted(results, key=lambda r: order[r["name"]])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache-dir", type=Path, required=True, help="the dir given to jit_cache_env (server's too)")
    ap.add_argument("--jobs", type=int, default=16)
    ap.add_argument("--only", nargs="+", metavar="NAME")
    ap.add_argument("--dry-run", action="store_true", help="list targets, module names, cache state; no compile")
    ap.add_argument("--summary", type=Path, help="JSON summary (default: <cache-dir>/prebuild_summary.json)")
    ap.add_argument("--keep-gpu-visible", action="store_true", help="do not set CUDA_VISIBLE_DEVICES='' for workers")
    ap.add_argument("--timeout", type=int, default=WORKER_TIMEOUT_S, help="seconds per module")
    ap.add_argument("--worker", metavar="NAME", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.worker:                                   # one module, in this process (env set by the parent)
        (t,) = _select([args.worker])
        print(json.dumps(run_target(t, build=True)), flush=True)
        return 0

    sel = _select(args.only)
    t0 = time.perf_counter()
    if args.dry_run:
        os.environ.update(sglang_jit_cache.jit_cache_env(args.cache_dir))   # same names as the workers see
        results = [run_target(t, build=False) for t in sel]
        for r in results:
            print(f"{r['name']:<42} {r['status']:<7} {r.get('build_dir') or r.get('error', '')}")
    else:
        print(f"[prebuild] {len(sel)} modules, {args.jobs} jobs, cache {args.cache_dir}, arch sm_90a", flush=True)
        results = build_all(sel, args.cache_dir, args.jobs, args.keep_gpu_visible, args.timeout,
                            log=lambda s: print(s, flush=True))
    bad = [r["name"] for r in results if r["status"] in ("error", "timeout")]
    summary = {
        "what": "SGLang V4 tvm-ffi JIT prebuild" + (" (dry run)" if args.dry_run else ""),
        "cache_dir": str(args.cache_dir.resolve()), "arch": "%d.%da" % ARCH, "jobs": args.jobs,
        "wall_s": round(time.perf_counter() - t0, 1), "failed": bad,
        "serial_sum_s": round(sum(r.get("seconds", 0) for r in results), 1),
        "targets": results, "other_dirs": _other_dirs(args.cache_dir, results),
    }
    out = args.summary or (args.cache_dir / ("prebuild_dryrun.json" if args.dry_run else "prebuild_summary.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2))
    print(f"[prebuild] done in {summary['wall_s']} s (serial sum {summary['serial_sum_s']} s), "
          f"{len(results) - len(bad)}/{len(results)} ok, failed {bad}; other dirs in the cache: "
          f"{len(summary['other_dirs'])}; summary {out}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

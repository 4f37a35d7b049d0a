"""SGLang 0.5.17's own DeepSeek-V4 decoder layer, timed per decode step on one GPU (issue 3 baseline).

What runs: SGLang's in-tree `DeepseekV4ForCausalLM` (srt/models/deepseek_v4.py) with random weights
(`--load-format dummy`), at the released **DeepSeek-V4-Flash** widths (hidden 4096, 256 experts, ...:
the V4 shape nearest to V4.1-Flash), truncated to a few layers of V4-Flash's own alternation of c4
(CSA + indexer) and c128 (HCA) layers. It is driven through SGLang's one-batch benchmark
(`sglang.benchmark.one_batch`, what `python -m sglang.bench_one_batch` runs): its `load_model`
(ModelRunner, memory pool, attention backend, decode CUDA graphs as SGLang captures them), its synthetic
requests and its `extend`/`decode` steps; a decode step is timed like its `latency_test_run_once`
(device sync, wall clock, median over steps). Two differences from the stock CLI, both recorded in the
JSON: each batch gets its own process-local run (one failure does not lose the others), and a batch
whose prompt tokens exceed `--prefill-chunk-tokens` is prefilled in groups of requests that are then
merged (`ScheduleBatch.merge_batch`, as SGLang's scheduler merges running batches) — the stock CLI
prefills the whole batch in one forward, which cannot fit 256 x 8K tokens.

Per-layer time: the model is run at two layer counts (default 2 and 4) in two processes;
per layer = (step(4) - step(2)) / 2 per batch size (the embedding, final mHC head, LM head and sampling
cancel), i.e. the mean of one c4 and one c128 layer. Output: `benchmarks/results/sglang_v4_baseline.json`
(+ `.png`; `--plot-only JSON` redraws it on a machine with matplotlib) with the config, the SGLang
argument lines, the environment switches, versions, per-batch step times and the nearest-shape caveats.
On any failure the JSON says what failed and why, and the exit status is non-zero.

Blocker found by reading 0.5.17 (CPU): on CUDA the V4 mHC Sinkhorn (`hc_split_sinkhorn`) exists only as a
TileLang kernel, and the default V4 paths also call DeepGEMM (wo_a FP8 einsum, indexer logits/metadata,
HC pre-norm GEMM). The project's GPU runtime (shared/gpu/build.sh) carries neither `tilelang` nor
`deep_gemm`: without TileLang this script stops at the preflight (seconds) and names the packages to
add with EXTRA; without DeepGEMM it selects SGLang's own switches for its torch paths (listed in
`sglang_env`) and records that the indexer/wo_a/HC-prenorm numbers are then not SGLang's fast path.

Verified on CPU (tests/test_bench_sglang_v4_baseline.py): the generated config.json parses with SGLang
0.5.17's `ModelConfig` (V4 architecture, widths, ratios, FP8 block quantization, MXFP4 experts, no hash
layers); the argument lines parse with SGLang's own `ServerArgs` + `BenchArgs` parsers; the result
arithmetic. Only the GPU run can show: that this V4 model loads and captures CUDA graphs on an H200 with
the carried kernels, the MoE/FP8 backends SGLang resolves there, memory fit at 256 x 8K, JIT time, and
every number.

JIT caches (2026-11-30, after attempts A/B): `--jit-cache DIR` points every JIT cache of the workers at
DIR (SGLang's tvm-ffi `load_jit` modules, TileLang, DeepGEMM, Triton, inductor, flashinfer, the CUDA PTX
cache: table in benchmarks/sglang_jit_cache.py); `--warmup` runs the same workers only to compile (same
server arguments and batches, 2 decode steps, the smaller layer count: both counts share kernel shapes),
then packs DIR into `$OUT/sglang_jit.tgz.partNN` (<= 4 x 14 MiB) + `sglang_jit.manifest.json` (files and
bytes per cache, stages, seconds, files per cache every 15 s, `warmup.complete`). Kernels are saved as
they are built, so a warm-up killed at its limit keeps them and the next warm-up continues;
`--jit-restore .gpu_jit` stages carried parts (in /tmp/sglang-jit-parts, across calls) and extracts them
once all are there. The timed JSON records the cache's files before/after (growth = JIT inside the run).

    python benchmarks/sglang_v4_baseline.py [--batches 1 8 64 256] [--context 8192] [--layers 2 4] [--out DIR]
        [--parallel-gpus] [--prefill-chunk-tokens N]
        [--jit-cache DIR [--jit-restore .gpu_jit] [--jit-pack DIR]] [--warmup [--warmup-layers 2]]
    python benchmarks/sglang_v4_baseline.py --plot-only benchmarks/results/sglang_v4_baseline.json

What worked (2026-11-30, session 4, runs 13-17 in docs/validation.md; 2x H200 = `nvidia-h200-x2`):
`--parallel-gpus` runs the two layer counts' workers at once, worker k on GPU k, each with its own JIT
cache (DIR/gpu<k>). On a fresh machine the first decode-graph capture (bs 256) JIT-compiled for 511 s
(TileLang + DeepGEMM + tvm-ffi), so a call with all four batches runs out of time; the caches stay on
the warm machine, and the batches then fit short calls (capture 55 s at bs 1, 14 s / 3 s later):
  CPU, once: EXTRA="<EXTRA_FOR_V4>" bash ../shared/gpu/build.sh        (<hash>: `ls .gpu/site`)
  1. run(kind="nvidia-h200-x2", carry=[".gpu/bin", ".gpu/site/extra-<hash>.tar.xz.part00"], timeout_s=120,
         command="bash -c 'source .gpu/bin/setup.sh; echo setup-rc=$?'")       # rc 3: part staged
  2. within 30 s, carry=[".gpu/bin", ".gpu/site/base-<hash>.tar.xz.part00"] (any other work may share this
     call), then every further call within 30 s of the last, carry=[".gpu/bin"], S = `R=$OUT;
     OUT=/tmp/setup-logs; source .gpu/bin/setup.sh >/tmp/s.log || exit 3; OUT=$R;`:
  3. S timeout 580 python3 benchmarks/sglang_v4_baseline.py --parallel-gpus --jit-cache /tmp/sglang_jit
         --time-budget 560 --out $OUT          # compiles; may end in the capture (no numbers)
  4. S ... --parallel-gpus --batches 1 --jit-cache /tmp/sglang_jit --time-budget 430 --out $OUT
  5. S ... --parallel-gpus --batches 8 64 ... ;  6. S ... --parallel-gpus --batches 256 ...
  then on the CPU machine: python benchmarks/sglang_v4_results.py merge benchmarks/results/sglang_v4_baseline.json
  <the JSONs of 4, 5, 6> (refuses other models, contexts or repeated batches). Device time ~21 min in all.
  The single-GPU alternative (warm-up packed to $OUT, carried back as .gpu_jit/, `--jit-restore`) is
  above; it needs more calls because one capture's compile alone is ~8.5 min.
Rebuild without EXTRA afterwards (bash ../shared/gpu/build.sh) so the project's own runs carry 49 MiB.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sglang_jit_cache  # noqa: E402  (standard library only)
from sglang_v4_results import per_layer, plot, timed_runs  # noqa: E402  (standard library only)
from sglang_v4_worker import PAGE, worker  # noqa: E402  (imports SGLang only when a worker runs)

RESULTS = Path(__file__).resolve().parent / "results"
BATCHES, CONTEXT, LAYER_COUNTS, DECODE_STEPS = (1, 8, 64, 256), 8192, (2, 4), 24
#: tokens per prefill extend with DeepGEMM: SGLang 0.5.17's V4 compressor plan (kernels/jit/csrc/deepseek_v4/
#: c_plan.cuh, plan_compress_prefill) requires < 65,536 query tokens per extend (uint16 counts); 65,536 failed
#: there on the H200 (2026-11-30, run 15)
PREFILL_CHUNK_DEEPGEMM = 32768
PACK_RESERVE_S = 40                          # warm-up: seconds kept for packing the cache after the workers
REQUIRED_MODULES = ("torch", "sglang", "sgl_kernel", "tilelang")
EXTRA_FOR_V4 = ("tilelang==0.1.11 sgl-deep-gemm==0.1.5.post1 z3-solver==4.15.4.0 cloudpickle==3.1.3 "
                "ml-dtypes==0.6.0 torch-c-dlpack-ext==0.1.5")

# Released DeepSeek-V4-Flash config.json values (public mirrors; V4-Flash = the V4 model nearest V4.1-Flash).
V4_FLASH: dict[str, Any] = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "torch_dtype": "bfloat16",
    "vocab_size": 129280, "hidden_size": 4096, "num_attention_heads": 64, "num_key_value_heads": 1,
    "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1024, "o_lora_rank": 1024, "o_groups": 8,
    "hidden_act": "silu", "swiglu_limit": 10.0, "rms_norm_eps": 1e-6, "attention_bias": False,
    "attention_dropout": 0.0, "tie_word_embeddings": False, "max_position_embeddings": 1048576,
    "rope_theta": 10000, "compress_rope_theta": 160000,
    "rope_scaling": {"type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                     "original_max_position_embeddings": 65536},
    "n_routed_experts": 256, "num_experts_per_tok": 6, "n_shared_experts": 1, "moe_intermediate_size": 2048,
    "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc", "norm_topk_prob": True,
    "routed_scaling_factor": 1.5, "first_k_dense_replace": 0, "sliding_window": 128,
    "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "num_nextn_predict_layers": 1,
    "bos_token_id": 0, "eos_token_id": 1, "initializer_range": 0.02, "use_cache": True,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
}
LAYER_PATTERN = (4, 128)                     # V4-Flash layers 2..41 alternate c4 / c128


def v4_config_dict(num_layers: int) -> dict[str, Any]:
    """V4-Flash config truncated to `num_layers` layers of the c4/c128 alternation (even count, so both
    kinds appear equally), trailing 0 = the MTP slot as in the release; hash routing off (see caveats)."""
    if num_layers < 2 or num_layers % 2:
        raise ValueError(f"num_layers must be even and >= 2 (c4/c128 pairs), got {num_layers}")
    cfg = json.loads(json.dumps(V4_FLASH))
    cfg.update(num_hidden_layers=num_layers, num_hash_layers=0,
               compress_ratios=list(LAYER_PATTERN) * (num_layers // 2) + [0])
    return cfg


def write_model_dir(out_dir: Path, num_layers: int) -> Path:
    """config.json + the project's tiny byte-level tokenizer (bench_one_batch always loads a tokenizer)."""
    from sglang_dsv41.checkpoint.tokenizer import build_tiny_tokenizer
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(v4_config_dict(num_layers), indent=2))
    build_tiny_tokenizer(out_dir)
    return out_dir


def sglang_env(deep_gemm_available: bool) -> dict[str, str]:
    """Environment switches (SGLang's own, srt/environ.py). Dummy weights take the MXFP4 expert path;
    without DeepGEMM, SGLang's torch indexer logits, BF16 wo_a and torch HC pre-norm are selected.
    With DeepGEMM, its all-M pre-compile is switched off (SGLANG_JIT_DEEPGEMM_PRECOMPILE=0): on a fresh
    GPU machine it JIT-compiles 16,384 M values per GEMM shape (measured 2026-11-30: > 70 s per shape,
    both workers killed at their time limits); without it DeepGEMM compiles the M values the CUDA-graph
    capture and the timed steps use, once, before timing."""
    env = {"SGLANG_DSV4_FP4_EXPERTS": "1", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    if deep_gemm_available:
        env["SGLANG_JIT_DEEPGEMM_PRECOMPILE"] = "0"
    else:
        env.update(SGLANG_FP8_PAGED_MQA_LOGITS_TORCH="1", SGLANG_OPT_FP8_WO_A_GEMM="0",
                   SGLANG_OPT_DEEPGEMM_HC_PRENORM="0", SGLANG_OPT_DSV4_NONPAGED_INDEXER="0")
    return env


def sglang_argv(model_dir: Path, batches: list[int], context: int, steps: int, mem_fraction: float,
                moe_runner: str, run_steps: int | None = None) -> list[str]:
    """ServerArgs + BenchArgs argument line (the one `python -m sglang.bench_one_batch` takes). `run_steps`
    (warm-up) changes only --output-len: the server arguments (context length, pool, graph batch sizes)
    stay those of the timed run with `steps`, so the warm-up compiles the kernels the timed run uses."""
    ctx_len = -(-(context + steps + 8) // PAGE) * PAGE
    return ["--model-path", str(model_dir), "--load-format", "dummy", "--trust-remote-code",
            "--tp-size", "1", "--context-length", str(ctx_len), "--max-total-tokens", str(max(batches) * ctx_len),
            "--max-running-requests", str(max(batches)), "--mem-fraction-static", str(mem_fraction),
            "--swa-full-tokens-ratio", "1.0", "--moe-runner-backend", moe_runner,
            "--sampling-backend", "pytorch", "--cuda-graph-bs-decode", *map(str, batches),
            "--cuda-graph-backend-prefill", "disabled", "--random-seed", "0",
            "--batch-size", *map(str, batches), "--input-len", str(context),
            "--output-len", str((steps if run_steps is None else run_steps) + 1)]


def bench_one_batch_command(argv: list[str]) -> str:
    return "python -m sglang.bench_one_batch " + " ".join(argv)


def nearest_shape_caveats() -> list[str]:
    """What differs between this V4 layer and a V4.1-Flash layer (spec model.md §1.2 vs V4_FLASH)."""
    from sglang_dsv41.presets import flash_config_dict
    t = flash_config_dict()["text_config"]
    act_v4 = 3 * V4_FLASH["hidden_size"] * V4_FLASH["moe_intermediate_size"]
    act_v41 = 3 * t["hidden_size"] * t["moe_intermediate_size"]
    return [
        f"widths: hidden {V4_FLASH['hidden_size']} vs V4.1 {t['hidden_size']}, q_lora {V4_FLASH['q_lora_rank']} vs "
        f"{t['q_lora_rank']}, routed experts {V4_FLASH['n_routed_experts']} vs {t['n_routed_experts']} (top-6 both), "
        f"expert width {V4_FLASH['moe_intermediate_size']} vs {t['moe_intermediate_size']}: one active expert is "
        f"{act_v41 / act_v4:.2f}x the bytes in V4.1; index heads {V4_FLASH['index_n_heads']} vs {t['index_n_heads']}",
        "layer kinds: V4 c4 (one compressed entry per 4 tokens + indexer top-512) and c128 (one per 128, all "
        "attended); V4.1 has ratio-2 and ratio-1 layers, shared KV/index sources, a candidate stage and Engram "
        "layers (none of which V4 has); per-layer time here = mean of one c4 and one c128 layer",
        "hash routing off (num_hash_layers 0; released V4-Flash hash-routes its first 3 layers) so every timed "
        "layer uses the learned router, as every V4.1 layer does",
        "V4 has a per-head query RMSNorm and a same-sublayer mHC pre-mix; V4.1 drops the first and lags the second",
        "KV: SGLang V4 on Hopper keeps the 584-B 'v4' fp8 layout; our runtime keeps BF16 rows today",
        "random weights (--load-format dummy): routing over random router logits, so expert load is roughly "
        "uniform (real checkpoints are skewed)",
        "MoE runner: --moe-runner-backend marlin (MXFP4 W4A16, the Hopper path of anchors.md §2.1); SGLang's "
        "'auto' on SM90 picks its FP8 Triton runner, which does not take MXFP4 expert bytes",
    ]


def preflight(need_gpus: int = 1) -> dict[str, Any]:
    """Which required / optional modules import, CUDA (at least `need_gpus` devices), nvcc; the blockers
    as plain sentences."""
    import shutil
    mods = {m: importlib.util.find_spec(m) is not None for m in (*REQUIRED_MODULES, "deep_gemm", "matplotlib")}
    info: dict[str, Any] = {"modules": mods, "nvcc": shutil.which("nvcc") or (
        "/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None)}
    blockers = [f"module '{m}' is not importable" for m in REQUIRED_MODULES if not mods[m]]
    if not mods["tilelang"]:
        blockers.append("SGLang 0.5.17 runs the V4 mHC Sinkhorn (hc_split_sinkhorn) only as a TileLang kernel on "
                        f"CUDA; add to the GPU runtime: EXTRA=\"{EXTRA_FOR_V4}\" bash ../shared/gpu/build.sh")
    if mods["torch"]:
        import torch
        info["cuda"] = torch.cuda.is_available()      # no context is created here (the workers own the GPU)
        info["gpus"] = torch.cuda.device_count() if info["cuda"] else 0
        if not info["cuda"]:
            blockers.append("no CUDA device")
        elif info["gpus"] < need_gpus:
            blockers.append(f"--parallel-gpus needs {need_gpus} GPUs, {info['gpus']} visible")
    info["blockers"] = blockers
    return info


# ---- parent: preflight, two workers, per-layer arithmetic, JSON + PNG -----------------------------
def _run_worker(layers: int, model_dir: Path, argv: list[str], env: dict[str, str], timeout: float,
                chunk_tokens: int, log: Path) -> dict[str, Any]:
    out = model_dir / "worker.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(out), "--deadline",
           str(time.time() + timeout - 25), "--prefill-chunk-tokens", str(chunk_tokens), "--", *argv]
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=max(timeout, 1))
        except subprocess.TimeoutExpired:
            rc = "timeout"
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(proc.pid, sig)
                    proc.wait(timeout=10)
                    break
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    continue
    rec = json.loads(out.read_text()) if out.exists() else {"runs": [], "errors": []}
    rec.update(layers=layers, returncode=rc, wall_s=time.perf_counter() - t0,
               log_tail=log.read_text(errors="replace")[-4000:] if (rc != 0 or rec.get("errors")) else "")
    return rec


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    ap.add_argument("--context", type=int, default=CONTEXT)
    ap.add_argument("--layers", type=int, nargs=2, default=list(LAYER_COUNTS))
    ap.add_argument("--steps", type=int, default=DECODE_STEPS)
    ap.add_argument("--time-budget", type=float, default=285.0, help="seconds for everything")
    ap.add_argument("--mem-fraction-static", type=float, default=0.5)
    ap.add_argument("--moe-runner-backend", default="marlin")
    ap.add_argument("--prefill-chunk-tokens", type=int, default=0,
                    help=f"0: {PREFILL_CHUNK_DEEPGEMM} with DeepGEMM, else 8192")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--plot-only", type=Path)
    ap.add_argument("--jit-cache", type=Path, help="one directory for every JIT cache of the workers")
    ap.add_argument("--jit-restore", type=Path, nargs="+", default=[],
                    help="folders with carried sglang_jit parts (e.g. .gpu_jit): staged, extracted when complete")
    ap.add_argument("--jit-pack", type=Path, help="after the run, pack --jit-cache here (warm-up: --out)")
    ap.add_argument("--jit-part-mib", type=int, default=sglang_jit_cache.PART_MIB)
    ap.add_argument("--parallel-gpus", action="store_true",
                    help="run the layer counts' workers at once, worker k on GPU k (needs as many GPUs)")
    ap.add_argument("--warmup", action="store_true", help="compile only: no timing; packs the cache")
    ap.add_argument("--warmup-layers", type=int, nargs="+", help="layer counts to warm (default: the smaller)")
    ap.add_argument("--warmup-steps", type=int, default=2, help="decode steps per batch in the warm-up")
    ap.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    args, rest = ap.parse_known_args(argv)
    if args.worker:
        return worker(args.worker, args.deadline, args.prefill_chunk_tokens, [a for a in rest if a != "--"])
    if args.plot_only:
        return plot(json.loads(args.plot_only.read_text()), args.plot_only.with_suffix(".png"))
    t_start = time.perf_counter()
    pre = preflight(len(args.layers) if args.parallel_gpus and not args.warmup else 1)
    env = sglang_env(pre["modules"]["deep_gemm"])
    chunk = args.prefill_chunk_tokens or (PREFILL_CHUNK_DEEPGEMM if pre["modules"]["deep_gemm"] else 8192)
    if args.warmup and not args.jit_cache:
        ap.error("--warmup needs --jit-cache DIR")
    jit: dict[str, Any] = {}
    if args.jit_cache:
        env.update(sglang_jit_cache.jit_cache_env(args.jit_cache), BENCH_JIT_CACHE_DIR=str(args.jit_cache.resolve()))
        if args.jit_restore:
            jit["restore"] = sglang_jit_cache.restore(args.jit_cache, args.jit_restore)
        jit["before"] = sglang_jit_cache.inventory(args.jit_cache)
        print(f"JIT cache {args.jit_cache}: {jit.get('restore', 'no restore')}; {jit['before']['files']} files",
              flush=True)
    if args.warmup:
        return warmup(args, pre, env, chunk, jit, t_start)
    result: dict[str, Any] = dict(
        what="SGLang 0.5.17 DeepseekV4ForCausalLM (V4-Flash widths, dummy weights) per-layer decode step",
        python=platform.python_version(), preflight=pre, env=env, batches=args.batches, context=args.context,
        layer_counts=args.layers, decode_steps=args.steps, prefill_chunk_tokens=chunk,
        configs={n: v4_config_dict(n) for n in args.layers}, caveats=nearest_shape_caveats(), jit=jit,
        timing="one_batch method: torch.cuda.synchronize + perf_counter per decode step (CUDA graph replay "
               "+ host prepare), median of the steps", workers=[], per_layer=[], errors=[])
    args.out.mkdir(parents=True, exist_ok=True)
    json_path = args.out / "sglang_v4_baseline.json"
    if pre["blockers"]:
        result["errors"] = [f"preflight: {b}" for b in pre["blockers"]]
        json_path.write_text(json.dumps(result, indent=2))
        print(f"blocked: {result['errors']}; wrote {json_path}")
        return 2
    with tempfile.TemporaryDirectory(prefix="sglang_v4_") as tmp:
        steps_by: dict[int, dict[int, dict]] = {}
        jobs = []
        for k, layers in enumerate(args.layers):
            model_dir = write_model_dir(Path(tmp) / f"v4_{layers}l", layers)
            sargv = sglang_argv(model_dir, args.batches, args.context, args.steps, args.mem_fraction_static,
                                args.moe_runner_backend)
            jobs.append((k, layers, model_dir, sargv))
        if args.parallel_gpus:
            recs = _run_workers_on_gpus(jobs, env, args, t_start, chunk)
            result["parallel_gpus"] = ("each layer count's worker on its own GPU at the same time "
                                       "(CUDA_VISIBLE_DEVICES = its index), each with its own JIT cache")
        for k, layers, model_dir, sargv in jobs:
            if args.parallel_gpus:
                rec, timeout = recs[k], recs[k]["timeout_s"]
            else:
                left = args.time_budget - (time.perf_counter() - t_start)
                timeout = left * (0.55 if k == 0 else 1.0) - 5
                print(f"{layers} layers: worker with {timeout:.0f} s", flush=True)
                rec = _run_worker(layers, model_dir, sargv, env, timeout, chunk,
                                  args.out / f"sglang_v4_baseline.{layers}l.log")
            rec["bench_one_batch_equivalent"] = bench_one_batch_command(sargv)
            result["workers"].append(rec)
            steps_by[layers] = timed_runs(rec)
            result["errors"] += [f"{layers} layers, {e['stage']}: {e['error']}" for e in rec["errors"]]
            if rec["returncode"] == "timeout":
                result["errors"].append(f"{layers} layers: worker killed at its {timeout:.0f} s limit")
            elif rec["returncode"] != 0 and not rec["errors"]:
                result["errors"].append(f"{layers} layers: worker exit {rec['returncode']} (see its log_tail)")
            for r in rec["runs"]:
                print(f"  bs {r['batch']:4d} ctx {r['context']}: step {r['step_median_us']:.0f} us", flush=True)
            json_path.write_text(json.dumps(result, indent=2))
    result["per_layer"] = per_layer(steps_by, args.layers, args.batches)
    result["errors"] += [f"per-layer, batch {r['batch']}: {r['error']}" for r in result["per_layer"] if "error" in r]
    if args.jit_cache:        # new files here mean the warm-up missed kernels (their JIT ran in this run)
        jit["after"] = sglang_jit_cache.inventory(args.jit_cache)
        if args.parallel_gpus:
            jit["after_per_gpu"] = {d.name: sglang_jit_cache.inventory(d) for d in sorted(args.jit_cache.glob("gpu*"))}
        if args.jit_pack:
            jit["pack"] = _pack(args.jit_cache, args.jit_pack, {}, args.jit_part_mib)
    result["wall_s"] = time.perf_counter() - t_start
    if pre["modules"]["matplotlib"]:
        plot(result, args.out / "sglang_v4_baseline.png")
    else:
        result["png"] = "not written: matplotlib missing here; run --plot-only on the JSON elsewhere"
    json_path.write_text(json.dumps(result, indent=2))
    print(f"wrote {json_path} ({result['wall_s']:.0f} s); per layer: "
          + ", ".join(f"bs {r['batch']}: {r['per_layer_us']:.0f} us" if "per_layer_us" in r
                      else f"bs {r['batch']}: {r['error']}" for r in result["per_layer"])
          + f"; errors: {result['errors'] or 'none'}")
    return 1 if result["errors"] else 0


def worker_env(env: dict[str, str], gpu: int, jit_cache: Path | None) -> dict[str, str]:
    """The environment of a worker pinned to GPU `gpu`: its own JIT cache under `jit_cache/gpu<k>` so two
    workers compiling at once never write the same cache entry."""
    env = {**env, "CUDA_VISIBLE_DEVICES": str(gpu)}
    if jit_cache is not None:
        own = jit_cache / f"gpu{gpu}"
        env.update(sglang_jit_cache.jit_cache_env(own), BENCH_JIT_CACHE_DIR=str(own.resolve()))
    return env


def _run_workers_on_gpus(jobs: list[tuple[int, int, Path, list[str]]], env: dict[str, str],
                         args: argparse.Namespace, t_start: float, chunk: int) -> dict[int, dict[str, Any]]:
    """--parallel-gpus: every layer count's worker at once, worker k on GPU k, each with the whole
    remaining budget (the JIT compile, the longest part on a fresh machine, then runs on both GPUs in
    parallel instead of one after the other)."""
    import concurrent.futures as cf
    left = args.time_budget - (time.perf_counter() - t_start) - 5
    print(f"layers {[j[1] for j in jobs]}: workers on GPUs {[j[0] for j in jobs]} with {left:.0f} s each",
          flush=True)
    with cf.ThreadPoolExecutor(len(jobs)) as pool:
        futs = {k: pool.submit(_run_worker, layers, model_dir, sargv, worker_env(env, k, args.jit_cache), left,
                               chunk, args.out / f"sglang_v4_baseline.{layers}l.log")
                for k, layers, model_dir, sargv in jobs}
        return {k: {**f.result(), "timeout_s": left} for k, f in futs.items()}


def _pack(cache_dir: Path, out: Path, extra: dict[str, Any], part_mib: int) -> dict[str, Any]:
    try:
        m = sglang_jit_cache.pack(cache_dir, out, extra, part_mib=part_mib)
        return {k: m[k] for k in ("id", "files", "bytes", "packed_bytes", "pack_s")} | {"parts": len(m["parts"])}
    except RuntimeError as exc:
        return {"error": str(exc)}


def warmup(args: argparse.Namespace, pre: dict[str, Any], env: dict[str, str], chunk: int, jit: dict[str, Any],
           t_start: float) -> int:
    """Compile only: the timed run's workers (same server arguments, batches, prefill groups) with
    `--warmup-steps` decode steps, at the smaller layer count unless --warmup-layers says otherwise (both
    counts have the same kernel shapes). Each JIT system saves a kernel as soon as it is built, so a worker
    killed at its limit still leaves them; the cache is packed (`sglang_jit.*` in --jit-pack or --out)
    with a manifest of stages: `warmup.complete` is true when every stage finished."""
    out = args.jit_pack or args.out
    out.mkdir(parents=True, exist_ok=True)
    layer_counts, stages = args.warmup_layers or [min(args.layers)], []
    if pre["blockers"]:
        stages.append({"stage": "preflight", "finished": False, "errors": pre["blockers"]})
    with tempfile.TemporaryDirectory(prefix="sglang_v4_warm_") as tmp:
        for layers in layer_counts if not pre["blockers"] else []:
            left = args.time_budget - (time.perf_counter() - t_start) - PACK_RESERVE_S
            if left < 60:
                stages.append({"stage": f"{layers} layers", "finished": False, "errors": ["skipped: out of time"]})
                continue
            model_dir = write_model_dir(Path(tmp) / f"v4_{layers}l", layers)
            sargv = sglang_argv(model_dir, args.batches, args.context, args.steps, args.mem_fraction_static,
                                args.moe_runner_backend, run_steps=args.warmup_steps)
            print(f"warm-up, {layers} layers: worker with {left:.0f} s", flush=True)
            rec = _run_worker(layers, model_dir, sargv, env, left, chunk, out / f"sglang_v4_warmup.{layers}l.log")
            stages.append({"stage": f"{layers} layers: load + decode capture bs {args.batches}, prefill + "
                                    f"{args.warmup_steps} steps per batch", "layers": layers,
                           "finished": rec["returncode"] == 0 and not rec["errors"], "returncode": rec["returncode"],
                           "wall_s": rec["wall_s"], "load_s": rec.get("load_s"),
                           "batches_done": [{k: r[k] for k in ("batch", "prefill_s", "step_median_us")}
                                            for r in rec["runs"]],
                           "errors": rec["errors"], "jit_progress": rec.get("jit_progress", []),
                           "log_tail": rec["log_tail"][-1500:]})
            print(f"  finished: {stages[-1]['finished']} ({rec['wall_s']:.0f} s)", flush=True)
    report = {"warmup": {"complete": bool(stages) and all(s["finished"] for s in stages), "stages": stages,
                         "layer_counts": layer_counts, "batches": args.batches, "context": args.context,
                         "env": env, "restore": jit.get("restore"), "before": jit.get("before"),
                         "wall_s": time.perf_counter() - t_start}}
    packed = _pack(args.jit_cache, out, report, args.jit_part_mib)
    if "error" in packed:
        (out / sglang_jit_cache.MANIFEST).write_text(json.dumps({**report, "pack_error": packed["error"]}, indent=2))
    print(f"warm-up complete: {report['warmup']['complete']}; pack: {packed}", flush=True)
    return 0 if report["warmup"]["complete"] and "error" not in packed else 1


if __name__ == "__main__":
    sys.exit(main())

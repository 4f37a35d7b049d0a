"""The worker process of benchmarks/sglang_v4_baseline.py: one SGLang 0.5.17 model (one layer count) loaded
through SGLang's one-batch benchmark (`sglang.benchmark.one_batch`: ModelRunner, memory pool, attention
backend, decode CUDA graphs as SGLang captures them), then per batch: prefill of synthetic requests in
groups of <= chunk tokens merged like the scheduler merges running batches, and timed decode steps
(`one_batch.latency_test_run_once`'s method: device sync, wall clock, median). Its record (JSON at `out`)
is rewritten after every stage and every 15 s (JIT progress), so a worker killed at its limit still
leaves what it measured. Started by the parent as `sglang_v4_baseline.py --worker OUT --deadline T -- ARGV`.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import sglang_jit_cache

PAGE = 256                                   # SGLang's V4 page size (arg_groups/overrides.py)


def _time_batch(ob, runner, bs: int, context: int, steps: int, chunk_tokens: int) -> dict[str, Any]:
    """Prefill `bs` synthetic requests of `context` tokens (groups of <= chunk_tokens, merged), then
    time `steps` decode steps like one_batch.latency_test_run_once (sync, perf_counter, median)."""
    import torch
    runner.clear()
    reqs = ob.prepare_synthetic_inputs_for_latency_test(bs, context)
    group = max(1, chunk_tokens // context)
    runner.synchronize()
    tic = time.perf_counter()
    ids, batch = [], None
    for i in range(0, bs, group):
        next_ids, _, part = runner.extend(reqs[i:i + group])
        ids.append(next_ids)
        if batch is None:
            batch = part
        else:
            batch.merge_batch(part)
    runner.synchronize()
    prefill_s = time.perf_counter() - tic
    next_ids = torch.cat(ids) if len(ids) > 1 else ids[0]
    lat = []
    for _ in range(steps):
        runner.synchronize()
        tic = time.perf_counter()
        next_ids, _ = runner.decode(next_ids, batch)
        runner.synchronize()
        lat.append(time.perf_counter() - tic)
    try:                       # after the timing: one eager step that records the routing
        routed = routed_experts_of_one_step(runner.torch_runner, lambda: runner.decode(next_ids, batch))
    except Exception as exc:   # the count is context, not the measurement: recorded, never fatal
        routed = {"error": f"{type(exc).__name__}: {exc}"[:400]}
    runner.cleanup(batch)
    q = statistics.quantiles(lat, n=10) if len(lat) >= 2 else lat * 9
    return dict(batch=bs, context=context, prefill_groups=-(-bs // group), prefill_s=prefill_s,
                step_median_us=statistics.median(lat) * 1e6, step_p10_us=q[0] * 1e6, step_p90_us=q[-1] * 1e6,
                steps_us=[x * 1e6 for x in lat], routed_experts=routed)


def routed_experts_of_one_step(model_runner, step, topk_cls=None) -> dict[str, Any]:
    """Distinct routed experts per MoE layer in one decode step, run eagerly: the decode CUDA graph
    runner is set aside for that step (a replay would not call the modules), every `TopK` module's
    output is read through a forward hook (`topk_ids`, the standard output format), then both are
    restored. Why: with dummy weights the router may send a batch to few experts, and how many
    experts a step reads sets its weight bytes (docs/performance.md, side-by-side caveats)."""
    if topk_cls is None:
        from sglang.srt.layers.moe.topk import TopK as topk_cls
    seen: list[int] = []
    formats: set[str] = set()

    def hook(_module, _inputs, output) -> None:
        ids = getattr(output, "topk_ids", None)
        if ids is None:
            formats.add(type(output).__name__)
            return
        seen.append(int(ids[ids >= 0].unique().numel()))
    handles = [m.register_forward_hook(hook) for m in model_runner.model.modules() if isinstance(m, topk_cls)]
    graph_runner = model_runner.decode_cuda_graph_runner
    model_runner.decode_cuda_graph_runner = None
    try:
        step()
    finally:
        model_runner.decode_cuda_graph_runner = graph_runner
        for h in handles:
            h.remove()
    out: dict[str, Any] = {"per_layer": seen, "topk_modules": len(handles)}
    if formats:
        out["unread_output_formats"] = sorted(formats)
    return out


def worker(out: Path, deadline: float, chunk_tokens: int, argv: list[str]) -> int:
    import torch
    import sglang
    from sglang.benchmark import one_batch as ob
    from sglang.srt.model_executor.cuda_graph_config import Phase
    from sglang.srt.server_args import PortArgs, ServerArgs
    rec: dict[str, Any] = {"argv": argv, "runs": [], "errors": [], "jit_progress": []}
    lock = threading.Lock()

    def save() -> None:
        with lock:
            out.write_text(json.dumps(rec, indent=2))
    t0 = time.perf_counter()
    cache_dir = os.environ.get("BENCH_JIT_CACHE_DIR")

    def watch_jit() -> None:                 # files per JIT cache every 15 s: progress survives a kill
        while cache_dir:
            inv = sglang_jit_cache.inventory(Path(cache_dir))
            with lock:
                rec["jit_progress"].append({"t_s": round(time.perf_counter() - t0, 1),
                                            **{k: v["files"] for k, v in inv["by_cache"].items() if v["files"]}})
            save()
            time.sleep(15)
    threading.Thread(target=watch_jit, daemon=True).start()
    try:
        parser = argparse.ArgumentParser()
        ServerArgs.add_cli_args(parser)
        ob.BenchArgs.add_cli_args(parser)
        args = parser.parse_args(argv)
        server_args, bench = ServerArgs.from_cli_args(args), ob.BenchArgs.from_cli_args(args)
        if server_args.cuda_graph_config is not None:     # as one_batch.main does
            server_args.cuda_graph_config[Phase.DECODE].max_bs = max(bench.batch_size)
        ob._set_envs_and_config(server_args)
        ob.initialize_moe_config(server_args)
        ob.initialize_fp8_gemm_config(server_args)
        ob.initialize_fp4_gemm_config(server_args)
        ob.configure_logger(server_args, prefix=" TP0")
        runner, _ = ob.load_model(server_args, PortArgs.init_new(server_args), 0, 0)
    except Exception as exc:
        rec["errors"].append({"stage": "server_args/load_model", "error": f"{type(exc).__name__}: {exc}",
                              "traceback": traceback.format_exc()[-3000:]})
        save()
        return 1
    from sglang.srt.layers import deep_gemm_wrapper
    rec.update(load_s=time.perf_counter() - t0, sglang=sglang.__version__, torch=torch.__version__,
               device=torch.cuda.get_device_name(0), deepgemm_enabled=deep_gemm_wrapper.ENABLE_JIT_DEEPGEMM,
               max_total_num_tokens=runner.torch_runner.max_total_num_tokens,
               resolved={k: str(getattr(server_args, k, None)) for k in (
                   "attention_backend", "moe_runner_backend", "fp8_gemm_runner_backend", "kv_cache_dtype",
                   "page_size", "cuda_graph_config", "max_running_requests", "swa_full_tokens_ratio")})
    save()
    plan = [("warmup", 1, PAGE, 4)] + [(f"batch {bs}", bs, bench.input_len[0], bench.output_len[0] - 1)
                                       for bs in bench.batch_size]
    for stage, bs, context, steps in plan:
        if time.time() > deadline:
            rec["errors"].append({"stage": stage, "error": "skipped: out of time"})
            continue
        try:
            r = _time_batch(ob, runner, bs, context, steps, chunk_tokens)
            rec["runs"].append({**r, "warmup": stage == "warmup"})
        except Exception as exc:
            rec["errors"].append({"stage": stage, "error": f"{type(exc).__name__}: {exc}",
                                  "traceback": traceback.format_exc()[-3000:]})
            torch.cuda.empty_cache()
        save()
    return 1 if rec["errors"] else 0

"""Routed-expert MoE at Flash widths on one H200: our MXFP4 path against the MXFP4 MoE kernels
SGLang 0.5.17 ships (issue 21, deliver 1 "routed experts"; spec `hopper-kernels.md` §1(d), §4.2).

Candidates, all W4A16 on the same random checkpoint-format layer (384 experts, top-6, hidden 5120,
intermediate 2304, `benchmarks/moe_mxfp4.random_layer`) and the same routing:

* **mxfp4** — ours, `kernels/moe_mxfp4.routed_experts_mxfp4` (`triton_kernels.matmul_ogs`);
* **marlin** — `fused_marlin_moe(clamp_limit=10)` after `prepare_moe_mxfp4_layer_for_marlin`
  (SGLang 0.5.17's `--moe-runner-backend marlin` for DeepSeek-V4 FP4 experts on SM90);
* **flashinfer_cutlass** — `flashinfer.fused_moe.cutlass_fused_moe(use_w4_group_scaling=True)`
  (upstream 0.5.23's SM90 choice). Its SM90 module is nvcc-JIT-built at first use (> 1 h on a lent
  machine, `docs/performance.md`), so it runs only when the module is already built (AOT package
  or JIT cache present); the JSON records which, or why not. JIT building is disabled here
  (`FLASHINFER_DISABLE_JIT=1`), so a missing module is an error entry, never an hour-long build;
* **bf16** (only with `--with-bf16`) — the same `matmul_ogs` calls on BF16-dequantised weights.

Per token count N (default 1, 8, 64, 256, 4096; uniform random routing, so N ≥ 256 touches all
384 experts) and candidate: median µs per call (`triton.testing.do_bench`, L2 flushed), eager and
as a replayed CUDA graph; the expert bytes touched (distinct experts × stored bytes per expert:
E2M1 + UE8M0 of w1, w3, w2 = 18.8 MB; BF16 for bf16); the roofline time = bytes / 4.8 TB/s (H200
HBM3e peak, `--hbm-tbs`) and `roofline_ratio` = roofline time / measured time (1.0 = at peak), also
against the copy bandwidth measured in the same run. Accuracy: every candidate's output at N = 8
against `reference.moe` (codec-dequantised weights) under `moe_mxfp4.routed_error_bound`, recorded,
never asserted (so one candidate's failure cannot hide the others' timings).

Robustness: every candidate's build, check and each timing is in its own try/except; an error is
recorded in the JSON (type, message, short traceback) and the run goes on. A `--budget-s` stops
timing new rows when the budget is spent (skipped rows are listed). Writes `moe.json` and
`moe.png` under `--out`.

    python benchmarks/moe.py [--tokens 1 8 64 256 4096] [--out DIR] [--budget-s 360] [--with-bf16]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

os.environ.setdefault("FLASHINFER_DISABLE_JIT", "1")       # never start FlashInfer's hour-long nvcc build

import torch  # noqa: E402

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
from plotting import pyplot, save_png  # noqa: E402

TOKENS = (1, 8, 64, 256, 4096)
HBM_TBS = 4.8                       # H200 HBM3e peak, TB/s
CHECK_TOKENS = 8


def error_entry(exc: BaseException) -> dict:
    return dict(error=f"{type(exc).__name__}: {exc}"[:2000], traceback=traceback.format_exc(limit=6)[-3000:])


def flashinfer_status() -> dict:
    """Whether FlashInfer's SM90 CUTLASS fused-MoE module is importable and already built."""
    try:
        import flashinfer
        from flashinfer.jit.fused_moe import gen_cutlass_fused_moe_sm90_module
        spec = gen_cutlass_fused_moe_sm90_module()
        return dict(version=flashinfer.__version__, module=spec.name, aot=bool(spec.is_aot),
                    compiled=bool(spec.is_compiled), library=str(spec.get_library_path()))
    except Exception as exc:
        return error_entry(exc)


def roofline(entry: dict, nbytes: int, hbm_tbs: float, copy_gbs: float | None) -> dict:
    """Adds expert bytes, the roofline time at `hbm_tbs` and measured/roofline ratios."""
    ideal_us = nbytes / (hbm_tbs * 1e12) * 1e6
    entry |= dict(expert_bytes=nbytes, roofline_us=ideal_us)
    for mode in ("eager", "graph"):
        us = entry.get(f"{mode}_us")
        if us:
            entry[f"{mode}_roofline_ratio"] = ideal_us / us
            if copy_gbs:
                entry[f"{mode}_fraction_of_copy_bw"] = nbytes / (us * 1e-6) / 1e9 / copy_gbs
    return entry


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", HERE / "results")))
    p.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    p.add_argument("--candidates", nargs="+", default=["mxfp4", "marlin", "flashinfer_cutlass"],
                   choices=["mxfp4", "marlin", "flashinfer_cutlass", "bf16"])
    p.add_argument("--with-bf16", action="store_true", help="add the BF16-dequantised path (27 GB of copies)")
    p.add_argument("--hbm-tbs", type=float, default=HBM_TBS)
    p.add_argument("--budget-s", type=float, default=360.0,
                   help="stop timing new (N, candidate) pairs past this many seconds from the start")
    return p.parse_args(argv)


def build_candidates(names: list[str], raw: dict, mm, device: torch.device) -> tuple[dict, dict]:
    """({name: fn(x, ids, w)}, {name: info}) — a candidate that fails to build has only info.error."""
    fns: dict[str, Callable] = {}
    info: dict[str, dict] = {}
    builders = {"marlin": mm.marlin_path, "flashinfer_cutlass": mm.flashinfer_cutlass_path, "bf16": mm.bf16_baseline}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for name in names:
        try:
            sync()
            t0 = time.perf_counter()
            if name == "mxfp4":
                from sglang_dsv41.kernels import moe_mxfp4 as mx
                experts = mx.prepare_mxfp4_stacked(raw["w1"], raw["w1_scale"], raw["w3"], raw["w3_scale"],
                                                   raw["w2"], raw["w2_scale"], device=device)
                fns[name] = lambda x, ids, w, _e=experts: mx.routed_experts_mxfp4(
                    x, ids, w, _e, swiglu_limit=mm.LIMIT, routed_scale=mm.SCALE)
                per_expert = experts.checkpoint_bytes_per_expert()
            else:
                if name == "flashinfer_cutlass":
                    status = flashinfer_status()
                    info[name] = dict(status=status)
                    if not (status.get("aot") or status.get("compiled")):
                        raise RuntimeError("FlashInfer's SM90 CUTLASS MoE module is not built on this machine "
                                           f"(no AOT package, no JIT cache): {status}")
                fns[name] = builders[name](raw)
                per_expert = 2 * 3 * mm.INTER * mm.HIDDEN if name == "bf16" else None
            sync()
            info.setdefault(name, {})["prepare_s"] = time.perf_counter() - t0
            info[name]["bytes_per_expert"] = per_expert
        except Exception as exc:
            info.setdefault(name, {}).update(error_entry(exc))
            fns.pop(name, None)
        print(f"build {name}: {info[name].get('error', 'ok')}", flush=True)
    mx_bytes = info.get("mxfp4", {}).get("bytes_per_expert") or mm_mxfp4_bytes(mm)
    for name in fns:
        if info[name].get("bytes_per_expert") is None:
            info[name]["bytes_per_expert"] = mx_bytes
    return fns, info


def mm_mxfp4_bytes(mm) -> int:
    """Stored MXFP4 bytes per expert: E2M1 nibbles + one UE8M0 byte per 32 weights, w1 + w3 + w2."""
    n = 3 * mm.INTER * mm.HIDDEN
    return n // 2 + n // 32


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    t_start = time.perf_counter()
    result: dict = dict(python=platform.python_version(), torch=torch.__version__, hbm_tbs=args.hbm_tbs,
                        timing="triton.testing.do_bench median, L2 flushed per call; eager and CUDA-graph replay",
                        roofline="expert bytes touched (distinct experts x stored bytes per expert) / HBM peak; "
                                 "roofline_ratio = roofline_us / measured_us (1.0 = at peak)")
    args.out.mkdir(parents=True, exist_ok=True)
    out_json = args.out / "moe.json"

    def save() -> None:
        out_json.write_text(json.dumps(result, indent=2))

    if not torch.cuda.is_available():
        result["error"] = "benchmarks/moe.py needs a CUDA GPU"
        save()
        raise SystemExit(result["error"])
    import triton
    import moe_mxfp4 as mm
    from device_bandwidth import copy_bandwidth_gbs

    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    result |= dict(device=props.name, sm_count=props.multi_processor_count, triton=triton.__version__,
                   shape=dict(experts=mm.EXPERTS, top_k=mm.TOP_K, hidden=mm.HIDDEN, intermediate=mm.INTER,
                              swiglu_limit=mm.LIMIT, routed_scale=mm.SCALE, routing="uniform random"),
                   flashinfer=flashinfer_status())
    names = list(dict.fromkeys(args.candidates + (["bf16"] if args.with_bf16 else [])))
    raw = mm.random_layer(device, seed=0)
    fns, info = build_candidates(names, raw, mm, device)
    result["candidates"] = info
    save()

    # accuracy at N = 8 against reference.moe (recorded, not asserted)
    try:
        g = torch.Generator(device=device).manual_seed(1)
        x_chk = torch.randn(CHECK_TOKENS, mm.HIDDEN, generator=g, device=device).to(torch.bfloat16)
        ids_chk, w_chk = mm.routing(CHECK_TOKENS, device, seed=2)
        ref = mm.reference(x_chk, ids_chk, w_chk, raw)
        for name, fn in fns.items():
            try:
                info[name]["check"] = mm.accuracy(fn(x_chk, ids_chk, w_chk), ref)
            except Exception as exc:
                info[name]["check"] = error_entry(exc)
            print(f"check {name}: {info[name]['check']}", flush=True)
    except Exception as exc:
        result["check_error"] = error_entry(exc)
    save()

    try:
        copy_gbs = copy_bandwidth_gbs(device)
    except Exception as exc:
        copy_gbs, result["copy_bandwidth_error"] = None, error_entry(exc)
    result["copy_bandwidth_gbs"] = copy_gbs
    rows, skipped = [], []
    g = torch.Generator(device=device).manual_seed(3)
    for T in args.tokens:
        row: dict = dict(tokens=T)
        try:
            x = torch.randn(T, mm.HIDDEN, generator=g, device=device).to(torch.bfloat16)
            ids, w = mm.routing(T, device, seed=100 + T)
            row["distinct_experts"] = distinct = int(torch.unique(ids).numel())
        except Exception as exc:
            rows.append(row | error_entry(exc))
            continue
        for name, fn in fns.items():
            if time.perf_counter() - t_start > args.budget_s:
                skipped.append(f"{name}@{T}")
                continue
            try:
                row[name] = roofline(mm.time_call(lambda: fn(x, ids, w)), distinct * info[name]["bytes_per_expert"],
                                     args.hbm_tbs, copy_gbs)
            except Exception as exc:
                row[name] = error_entry(exc)
            r = row[name]
            print(f"N={T:5d} experts {distinct:3d} {name:18s} " + (
                f"{r.get('eager_us', float('nan')):9.1f} us eager {r.get('graph_us', float('nan')):9.1f} us graph "
                f"roofline {r['roofline_us']:8.1f} us ({r.get('graph_roofline_ratio', r.get('eager_roofline_ratio', 0)):.0%}"
                f" of {args.hbm_tbs} TB/s; {r.get('graph_fraction_of_copy_bw', float('nan')):.0%} of copy bandwidth)"
                if "error" not in r else f"ERROR {r['error'][:200]}"), flush=True)
        rows.append(row)
        result["rows"], result["skipped"] = rows, skipped
        save()
    result |= dict(rows=rows, skipped=skipped, wall_s=time.perf_counter() - t_start)
    save()
    try:
        plot(result, args.out / "moe.png", list(fns))
    except Exception as exc:
        result["plot_error"] = error_entry(exc)
        save()
    print(f"wrote {out_json} in {result['wall_s']:.0f} s", flush=True)


def plot(result: dict, path: Path, names: list[str]) -> None:
    plt = pyplot(required=True)

    rows = result["rows"]
    fig, (ax_t, ax_r) = plt.subplots(1, 2, figsize=(11, 4))
    for name in names:
        for mode, style in (("graph", "o-"), ("eager", "x:")):
            pts = [(r["tokens"], r[name][f"{mode}_us"], r[name][f"{mode}_roofline_ratio"]) for r in rows
                   if isinstance(r.get(name), dict) and f"{mode}_us" in r[name]]
            if pts:
                ax_t.plot([p[0] for p in pts], [p[1] for p in pts], style, label=f"{name} ({mode})")
                ax_r.plot([p[0] for p in pts], [p[2] for p in pts], style, label=f"{name} ({mode})")
    roof = [(r["tokens"], r[n]["roofline_us"]) for r in rows for n in names[:1] if isinstance(r.get(n), dict)
            and "roofline_us" in r[n]]
    if roof:
        ax_t.plot([p[0] for p in roof], [p[1] for p in roof], "k--", label=f"roofline {result['hbm_tbs']} TB/s")
    ax_t.set(xscale="log", yscale="log", xlabel="tokens N", ylabel="µs per call",
             title=f"{result.get('device', '?')}: routed experts, Flash widths")
    ax_r.set(xscale="log", xlabel="tokens N", ylabel="roofline time / measured", ylim=(0, 1.05),
             title="fraction of the HBM roofline (expert bytes)")
    for ax in (ax_t, ax_r):
        ax.legend(fontsize=7)
    save_png(fig, path, dpi=120)


if __name__ == "__main__":
    main()

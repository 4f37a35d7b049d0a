"""Benchmark of `sglang_dsv41.kernels.moe_mxfp4` (routed MXFP4 experts, W4A16) at the Flash shape
(384 experts, top-6, hidden 5120, intermediate 2304; one MoE layer of random weights). CUDA, Hopper.

For T ∈ {1, 8, 64, 256} tokens (uniform random routing: the most distinct experts per call) it

1. checks `routed_experts_mxfp4` once (T = 8, every touched expert decoded on the CPU with
   `codecs.dequantize_mxfp4`) against `reference.moe` (`routed_expert` per slot + the sublayer's
   finalize): per element |Δ| ≤ ulp(ref) + 1.5·Σ_j w_j·ulp(E_j) and ≤ 2 % of outputs differing
   (`mx.routed_error_bound`, derived there; the bound of `tests/test_kernels_moe_mxfp4.py`); a
   failure aborts before any timing. Also recorded: run-to-run
   determinism and batch invariance (a token's output alone, in 8, in 64 tokens). The two
   comparison paths below get the same accuracy check, reported (not asserted);
2. times one call (`triton.testing.do_bench` median, L2 flushed before every call), eagerly and
   as a replayed CUDA graph (launch overhead removed; the routing plan is part of the call);
3. counts the expert bytes a call must read: distinct experts × (packed E2M1 + UE8M0 scales of
   w1, w3, w2) = 18.8 MB per expert, and reports GB/s against the device copy bandwidth measured
   here (`dst.copy_(src)` of 2 GiB, read + write);
4. does the same for two comparison paths with the same routing: **bf16** — the experts
   dequantised to BF16 (4× the bytes) through the same `matmul_ogs` calls, epilogue and combine;
   **marlin** — SGLang 0.5.17's DeepSeek-V4 Hopper FP4 path (`prepare_moe_mxfp4_layer_for_marlin`
   + `fused_marlin_moe(clamp_limit=10)`, router weights pre-multiplied by 1.5);
   **flashinfer_cutlass** — what upstream picks on SM90: FlashInfer's CUTLASS W4A16
   `cutlass_fused_moe(use_w4_group_scaling=True, swiglu_limit=10)` on the checkpoint bytes repacked
   as SGLang 0.5.17 does (w13 = [w3; w1] halves, `interleave_moe_weights_for_sm90_mixed_gemm` +
   `interleave_moe_scales_for_sm90_mixed_gemm`). Its module is nvcc-JIT-built on first use, so
   it runs only with `--flashinfer-ready MARKER` (a file that `scripts/gpu/flashinfer_moe_jit.py`
   writes once the build finished); otherwise it is reported as not built. A comparison path
   that fails to build or run is reported with its error in the JSON. `prepare_s`: wall seconds
   each path's load-time conversion (repack) of the 384-expert layer took.

Writes `benchmarks/results/moe_mxfp4.json` and `moe_mxfp4.png`.

    python benchmarks/moe_mxfp4.py [--tokens 1 8 64 256] [--skip-bf16] [--flashinfer-ready MARKER]
        [--out benchmarks/results]
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import torch
import triton
import triton.testing

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
from device_bandwidth import copy_bandwidth_gbs  # noqa: E402
from triton_kernels.matmul_ogs import PrecisionConfig, matmul_ogs

from sglang_dsv41.checkpoint.codecs import E2M1_VALUES, dequantize_mxfp4, ue8m0_to_float
from sglang_dsv41.kernels import moe_mxfp4 as mx
from sglang_dsv41.reference.moe import routed_expert
from sglang_dsv41.reference.ops import bf16

EXPERTS, TOP_K, HIDDEN, INTER = 384, 6, 5120, 2304
LIMIT, SCALE = 10.0, 1.5
TOKENS = (1, 8, 64, 256)
CHECK_TOKENS = 8
# Accuracy bound: |Δ| ≤ B = ulp(ref) + 1.5·Σ_j w_j·ulp(E_j) per element — one ±1-ulp flip of each
# per-slot BF16 expert output and one of the final rounding (derivation: mx.routed_error_bound).
# The former 2⁻⁶·RMS(row) was mis-derived: a single final-rounding flip at |ref| ≈ 4·RMS exceeds it.
BOUND_RATIO, BOUND_FRACTION = 1.0, mx.ROUTED_DIFF_FRACTION_BOUND


def random_layer(device: torch.device, seed: int) -> dict[str, torch.Tensor]:
    """Stacked packed experts on the device; scale bytes around 2^−6 (w1/w3) and 2^−8 (w2) keep
    g/u near N(0, 3²) (clamp reached) and expert outputs O(1) for x ~ N(0, 1)."""
    g = torch.Generator(device=device).manual_seed(seed)
    byte = lambda *s: torch.randint(0, 256, s, generator=g, device=device, dtype=torch.uint8)
    sc = lambda e, *s: (127 + e + torch.randint(-1, 2, s, generator=g, device=device)).to(torch.uint8)
    return {"w1": byte(EXPERTS, INTER, HIDDEN // 2), "w1_scale": sc(-6, EXPERTS, INTER, HIDDEN // 32),
            "w3": byte(EXPERTS, INTER, HIDDEN // 2), "w3_scale": sc(-6, EXPERTS, INTER, HIDDEN // 32),
            "w2": byte(EXPERTS, HIDDEN, INTER // 2), "w2_scale": sc(-8, EXPERTS, HIDDEN, INTER // 32)}


def routing(T: int, device: torch.device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)
    ids = torch.rand(T, EXPERTS, generator=g, device=device).topk(TOP_K, dim=-1).indices
    w = torch.rand(T, TOP_K, generator=g, device=device) + 0.05
    return ids, (w / w.sum(-1, keepdim=True)).float()


def reference(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, raw: dict[str, torch.Tensor]
              ) -> SimpleNamespace:
    """reference.moe on x's device, weights decoded on the CPU by the codec (independent of the
    kernel): `.out` [T, H] and the per-element bound `.bound` (needs the per-slot outputs)."""
    T, k = ids.shape
    per_slot = torch.zeros(T, k, HIDDEN, dtype=torch.float64, device=x.device)
    for e in torch.unique(ids).tolist():
        rows, slot = torch.nonzero(ids == e, as_tuple=True)
        d = {n: dequantize_mxfp4(raw[n][e].cpu(), raw[n + "_scale"][e].cpu()).to(x.device) for n in ("w1", "w2", "w3")}
        per_slot[rows, slot] = routed_expert(x[rows].float(), d["w1"], d["w2"], d["w3"], LIMIT).double()
    out = bf16((SCALE * (w.double().unsqueeze(-1) * per_slot).sum(dim=1)).float())
    return SimpleNamespace(out=out, bound=mx.routed_error_bound(out, per_slot, w, SCALE))


def accuracy(out: torch.Tensor, ref: SimpleNamespace) -> dict:
    o, r = out.float(), ref.out.float()
    rms = r.pow(2).mean(dim=-1, keepdim=True).sqrt().clamp(min=1e-30)
    worst = ((o - r).abs() / rms).max().item()
    ratio = ((o - r).abs() / ref.bound).max().item()
    frac = (o != r).float().mean().item()
    return dict(max_abs_diff_over_bound=ratio, max_abs_diff_over_row_rms=worst, fraction_differing=frac,
                finite=bool(torch.isfinite(o).all()),
                within_bound=bool(torch.isfinite(o).all()) and ratio <= BOUND_RATIO and frac <= BOUND_FRACTION)


# ---- comparison paths -----------------------------------------------------------------------
def _dequant_on_device(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2).long()
    *lead, K = codes.shape
    vals = table[codes].view(*lead, K // 32, 32) * ue8m0_to_float(scale).unsqueeze(-1)
    return vals.view(*lead, K)


def bf16_baseline(raw: dict[str, torch.Tensor]) -> Callable:
    """Same matmul_ogs calls, epilogue and combine as the MXFP4 path, weights dequantised to BF16
    (w13 [E, H, 2I] with interleaved gate/up columns, w2 [E, I, H]; K-contiguous)."""
    dev = raw["w1"].device
    w13 = torch.empty(EXPERTS, 2 * INTER, HIDDEN, dtype=torch.bfloat16, device=dev)
    w2 = torch.empty(EXPERTS, HIDDEN, INTER, dtype=torch.bfloat16, device=dev)
    for e0 in range(0, EXPERTS, 16):
        s = slice(e0, e0 + 16)
        g = _dequant_on_device(raw["w1"][s], raw["w1_scale"][s])
        u = _dequant_on_device(raw["w3"][s], raw["w3_scale"][s])
        w13[s] = torch.stack((g, u), dim=2).reshape(-1, 2 * INTER, HIDDEN).to(torch.bfloat16)
        w2[s] = _dequant_on_device(raw["w2"][s], raw["w2_scale"][s]).to(torch.bfloat16)
    w13_t, w2_t = w13.mT, w2.mT
    pc = PrecisionConfig(out_dtype=torch.bfloat16)

    def run(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        plan = mx.make_routing_plan(ids, EXPERTS)
        h = matmul_ogs(x, w13_t, None, plan.routing_data(), gather_indx=plan.gather(), precision_config=pc,
                      fused_activation=mx.clamped_swiglu_activation(LIMIT))
        y = matmul_ogs(h, w2_t, None, plan.routing_data(), precision_config=pc)
        return mx.combine_routed(y, plan, w, SCALE, HIDDEN)
    return run


def marlin_path(raw: dict[str, torch.Tensor]) -> Callable:
    """SGLang 0.5.17's FP4-expert path for DeepSeek-V4 on SM90 (Marlin W4A16, clamped SwiGLU)."""
    from sglang.srt.layers.moe.fused_moe_triton.fused_marlin_moe import fused_marlin_moe
    from sglang.srt.layers.quantization.marlin_utils_fp4 import prepare_moe_mxfp4_layer_for_marlin

    layer = SimpleNamespace(
        w13_weight=torch.cat((raw["w1"], raw["w3"]), dim=1),          # [w1; w3] halves, as Marlin wants
        w2_weight=raw["w2"].clone(),
        w13_weight_scale=torch.cat((raw["w1_scale"], raw["w3_scale"]), dim=1).view(torch.float8_e8m0fnu),
        w2_weight_scale=raw["w2_scale"].view(torch.float8_e8m0fnu).clone())
    prepare_moe_mxfp4_layer_for_marlin(layer)

    def run(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return fused_marlin_moe(x, layer.w13_weight, layer.w2_weight, layer.w13_weight_scale, layer.w2_weight_scale,
                                torch.empty(x.shape[0], EXPERTS, device=x.device), (w * SCALE).float(),
                                ids.to(torch.int32), workspace=layer.workspace, num_bits=4, clamp_limit=LIMIT)
    return run


def flashinfer_cutlass_path(raw: dict[str, torch.Tensor]) -> Callable:
    """FlashInfer CUTLASS W4A16 (upstream's SM90 choice), weights repacked as SGLang 0.5.17 does
    for SM90 (`mxfp4.py` gpt-oss and `mxfp4_flashinfer_cutlass_moe.py` DSv4 paths): w13 halves in
    [up; gate] = [w3; w1] order, byte- and scale-interleaved; clamp 10, α = 1, β = 0 (defaults)."""
    from flashinfer.fused_moe import (cutlass_fused_moe, interleave_moe_scales_for_sm90_mixed_gemm,
                                      interleave_moe_weights_for_sm90_mixed_gemm)
    from flashinfer.fused_moe.core import ActivationType

    w13 = interleave_moe_weights_for_sm90_mixed_gemm(torch.cat((raw["w3"], raw["w1"]), dim=1).contiguous(), "fp4")
    w2 = interleave_moe_weights_for_sm90_mixed_gemm(raw["w2"].contiguous(), "fp4")
    s13 = interleave_moe_scales_for_sm90_mixed_gemm(torch.cat((raw["w3_scale"], raw["w1_scale"]), dim=1), group_size=32)
    s2 = interleave_moe_scales_for_sm90_mixed_gemm(raw["w2_scale"].contiguous(), group_size=32)
    limit = torch.full((EXPERTS,), LIMIT, dtype=torch.float32, device=raw["w1"].device)

    def run(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x.shape[0], HIDDEN, dtype=torch.bfloat16, device=x.device)
        cutlass_fused_moe(input=x, token_selected_experts=ids.to(torch.int32), token_final_scales=(w * SCALE).float(),
                          fc1_expert_weights=w13, fc2_expert_weights=w2, output_dtype=torch.bfloat16,
                          quant_scales=[s13.view(torch.int32), s2.view(torch.int32)], swiglu_limit=limit,
                          use_w4_group_scaling=True, activation_type=ActivationType.Swiglu,
                          tune_max_num_tokens=triton.next_power_of_2(x.shape[0]), output=out)
        return out
    return run


def comparison_paths(args: argparse.Namespace, mxfp4_bytes_per_expert: int) -> tuple[list, dict]:
    """([(name, build(raw), bytes per expert)], {name: {"error": why not built}}) for the comparison
    paths the arguments ask for: bf16 (unless --skip-bf16), marlin, and flashinfer_cutlass only when
    the JIT-ready marker exists (its nvcc build takes far longer than a benchmark)."""
    comparisons = [] if args.skip_bf16 else [("bf16", bf16_baseline, 2 * (3 * INTER * HIDDEN))]
    comparisons.append(("marlin", marlin_path, mxfp4_bytes_per_expert))
    if args.flashinfer_ready is not None and args.flashinfer_ready.exists():
        return comparisons + [("flashinfer_cutlass", flashinfer_cutlass_path, mxfp4_bytes_per_expert)], {}
    return comparisons, {"flashinfer_cutlass": dict(
        error="not built: FlashInfer's CUTLASS MoE module is nvcc-JIT-compiled at first use and its build had not "
              f"finished (no --flashinfer-ready marker {args.flashinfer_ready})")}


def timed_build(build: Callable[[], Callable]) -> tuple[Callable, float]:
    """(build(), wall seconds it took, device work included)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn = build()
    torch.cuda.synchronize()
    return fn, time.perf_counter() - t0


# ---- timing -----------------------------------------------------------------------------------
def time_call(fn: Callable[[], torch.Tensor]) -> dict:
    """Median µs of one call, eager and replayed as a CUDA graph (L2 flushed before each call)."""
    out = dict(eager_us=triton.testing.do_bench(fn, warmup=10, rep=200, return_mode="median") * 1e3)
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        out["graph_us"] = triton.testing.do_bench(graph.replay, warmup=10, rep=200, return_mode="median") * 1e3
    except Exception as exc:  # reported in the JSON, the eager number stands
        out["graph_error"] = f"{type(exc).__name__}: {exc}"
    return out


def with_bandwidth(t: dict, nbytes: int, copy_gbs: float) -> dict:
    for mode in ("eager", "graph"):
        if f"{mode}_us" in t:
            gbs = nbytes / (t[f"{mode}_us"] * 1e-6) / 1e9
            t[f"{mode}_gbs"], t[f"{mode}_fraction_of_copy_bw"] = gbs, gbs / copy_gbs
    return t


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    parser.add_argument("--skip-bf16", action="store_true",
                        help="leave out the BF16-dequantised comparison path (27 GB of copies: saves device time)")
    parser.add_argument("--flashinfer-ready", type=Path, default=None,
                        help="marker file written when FlashInfer's CUTLASS MoE JIT module was built "
                             "(scripts/gpu/flashinfer_moe_jit.py); without it that path is reported as not built")
    parser.add_argument("--time-even-if-inaccurate", action="store_true",
                        help="record a failed accuracy self-check in the JSON (within_bound=false) and "
                             "time anyway — for diagnosing, never for reporting a result")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/moe_mxfp4.py needs a CUDA GPU")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    raw = random_layer(device, seed=0)
    experts, prepare_s = timed_build(lambda: mx.prepare_mxfp4_stacked(
        raw["w1"], raw["w1_scale"], raw["w3"], raw["w3_scale"], raw["w2"], raw["w2_scale"], device=device))
    ours = lambda x, ids, w: mx.routed_experts_mxfp4(x, ids, w, experts, swiglu_limit=LIMIT, routed_scale=SCALE)

    # 1. self-check (aborts on failure), then build and check the comparison paths
    g = torch.Generator(device=device).manual_seed(1)
    x_chk = torch.randn(CHECK_TOKENS, HIDDEN, generator=g, device=device).to(torch.bfloat16)
    ids_chk, w_chk = routing(CHECK_TOKENS, device, seed=2)
    ref = reference(x_chk, ids_chk, w_chk, raw)
    out_chk = ours(x_chk, ids_chk, w_chk)
    check = accuracy(out_chk, ref)
    print(f"self-check T={CHECK_TOKENS}: {check}", flush=True)
    if not check["within_bound"] and args.time_even_if_inaccurate:
        print(f"WARNING: accuracy self-check FAILED, timing anyway: {check}")
    elif not check["within_bound"]:
        raise SystemExit(f"routed_experts_mxfp4 is outside the stated bound: {check}")
    # informational: run-to-run determinism, and whether a token's output depends on its batch
    check["deterministic"] = bool(torch.equal(ours(x_chk, ids_chk, w_chk), out_chk))
    big_x = torch.cat((x_chk, torch.randn(56, HIDDEN, generator=g, device=device).to(torch.bfloat16)))
    big_ids, big_w = routing(64, device, seed=3)
    big_ids[:CHECK_TOKENS], big_w[:CHECK_TOKENS] = ids_chk, w_chk
    check["batch_invariant_8_vs_64"] = bool(torch.equal(ours(big_x, big_ids, big_w)[:CHECK_TOKENS], out_chk))
    check["batch_invariant_1_vs_8"] = bool(torch.equal(ours(x_chk[:1], ids_chk[:1], w_chk[:1]), out_chk[:1]))
    paths: dict[str, Callable] = {"mxfp4": ours}
    path_info: dict[str, dict] = {"mxfp4": dict(check=check, bytes_per_expert=experts.checkpoint_bytes_per_expert(),
                                                prepare_s=prepare_s)}
    comparisons, not_built = comparison_paths(args, experts.checkpoint_bytes_per_expert())
    path_info |= not_built
    for name, build, per_expert in comparisons:
        try:
            fn, build_s = timed_build(lambda: build(raw))
            paths[name] = fn
            path_info[name] = dict(check=accuracy(fn(x_chk, ids_chk, w_chk), ref), bytes_per_expert=per_expert,
                                   prepare_s=build_s)
        except Exception as exc:
            path_info[name] = dict(error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc(limit=4))
        print(f"{name}: {path_info[name].get('check', path_info[name].get('error'))}", flush=True)

    # 2-4. timing
    copy_gbs = copy_bandwidth_gbs(device)
    rows = []
    for T in args.tokens:
        x = torch.randn(T, HIDDEN, generator=g, device=device).to(torch.bfloat16)
        ids, w = routing(T, device, seed=100 + T)
        distinct = int(torch.unique(ids).numel())
        row = dict(tokens=T, distinct_experts=distinct)
        for name, fn in paths.items():
            nbytes = distinct * path_info[name]["bytes_per_expert"]
            timed = lambda: with_bandwidth(time_call(lambda: fn(x, ids, w)), nbytes, copy_gbs) | dict(expert_bytes=nbytes)
            if name == "mxfp4":          # the subject: errors propagate
                row[name] = timed()
                continue
            try:
                row[name] = timed()
            except Exception as exc:     # a comparison path: reported in the JSON
                row[name] = dict(error=f"{type(exc).__name__}: {exc}")
        rows.append(row)
        m = row["mxfp4"]
        print(f"T={T:4d}  experts {distinct:3d}  mxfp4 {m['eager_us']:8.1f} us eager / "
              f"{m.get('graph_us', float('nan')):8.1f} us graph  {m.get('graph_gbs', m['eager_gbs']):6.0f} GB/s "
              f"({m.get('graph_fraction_of_copy_bw', m['eager_fraction_of_copy_bw']):.0%} of copy)  "
              + "  ".join(f"{n} {row[n].get('graph_us', row[n].get('eager_us', float('nan'))):.1f} us"
                          for n in paths if n != "mxfp4"), flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    result = dict(device=props.name, sm_count=props.multi_processor_count, torch=torch.__version__,
                  triton=triton.__version__, python=platform.python_version(),
                  shape=dict(experts=EXPERTS, top_k=TOP_K, hidden=HIDDEN, intermediate=INTER,
                             swiglu_limit=LIMIT, routed_scale=SCALE, routing="uniform random, distinct per token"),
                  copy_bandwidth_gbs=copy_gbs,
                  timing="triton.testing.do_bench median, L2 flushed per call; eager and CUDA-graph replay",
                  bytes_counted="distinct experts x stored bytes per expert (mxfp4/marlin: E2M1 + UE8M0 of w1,w3,w2; "
                                "bf16: 2 bytes per weight); activations excluded",
                  bound=dict(max_abs_diff_over_bound=BOUND_RATIO, fraction_differing=BOUND_FRACTION),
                  paths=path_info, rows=rows)
    (args.out / "moe_mxfp4.json").write_text(json.dumps(result, indent=2))

    fig, (ax_bw, ax_t) = plt.subplots(1, 2, figsize=(11, 4))
    ts = [r["tokens"] for r in rows]
    for name in paths:
        for mode, style in (("graph", "o-"), ("eager", "x:")):
            ys = [r[name].get(f"{mode}_gbs") for r in rows]
            if all(v is not None for v in ys):
                ax_bw.plot(ts, ys, style, label=f"{name} ({mode})")
            us = [r[name].get(f"{mode}_us") for r in rows]
            if all(v is not None for v in us):
                ax_t.plot(ts, us, style, label=f"{name} ({mode})")
    ax_bw.axhline(copy_gbs, color="gray", ls="--", label=f"device copy {copy_gbs:.0f} GB/s")
    ax_bw.set(xscale="log", xlabel="tokens T", ylabel="GB/s (expert bytes read)",
              title=f"{props.name}: {EXPERTS} experts top-{TOP_K}, H={HIDDEN} I={INTER}")
    ax_bw.legend(fontsize=7)
    ax_t.set(xscale="log", yscale="log", xlabel="tokens T", ylabel="µs per call", title="time per call")
    ax_t.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out / "moe_mxfp4.png", dpi=120)
    print(f"wrote {args.out / 'moe_mxfp4.json'} and {args.out / 'moe_mxfp4.png'}")


if __name__ == "__main__":
    main()

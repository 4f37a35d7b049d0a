"""Old against new for the decode-step kernel choices of issue 21 (session 11), in one process
(`decode_step.py --variants`).

Per decode batch N, on the layer and caches `decode_step.py` built, every variant of a component is
captured alone in a CUDA graph and its replay timed (`step_timing.measure`: CUDA events, 256 MB L2
flush before each replay, median), with its output compared with the old variant's:

* `attention`: `one_split` (deterministic mode, ATTENTION_KEY_SPLITS = 1) · `decode_splits`
  (`plan_decode_config`, the serving default since session 12) · `decode_splits_h16` (the same with 16
  heads per program) — agreement: max |Δ| in BF16 ulps of the output scale (each is within 1 of
  the exact value, so ≤ 2) and the fraction of equal elements; `flashmla_decode`
  (SGLANG_DSV41_ATTN_DECODE=flashmla: `attention_flashmla.decode_attend`, within `flashmla_bound`
  of the Triton kernel rather than 2 ulps); `gather_decode` (SGLANG_DSV41_ATTN_DECODE=gather: the entries
  decoded into BF16 rows first, then the same kernel and plan: `decode_splits`' bits);
* `indexer`: `fp64_head_sum` (default) · `fp32_head_sum` (SGLANG_DSV41_INDEXER_HEAD_SUM=fp32) ·
  each with `_fused_topk` (`kernels.topk_select`, SGLANG_DSV41_INDEXER_TOPK=fused: the same
  selection in one launch) — agreement: the mean fraction of each query's selection that is the same set;
* `moe_routed`: `default` (triton_kernels' own launch flags) · `flags:<k=v,...>` for each of
  MOE_FLAG_SETS (SGLANG_DSV41_MOE_DECODE_FLAGS; at N ≤ DECODE_FLAG_MAX_TOKENS only, as the runtime) — agreement: max |Δ| in units of the
  output's BF16 ulp, and the fraction of equal elements;
* `torch`: the layer's torch work with FP8 linears `w8a8_f16` (the serving default) · `tiered`;
* `step`: the whole step `default` (the pre-session-12 default: w8a8_f16, fp64 head sum, torch top-k, one split)
  · `new` (w8a8_f16, fp32 head sum, fused top-k, decode splits, default MoE flags) — the graphed layer
  step old → new.
A variant that fails records its error; the others still run.
"""
from __future__ import annotations

import math
import os
import time
from typing import Callable, Mapping

import torch
from torch import Tensor

#: MoE launch-flag sets tried at decode (triton_kernels' opt-flag constraints); KERNEL_VARIANTS_MOE_FLAGS
#: replaces them (sets separated by ";", "none" for none: each set compiles two GEMMs)
MOE_FLAG_SETS = ("block_k=256", "block_k=64", "num_stages=5", "block_m=16,num_stages=4", "split_k=2", "split_k=4")
MOE_FLAGS_ENV = "KERNEL_VARIANTS_MOE_FLAGS"


def moe_flag_sets() -> tuple[str, ...]:
    """MOE_FLAG_SETS, or the sets KERNEL_VARIANTS_MOE_FLAGS names."""
    text = os.environ.get(MOE_FLAGS_ENV)
    if text is None:
        return MOE_FLAG_SETS
    return () if text.strip().lower() == "none" else tuple(t.strip() for t in text.split(";") if t.strip())
CAP_S = 0.3


def selection_agreement(a: Tensor, b: Tensor) -> float:
    """Mean over queries of |set(a_t) ∩ set(b_t)| / |set(a_t)| (−1 = empty slot, ignored)."""
    total = 0.0
    for x, y in zip(a.tolist(), b.tolist()):
        sx, sy = {v for v in x if v >= 0}, {v for v in y if v >= 0}
        total += len(sx & sy) / len(sx) if sx else float(not sy)
    return total / max(1, a.shape[0])


def ulp_agreement(got: Tensor, want: Tensor) -> dict:
    """max |got − want| in BF16 ulps of |want| (elementwise) and the fraction of equal elements."""
    w = want.float()
    ulp = torch.ldexp(torch.ones_like(w), torch.frexp(w.abs().clamp(min=2.0 ** -126))[1] - 8)
    d = (got.float() - w).abs()
    return dict(max_ulps=float((d / ulp).max()) if d.numel() else 0.0, equal_fraction=float((d == 0).float().mean()))


def scale_ulp_agreement(got: Tensor, want: Tensor) -> dict:
    """Attention's contract measure: max |got − want| in BF16 ulps of the output scale (max |o| of
    the query and head, last dim), and the fraction of equal elements."""
    w = want.float()
    scale = w.abs().amax(dim=-1, keepdim=True).clamp(min=2.0 ** -126)
    ulp = torch.exp2(torch.floor(torch.log2(scale)) - 7)
    d = (got.float() - w).abs()
    return dict(max_scale_ulps=float((d / ulp).max()) if d.numel() else 0.0,
                equal_fraction=float((d == 0).float().mean()))


def with_env(name: str, value: str, fn: Callable[[], object]) -> Callable[[], object]:
    """fn with os.environ[name] = value for the call (the kernels read their switch per call; a
    CUDA graph keeps what the captured call chose)."""
    def run():
        old = os.environ.get(name)
        os.environ[name] = value
        try:
            return fn()
        finally:
            if old is None:
                del os.environ[name]
            else:
                os.environ[name] = old
    return run


def _graph_us(fn: Callable[[], object], dev) -> dict:
    from step_timing import capture_graph, measure
    g = capture_graph([fn], warmup_calls=2)
    return dict(graph_us=measure(g.replay, CAP_S, dev)["median_us"])


def variant_callables(layer, caches, N: int, context: int) -> dict[str, dict[str, Callable]]:
    """{component: {variant: callable}} at decode batch N (module doc), in the order they run: the
    whole step first (its `new` compiles most of what the others need), the MoE flag sets last
    (each compiles two GEMMs)."""
    import flash_layer as fl
    from sglang_dsv41.kernels import indexer_select as SEL
    from sglang_dsv41.kernels import moe_mxfp4 as mx
    from sglang_dsv41.numerics import rounding as ops
    from sglang_dsv41.runtime.triton_backend import TritonBackend
    t, dev = layer.text, torch.device("cuda")
    req, pos = torch.arange(N, device=dev), torch.full((N,), context - 1, dtype=torch.long, device=dev)
    g = torch.Generator(device=dev).manual_seed(N)
    R = ops.bf16(torch.randn(N, t.hc_mult, t.hidden_size, generator=g, device=dev)).to(fl.mhc_for(dev).residual_dtype)
    q = ops.bf16(torch.randn(N, t.num_attention_heads, t.head_dim, generator=g, device=dev))
    sink = layer.weights[f"layers.{layer.role.layer}.attn.attn_sink"]
    qs = fl.queries(layer, caches, req, pos)
    old, _ = fl.kernel_components(layer, caches, qs, q, sink, splits="one", head_sum="fp64")
    new, _ = fl.kernel_components(layer, caches, qs, q, sink, splits="decode", head_sum="fp32")
    h16, _ = fl.kernel_components(layer, caches, qs, q, sink, splits="decode", head_sum="fp32", block_h=16)
    x, routing = fl.torch_work(layer, R, pos)
    backends = {m: TritonBackend(layer.backend.dense, fp8_gemm=m) for m in ("w8a8_f16", "tiered")}
    moe = {"default": lambda: fl.moe_routed(layer, x, routing)}
    for flags in (moe_flag_sets() if N <= mx.DECODE_FLAG_MAX_TOKENS else ()):    # the runtime applies them up to there
        moe[f"flags:{flags}"] = (lambda f: lambda: mx.with_decode_flags(
            mx.parse_decode_flags(f), lambda: fl.moe_routed(layer, x, routing)))(flags)
    torch_parts = {m: (lambda be: lambda: fl.torch_work(layer, R, pos, be))(be) for m, be in backends.items()}

    fused = with_env(SEL.TOPK_METHOD_ENV, "fused", new["indexer"])
    fp64_indexer = old["indexer"]
    old["indexer"] = with_env(SEL.TOPK_METHOD_ENV, "torch", old["indexer"])     # CUDA's default is fused now
    new["indexer"] = with_env(SEL.TOPK_METHOD_ENV, "torch", new["indexer"])

    def step(parts):
        return lambda: [p() for p in parts]
    return {"step": {"default": step([torch_parts["w8a8_f16"], old["indexer"], old["attention"], moe["default"]]),
                     "new": step([torch_parts["w8a8_f16"], fused, new["attention"], moe["default"]])},
            "attention": {"one_split": old["attention"], "decode_splits": new["attention"],
                          "decode_splits_h16": h16["attention"], "flashmla_decode": new["attention_flashmla"],
                          "gather_decode": new["attention_gather"]},
            "indexer": {"fp64_head_sum": old["indexer"], "fp32_head_sum": new["indexer"],
                        "fp32_head_sum_fused_topk": fused,
                        "fp64_head_sum_fused_topk": with_env(SEL.TOPK_METHOD_ENV, "fused", fp64_indexer)},
            "torch": torch_parts, "moe_routed": moe}


def agreement(component: str, got, want) -> dict:
    if component == "attention":
        return scale_ulp_agreement(got, want)
    if component == "indexer":
        return dict(selection_agreement=selection_agreement(got, want))
    if component == "moe_routed":
        return ulp_agreement(got, want)
    return {}


def run_variants(layer, caches, N: int, context: int, errors: list[str], deadline: float = math.inf) -> dict:
    """Timings and agreements of every variant at N (module doc); variants past `deadline`
    (time.perf_counter) are recorded as skipped."""
    from step_timing import _describe
    dev = torch.device("cuda")
    out: dict[str, dict] = {}
    try:
        table = variant_callables(layer, caches, N, context)
    except Exception as exc:
        errors.append(f"variants N={N} set-up: {_describe(exc)}")
        return dict(error=_describe(exc))
    for comp, variants in table.items():
        out[comp] = {}
        first = next(iter(variants))
        want = None
        for name, fn in variants.items():
            if time.perf_counter() > deadline:
                out[comp][name] = dict(skipped="over the wall budget")
                continue
            try:
                got = fn()
                torch.cuda.synchronize()
                row = _graph_us(fn, dev)
                if name == first:
                    want = got
                elif want is not None:
                    row |= agreement(comp, got, want)
            except Exception as exc:
                errors.append(f"variants N={N} {comp}/{name}: {_describe(exc)}")
                row = dict(error=_describe(exc))
            out[comp][name] = row
        torch.cuda.empty_cache()
    return out


def summary_line(N: int, row: Mapping) -> str:
    parts = []
    for comp, variants in row.items():
        if isinstance(variants, Mapping):
            us = " / ".join(f"{n} {v['graph_us']:.0f}" if "graph_us" in v else f"{n} {'ERR' if 'error' in v else '-'}"
                            for n, v in variants.items())
            parts.append(f"{comp}: {us}")
    return f"variants N={N} µs (graph): " + " | ".join(parts)

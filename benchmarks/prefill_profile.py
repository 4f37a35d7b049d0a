"""Per-component GPU time of one 8K-token prefill of a full-width Flash layer (issue 21; `decode_step.py --profile-prefill`).

What it answers: of the device time of one prefill chunk — one request, positions 0 … T − 1
(T = `decode_step.PREFILL_TOKENS`, 8,192), through the parts behind decode_step.py's prefill
tokens/s (`decode_step.STEP_PARTS`: the layer's torch work, the indexer, attention, the routed
experts; layer 2 = ratio-2 kv source with the indexer) — how much each component takes:
`PREFILL_COMPONENTS` — the FP8 GEMMs (also by weight name, split into the GEMM and its operand
passes: activation quantisation, weight dequantisation), BF16 linears, attention, indexer scoring /
top-k / query, compressor, router, routed experts (MXFP4 GEMMs / routing plan / combine), shared
expert, mHC, norms, RoPE, the other elementwise kernels, torch glue and what is left unlabelled.
Engram is not in layer 2 (the JSON says so).

Method: eager (a prefill chunk is not graphed). Per variant one warm-up pass (compiles), then
`REPEATS` passes, each under `torch.profiler` with `step_profile.labels_on`'s labels (the runtime's
linears by weight name, norms, elementwise primitives, mHC, compressor, router, …; nothing in
`runtime/` changes) and "part:<name>" ranges: every kernel takes the label open at its launch
(`step_profile.labelled_kernels`); kernels of the parts `indexer` and `moe_routed` are told apart
by name (`prefill_component`). Per component the median over passes of the summed device µs;
`gaps_us` = span − union of kernel time (host-side launch and sync gaps of the eager pass). Then
`REPEATS` unprofiled passes timed per part with CUDA events (`wall_us`, the figure comparable with
decode_step.py's prefill row; no L2 flush: the 8K working set dwarfs L2), and the parts launched back to back
between one pair of events (`wall_us_chained`, `tokens_per_s_chained`: no sync between parts, as in a
forward, where a part's host set-up overlaps the kernels before it). The host side of the same chain:
`host_us_chained` (until the launches return, no sync after: near `wall_us_chained` means launch-bound) and one
chained pass under cProfile (`host_profile`: self time by package, the top functions and their callers).

Variants (`VARIANTS`, old against new in one process): `before` = session 11's path (RoPE and its
BF16 rounding as two launches, packed attention rows, torch top-k, BF16-weight products in 128-row
blocks: OLD); `session12` = the serving default before session 13 (packed rows, 128-row blocks);
`default` = the serving defaults now (SWITCHES: BF16 attention workspace read by
`kernels.sparse_attention_prefill` (`wide`, since session 33; `session32` = the same read by
`sparse_attention` launched with `plan_prefill_config`), fused top-k, the `auto` head sum (fp32 at this eager 8K
chunk since session 35; `session34` = the fp64 one), BF16-weight products in one GEMM); `new` = the default with the
fp32 indexer head sum forced (the same as `default` at this size since session 35); then each session-12 prefill choice
alone on OLD (`attn_bf16_workspace`, `indexer_fp32_head_sum`, `indexer_fused_topk`,
`whole_bf16_rows`); `new_mhc_rows` = `new` with the per-token mHC kernels
(SGLANG_DSV41_MHC_MIX=rows, as `before` and `session12`); `new_moe_block_m64[_s3]` = `new` with the
MXFP4 expert GEMMs' prefill tiles constrained (SGLANG_DSV41_MOE_PREFILL_FLAGS); `flashmla` = `default`
with the workspace read by one `flash_mla_sparse_fwd` launch (`runtime.attention_flashmla`; its
attention part includes the per-call index construction and the SWA-block gather); `wide` = `default` with the
workspace read by `kernels.sparse_attention_prefill` (every head of a query in one program). `moe_experts` = both
expert GEMMs (GEMM1 with the fused SwiGLU is `…_dsv41_clamped_swiglu`; before session 13 it showed as
`clamped_swiglu_tile` and was counted as `moe_routing`). A variant sets its environment switches (and
instance patches) for its duration only. Last (`attention_sweep`, deadline permitting): the attention alone at the prefill shape on the
BF16 workspace under a few launch configurations (ATTENTION_SWEEP), losers kept.
"""
from __future__ import annotations

import contextlib
import functools
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

import torch

if str(Path(__file__).resolve().parent) not in sys.path:   # sibling benchmark modules (loaded by path too)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from host_profile import host_profile, summary_lines  # noqa: E402

REPEATS = 3
#: the switches a variant may set, at the CUDA serving defaults; every variant sets all of them
SWITCHES = {"SGLANG_DSV41_ATTN_PREFILL": "wide", "SGLANG_DSV41_INDEXER_HEAD_SUM": "auto",
            "SGLANG_DSV41_INDEXER_TOPK": "fused", "SGLANG_DSV41_MHC_MIX": "tc", "SGLANG_DSV41_MOE_PREFILL_FLAGS": "",
            "SGLANG_DSV41_TOPK_SEARCH": "radix", "SGLANG_DSV41_INDEXER_PREFILL_KEYS": "bf16"}
#: session 11's switches (with the patch `blocked_bf16_rows`: its BF16-weight rows)
OLD = {"SGLANG_DSV41_ATTN_PREFILL": "packed", "SGLANG_DSV41_INDEXER_HEAD_SUM": "fp64",
       "SGLANG_DSV41_INDEXER_TOPK": "torch", "SGLANG_DSV41_MHC_MIX": "rows", "SGLANG_DSV41_MOE_PREFILL_FLAGS": "",
       "SGLANG_DSV41_TOPK_SEARCH": "bisect", "SGLANG_DSV41_INDEXER_PREFILL_KEYS": "packed"}
NEW = SWITCHES | {"SGLANG_DSV41_INDEXER_HEAD_SUM": "fp32"}
#: the serving default before session 35 at an 8K prefill (the fp64 head sum; `whole` and `direct` BF16 rows
#: are the same call there)
SESSION34 = {"SGLANG_DSV41_INDEXER_HEAD_SUM": "fp64"}
#: name → (environment over SWITCHES, backend patches): `two_pass_rope` = session 11's RoPE (`TwoPassRope`);
#: `blocked_bf16_rows` = SGLANG_DSV41_BF16_GEMM=blocked (`BlockedBf16Gemm.whole_rows` False, read at build: set
#: on the layer's backend; without the patch: `direct`, the serving default); `fp32_activations` = every
#: activation in fp32 as before session 26 (`Fp32Activations`: the backend's `bf16_out` ignored, the mHC
#: sublayer input written as fp32); `fp32_residual` = the CUDA mHC's residual streams R held as fp32 again
#: (`mhc_ops.TritonMhc.residual_dtype`; the same values)
VARIANTS: dict[str, tuple[dict[str, str], tuple[str, ...]]] = {
    "before": (OLD, ("two_pass_rope", "blocked_bf16_rows")),
    "session12": ({"SGLANG_DSV41_ATTN_PREFILL": "packed", "SGLANG_DSV41_MHC_MIX": "rows"}, ("blocked_bf16_rows",)),
    "default": ({}, ()), "new": (NEW, ()),
    "attn_bf16_workspace": (OLD | {"SGLANG_DSV41_ATTN_PREFILL": "bf16"}, ("blocked_bf16_rows",)),
    "indexer_fp32_head_sum": (OLD | {"SGLANG_DSV41_INDEXER_HEAD_SUM": "fp32"}, ("blocked_bf16_rows",)),
    "indexer_fused_topk": (OLD | {"SGLANG_DSV41_INDEXER_TOPK": "fused"}, ("blocked_bf16_rows",)),
    "whole_bf16_rows": (OLD, ()),
    # session 13 (prefill8): `new` with the per-token mHC kernels, and with MoE prefill tiles
    "new_mhc_rows": (NEW | {"SGLANG_DSV41_MHC_MIX": "rows"}, ()),
    "new_moe_block_m64": (NEW | {"SGLANG_DSV41_MOE_PREFILL_FLAGS": "block_m=64"}, ()),
    "new_moe_block_m64_s3": (NEW | {"SGLANG_DSV41_MOE_PREFILL_FLAGS": "block_m=64,num_stages=3"}, ()),
    # session 14 (flashmla): the serving default with the workspace read by one FlashMLA launch
    "flashmla": ({"SGLANG_DSV41_ATTN_PREFILL": "flashmla"}, ()),
    # session 19: the serving default with session 12's bisection top-k search
    "topk_bisect": ({"SGLANG_DSV41_TOPK_SEARCH": "bisect"}, ()),
    # session 22: the mHC partial dots on BF16 tensor cores (split-BF16×3 F), and the FlashMLA prefill with it
    "mhc_tc": ({"SGLANG_DSV41_MHC_MIX": "tc"}, ()),
    # session 26: the default with its activations in fp32 again (what BF16_OUT removed)
    "fp32_activations": ({}, ("fp32_activations",)),
    # the default with the mHC residual streams held as fp32 (what holding them as BF16 removed)
    "fp32_residual": ({}, ("fp32_residual",)),
    "flashmla_mhc_tc": ({"SGLANG_DSV41_ATTN_PREFILL": "flashmla", "SGLANG_DSV41_MHC_MIX": "tc"}, ()),
    # session 33: the workspace read by `kernels.sparse_attention_prefill` (every head of a query per program;
    # the default since), and the default before it (the workspace read by `sparse_attention`)
    "wide": ({"SGLANG_DSV41_ATTN_PREFILL": "wide"}, ()),
    # session 45: the workspace read by the heads layout (`plan_heads`: 16-key tiles, 5 stages)
    "heads": ({"SGLANG_DSV41_ATTN_PREFILL": "heads"}, ()),
    "session32": ({"SGLANG_DSV41_ATTN_PREFILL": "bf16", "SGLANG_DSV41_INDEXER_PREFILL_KEYS": "packed"}, ()),
    # session 33: the indexer reading its packed keys (the default before the BF16 key workspace)
    "packed_keys": ({"SGLANG_DSV41_INDEXER_PREFILL_KEYS": "packed"}, ()),
    # session 35: the default before it
    "session34": (SESSION34, ()),
    # session 32: the default before it (the fp32 `dot` mHC partials)
    "session31": ({"SGLANG_DSV41_MHC_MIX": "dot", "SGLANG_DSV41_ATTN_PREFILL": "bf16",
                   "SGLANG_DSV41_INDEXER_PREFILL_KEYS": "packed"}, ())}
DEFAULT_VARIANTS = ("before", "session12", "default", "new", "attn_bf16_workspace", "indexer_fp32_head_sum",
                    "indexer_fused_topk", "whole_bf16_rows")
PREFILL_COMPONENTS = ("dense_fp8", "dense_bf16", "attention", "indexer_scores", "indexer_topk", "indexer_query",
                      "compressor", "router", "moe_experts", "moe_routing", "moe_combine", "shared_expert", "mhc",
                      "norms", "rope", "elementwise", "torch_glue", "engram", "unattributed")
#: attention launch configurations timed at the prefill shape on the BF16 workspace (`attention_sweep`),
#: as changes to `kernels.sparse_attention.plan_config`'s (block_h 32, block_n 32, 8 warps, 2 stages at
#: Flash; `block_h16_w4` is the runtime's `plan_prefill_config` there); losers are kept in the JSON
ATTENTION_SWEEP = {"plan": {}, "stages3": dict(num_stages=3), "block_h16_w4": dict(block_h=16, num_warps=4),
                   "block_h16_w8": dict(block_h=16, num_warps=8), "block_n64_s1": dict(block_n=64, num_stages=1)}
#: kernel-name fragments of a linear's operand passes (not its GEMM)
OPERAND_KERNELS = ("quantize", "dequantize", "round")


def prefill_component(label: str, kernel: str, fp8_linears: Iterable[str] = ()) -> str:
    """The PREFILL_COMPONENTS entry of a kernel `kernel` launched under `label` (module doc)."""
    import step_profile as sp
    if label == "part:indexer":
        return "indexer_scores" if "index_scores" in kernel else "indexer_topk"
    if label == "part:moe_routed":         # GEMM1 (fused SwiGLU) showed as `clamped_swiglu_tile` before session 13
        return ("moe_combine" if "combine" in kernel else
                "moe_experts" if "matmul" in kernel or "swiglu" in kernel else "moe_routing")
    if label.startswith("linear:"):
        name = label[len("linear:"):]
        for fragment, comp in (("compressor", "compressor"), ("indexer.", "indexer_query"),
                               ("shared_experts", "shared_expert"), ("engram", "engram")):
            if fragment in name:
                return comp
        return "dense_fp8" if name in set(fp8_linears) else "dense_bf16"
    if label in ("elementwise:apply_rope_tail", "elementwise:bf16_rope_tail"):
        return "rope"
    comp = sp.component(label, fp8_linears)
    return "indexer_query" if comp == "indexer" else comp


def summarise_passes(passes: Sequence[Sequence[tuple[str, str, float]]], spans: Sequence[tuple[float, float]],
                     fp8_linears: Iterable[str], top: int = 30) -> dict:
    """Per component / linear / label the median over passes of the summed device µs; the busy
    time, span and gaps (median); the `top` kernels of the first pass by µs (name, label, count)."""
    fp8 = list(fp8_linears)
    comp_runs: dict[str, list[float]] = defaultdict(list)
    label_runs: dict[str, list[float]] = defaultdict(list)
    linear_runs: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for kernels in passes:
        comp: dict[str, float] = defaultdict(float)
        labels: dict[str, float] = defaultdict(float)
        linears: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        for name, label, us in kernels:
            comp[prefill_component(label, name, fp8)] += us
            labels[label] += us
            if label.startswith("linear:"):
                part = "operands" if any(f in name.lower() for f in OPERAND_KERNELS) else "gemm"
                linears[label[len("linear:"):]][part] += us
        for key in set(comp) | set(comp_runs):
            comp_runs[key].append(comp.get(key, 0.0))
        for key in set(labels) | set(label_runs):
            label_runs[key].append(labels.get(key, 0.0))
        for lin, parts in linears.items():
            for part in ("gemm", "operands"):
                linear_runs[lin][part].append(parts.get(part, 0.0))
    med = statistics.median
    by_comp = {c: med(comp_runs[c]) for c in PREFILL_COMPONENTS if c in comp_runs}
    first: dict[tuple[str, str], list[float]] = defaultdict(list)
    for name, label, us in (passes[0] if passes else ()):
        first[(name, label)].append(us)
    kernels = sorted(((sum(v), n, lab, len(v)) for (n, lab), v in first.items()), reverse=True)[:top]
    busy = med([b for b, _ in spans]) if spans else 0.0
    span = med([s for _, s in spans]) if spans else 0.0
    return dict(passes=len(passes), kernels_per_pass=[len(k) for k in passes], busy_us=busy, span_us=span,
                gaps_us=span - busy, by_component=by_comp, device_us=sum(by_comp.values()),
                by_linear={k: {p: med(v) for p, v in parts.items()} | {"total": sum(med(v) for v in parts.values())}
                           for k, parts in sorted(linear_runs.items())},
                by_label=dict(sorted(((k, med(v)) for k, v in label_runs.items()), key=lambda kv: -kv[1])),
                top_kernels=[dict(kernel=n[:120], label=lab, us=us, count=c) for us, n, lab, c in kernels])


@contextlib.contextmanager
def variant_scope(name: str, backend) -> Iterable[None]:
    """The variant's switches (all of SWITCHES, defaults where it sets none) and backend patch,
    restored on exit."""
    env, patches = VARIANTS[name]
    saved = {k: os.environ.get(k) for k in SWITCHES}
    os.environ.update(SWITCHES | env)
    _reread_moe_flags()
    saved_rope = getattr(backend, "rope", None)
    patched = "two_pass_rope" in patches and saved_rope is not None   # only the Triton backend launches kernels
    if patched:                        # session 11: RoPE, then the BF16 rounding as a second launch
        backend.rope = TwoPassRope(saved_rope, backend.fe)
    dense = getattr(backend, "dense", None)
    saved_whole = getattr(dense, "whole_rows", None)
    saved_unpadded = getattr(dense, "unpadded", None)
    if saved_whole is not None:        # the serving default's `direct` rows, or 128-row blocks with the patch
        dense.whole_rows = dense.unpadded = "blocked_bf16_rows" not in patches
    from fp32_activations import Fp32Activations
    from sglang_dsv41.runtime.mhc_ops import TritonMhc

    fp32 = Fp32Activations(backend) if "fp32_activations" in patches else contextlib.nullcontext()
    saved_residual = TritonMhc.residual_dtype
    if "fp32_residual" in patches:
        TritonMhc.residual_dtype = torch.float32
    try:
        with fp32:
            yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if patched:
            backend.rope = saved_rope
        if saved_whole is not None:
            dense.whole_rows, dense.unpadded = saved_whole, saved_unpadded
        TritonMhc.residual_dtype = saved_residual
        _reread_moe_flags()


def _reread_moe_flags() -> None:
    """The MXFP4 experts read SGLANG_DSV41_MOE_PREFILL_FLAGS once: re-read it after a variant's change."""
    import sys
    mx = sys.modules.get("sglang_dsv41.kernels.moe_mxfp4")
    if mx is not None:
        mx.prefill_flags.cache_clear()


class TwoPassRope:
    """`kernels.rope` with `apply_rope_tail(round_bf16=True)` as two launches (RoPE, then
    `fused_elementwise.round_bf16`): the Triton backend's `bf16_rope_tail` before session 12 (same bits)."""

    def __init__(self, rope, fe) -> None:
        self._rope, self._fe = rope, fe

    def __getattr__(self, name: str):
        return getattr(self._rope, name)

    def apply_rope_tail(self, x, positions, inv_freq, inverse: bool = False, round_bf16: bool = False,
                        out_dtype: torch.dtype = torch.float32, round_input: bool = False, in_place: bool = False):
        src = x
        if round_input:                                   # the input rounding as its own launch too
            x = self._fe.round_bf16(x.float())
        y = self._rope.apply_rope_tail(x, positions, inv_freq, inverse)
        y = self._fe.round_bf16(y) if round_bf16 else y
        y = y if out_dtype == torch.float32 else y.to(out_dtype)
        return src.copy_(y) if in_place else y           # session 11 had no in-place form: a copy back


def selection_agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean over rows of |A ∩ B| / |A| (A, B: the rows' entries ≥ 0, each row's entries distinct;
    an empty A agrees iff B is empty) — vectorised (`kernel_variants.selection_agreement`'s value)."""
    c = torch.sort(torch.cat((a, b), dim=1), dim=1).values
    inter = ((c[:, 1:] == c[:, :-1]) & (c[:, 1:] >= 0)).sum(dim=1).float()
    na = (a >= 0).sum(dim=1).float()
    per_row = torch.where(na > 0, inter / na.clamp(min=1), ((b >= 0).sum(dim=1) == 0).float())
    return float(per_row.mean()) if per_row.numel() else 1.0


def agreement(outputs: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor]) -> dict:
    """Attention: max |Δ| in BF16 ulps of the output scale (`kernel_variants.scale_ulp_agreement`);
    indexer: the selections' overlap — of a variant's outputs against the reference variant's."""
    import kernel_variants as kv
    out = {}
    if "attention" in outputs and "attention" in reference:
        out["attention"] = kv.scale_ulp_agreement(outputs["attention"], reference["attention"])
    if "indexer" in outputs and "indexer" in reference:
        out["indexer"] = dict(selection_overlap=selection_agreement(outputs["indexer"], reference["indexer"]),
                              equal=bool(torch.equal(outputs["indexer"], reference["indexer"])))
    return out


def _wall_us(fn: Callable[[], object], device: torch.device) -> float:
    """µs of one fn() call: CUDA events around it, then a sync (CPU layers: the host clock)."""
    if device.type != "cuda":
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e6
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3


def _part_walls(parts: Mapping[str, Callable[[], object]], repeats: int, device: torch.device) -> dict[str, float]:
    """Median µs per part over `repeats` unprofiled passes, each part timed alone (`_wall_us`)."""
    times: dict[str, list[float]] = defaultdict(list)
    for _ in range(repeats):
        for name, fn in parts.items():
            times[name].append(_wall_us(fn, device))
    return {k: statistics.median(v) for k, v in times.items()}


def _chain(parts: Mapping[str, Callable[[], object]]) -> Callable[[], None]:
    """One pass over every part, back to back, no sync between parts (as in a forward: a part's host set-up
    overlaps the previous part's kernels)."""
    def chain() -> None:
        for fn in parts.values():
            fn()
    return chain


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _chained_wall(parts: Mapping[str, Callable[[], object]], repeats: int, device: torch.device) -> float:
    """Median µs of a `_chain` pass between one pair of CUDA events."""
    _sync(device)
    return statistics.median(_wall_us(_chain(parts), device) for _ in range(repeats))


def _chained_host(parts: Mapping[str, Callable[[], object]], repeats: int, device: torch.device) -> float:
    """Median µs until a `_chain` pass returns to Python, synchronised before and not after: the host's own
    time for the launches. Near `wall_us_chained`: the pass is launch-bound."""
    chain, times = _chain(parts), []
    for _ in range(repeats):
        _sync(device)
        t = time.perf_counter()
        chain()
        times.append((time.perf_counter() - t) * 1e6)
    _sync(device)
    return statistics.median(times)


def profile_variant(layer, caches, tokens: int, name: str, parts_order: Sequence[str], errors: list[str],
                    repeats: int = REPEATS, outputs: dict | None = None) -> dict:
    """One variant (module doc): labelled passes → `summarise_passes`, plus CUDA-event walls;
    the attention output and the indexer selection go to `outputs` (for `agreement`)."""
    import flash_layer
    import step_profile as sp
    dev = layer.inv_freq.device
    names = sp.weight_names(layer.weights, layer.role.layer)
    fp8 = [names[id(v)] for v in layer.weights.values()
           if isinstance(v, torch.Tensor) and v.dtype == torch.float8_e4m3fn and id(v) in names]
    pos = torch.arange(tokens, device=dev)
    row: dict = dict(variant=name, tokens=tokens, env=SWITCHES | VARIANTS[name][0], patches=list(VARIANTS[name][1]))
    with variant_scope(name, layer.backend):
        comps, meta = flash_layer.step_components(layer, caches, torch.zeros_like(pos), pos, errors)
        parts = {c: comps[c] for c in parts_order if c in comps}
        row |= dict(parts=list(parts), distinct_experts=meta.get("distinct_experts"))

        def one_pass():
            for part, fn in parts.items():
                with torch.profiler.record_function(sp.PREFIX + "part:" + part):
                    fn()
            if dev.type == "cuda":
                torch.cuda.synchronize()
        passes, spans = [], []
        with sp.labels_on(layer.backend, names, flash_layer):
            one_pass()                                   # warm-up: compiles and autotunes outside the traces
            for _ in range(repeats):
                trace = sp._trace_of(one_pass)
                passes.append(sp.labelled_kernels(trace))
                spans.append(sp.busy_span(sp._device_events(trace)))
        row |= summarise_passes(passes, spans, fp8)
        row["wall_us"] = _part_walls(parts, repeats, dev)
        row["wall_us_chained"] = _chained_wall(parts, repeats, dev)
        row["host_us_chained"] = _chained_host(parts, repeats, dev)
        row["host_profile"] = host_profile(_chain(parts), functools.partial(_sync, dev))
        if outputs is not None:
            outputs.update({p: parts[p]() for p in ("attention", "indexer") if p in parts})
    row["wall_us_total"] = sum(row["wall_us"].values())
    row["tokens_per_s"] = tokens / (row["wall_us_total"] * 1e-6) if row["wall_us_total"] else None
    row["tokens_per_s_chained"] = tokens / (row["wall_us_chained"] * 1e-6) if row["wall_us_chained"] else None
    return row


def attention_sweep(layer, caches, tokens: int, errors: list[str], deadline: float, repeats: int = REPEATS) -> dict:
    """ATTENTION_SWEEP at the prefill shape with the BF16 workspace (SGLANG_DSV41_ATTN_PREFILL=bf16
    for the duration): per configuration the CUDA-event µs (median of `repeats`) and the output
    against the planned configuration's (BF16 ulps of the output scale); a configuration that fails
    (e.g. out of shared memory) is recorded with its error (not in `errors`); past `deadline`: skipped."""
    import dataclasses

    import flash_layer
    import kernel_variants as kv
    from sglang_dsv41.kernels import sparse_attention as SA
    from step_timing import _describe
    t, dev = layer.text, layer.inv_freq.device
    pos = torch.arange(tokens, device=dev)
    qs = flash_layer.queries(layer, caches, torch.zeros_like(pos), pos)
    g = torch.Generator(device=dev).manual_seed(tokens)
    q = flash_layer.ops.bf16(torch.randn(tokens, t.num_attention_heads, t.head_dim, generator=g, device=dev))
    sink = layer.weights[f"layers.{layer.role.layer}.attn.attn_sink"]
    plan = dataclasses.replace(SA.plan_config(tokens, t.num_attention_heads, t.head_dim, t.sliding_window,
                                              t.index_topk, 1), num_splits=1)
    out: dict = {}
    reference = None
    with variant_scope("attn_bf16_workspace", layer.backend):
        for name, change in ATTENTION_SWEEP.items():
            if time.perf_counter() > deadline:
                out[name] = dict(skipped="over the wall budget")
                continue
            cfg = dataclasses.replace(plan, **change)
            try:
                comps, _ = flash_layer.kernel_components(layer, caches, qs, q, sink, att_config=cfg)
                o = comps["attention"]()
                row = dict(config=dataclasses.asdict(cfg),
                           us=_part_walls({"attention": comps["attention"]}, repeats, dev)["attention"])
                if reference is None:
                    reference = o
                row["agreement_with_plan"] = kv.scale_ulp_agreement(o, reference)
                out[name] = row
            except Exception as exc:        # a candidate that does not compile (resources) is a loser, not an error
                out[name] = dict(config=dataclasses.asdict(cfg), error=_describe(exc)[:300])
    return out


def write_prefill_profile(layer, out: Path, device_name: str, tokens: int, parts_order: Sequence[str],
                          variants: Sequence[str], errors: list[str], deadline: float = float("inf"),
                          repeats: int = REPEATS) -> dict:
    """Every variant (past `deadline`: recorded as skipped) → prefill_profile.json (+ .png). A CPU
    layer runs the same flow (no kernels: walls only; the tests' tiny check)."""
    import json

    from flash_layer import make_caches
    from step_timing import _describe
    t0 = time.perf_counter()
    caches = make_caches(layer, 1, tokens, layer.inv_freq.device, seed=2)
    rows, reference = [], {}
    for name in variants:
        if name not in VARIANTS:
            errors.append(f"prefill profile: unknown variant {name!r} (known: {list(VARIANTS)})")
            continue
        if time.perf_counter() > deadline:
            rows.append(dict(variant=name, skipped="over the wall budget"))
            continue
        try:
            outputs: dict = {}
            rows.append(profile_variant(layer, caches, tokens, name, parts_order, errors, repeats, outputs))
            if not reference:                    # the first variant's outputs (`before`: session 11's packed path)
                reference = dict(outputs, variant=name)
            rows[-1]["agreement_with"] = reference["variant"]
            rows[-1]["agreement"] = agreement(outputs, reference)
            del outputs
        except Exception as exc:
            errors.append(f"prefill profile {name}: {_describe(exc)}")
            rows.append(dict(variant=name, error=_describe(exc)))
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        r = rows[-1]
        if "by_component" in r:
            comps = "  ".join(f"{c} {us / 1e3:.2f}" for c, us in sorted(r["by_component"].items(), key=lambda kv: -kv[1]))
            walls = "  ".join(f"{p} {us / 1e3:.2f}" for p, us in r["wall_us"].items())
            print(f"prefill {name}: {r['tokens_per_s']:,.0f} tokens/s ({r['tokens_per_s_chained']:,.0f} chained), "
                  f"wall ms {walls} | device ms {comps} | "
                  f"gaps {r['gaps_us'] / 1e3:.2f} | host ms (chained, to return) {r['host_us_chained'] / 1e3:.2f}",
                  flush=True)
            print("\n".join(summary_lines(r["host_profile"], rows=16)), flush=True)
    sweep = (attention_sweep(layer, caches, tokens, errors, deadline, repeats)
             if layer.inv_freq.device.type == "cuda" else dict(skipped="CUDA only"))
    print("attention sweep (workspace) µs: " + "  ".join(f"{k} {v['us']:.0f}" if "us" in v else f"{k} -"
                                                         for k, v in sweep.items() if isinstance(v, dict)), flush=True)
    del caches
    engram = layer.role.layer in layer.text.engram_layer_ids
    result = dict(device=device_name, layer=layer.role.layer, tokens=tokens, method=__doc__,
                  components=PREFILL_COMPONENTS, rows=rows, attention_sweep=sweep, wall_s=time.perf_counter() - t0,
                  engram=("in this layer's torch part" if engram else
                          f"not in layer {layer.role.layer} (Engram layers {list(layer.text.engram_layer_ids)})"))
    path = out / "prefill_profile.json"
    path.write_text(json.dumps(result, indent=1))
    try:
        plot(rows, out / "prefill_profile.png", device_name, tokens)
    except Exception as exc:
        errors.append(f"prefill profile plot: {_describe(exc)}")
    return dict(path=str(path), rows=len(rows))


def plot(rows: Sequence[Mapping], path: Path, device_name: str, tokens: int) -> None:
    """One horizontal stacked bar per variant: device ms by component, annotated with tokens/s."""
    from plotting import pyplot, save_png

    plt = pyplot(required=True)
    rows = [r for r in rows if "by_component" in r]
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(rows) + 2.5))
    names = [r["variant"] for r in rows]
    left = [0.0] * len(rows)
    cmap = plt.get_cmap("tab20")
    for i, c in enumerate(PREFILL_COMPONENTS):
        ms = [r["by_component"].get(c, 0.0) / 1e3 for r in rows]
        if any(ms):
            ax.barh(names, ms, left=left, label=c, color=cmap(i % 20))
            left = [a + b for a, b in zip(left, ms)]
    for y, r in enumerate(rows):
        ax.annotate(f" {r['tokens_per_s']:,.0f} tok/s (wall {r['wall_us_total'] / 1e3:.1f} ms)", (left[y], y),
                    va="center", fontsize=7)
    ax.set(xlabel=f"device ms of one {tokens}-token prefill (median of passes)",
           title=f"{device_name}: one Flash layer, prefill by component")
    ax.legend(fontsize=7, ncol=5, loc="upper center", bbox_to_anchor=(0.5, -0.15))
    save_png(fig, path, dpi=120)

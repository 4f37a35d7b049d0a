"""The indexer's top-k: ours (`kernels.indexer_select.select_topk`, the fused Triton kernel on CUDA) against
SGLang 0.5.17's JIT radix top-k v1 and v2 through `kernels.topk_sglang` (issue 21).

Shapes (rows N × columns E, top-k; `CASES`): decode (N 1 / 8 / 64 × E 8K / 32K / 64K, every column
valid), "long" decode rows past the fused kernel's 64K columns (N 1 / 8 / 64 × E 128K / 256K, N 1 × 1M;
only with --cases long), hit extends (N 32 × E 16K / 32K) and prefill chunks (N 8,192 × E 4K / 8K / 16K) with causal
lengths rising along the rows (row t sees (4E − (N − 1 − t)) // 4 columns: ratio 4); k 512.
Scores: BF16-valued normal (`--dist bf16`, as the indexer's: exact ties occur) or fp32 normal
(`--dist fp32`), −∞ past each row's length (as `index_scores` writes them).

Per case and method, median µs (`step_timing.measure`: CUDA events, a 256 MB L2 flush before each
call) and the first call's wall ms (Triton / JIT builds of a new shape class land there):

* `ours`: `select_topk(scores, k, check_nan=False)` (no lengths: it reads the −∞), the fused kernel
  with the threshold search of SGLANG_DSV41_TOPK_SEARCH (default `topk_select.DEFAULT_SEARCH`);
* `ours_bisect`: the fused kernel with the bisection search (`select_topk_fused(..., radix=False)`),
  and `ours_radix_w4` / `ours_radix_w16`: the radix search at 4 / 16 warps per row instead of
  `topk_select.launch_blocks`' choice, and `ours_split`: the two-stage ranking of `kernels.topk_split`
  (segments of 4,096 columns; SGLANG_DSV41_TOPK_SPLIT=on sends few wide rows there) — each must equal
  `ours` exactly (its `agreement`);
* `sglang_v1`, `sglang_v2`: `select_topk_sglang(..., valid_lengths=lengths, check_nan=False,
  variant=…)` — SGLang's kernel + our glue (−∞ / length mask, ascending sort, int64);
* `raw_v1`, `raw_v2`: SGLang's functions alone on prepared int32 buffers (v2: plan + transform).

`jit`: the first call of each SGLang variant in the process (N = 1, E = 4,096: the nvcc JIT build
when the cache is cold, else the module's load) and a second call, wall ms; `jit_cache_files_before`:
the files in TVM_FFI_CACHE_DIR before them (0: a cold build was timed). `agreement` per SGLang variant: the fraction of rows
whose selection equals ours exactly, and up to ties (the selected scores sorted are equal).
Writes OUT/topk_kernels.json and OUT/topk_kernels.png. CUDA only.

    python benchmarks/topk_kernels.py --out DIR [--cases decode hit prefill long] [--dist bf16] [--cap-s 0.3]
        [--budget-s 240]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable

import torch

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
from plotting import pyplot, save_png  # noqa: E402
from step_timing import attempt, measure  # noqa: E402

K = 512
RATIO = 4
#: (group, rows, width, causal lengths)
CASES = ([("decode", n, e, False) for n in (1, 8, 64) for e in (8192, 32768, 65536)]
         + [("hit", 32, e, True) for e in (16384, 32768)]
         + [("prefill", 8192, e, True) for e in (4096, 8192, 16384)]
         + [("long", n, e, False) for n in (1, 8, 64) for e in (131072, 262144)] + [("long", 1, 1048576, False)])
#: groups timed unless --cases names others ("long": decode rows wider than the fused kernel's limit)
DEFAULT_GROUPS = ("decode", "hit", "prefill")
METHODS = ("ours", "ours_torch", "ours_bisect", "ours_radix_w4", "ours_radix_w16", "ours_split", "sglang_v1",
           "sglang_v2", "raw_v1", "raw_v2")
#: methods whose selection is compared with ours (agreement, over_ours)
COMPARED = ("ours_torch", "ours_bisect", "ours_radix_w4", "ours_radix_w16", "ours_split", "sglang_v1", "sglang_v2")
#: a row's entry for a method left out by --methods
NOT_TIMED = dict(skipped="not in --methods")


def lengths(rows: int, width: int, causal: bool, device: torch.device | str = "cpu") -> torch.Tensor:
    """[rows] int64 valid columns: `width` each, or causal — the last row's token completes entry
    `width` and row t is rows − 1 − t tokens earlier: (RATIO·width − (rows − 1 − t)) // RATIO, ≥ 0."""
    t = torch.arange(rows, device=device)
    if not causal:
        return torch.full((rows,), width, dtype=torch.int64, device=device)
    return torch.div(RATIO * width - (rows - 1 - t), RATIO, rounding_mode="floor").clamp(min=0)


def make_scores(rows: int, width: int, lens: torch.Tensor, dist: str, gen: torch.Generator) -> torch.Tensor:
    """fp32 [rows, width]: normal (BF16-rounded for `dist` "bf16"), −∞ from each row's length on."""
    s = torch.randn((rows, width), generator=gen, device=lens.device)
    if dist == "bf16":
        s = s.to(torch.bfloat16).to(torch.float32)
    cols = torch.arange(width, device=lens.device)[None, :]
    return s.masked_fill(cols >= lens[:, None], float("-inf"))


def agreement(scores: torch.Tensor, ours: torch.Tensor, other: torch.Tensor) -> dict:
    """Fractions of rows where `other` equals `ours` exactly and up to ties (same sorted selected
    scores), plus the worst row's count of columns not in ours. Both [N, k] ascending, −1 padded."""
    exact = (ours == other).all(dim=1)

    def picked(idx: torch.Tensor) -> torch.Tensor:
        v = scores.gather(1, idx.clamp(min=0)).masked_fill(idx < 0, float("-inf"))
        return torch.sort(v, dim=1, descending=True).values

    ties = (picked(ours) == picked(other)).all(dim=1)
    n = max(1, ours.shape[0])
    missing = 0
    for i in torch.nonzero(~exact).flatten().tolist()[:64]:
        a, b = set(ours[i].tolist()) - {-1}, set(other[i].tolist()) - {-1}
        missing = max(missing, len(b - a))
    return dict(exact_rows=float(exact.sum()) / n, equal_up_to_ties_rows=float(ties.sum()) / n,
                worst_row_columns_not_in_ours=missing)


def wall_ms(fn: Callable[[], object], device: torch.device | None = None) -> float:
    """Wall ms of one call of `fn`, the device synchronised before and after (CUDA by default)."""
    sync = torch.cuda.synchronize if device is None or device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return (time.perf_counter() - t0) * 1e3


def method_calls(TS, IX, module, scores: torch.Tensor, lens: torch.Tensor,
                 methods: tuple[str, ...] = METHODS) -> dict[str, Callable[[], object]]:
    """method → a call of it on this case, for `methods` ("ours" always: the others are compared with it)."""
    n, e = scores.shape
    lens32 = lens.to(torch.int32)
    raw = module is not None and any(m.startswith("raw_") for m in methods)
    pages, page_size = TS.identity_pages(n, e, scores.device) if raw else (None, None)
    out = torch.empty((n, K), dtype=torch.int32, device=scores.device)
    s2 = TS.v2_scores(scores) if raw else None
    calls = {
        "ours": lambda: IX.select_topk(scores, K, check_nan=False),
        "ours_torch": lambda: IX.select_topk(scores, K, check_nan=False, method="torch"),
        "ours_bisect": lambda: IX.TS.select_topk_fused(scores, K, radix=False),
        "ours_radix_w4": lambda: IX.TS.select_topk_fused(scores, K, radix=True, num_warps=4),
        "ours_radix_w16": lambda: IX.TS.select_topk_fused(scores, K, radix=True, num_warps=16),
        "ours_split": lambda: IX.TSPLIT.select_topk_split(scores, K),
        "sglang_v1": lambda: TS.select_topk_sglang(scores, K, valid_lengths=lens, check_nan=False, variant="v1"),
        "sglang_v2": lambda: TS.select_topk_sglang(scores, K, valid_lengths=lens, check_nan=False, variant="v2"),
        "raw_v1": lambda: module.topk_transform_512(scores, lens32, pages, out, page_size),
        "raw_v2": lambda: module.topk_transform_512_v2(s2, lens32, pages, out, page_size, module.plan_topk_v2(lens32)),
    }
    return {m: f for m, f in calls.items() if m == "ours" or m in methods}


def ours_method(IX, rows: int, width: int, cuda: bool = True) -> str:
    """What `select_topk` runs for rows × width by default (as its dispatch decides, split included)."""
    method = IX.topk_method(cuda)
    if method != "fused":
        return method
    if IX.TSPLIT.split_applies(rows, width, K):
        return "split"
    return method if width <= IX.TS.FUSED_MAX_ENTRIES else "torch"


def run_case(TS, IX, module, case: tuple[str, int, int, bool], dist: str, gen: torch.Generator, cap_s: float,
             errors: list[str], skipped: list[str], deadline: float, methods: tuple[str, ...] = METHODS) -> dict:
    """One case's row: per method first call + `measure` (or its error / skip), agreement with ours."""
    group, n, e, causal = case
    dev = gen.device
    lens = lengths(n, e, causal, dev)
    scores = make_scores(n, e, lens, dist, gen)
    row: dict = dict(group=group, rows=n, width=e, k=K, causal=causal, mean_length=float(lens.float().mean()),
                     ours_method=ours_method(IX, n, e, dev.type == "cuda"))
    calls = method_calls(TS, IX, module, scores, lens, methods)
    for name in METHODS:
        row[name] = dict(NOT_TIMED)
    for name, fn in calls.items():
        row[name] = attempt(f"{group} N={n} E={e} {name}",
                            lambda fn=fn: dict(first_ms=wall_ms(fn, dev)) | measure(fn, cap_s, dev),
                            errors, skipped, deadline)
    if "median_us" in row["ours"]:
        ours = calls["ours"]()
        for v in COMPARED:
            if "median_us" in row[v]:
                row[v]["agreement"] = agreement(scores, ours, calls[v]())
                row[v]["over_ours"] = row[v]["median_us"] / row["ours"]["median_us"]
    return row


def case_line(row: dict) -> str:
    """One printed line of a case: median µs per method, agreement exact / up to ties per SGLang variant."""
    return (f"{row['group']} N={row['rows']} E={row['width']}: "
            + "  ".join(f"{m} {row[m]['median_us']:.1f}us" for m in METHODS if "median_us" in row[m])
            + "".join(f"  {v} agree {row[v]['agreement']['exact_rows']:.3f}/{row[v]['agreement']['equal_up_to_ties_rows']:.3f}"
                      for v in COMPARED if "agreement" in row[v])
            + "".join(f"  {m} {'ERROR' if 'error' in row[m] else 'skipped'}" for m in METHODS
                      if "median_us" not in row[m] and row[m] != NOT_TIMED))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--cases", nargs="+", choices=(*DEFAULT_GROUPS, "long"), default=list(DEFAULT_GROUPS))
    p.add_argument("--dist", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--cap-s", type=float, default=0.3, help="timing cap per method and case")
    p.add_argument("--budget-s", type=float, default=240.0, help="cases past this wall time are skipped")
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS),
                   help="methods to time (ours always); without sglang_*/raw_* SGLang's JIT modules are not built")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("topk_kernels.py needs CUDA (SGLang's JIT top-k and the fused kernel)")
    from sglang_dsv41.kernels import indexer_select as IX
    from sglang_dsv41.kernels import topk_sglang as TS

    deadline = time.perf_counter() + args.budget_s
    dev = torch.device("cuda")
    errors: list[str] = []
    skipped: list[str] = []
    methods = tuple(args.methods)
    sglang = any(m.startswith(("sglang_", "raw_")) for m in methods)
    module = TS.sglang_topk_module() if sglang else None
    probe = torch.randn((1, 4096), device=dev)
    cache = Path(os.environ.get("TVM_FFI_CACHE_DIR", Path.home() / ".cache" / "tvm-ffi"))
    cache_files = sum(1 for p in cache.rglob("*") if p.is_file()) if cache.is_dir() else 0
    jit = {}
    for v in ("v1", "v2") if sglang else ():
        jit[v] = attempt(f"jit {v}", lambda v=v: dict(
            first_ms=wall_ms(lambda: TS.select_topk_sglang(probe, K, variant=v)),
            second_ms=wall_ms(lambda: TS.select_topk_sglang(probe, K, variant=v))), errors, skipped, deadline)
        print(f"jit {v}: {jit[v]}", flush=True)
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for group, n, e, causal in CASES:
        if group in args.cases:
            rows.append(run_case(TS, IX, module, (group, n, e, causal), args.dist, gen, args.cap_s, errors, skipped,
                                 deadline, methods))
            print(case_line(rows[-1]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    doc = dict(device=torch.cuda.get_device_name(), k=K, dist=args.dist, ratio=RATIO, jit=jit,
               jit_cache=str(cache), jit_cache_files_before=cache_files, rows=rows,
               errors=errors, skipped=skipped, when=time.strftime("%F %T"),
               timing="step_timing.measure median, 256 MB L2 flush per call; first_ms = the case's first call, wall")
    (args.out / "topk_kernels.json").write_text(json.dumps(doc, indent=1))
    plot(doc, args.out / "topk_kernels.png")
    print(f"errors {len(errors)}, skipped {len(skipped)}")
    return 1 if errors else 0


def plot(doc: dict, path: Path) -> bool:
    """Median µs per case (log scale) of ours and the SGLang wrappers / raw kernels; False without matplotlib."""
    plt = pyplot()
    if plt is None:
        print("matplotlib missing: no plot")
        return False
    fig, ax = plt.subplots(figsize=(12, 4.8))
    rows = doc["rows"]
    width = 0.8 / len(METHODS)
    for j, m in enumerate(METHODS):
        ys = [r.get(m, {}).get("median_us", 0.0) for r in rows]
        ax.bar([i + j * width for i in range(len(rows))], ys, width, label=m)
    ax.set_xticks([i + width * (len(METHODS) - 1) / 2 for i in range(len(rows))],
                  [f"{r['group']}\n{r['rows']}×{r['width'] // 1024}K" for r in rows], fontsize=7)
    ax.set(yscale="log", ylabel="µs per call (median)",
           title=f"indexer top-{doc['k']}: ours vs SGLang JIT top-k ({doc.get('device', '')}, {doc.get('dist', '')} scores)")
    ax.legend(fontsize=7, ncol=len(METHODS))
    save_png(fig, path)
    return True


if __name__ == "__main__":
    raise SystemExit(main())

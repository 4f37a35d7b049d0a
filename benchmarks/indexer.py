"""Benchmark of `sglang_dsv41.kernels.indexer` at Flash indexer shapes (CUDA only).

Decode steps: N ∈ {1, 64} requests with one query each, every request holding E ∈ {4K, 64K,
512K} compressed entries (all visible), index-key rows (Hi 32, Di 128, BF16 FP4 values) at
scattered slots of a pool of N·E rows. For every (N, E) it

1. checks the inputs it times (a failure aborts before any timing): `index_scores` on the first
   and last query against the float64 oracle (`reference.indexer.index_scores` on the gathered
   keys) — float64 head sum bit for bit, fp32 head sum within (Di+Hi+2)·2⁻²³·Σ|w||q||k| — and
   `select_topk` / `candidate_blocks` on those rows against the reference's stable-sort top-k
   and candidate blocks;
2. times (`triton.testing.do_bench`, L2 flushed, median) the scoring kernel (both head sums),
   `select_topk(512)`, `candidate_blocks(8, 2048)`, and one indexer layer per role: source
   (scores + top-k), candidate source (+ blocks), consumer (scores + restriction + top-k); value
   checks off (`check_inputs=False`, `check_nan=False`: what a CUDA-graph decode step runs). For
   E ≤ 64K also the runtime's current torch path (per-request float64 scoring + stable sort);
3. counts the scoring kernel's compulsory HBM bytes (`score_bytes_per_query`) and reports GB/s
   against the device copy bandwidth measured here (read + write of 2 GiB);
4. the packed path (contracts §1/§2): the same keys are also stored as packed FP4 entries of the
   Flash ratio-1 kv source in 170-byte index-key rows (production codec `runtime/kv_layout.py`; the key
   rows ARE the decoded entries), entry index = slot. Asserts packed scores == BF16-key scores
   bit for bit (whole [N, E], both head sums), then times scoring and the source layer; bytes
   count 68 B per key entry (Di/2 nibbles + Di/32 UE8M0) instead of a 256 B BF16 row.

Writes `benchmarks/results/indexer.json` and `indexer.png` (drawn with Pillow). `--sweep` also
times alternative tilings of the scoring kernel (block_j, j_steps, num_warps).

    python benchmarks/indexer.py [--sweep] [--out benchmarks/results]
"""
from __future__ import annotations

import argparse
import json
import math
import platform
from pathlib import Path

import torch
import triton
import triton.testing
from device_bandwidth import copy_bandwidth_gbs  # benchmarks/ is on sys.path when run as a script
from PIL import Image, ImageDraw

from sglang_dsv41.config import DeepseekV41Config
from sglang_dsv41.kernels import indexer as K
from sglang_dsv41.kernels import indexer_select as SEL
from sglang_dsv41.presets import flash_config_dict
from sglang_dsv41.reference import indexer as ref
from sglang_dsv41.reference import ops
from sglang_dsv41.runtime import kv_layout

HI, DI, TOPK, BLOCK, TOPK_BLOCKS = 32, 128, 512, 8, 2048
BATCHES = (1, 64)
ENTRIES = (4096, 65536, 524288)
TORCH_PATH_MAX_E = 65536


KEY_SOURCE = 3          # Flash row: sources (ratio 2, 2, 2, 1); #3 = the ratio-1 source (entry e = row e)
ENCODE_CHUNK = 1 << 20


def decode_case(n: int, e: int, device: torch.device, seed: int) -> dict:
    """n requests of e visible entries each, one query each. Keys are written as packed FP4
    entries (170-byte Flash index-key rows, ratio-1 source) and `keys` holds their decoded BF16 values, so
    `slots` address both (entry index = slot at ratio 1)."""
    g = torch.Generator(device=device).manual_seed(seed)
    rows = n * e
    layout = kv_layout.CompressedRowLayout.from_config(DeepseekV41Config.from_dict(flash_config_dict()).text)
    source = layout.sources[KEY_SOURCE]
    packed_rows = torch.zeros(rows, layout.key_row_bytes, dtype=torch.uint8, device=device)
    keys = torch.empty(rows, DI, dtype=torch.bfloat16, device=device)
    for r0 in range(0, rows, ENCODE_CHUNK):                                # FP4 rows, chunked
        idx = torch.arange(r0, min(rows, r0 + ENCODE_CHUNK), device=device)
        key_part = kv_layout.encode_keys(torch.randn(idx.numel(), DI, generator=g, device=device))
        kv_layout.write_entries(packed_rows, source.key, idx, key_part)
        keys[idx] = kv_layout.decode_keys(key_part, DI).to(torch.bfloat16)
    return dict(
        q=ops.fp4_fake_quant_ue8m0_scale(torch.randn(n, HI, DI, generator=g, device=device)),
        w=ops.bf16(torch.randn(n, HI, generator=g, device=device)) / 64,
        keys=keys,
        packed=K.PackedSource(packed_rows, source.key.offset, source.key.share, source.ratio, layout.head_dim, DI,
                              "key"),
        slots=torch.randperm(rows, generator=g, device=device).view(n, e),
        token_req=torch.arange(n, device=device),
        n_visible=torch.full((n,), e, dtype=torch.int64, device=device))


def packed_args_of(c: dict) -> tuple:
    return c["q"], c["w"], c["packed"], c["slots"], c["token_req"], c["n_visible"]


def check_packed_bit_identical(c: dict) -> None:
    """Packed-key scores == BF16-key scores on the decoded keys, every query and entry."""
    for fp64 in (True, False):
        packed = K.index_scores(*packed_args_of(c), head_sum_exact=fp64)
        plain = K.index_scores(*args_of(c), head_sum_exact=fp64)
        if not torch.equal(packed.view(torch.int32), plain.view(torch.int32)):
            raise AssertionError(f"packed-key scores (head_sum_exact={fp64}) differ from the BF16-key path in "
                                 f"{int((packed != plain).sum())} entries")


def args_of(c: dict) -> tuple:
    return c["q"], c["w"], c["keys"], c["slots"], c["token_req"], c["n_visible"]


def check_against_oracle(c: dict) -> dict:
    """Item 1 of the module docstring; raises AssertionError on any disagreement."""
    exact = K.index_scores(*args_of(c))
    fast = K.index_scores(*args_of(c), head_sum_exact=False)
    n = c["q"].shape[0]
    worst_fast = 0.0
    for t in sorted({0, n - 1}):
        keys = c["keys"][c["slots"][t]].float()
        q, w = c["q"][t:t + 1], c["w"][t:t + 1]
        want = ref.index_scores(ref.IndexQuery(q, w), keys)
        bound = (DI + HI + 2) * 2.0**-23 * torch.einsum("th,thd,nd->tn", w.double().abs(), q.double().abs(),
                                                         keys.double().abs())
        if not torch.equal(exact[t:t + 1], want):
            raise AssertionError(f"query {t}: float64-head-sum scores differ from the oracle in "
                                 f"{int((exact[t:t + 1] != want).sum())} entries")
        err = (fast[t:t + 1].double() - want.double()).abs()
        if not bool((err <= bound).all()):
            raise AssertionError(f"query {t}: fp32-head-sum error {float(err.max()):.3g} exceeds the bound")
        worst_fast = max(worst_fast, float((err / bound.clamp(min=1e-300)).max()))
        allowed = torch.ones_like(want, dtype=torch.bool)
        if not torch.equal(SEL.select_topk(exact[t:t + 1], TOPK), ref.top_k_lower_index_on_ties(want, allowed, TOPK)):
            raise AssertionError(f"query {t}: select_topk differs from the reference top-k")
        nv = c["n_visible"][t:t + 1]
        if not torch.equal(SEL.candidate_blocks(exact[t:t + 1], nv, BLOCK, TOPK_BLOCKS),
                           ref.candidate_blocks(want, nv, BLOCK, TOPK_BLOCKS)):
            raise AssertionError(f"query {t}: candidate_blocks differ from the reference")
    return dict(checked_queries=sorted({0, n - 1}), fp64_head_sum="bitwise", fp32_head_sum_worst_error_over_bound=worst_fast)


def torch_path(c: dict) -> None:
    """The runtime's current path: per request, gather keys, float64 scores, stable-sort top-k."""
    for t in range(c["q"].shape[0]):
        keys = c["keys"][c["slots"][t]].float()
        s = ref.index_scores(ref.IndexQuery(c["q"][t:t + 1], c["w"][t:t + 1]), keys)
        ref.top_k_lower_index_on_ties(s, torch.ones_like(s, dtype=torch.bool), TOPK)


def bench(fn, rep: int = 100) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median")


def measure(c: dict, sweep: bool) -> dict:
    a = args_of(c)
    nv = c["n_visible"]
    off = dict(check_inputs=False)
    scores = K.index_scores(*a)
    blocks = SEL.candidate_blocks(scores, nv, BLOCK, TOPK_BLOCKS)
    t = dict(
        scores_fp64_sum=bench(lambda: K.index_scores(*a, **off)),
        scores_fp32_sum=bench(lambda: K.index_scores(*a, head_sum_exact=False, **off)),
        select_topk=bench(lambda: SEL.select_topk(scores, TOPK, check_nan=False)),
        candidate_blocks=bench(lambda: SEL.candidate_blocks(scores, nv, BLOCK, TOPK_BLOCKS, check_nan=False)),
        restrict_to_blocks=bench(lambda: SEL.restrict_to_blocks(scores, blocks, BLOCK)),
        layer_source=bench(lambda: SEL.select_topk(K.index_scores(*a, **off), TOPK, check_nan=False)),
        layer_candidate_source=bench(lambda: (
            lambda s: (SEL.candidate_blocks(s, nv, BLOCK, TOPK_BLOCKS, check_nan=False),
                       SEL.select_topk(s, TOPK, check_nan=False)))(K.index_scores(*a, **off))),
        layer_consumer=bench(lambda: SEL.select_topk(
            SEL.restrict_to_blocks(K.index_scores(*a, **off), blocks, BLOCK), TOPK, check_nan=False)),
    )
    p = packed_args_of(c)
    t.update(
        scores_packed_fp64_sum=bench(lambda: K.index_scores(*p, **off)),
        scores_packed_fp32_sum=bench(lambda: K.index_scores(*p, head_sum_exact=False, **off)),
        layer_source_packed=bench(lambda: SEL.select_topk(K.index_scores(*p, **off), TOPK, check_nan=False)),
    )
    if c["slots"].shape[1] <= TORCH_PATH_MAX_E:
        t["torch_path"] = bench(lambda: torch_path(c), rep=20)
    out = dict(ms=t)
    if sweep:
        out["sweep"] = []
        for block_j in (32, 64, 128):
            for j_steps in (1, 4, 16):
                for warps in (4, 8):
                    cfg = dict(block_j=block_j, j_steps=j_steps, num_warps=warps)
                    out["sweep"].append(dict(config=cfg, ms=bench(lambda: K.index_scores(*a, **off, **cfg))))
    return out


def draw_png(rows: list[dict], copy_gbs: float, title: str, path: Path) -> None:
    """Two log-log panels: indexer layer time per decode step, scoring bandwidth (Pillow only)."""
    panel_w, panel_h, pad = 520, 380, 60
    img = Image.new("RGB", (2 * panel_w, panel_h + 30), "white")
    d = ImageDraw.Draw(img)
    d.text((10, 5), title, fill="black")
    colors = {1: (31, 119, 180), 64: (214, 39, 40)}
    packed_colors = {1: (120, 180, 230), 64: (240, 140, 120)}

    def panel(x0: int, ylabel: str, series: dict, hline: float | None) -> None:
        xs = [v for pts in series.values() for v, _ in pts]
        ys = [v for pts in series.values() for _, v in pts] + ([hline] if hline else [])
        lx = (math.log10(min(xs)) - 0.2, math.log10(max(xs)) + 0.2)
        ly = (math.log10(min(ys)) - 0.2, math.log10(max(ys)) + 0.2)
        box = (x0 + pad, 40, x0 + panel_w - 20, panel_h - 30)
        px = lambda v: box[0] + (math.log10(v) - lx[0]) / (lx[1] - lx[0]) * (box[2] - box[0])  # noqa: E731
        py = lambda v: box[3] - (math.log10(v) - ly[0]) / (ly[1] - ly[0]) * (box[3] - box[1])  # noqa: E731
        d.rectangle(box, outline="black")
        for e in sorted(set(xs)):
            d.text((px(e) - 14, box[3] + 4), f"{e // 1024}K", fill="black")
        for p in range(math.floor(ly[0]), math.ceil(ly[1]) + 1):
            for v in (10**p, 2 * 10**p, 5 * 10**p):
                if ly[0] <= math.log10(v) <= ly[1]:
                    d.line((box[0] - 4, py(v), box[0], py(v)), fill="black")
                    d.text((x0 + 4, py(v) - 6), f"{v:g}", fill="black")
        d.text((box[0], 24), ylabel + "  vs E (log-log)", fill="black")
        if hline:
            d.line((box[0], py(hline), box[2], py(hline)), fill=(128, 128, 128))
            d.text((box[2] - 150, py(hline) - 14), f"copy {hline:.0f} GB/s", fill=(128, 128, 128))
        for i, (label, pts) in enumerate(series.items()):
            n_req = int(label.split("=")[1].split()[0])
            color = packed_colors[n_req] if "packed" in label else colors[n_req]
            pts = sorted(pts)
            d.line([(px(x), py(y)) for x, y in pts], fill=color, width=2)
            for x, y in pts:
                d.ellipse((px(x) - 3, py(y) - 3, px(x) + 3, py(y) + 3), fill=color)
            d.text((box[0] + 8, box[1] + 6 + 14 * i), label, fill=color)

    series_t = {f"N={n}": [(r["E"], r["ms"]["layer_source"] * 1e3) for r in rows if r["N"] == n] for n in BATCHES}
    series_bw = {f"N={n}": [(r["E"], r["scores_gbs"]) for r in rows if r["N"] == n] for n in BATCHES}
    series_bw.update({f"N={n} packed": [(r["E"], r["packed_scores_gbs"]) for r in rows if r["N"] == n]
                      for n in BATCHES})
    series_t.update({f"N={n} packed": [(r["E"], r["ms"]["layer_source_packed"] * 1e3) for r in rows if r["N"] == n]
                     for n in BATCHES})
    panel(0, "source indexer layer, us per decode step", series_t, None)
    panel(panel_w, "index_scores GB/s (compulsory bytes)", series_bw, copy_gbs)
    img.save(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--sweep", action="store_true", help="also time alternative scoring-kernel tilings")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/indexer.py needs a CUDA GPU")
    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    copy_gbs = copy_bandwidth_gbs(device)
    rows = []
    for n in BATCHES:
        for e in ENTRIES:
            c = decode_case(n, e, device, seed=n * 7 + e)
            accuracy = check_against_oracle(c)
            check_packed_bit_identical(c)
            accuracy["packed_keys"] = "bitwise equal to the BF16-key path (both head sums)"
            m = measure(c, args.sweep)
            nbytes = n * K.score_bytes_per_query(e, e, HI, DI, key_bytes=2, slot_bytes=8, q_bytes=4)
            gbs = nbytes / (m["ms"]["scores_fp64_sum"] * 1e-3) / 1e9
            packed_bytes = n * K.score_bytes_per_query(e, e, HI, DI, slot_bytes=8, q_bytes=4, packed_keys=True)
            packed_gbs = packed_bytes / (m["ms"]["scores_packed_fp64_sum"] * 1e-3) / 1e9
            row = dict(N=n, E=e, scores_bytes=nbytes, scores_gbs=gbs, fraction_of_copy_bw=gbs / copy_gbs,
                       packed_scores_bytes=packed_bytes, packed_scores_gbs=packed_gbs,
                       packed_fraction_of_copy_bw=packed_gbs / copy_gbs, accuracy=accuracy, **m)
            rows.append(row)
            t = m["ms"]
            print(f"N={n:3d} E={e:7d}  scores {t['scores_fp64_sum'] * 1e3:9.1f} us (fp32 sum "
                  f"{t['scores_fp32_sum'] * 1e3:8.1f})  {gbs:6.0f} GB/s ({gbs / copy_gbs:.0%} of copy)  "
                  f"topk {t['select_topk'] * 1e3:8.1f} us  blocks {t['candidate_blocks'] * 1e3:8.1f} us  "
                  f"layer src/cand/cons {t['layer_source'] * 1e3:.0f}/{t['layer_candidate_source'] * 1e3:.0f}/"
                  f"{t['layer_consumer'] * 1e3:.0f} us  packed scores {t['scores_packed_fp64_sum'] * 1e3:9.1f} us "
                  f"{packed_gbs:6.0f} GB/s ({packed_gbs / copy_gbs:.0%})"
                  + (f"  torch path {t['torch_path']:.2f} ms" if "torch_path" in t else ""), flush=True)
            c_source = dict(offset=c["packed"].offset, share=c["packed"].share, ratio=c["packed"].ratio,
                            row_bytes=c["packed"].rows.shape[1])
            del c
            torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    result = dict(device=props.name, sm_count=props.multi_processor_count, torch=torch.__version__,
                  triton=triton.__version__, python=platform.python_version(),
                  shape=dict(heads=HI, head_dim=DI, topk=TOPK, block=BLOCK, topk_blocks=TOPK_BLOCKS,
                             key_dtype="bf16", slot_dtype="int64", q_dtype="fp32"),
                  copy_bandwidth_gbs=copy_gbs, timing="triton.testing.do_bench median (ms), L2 flushed per call",
                  bytes_counted="per query: visible slot ids + key rows (BF16 256 B; packed 68 B = Di/2 nibbles + "
                                "Di/32 UE8M0), q + head weights, the whole score row",
                  packed_source=dict(offset=c_source["offset"], share=c_source["share"], ratio=c_source["ratio"],
                                     row_bytes=c_source["row_bytes"]),
                  rows=rows)
    (args.out / "indexer.json").write_text(json.dumps(result, indent=2))
    draw_png(rows, copy_gbs, f"{props.name}: indexer Hi={HI} Di={DI} top-{TOPK}, decode", args.out / "indexer.png")
    print(f"wrote {args.out / 'indexer.json'} and {args.out / 'indexer.png'}")


if __name__ == "__main__":
    main()

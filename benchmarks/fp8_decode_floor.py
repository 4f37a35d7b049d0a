"""Where the dense FP8 GEMM's time goes at one decode row (issue 21): the runtime's kernel against
floors and two experimental structures, per Flash weight, each as the mean of back-to-back calls in
one CUDA graph over enough weight copies to miss the L2 (the state of a model step).

Variants (µs per call, GB/s of the weight bytes each reads, fraction of the copy bandwidth):

* `current`: `fp8_w8a8_linear` as the runtime calls it (BF16 x, split-K counters); `noquant`: the
  same kernel with `act_quant=False` (x rounded to BF16, no per-block quantisation: what the
  quantisation costs); `gemv`: the opt-in CUDA-core tier;
* `stream_t<P>`: a pure read of the weight bytes on the current kernel's grid shape (64-row
  programs, K cut by `k_chunks(·, ·, P)`, 128 bytes of K per step) — the floor of that structure;
* `fold_n<BN>_t<P>`: an experimental tensor-core structure: x arrives already quantised (BF16
  holding q·s, as `fake_quantize_activations_bf16` gives), each 128-wide K step multiplies E4M3
  widened to BF16 and scaled by its tile scale (exact: powers of two) in one BF16 MMA, split-K
  partials summed inside the launch as the current kernel does. It checks its result against
  `current` (relative error of the largest column);
* `fold_tier` / `fold_tier_<change>`: that structure as the runtime's opt-in tier (`kernels.fp8_fold`,
  `fp8_w8a8_linear(fold=True)`: x quantised inside the kernel) with FOLD_CONFIG, or one field changed;
* `cublas_bf16`: `torch.mm` of one BF16 row and the dequantised BF16 weight (2 B per weight);
* `scaled_mm`: `torch._scaled_mm` of 16 E4M3 rows and the E4M3 weight, unit scales (cuBLASLt FP8;
  not our numerics, a vendor reference for the bytes).

Writes `fp8_decode_floor.json` and `fp8_decode_floor.png` (µs per weight of a few variants) to `--out`.
CUDA only, except `--plot JSON` (the PNG of an earlier record).

    python benchmarks/fp8_decode_floor.py [--out DIR] [--min-mb 160] [--replays 20] [--only PREFIX ...]
    python benchmarks/fp8_decode_floor.py --plot JSON [--out DIR]

`--only`: time just the variants whose labels start with one of the prefixes.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
from device_bandwidth import copy_bandwidth_gbs  # noqa: E402
from plotting import pyplot, save_png  # noqa: E402

#: (name, N, K, groups) of one Flash layer's FP8 products as the runtime runs them (stacks included)
SHAPES = (("wq_a|wkv", 1792, 5120, 1), ("wq_b", 32768, 1280, 1), ("wo_a", 8192, 4096, 8), ("wo_b", 5120, 8192, 1),
          ("shared w1|w3", 4608, 5120, 1), ("shared w2", 5120, 2304, 1), ("indexer wq_b", 4096, 1280, 1))


def _fold_tier_variants() -> dict:
    from sglang_dsv41.kernels.fp8_w8a8 import FOLD_CONFIG as F

    return {"fold_tier": F, "fold_tier_t528": dataclasses.replace(F, target_programs=528),
            "fold_tier_t132": dataclasses.replace(F, target_programs=132),
            "fold_tier_s3": dataclasses.replace(F, num_stages=3),
            "fold_tier_bn32": dataclasses.replace(F, block_n=32),
            "fold_tier_sub8_w8": dataclasses.replace(F, sub_blocks=8, num_warps=8),
            "fold_tier_sub8_w4": dataclasses.replace(F, sub_blocks=8, num_stages=3),
            "fold_tier_sub2": dataclasses.replace(F, sub_blocks=2, num_stages=6)}


@triton.jit
def _stream_kernel(w_ptr, out_ptr, N, K, chunk, stride_wn, BN: tl.constexpr, BK: tl.constexpr):
    """Sum of the bytes of rows [pid_n·BN, +BN) over K range [c·chunk, +chunk): a pure read."""
    pid_n = tl.program_id(0)
    c = tl.program_id(1)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    k_begin = c * chunk
    k_end = tl.minimum(k_begin + chunk, K)
    acc = tl.zeros((BN, BK), dtype=tl.int32)
    for k0 in range(k_begin, k_end, BK):
        kk = k0 + offs_k
        w = tl.load(w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + kk[None, :],
                    mask=(offs_n < N)[:, None] & (kk < k_end)[None, :], other=0)
        acc += w.to(tl.int32)
    tl.store(out_ptr + c * N + offs_n, tl.sum(acc, axis=1), mask=offs_n < N)


@triton.jit
def _fold_kernel(x_ptr, w_ptr, ws_ptr, part_ptr, y_ptr, counters_ptr, M, N, K, n_per_group, chunk_blocks, n_chunks,
                 stride_xm, stride_wn, stride_wsn, stride_pm, stride_pc,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, INTERPRET: tl.constexpr):
    """Experimental: x [M, G·K] BF16 holding quantised values; each BK step: W [BN, BK] E4M3 → fp32 ·
    tile scale → BF16 (exact), one MMA x·Wᵀ; split-K partials, summed by the last arriving chunk."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    c = tl.program_id(2)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    offs_g = tl.arange(0, BK // 32)
    m_ok = offs_m < M
    n_ok = offs_n < N
    group = (pid_n * BN) // n_per_group
    kb_begin = c * chunk_blocks
    k_begin = kb_begin * 32
    k_end = tl.minimum(kb_begin + chunk_blocks, K // 32) * 32
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + group * K
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    s_rows = ws_ptr + (offs_n // 32).to(tl.int64)[:, None] * stride_wsn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BK):
        kk = k0 + offs_k
        live = kk < k_end
        xv = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & live[None, :], other=0.0)
        wv = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & live[None, :], other=0.0)
        sv = tl.load(s_rows + (k0 // 32 + offs_g)[None, :], mask=n_ok[:, None] & ((k0 + offs_g * 32) < k_end)[None, :],
                     other=0.0)
        wf = tl.reshape(tl.reshape(wv.to(tl.float32), (BN, BK // 32, 32)) * sv[:, :, None], (BN, BK))
        if INTERPRET:                          # the interpreter's BF16 dot is unusable (Triton 3.6)
            acc += tl.dot(xv.to(tl.float32), tl.trans(wf), input_precision="ieee")
        else:
            acc += tl.dot(xv, tl.trans(wf.to(tl.bfloat16)))
    tile = offs_m.to(tl.int64)[:, None] * stride_pm + offs_n[None, :]
    ok = m_ok[:, None] & n_ok[None, :]
    tl.store(part_ptr + c.to(tl.int64) * stride_pc + tile, acc, mask=ok)
    tl.debug_barrier()
    slot = counters_ptr + pid_m * tl.num_programs(0) + pid_n
    arrived = tl.atomic_add(slot, 1, sem="acq_rel", scope="gpu")
    if arrived == n_chunks - 1:
        y = tl.zeros((BM, BN), dtype=tl.float32)
        for i in range(n_chunks):
            y += tl.load(part_ptr + i * stride_pc + tile, mask=ok, other=0.0, cache_modifier=".cg")
        tl.store(y_ptr + tile, y.to(tl.bfloat16), mask=ok)
        tl.atomic_xchg(slot, 0, sem="relaxed", scope="gpu")


def fold_linear(xf, values, scales, groups, counters, bn, target, bm=16, bk=128, warps=4, stages=3):
    from sglang_dsv41.kernels.fp8_w8a8 import INTERPRETED, k_chunks
    M, N, K = xf.shape[0], values.shape[0], values.shape[1]
    chunks = k_chunks(N, K, target)
    chunk_blocks = -(-(K // 32) // chunks)
    y = torch.empty(M, N, dtype=torch.bfloat16, device=xf.device)
    part = torch.empty(chunks, M, N, dtype=torch.float32, device=xf.device)
    grid = (triton.cdiv(N, bn), triton.cdiv(M, bm), chunks)
    _fold_kernel[grid](xf, values, scales, part, y, counters, M, N, K, N // groups, chunk_blocks, chunks,
                       xf.stride(0), values.stride(0), scales.stride(0), part.stride(-2), part.stride(0),
                       BM=bm, BN=bn, BK=bk, INTERPRET=INTERPRETED,
                       **({} if INTERPRETED else {"num_warps": warps, "num_stages": stages}))
    return y


def stream_read(values, out, target, bn=64, bk=128, warps=4, stages=3):
    from sglang_dsv41.kernels.fp8_w8a8 import INTERPRETED, k_chunks
    N, K = values.shape
    chunks = k_chunks(N, K, target)
    chunk = -(-(K // 32) // chunks) * 32
    _stream_kernel[(triton.cdiv(N, bn), chunks)](values.view(torch.uint8), out, N, K, chunk, values.stride(0),
                                                 BN=bn, BK=bk,
                                                 **({} if INTERPRETED else {"num_warps": warps, "num_stages": stages}))


def graph_us(calls, replays: int) -> float:
    """Mean µs per call of `calls` (one graph of them all, after two eager rounds)."""
    for _ in range(2):
        for f in calls:
            f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in calls:
            f()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        g.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * len(calls))


def bench_shape(name, N, K, G, dev, min_mb, replays, copy_gbs, only=None):
    from sglang_dsv41.kernels.fp8_w8a8 import dequantize_weight_bf16, fake_quantize_activations_bf16, \
        fp8_w8a8_linear, split_k_counters, weight_bytes

    nbytes = weight_bytes(N, K)
    copies = max(2, min(64, -(-(min_mb << 20) // nbytes)))
    gen = torch.Generator(device=dev).manual_seed(0)
    vals = [(torch.randn(N, K, device=dev, generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
            for _ in range(copies)]
    scales = [torch.exp2(torch.randint(-12, -6, (-(-N // 32), K // 32), device=dev, generator=gen).float())
              for _ in range(copies)]
    x = torch.randn(1, G * K, device=dev, generator=gen).to(torch.bfloat16)
    ctr = split_k_counters(N, dev)
    rec = dict(name=name, N=N, K=K, groups=G, weight_mb=nbytes / 1e6, copies=copies, variants={})
    fold_variants = _fold_tier_variants()

    def put(label, us, nb=nbytes, **extra):
        rec["variants"][label] = dict(us=round(us, 2), gbs=round(nb / us / 1e3, 1),
                                      of_copy=round(nb / us / 1e3 / copy_gbs, 4), **extra)
        print(f"{name:14s} {label:16s} {us:8.2f} µs {nb / us / 1e3:8.1f} GB/s", flush=True)

    def attempt(label, fn, **kw):
        if only and not label.startswith(tuple(only)):
            return
        try:
            fn(label, **kw)
        except Exception as e:  # noqa: BLE001 — an experimental variant may not build
            rec["variants"][label] = dict(error=f"{type(e).__name__}: {e}"[:300])
            print(f"{name:14s} {label:16s} ERROR {type(e).__name__}: {str(e)[:200]}", flush=True)

    ref = fp8_w8a8_linear(x, vals[0], scales[0], groups=G, act_quant=G == 1, counters=ctr).float()
    aq = G == 1
    attempt("current", lambda lb: put(lb, graph_us([lambda i=i: fp8_w8a8_linear(
        x, vals[i], scales[i], groups=G, act_quant=aq, counters=ctr) for i in range(copies)], replays)))
    if aq:
        attempt("noquant", lambda lb: put(lb, graph_us([lambda i=i: fp8_w8a8_linear(
            x, vals[i], scales[i], groups=G, act_quant=False, counters=ctr) for i in range(copies)], replays)))
        attempt("gemv", lambda lb: put(lb, graph_us([lambda i=i: fp8_w8a8_linear(
            x, vals[i], scales[i], groups=G, counters=ctr, gemv=True) for i in range(copies)], replays)))
    out = torch.empty(4096 * N, dtype=torch.int32, device=dev)
    for t in (264, 528, 1056, 2112):
        attempt(f"stream_t{t}", lambda lb, t=t: put(lb, graph_us(
            [lambda i=i: stream_read(vals[i], out, t) for i in range(copies)], replays)))
    attempt("stream_t264_bk256", lambda lb: put(lb, graph_us(
        [lambda i=i: stream_read(vals[i], out, 264, bk=256) for i in range(copies)], replays)))
    for label, cfg in fold_variants.items():
        attempt(label, lambda lb, cfg=cfg: put(lb, graph_us([lambda i=i: fp8_w8a8_linear(
            x, vals[i], scales[i], groups=G, act_quant=aq, counters=ctr, config=cfg) for i in range(copies)],
            replays)))
    xf = fake_quantize_activations_bf16(x) if aq else x
    for bn, t, st in ((64, 264, 4), (128, 264, 4)):
        def run_fold(lb, bn=bn, t=t, st=st):
            y = fold_linear(xf, vals[0], scales[0], G, ctr, bn, t, stages=st).float()
            err = float(((y - ref).abs().max() / ref.abs().max().clamp(min=1e-30)))
            put(lb, graph_us([lambda i=i: fold_linear(xf, vals[i], scales[i], G, ctr, bn, t, stages=st)
                              for i in range(copies)], replays), rel_err_vs_current=err)
        attempt(f"fold_n{bn}_t{t}_s{st}", run_fold)
    if G == 1:
        wb = [dequantize_weight_bf16(vals[i], scales[i]) for i in range(min(copies, max(2, copies // 2)))]
        attempt("cublas_bf16", lambda lb: put(lb, graph_us([lambda w=w: x @ w.t() for w in wb], replays),
                                              nb=2 * N * K))
        del wb
        xq = torch.zeros(16, K, device=dev).to(torch.float8_e4m3fn)
        one = torch.ones((), device=dev)
        attempt("scaled_mm", lambda lb: put(lb, graph_us([lambda i=i: torch._scaled_mm(
            xq, vals[i].t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16) for i in range(copies)], replays),
            nb=N * K))
    return rec


#: the variants the PNG draws, when a record has them (the runtime's two tiers, the floors, cuBLASLt)
PLOTTED = ("current", "fold_tier", "fold_n64_t264_s4", "stream_t264_bk256", "scaled_mm")


def plot(rec: dict, path: Path) -> bool:
    """Grouped bars: µs per call of each weight for the PLOTTED variants the record has; False without
    matplotlib."""
    plt = pyplot()
    if plt is None:
        return False
    shapes = rec["shapes"]
    labels = [v for v in PLOTTED if any("us" in s["variants"].get(v, {}) for s in shapes)]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / max(len(labels), 1)
    for j, label in enumerate(labels):
        xs = [i + j * width for i in range(len(shapes))]
        ax.bar(xs, [s["variants"].get(label, {}).get("us", 0.0) for s in shapes], width, label=label)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(shapes))], [s["name"] for s in shapes], fontsize=8)
    ax.set_ylabel("µs per call (graphed, weights out of L2)")
    ax.set_title(f"dense FP8 products of one Flash layer at one row ({rec['device']}, copy {rec['copy_gbs']:.0f} GB/s)",
                 fontsize=9)
    ax.legend(fontsize=7)
    save_png(fig, path)
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--min-mb", type=int, default=160)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--only", nargs="+", default=None)
    ap.add_argument("--plot", type=Path, default=None, help="only draw the PNG of this earlier JSON")
    args = ap.parse_args()
    if args.plot is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        if not plot(json.loads(args.plot.read_text()), args.out / "fp8_decode_floor.png"):
            raise SystemExit("no PNG: matplotlib is not installed")
        return
    if not torch.cuda.is_available():
        raise SystemExit("fp8_decode_floor.py needs CUDA")
    dev = torch.device("cuda")
    copy_gbs = copy_bandwidth_gbs(dev)
    print(f"copy bandwidth {copy_gbs:.0f} GB/s", flush=True)
    t0 = time.time()
    rows = []
    for shape in SHAPES:
        rows.append(bench_shape(*shape, dev, args.min_mb, args.replays, copy_gbs, args.only))
        torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    rec = dict(device=torch.cuda.get_device_name(dev), copy_gbs=round(copy_gbs, 1), rows=1, shapes=rows,
               seconds=round(time.time() - t0, 1))
    (args.out / "fp8_decode_floor.json").write_text(json.dumps(rec, indent=1))
    if not plot(rec, args.out / "fp8_decode_floor.png"):
        print("no fp8_decode_floor.png: matplotlib is not installed", flush=True)


if __name__ == "__main__":
    main()

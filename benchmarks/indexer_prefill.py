"""The indexer's scoring kernel at the Flash prefill shape (issue 21; CUDA only).

One request of `--tokens` queries (32 heads × 128, FP4 values) over its ⌊T/2⌋ compressed entries
(ratio 2), query t seeing the first ⌊(t + 1)/2⌋: the launch the runtime makes for a prefill chunk of
an indexer layer. The keys are packed FP4 entries written by the production codec
(`benchmarks/indexer.py`'s `decode_case`) and, decoded, BF16 rows at the same slots. Candidates
(median of `triton.testing.do_bench`, value checks off):

* `packed_fp64` — the serving default (packed keys decoded in the kernel, exact head sum);
* `packed_fp32` — the fp32 head sum (SGLANG_DSV41_INDEXER_HEAD_SUM=fp32);
* `bf16_fp64` / `bf16_fp32` — the keys as BF16 rows (a per-forward workspace of decoded keys would
  give these; the scores are the packed path's bit for bit, checked here);
* `packed_fp64_<tiling>` — other block_t (queries a program) / block_j / num_warps (the same bits:
  each score's arithmetic does not depend on the tiling; checked).

Writes indexer_prefill.json.

    python benchmarks/indexer_prefill.py [--tokens 8192] [--out DIR]
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
import triton.testing

HI, DI, RATIO = 32, 128, 2
#: tilings timed besides the default (block_t, block_j, num_warps)
TILINGS = {"t2_j64_w4": (2, 64, 4), "t4_j64_w4": (4, 64, 4), "t8_j64_w8": (8, 64, 8), "t4_j128_w8": (4, 128, 8),
           "t4_j32_w4": (4, 32, 4), "t2_j128_w8": (2, 128, 8)}


def prefill_case(tokens: int, device: torch.device, seed: int = 0) -> dict:
    """The queries, head weights and visibility of one prefill chunk over `indexer.decode_case`'s keys."""
    import indexer as ib
    from sglang_dsv41.reference import ops
    entries = tokens // RATIO
    c = ib.decode_case(1, entries, device, seed)
    g = torch.Generator(device=device).manual_seed(seed + 1)
    t = torch.arange(tokens, device=device)
    return dict(q=ops.fp4_fake_quant_ue8m0_scale(torch.randn(tokens, HI, DI, generator=g, device=device)),
                w=ops.bf16(torch.randn(tokens, HI, generator=g, device=device)) / 64,
                keys=c["keys"], packed=c["packed"], slots=c["slots"],
                token_req=torch.zeros(tokens, dtype=torch.int64, device=device), n_visible=(t + 1) // RATIO)


def candidates(c: dict) -> dict:
    from sglang_dsv41.kernels import indexer as K
    off = dict(check_inputs=False)

    def call(keys, exact, **kw):
        return lambda: K.index_scores(c["q"], c["w"], keys, c["slots"], c["token_req"], c["n_visible"],
                                      head_sum_exact=exact, **off, **kw)
    calls = {"packed_fp64": call(c["packed"], True), "packed_fp32": call(c["packed"], False),
             "bf16_fp64": call(c["keys"], True), "bf16_fp32": call(c["keys"], False)}
    for name, (bt, bj, w) in TILINGS.items():
        calls[f"packed_fp64_{name}"] = call(c["packed"], True, block_t=bt, block_j=bj, num_warps=w)
        calls[f"bf16_fp64_{name}"] = call(c["keys"], True, block_t=bt, block_j=bj, num_warps=w)
    return calls


def run(tokens: int) -> dict:
    dev = torch.device("cuda", torch.cuda.current_device())
    c = prefill_case(tokens, dev)
    rows, refs = {}, {}
    for name, fn in candidates(c).items():
        try:
            out = fn()
            key = "fp32" if "fp32" in name else "fp64"
            refs.setdefault(key, out)
            rows[name] = dict(ms=triton.testing.do_bench(fn, warmup=5, rep=50, return_mode="median"),
                              same_bits_as_packed=bool(torch.equal(out.view(torch.int32), refs[key].view(torch.int32))))
        except Exception as exc:     # a tiling that does not launch is a loser, not an error
            rows[name] = dict(error=f"{type(exc).__name__}: {exc}"[:300])
        print(name, rows[name], flush=True)
    return dict(device=torch.cuda.get_device_name(dev), tokens=tokens, entries=tokens // RATIO, heads=HI,
                head_dim=DI, method=__doc__, candidates=rows)


def main() -> None:
    from results_io import require_cuda, write_result
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = ap.parse_args()
    require_cuda("indexer_prefill benchmark")
    write_result(args.out, "indexer_prefill.json", run(args.tokens))


if __name__ == "__main__":
    main()

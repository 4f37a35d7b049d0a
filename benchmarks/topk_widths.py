"""What the fused top-k's fixed resident widths cost (issue 21; branch `buildonce`).

`kernels.topk_select` holds a row of E ≤ RESIDENT_MAX_ENTRIES scores in registers. Its register
width was the row's next power of two (one kernel build per power of two, each first use a compile
of seconds in a serving request); it is now the smallest of RESIDENT_BLOCKS that holds the row
(`launch_blocks`: three builds in all). A narrow row in a wide block runs its 34 counting passes
over masked lanes, so this times both policies, same kernel, at N rows × E columns:
`pow2_us` (BLOCK = next power of two, the old policy) and `fixed_us` (launch_blocks), median of
`triton.testing.do_bench`, plus the outputs' equality (they must be bit-equal: same contract).
Writes OUT/topk_widths.json.

    python benchmarks/topk_widths.py --out DIR
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton
import triton.testing

ROWS = (1, 8, 64, 512)
WIDTHS = (64, 128, 256, 512, 1024, 2048, 4096, 8192)
K = 512


def run(scores: torch.Tensor, k: int, block: int, resident: bool, warps: int) -> torch.Tensor:
    from sglang_dsv41.kernels.topk_select import WRITE_BLOCK, _topk_rows_kernel

    n, e = scores.shape
    out = torch.empty((n, k), dtype=torch.int64, device=scores.device)
    _topk_rows_kernel[(n,)](scores, out, out, scores, e, e, 1, k, scores.stride(0), out.stride(0), HAS_LEN=False,
                            BLOCK=block, RESIDENT=resident, WBLOCK=min(block, WRITE_BLOCK), CAND=False,
                            num_warps=warps)
    return out


def main() -> None:
    from sglang_dsv41.kernels.topk_select import launch_blocks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for n in ROWS:
        for e in WIDTHS:
            s = torch.randn((n, e), device="cuda", generator=gen)
            p2 = max(16, triton.next_power_of_2(e))
            old = (p2, True, 8 if p2 >= 4096 else 4)
            new = launch_blocks(e)
            a, b = run(s, K, *old), run(s, K, *new)
            row = dict(rows=n, width=e, pow2_block=p2, fixed_block=new[0], equal=bool(torch.equal(a, b)),
                       pow2_us=1e3 * triton.testing.do_bench(lambda: run(s, K, *old), rep=50),
                       fixed_us=1e3 * triton.testing.do_bench(lambda: run(s, K, *new), rep=50))
            row["fixed_over_pow2"] = row["fixed_us"] / row["pow2_us"]
            rows.append(row)
            print(f"N {n:4d} E {e:5d}: pow2 {p2:5d} {row['pow2_us']:8.1f} us  fixed {new[0]:5d} "
                  f"{row['fixed_us']:8.1f} us  x{row['fixed_over_pow2']:.2f}  equal {row['equal']}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    doc = dict(device=torch.cuda.get_device_name(), k=K, rows=rows,
               worst_ratio=max(r["fixed_over_pow2"] for r in rows), all_equal=all(r["equal"] for r in rows))
    (args.out / "topk_widths.json").write_text(json.dumps(doc, indent=1))
    print(f"worst fixed/pow2 {doc['worst_ratio']:.2f}; all equal {doc['all_equal']}")


if __name__ == "__main__":
    main()

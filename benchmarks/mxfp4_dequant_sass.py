"""Instructions per weight byte of the MXFP4 → BF16 upcast the routed-expert GEMMs run on Hopper (CPU only).

`kernels/moe_mxfp4.py` multiplies by MXFP4 experts through `triton_kernels.matmul_ogs`. On SM90 that
kernel upcasts each weight tile to BF16 in registers with `mxfp4_to_bf16_triton` before a BF16 `tl.dot`.
Its decode GEMMs stream about 3.0 TB/s on the H100 and, inferred, about 3.1 on the H200 (docs/performance.md
"Session 35"). Those two GPUs have the same SMs and clocks but 3.0 against 4.3 TB/s of copy bandwidth, so the
kernel may be bound by instruction issue rather than by memory.

This script compiles one upcast of a [256 × 128] weight tile (the kernel's Hopper tile: 8 warps) for
sm_90a with Triton's bundled ptxas, no GPU needed. It counts the SASS opcodes per weight byte and writes the
JSON. The tile's loads, stores and layout conversion are counted too, so the figures bound the upcast from
above. The matmul's inner loop needs a GPU-side dump to count.

    python benchmarks/mxfp4_dequant_sass.py [--out benchmarks/results/mxfp4_dequant_sass.json]
"""
from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess
import tempfile
from pathlib import Path

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton_kernels.tensor_details.layout_details.hopper_value import mxfp4_to_bf16_triton

BLOCK_N, BLOCK_K, NUM_WARPS = 256, 128, 8      # triton_kernels' Hopper MXFP4 tile (HopperMXScaleLayout, 8 warps)
#: opcodes of the upcast's arithmetic: integer bit work and the BF16x2 multiplies (bias, then scale)
INT_OPS, FP_OPS = ("LOP3", "SHF", "PRMT", "IADD3", "IMAD", "LEA", "SGXT"), ("HFMA2", "HMUL2")
SASS_LINE = re.compile(r"\s+/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)")


@triton.jit
def _upcast_tile(W, S, O, BN: tl.constexpr, BK: tl.constexpr):
    """O [BN, BK] bf16 = the upcast of one swizzled tile W [BN / 4, 2·BK] uint8 with scales S [BN, BK / 32]."""
    r = tl.arange(0, BN // 4)
    c = tl.arange(0, 2 * BK)
    n = tl.arange(0, BN)
    w = tl.load(W + r[:, None] * (2 * BK) + c[None, :])
    s = tl.load(S + n[:, None] * (BK // 32) + tl.arange(0, BK // 32)[None, :])
    tl.store(O + n[:, None] * BK + tl.arange(0, BK)[None, :], mxfp4_to_bf16_triton(w, s, 1))


def opcode_counts(sass: str) -> collections.Counter:
    """SASS text (cuobjdump -sass) → count per opcode (the part before the first dot)."""
    return collections.Counter(m.group(1).split(".")[0] for m in map(SASS_LINE.match, sass.splitlines()) if m)


def measure() -> dict:
    src = ASTSource(_upcast_tile, {"W": "*u8", "S": "*u8", "O": "*bf16", "BN": "constexpr", "BK": "constexpr"},
                    constexprs={"BN": BLOCK_N, "BK": BLOCK_K})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": NUM_WARPS})
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "upcast.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        sass = subprocess.run([str(cuobjdump), "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    ops = opcode_counts(sass)
    bytes_per_thread = BLOCK_N * BLOCK_K // 2 / (NUM_WARPS * 32)
    per_byte = {op: n / bytes_per_thread for op, n in ops.most_common()}
    return {"what": "SASS opcodes per MXFP4 weight byte of one upcast tile (loads, stores and layout conversion "
                    "included: an upper bound on the upcast)",
            "target": "sm_90a", "tile": [BLOCK_N, BLOCK_K], "num_warps": NUM_WARPS, "triton": triton.__version__,
            "bytes_per_thread": bytes_per_thread, "instructions_per_thread": sum(ops.values()),
            "per_byte": per_byte,
            "int_per_byte": sum(per_byte.get(op, 0.0) for op in INT_OPS),
            "fp_per_byte": sum(per_byte.get(op, 0.0) for op in FP_OPS)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "mxfp4_dequant_sass.json")
    args = ap.parse_args(argv)
    result = measure()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{result['instructions_per_thread']} instructions for {result['bytes_per_thread']:.0f} weight bytes a "
          f"thread: integer {result['int_per_byte']:.2f}, BF16x2 {result['fp_per_byte']:.2f} per byte")
    for op, v in list(result["per_byte"].items())[:10]:
        print(f"  {op:8s} {v:.2f} per byte")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Launch configurations of the W8A8 FP8 GEMM (`kernels/fp8_w8a8.py`, which re-exports every name here).

`W8A8Config` (tile sizes, warps, stages, which kernel form and tier), the row tiers (ROW_TIERS,
FP8_MMA_ROW_TIERS, PREFILL_CONFIG above them; the opt-in GEMV_CONFIG and the serving default's
FOLD_CONFIG for the fewest rows), the per-weight-shape entries of SHAPE_CONFIGS, `config_for_rows`
(rows → configuration), `divisor_block_n` (a grouped weight's BLOCK_N) and `k_chunks` (how K is cut
into split-K chunks).

Invariants: a configuration is a function of the row tier and the weight shape (N, K, groups) only,
never of M inside a tier, and `k_chunks` of (N, K, `target_programs`) only — so within one
configuration a row's bits depend neither on the batch nor on split-K (`kernels.fp8_w8a8` module
doc, step 3). Different configurations may give other bits, each within that module's bound. No
program straddles two groups of a grouped weight (`divisor_block_n`). Nothing here launches a kernel
or touches a device.
"""
from __future__ import annotations

from dataclasses import dataclass

from sglang_dsv41.kernels.fp8_quant import TILE

#: split-K targets about this many programs for a weight (2 per SM of an H200's 132): shape-only
TARGET_PROGRAMS = 264
#: columns per program assumed when cutting K into chunks (shape-only; any BLOCK_N may run them)
CHUNK_BLOCK_N = 64
#: at least this many 32-wide K blocks per chunk
MIN_CHUNK_BLOCKS = 4


@dataclass(frozen=True)
class W8A8Config:
    """Launch configuration. `sub_blocks` 32-wide K blocks are loaded per loop step (one dot each);
    `fused_quant`: quantise x inside the GEMM; `split_k`: one program per K chunk (fp32 partials);
    `fp8_mma`: the E4M3 operands go into the MMA as they are (Hopper's FP8 tensor-core sums,
    ~14 bits), else widened to f16 first (exact products, fp32 sums: the reference's arithmetic);
    `target_programs`: the program count `k_chunks` aims at (shape-only); `swap_ab`: the weight
    block is the MMA's first operand (yᵀ tile = W·xqᵀ: BLOCK_N weight rows on the MMA's M side,
    BLOCK_M x rows on its N side), the same products and sums in the same order; `gemv`: the CUDA-core
    kernel of `kernels.fp8_gemv` (BLOCK_M = its most rows; `fused_quant` False: x quantised by a launch
    before it); `fold`: the scale-folded BF16 MMA kernel of `kernels.fp8_fold` (32·`sub_blocks` columns per
    MMA; x always quantised inside it)."""
    block_m: int
    block_n: int
    sub_blocks: int
    num_warps: int
    num_stages: int
    fused_quant: bool
    split_k: bool
    fp8_mma: bool = False
    target_programs: int = TARGET_PROGRAMS
    swap_ab: bool = False
    gemv: bool = False
    fold: bool = False


#: split-K target of the decode tier: ≈ 8 programs per SM, so small weights spread over the GPU
DECODE_TARGET_PROGRAMS = 1056

#: the tests compile these for sm_90 (no spills, cp.async pipelining). Row tiers of the serving
#: default (`fp8_mma` False): `mma.sync` f16 for BLOCK_M 16, `wgmma` f16 for BLOCK_M 64 — exact
#: products, fp32 sums (docs/performance.md "session 10")
DECODE_CONFIG = W8A8Config(16, 64, 4, 4, 3, fused_quant=True, split_k=True, target_programs=DECODE_TARGET_PROGRAMS)
MID_CONFIG = W8A8Config(64, 128, 1, 4, 4, fused_quant=True, split_k=True)
PREFILL_CONFIG = W8A8Config(64, 256, 1, 8, 3, fused_quant=False, split_k=False)
#: the mid tier on Hopper's FP8 MMA (`wgmma` m64nNk32 e4m3: DeepGEMM block32's accumulation class)
MID_FP8_CONFIG = W8A8Config(64, 128, 1, 4, 4, fused_quant=True, split_k=True, fp8_mma=True)
#: session 7's decode tier (4 stages, ≈ 2 programs per SM), kept for old-vs-new measurements
DECODE_S7_CONFIG = W8A8Config(16, 64, 4, 4, 4, fused_quant=True, split_k=True)
#: the opt-in `gemv` tier (`kernels.fp8_gemv`, ≤ 4 rows): 64 weight rows and 4 K blocks per step, x quantised
#: inside the kernel, split-K to the decode tier's target
GEMV_CONFIG = W8A8Config(4, 64, 4, 4, 1, fused_quant=True, split_k=True, target_programs=DECODE_TARGET_PROGRAMS,
                         gemv=True)
#: the `fold` tier (`kernels.fp8_fold`, ≤ 16 rows; the serving default's `w8a8_fold`): 64 weight rows, 128 columns
#: per BF16 MMA, ≈ 2 programs per SM (chosen with `benchmarks/fp8_decode_floor.py`, docs/performance.md "Session 29")
FOLD_CONFIG = W8A8Config(16, 64, 4, 4, 4, fused_quant=True, split_k=True, target_programs=TARGET_PROGRAMS, fold=True)
#: rows → configuration: the first tier whose row limit is ≥ M (`fp8_mma`: FP8_MMA_ROW_TIERS)
ROW_TIERS: tuple[tuple[int, W8A8Config], ...] = ((16, DECODE_CONFIG), (256, MID_CONFIG))
FP8_MMA_ROW_TIERS: tuple[tuple[int, W8A8Config], ...] = ((16, DECODE_CONFIG), (256, MID_FP8_CONFIG))
#: (row-tier limit, N, K, groups) → the configuration of that weight shape in that tier, replacing
#: the tier's default: a function of the shape and the tier only (never of M), so a row's bits
#: stay the same at every M of the tier
SHAPE_CONFIGS: dict[tuple[int, int, int, int], W8A8Config] = {
    # the Flash weights whose best candidate beat the tier's default by ≥ 3 % in the H200 sweep
    # (`benchmarks/fp8_w8a8.py --sweep`, docs/performance.md "Session 24"), builds without spills only
    (16, 1280, 5120, 1): W8A8Config(16, 64, 4, 4, 3, fused_quant=True, split_k=True, target_programs=2112),
    (16, 512, 5120, 1): W8A8Config(16, 64, 4, 4, 3, fused_quant=True, split_k=True, target_programs=2112,
                                   swap_ab=True),
    # the stacks of runtime/stacked_linear.py, wq_a | wkv and the shared w1 | w3: wq_a's and w1's picks, not
    # swept for these shapes
    (16, 1792, 5120, 1): W8A8Config(16, 64, 4, 4, 3, fused_quant=True, split_k=True, target_programs=2112),
    (16, 4608, 5120, 1): W8A8Config(16, 64, 4, 4, 3, fused_quant=True, split_k=True, target_programs=2112),
    (16, 32768, 1280, 1): W8A8Config(16, 128, 2, 4, 4, fused_quant=True, split_k=True, target_programs=2112),
    (16, 2304, 5120, 1): W8A8Config(16, 64, 4, 4, 3, fused_quant=True, split_k=True, target_programs=2112),
    (16, 5120, 2304, 1): W8A8Config(16, 64, 4, 4, 3, fused_quant=True, split_k=True, target_programs=2112),
    (256, 8192, 4096, 8): W8A8Config(32, 128, 2, 4, 3, fused_quant=True, split_k=True, target_programs=1056),
    (256, 5120, 8192, 1): W8A8Config(32, 128, 2, 4, 3, fused_quant=True, split_k=True, target_programs=1056),
}


def config_for_rows(m: int, fp8_mma: bool = False, shape: tuple[int, int, int] | None = None,
                    gemv: bool = False, fold: bool = False) -> W8A8Config:
    """The configuration for M rows (decode: small tiles + split-K; prefill: large tiles);
    `fp8_mma`: the mid tier on the FP8 MMA (FP8_MMA_ROW_TIERS); `shape` (N, K, groups): that
    shape's entry of SHAPE_CONFIGS for the tier, if any (not with `fp8_mma`); `gemv`: GEMV_CONFIG
    up to its BLOCK_M rows; `fold`: FOLD_CONFIG likewise."""
    if gemv and fold:
        raise ValueError("config_for_rows: pick one small-row tier, gemv or fold")
    if gemv and m <= GEMV_CONFIG.block_m:
        return GEMV_CONFIG
    if fold and m <= FOLD_CONFIG.block_m:
        return FOLD_CONFIG
    for limit, cfg in (FP8_MMA_ROW_TIERS if fp8_mma else ROW_TIERS):
        if m <= limit:
            if shape is not None and not fp8_mma:
                return SHAPE_CONFIGS.get((limit, *shape), cfg)
            return cfg
    return PREFILL_CONFIG


def divisor_block_n(n_per_group: int, block_n: int, who: str) -> int:
    """`block_n` halved until it divides a group's `n_per_group` rows (a program never straddles two
    groups); ValueError below 16 rows."""
    while n_per_group % block_n:
        block_n //= 2
    if block_n < 16:
        raise ValueError(f"{who}: {n_per_group} rows per group need a 16-row divisor")
    return block_n


def k_chunks(n: int, k: int, target: int = TARGET_PROGRAMS) -> int:
    """How many chunks K is cut into for a weight [n, k] (`kernels.fp8_w8a8` module doc, step 3) — shape only (and
    the configuration's `target`): enough for ≈ `target` programs of CHUNK_BLOCK_N columns,
    ≥ MIN_CHUNK_BLOCKS blocks each."""
    blocks = -(-k // TILE)
    column_programs = -(-n // CHUNK_BLOCK_N)
    wanted = max(1, min(-(-target // column_programs), blocks // MIN_CHUNK_BLOCKS))
    per_chunk = -(-blocks // wanted)
    return -(-blocks // per_chunk)


__all__ = ["CHUNK_BLOCK_N", "DECODE_CONFIG", "DECODE_S7_CONFIG", "DECODE_TARGET_PROGRAMS", "FOLD_CONFIG",
           "FP8_MMA_ROW_TIERS", "GEMV_CONFIG", "MID_CONFIG", "MID_FP8_CONFIG", "MIN_CHUNK_BLOCKS", "PREFILL_CONFIG",
           "ROW_TIERS", "SHAPE_CONFIGS", "TARGET_PROGRAMS", "W8A8Config", "config_for_rows", "divisor_block_n",
           "k_chunks"]

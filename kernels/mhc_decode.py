"""The mHC coefficients in one launch for decode-sized batches (`kernels.mhc.hc_coefficients`
with mix="fused", an opt-in: `mhc_ops.FUSED_MAX_TOKENS`; semantics and bound = `kernels.mhc`'s
module doc, COEFFICIENT_BOUND), and the device helpers `kernels.mhc`'s kernels share with it
(`_slice_partials`, `_hc_params`, `_sigmoid`).

Grid (⌈T/FUSED_BLOCK_T⌉, S) with S = ⌈hc·H / FUSED_SPLIT_K⌉: program (b, s) forms, for the
FUSED_BLOCK_T tokens of block b, the fp32 partial dots of F's columns [s·SPLIT_K, (s+1)·SPLIT_K)
with x (one `tl.dot` per SUB_K columns, input_precision "ieee": FMA, no TF32, chained in column
order) and the partial Σx² (a `tl.sum` per SUB_K columns, added in column order), and stores them
to `partials` [T, S, SLOT]. It then takes an arrival ticket on the block's int32 counter
(`tl.atomic_add`, acq_rel, gpu scope; every thread's stores precede it). The program that draws
the last ticket (S − 1) reloads the block's S partials (L1 bypassed) and adds them in a fixed
order — a `tl.sum` over FUSED_SPLITS_BLOCK splits at a time, the block sums in split order — then
runs the coefficient math of `kernels.mhc._hc_coefficients_kernel` (fp32, IEEE division and
square root, same operation order) on [BLOCK_T, hc, hc] tiles, and sets the counter back to 0,
so a launch leaves `counters` as it found them (zero): CUDA-graph replays reuse them. Which
program arrives last varies; what it computes does not (the partials are in memory, the order of
the sum is fixed), so the result is deterministic. No other atomics, no host sync.

Batch invariance: BLOCK_T, SPLIT_K, SUB_K and the split blocking depend on hc and H only, masked
rows are zeros, and every reduction runs along one token's row, so a token's coefficients do not
depend on T or on the other tokens. The bits differ from the `dot` / `rows` kernels (different
partial sums); each is within COEFFICIENT_BOUND of the reference.

`counters` must hold ⌈T/FUSED_BLOCK_T⌉ zeroed int32 (`fused_counters`); calls that share a
counter buffer must not run concurrently (one stream). Under Triton's interpreter the programs
run one after another, so the last program of the grid does the sum.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

#: Tokens per program (the `tl.dot` minimum): fixed, so a token's bits do not depend on T.
FUSED_BLOCK_T = 16
#: Columns of F per program, and per chained `tl.dot` step.
FUSED_SPLIT_K = 512
FUSED_SUB_K = 64
#: Splits summed per `tl.sum` by the last program (the block sums added in split order).
FUSED_SPLITS_BLOCK = 8
FUSED_NUM_WARPS = 4


@triton.jit
def _sigmoid(z):
    return tl.div_rn(1.0, 1.0 + tl.exp(-z))


@triton.jit
def _hc_params(base_ptr, scale_ptr, HC: tl.constexpr):
    """(α₀, α₁, α₂, b_pre [HC], b_post [HC], b_comb [HC, HC]) of one hyper-connection (spec §3.2)."""
    j = tl.arange(0, HC)
    return (tl.load(scale_ptr), tl.load(scale_ptr + 1), tl.load(scale_ptr + 2), tl.load(base_ptr + j),
            tl.load(base_ptr + HC + j), tl.load(base_ptr + 2 * HC + j[:, None] * HC + j[None, :]))


@triton.jit
def _slice_partials(x_ptr, f_ptr, part_ptr, T, K, stride_xt, tb, s, NUM_SLICES,
                    ROWS: tl.constexpr, ROWS_PAD: tl.constexpr, SLOT: tl.constexpr, BLOCK_T: tl.constexpr,
                    COLS: tl.constexpr, SUB_K: tl.constexpr, SPLIT3: tl.constexpr = False,
                    INTERPRET: tl.constexpr = False):
    """Token block tb, column slice s (COLS columns of F): part[t, s, r] = the fp32 dots (FMA, `ieee`,
    chained over SUB_K-column steps) for r < ROWS and part[t, s, ROWS] = Σx² (a `tl.sum` per step,
    added in step order). A token's values depend on its row only (padded rows and columns are
    zeros). Returns the block's token ids and their mask.

    x (the residual) fp32 or BF16, widened to fp32 as loaded.
    SPLIT3: the dots on BF16 tensor cores instead — x as BF16 (exact: the residual holds BF16
    values), F split into three BF16 parts f₁ + f₂ + f₃ = f exactly, each step's three products
    (exact in fp32) accumulated by the MMA into a fresh fp32 tile that is then added to the running
    dots (`kernels.mhc` module doc, "tc"). INTERPRET: the same values as fp32 `ieee` dots (Triton
    3.6's interpreter multiplies BF16 dot operands as raw integers)."""
    r = tl.arange(0, ROWS_PAD)
    r_ok = r < ROWS
    t = tb.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < T
    dots = tl.zeros([BLOCK_T, ROWS_PAD], dtype=tl.float32)
    sumsq = tl.zeros([BLOCK_T], dtype=tl.float32)
    for i in tl.static_range(COLS // SUB_K):
        k = s * COLS + i * SUB_K + tl.arange(0, SUB_K)
        k_ok = k < K
        f = tl.load(f_ptr + r[None, :] * K + k[:, None], mask=k_ok[:, None] & r_ok[None, :], other=0.0)
        xr = tl.load(x_ptr + t[:, None] * stride_xt + k[None, :], mask=t_ok[:, None] & k_ok[None, :], other=0.0)
        x = xr.to(tl.float32)
        if SPLIT3:
            f1 = f.to(tl.bfloat16)
            r1 = f - f1.to(tl.float32)
            f2 = r1.to(tl.bfloat16)
            f3 = (r1 - f2.to(tl.float32)).to(tl.bfloat16)
            if INTERPRET:
                step = tl.dot(x, f1.to(tl.float32), input_precision="ieee")
                step = tl.dot(x, f2.to(tl.float32), step, input_precision="ieee")
                step = tl.dot(x, f3.to(tl.float32), step, input_precision="ieee")
            else:
                xb = xr.to(tl.bfloat16)                  # exact (BF16 values); BF16 R as loaded
                step = tl.dot(xb, f1, out_dtype=tl.float32)
                step = tl.dot(xb, f2, step, out_dtype=tl.float32)
                step = tl.dot(xb, f3, step, out_dtype=tl.float32)
            dots = dots + step
        else:
            dots = tl.dot(x, f, dots, input_precision="ieee")
        sumsq = sumsq + tl.sum(x * x, axis=1)
    out = part_ptr + (t * NUM_SLICES + s) * SLOT
    tl.store(out[:, None] + r[None, :], dots, mask=t_ok[:, None] & r_ok[None, :])
    tl.store(out + ROWS, sumsq, mask=t_ok)
    return t, t_ok


@triton.jit
def _hc_fused_coefficients_kernel(x_ptr, f_ptr, part_ptr, cnt_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr,
                                  T, K, stride_xt, iters,
                                  HC: tl.constexpr, ROWS_PAD: tl.constexpr, SLOT: tl.constexpr,
                                  SPLITS: tl.constexpr, SPLITS_BLOCK: tl.constexpr, SPLIT_K: tl.constexpr,
                                  SUB_K: tl.constexpr, BLOCK_T: tl.constexpr,
                                  RMS_EPS: tl.constexpr, HC_EPS: tl.constexpr):
    """Partial dots of one (token block, column split); the last split of the block to arrive
    sums all splits in fixed order and writes pre / post / comb (module doc)."""
    ROWS: tl.constexpr = HC * (2 + HC)
    tb = tl.program_id(0)
    t, t_ok = _slice_partials(x_ptr, f_ptr, part_ptr, T, K, stride_xt, tb, tl.program_id(1), SPLITS,
                              ROWS, ROWS_PAD, SLOT, BLOCK_T, SPLIT_K, SUB_K)

    tl.debug_barrier()                                   # every thread's partials stored before the ticket
    arrived = tl.atomic_add(cnt_ptr + tb, 1, sem="acq_rel", scope="gpu")
    if arrived == SPLITS - 1:
        j = tl.arange(0, HC)
        jj = tl.arange(0, HC * HC)
        sb = tl.arange(0, SPLITS_BLOCK)
        row = part_ptr + t[:, None] * (SPLITS * SLOT) + sb[None, :] * SLOT          # [BLOCK_T, SPLITS_BLOCK]
        ss = tl.zeros([BLOCK_T], dtype=tl.float32)
        pre_dot = tl.zeros([BLOCK_T, HC], dtype=tl.float32)
        post_dot = tl.zeros([BLOCK_T, HC], dtype=tl.float32)
        comb_dot = tl.zeros([BLOCK_T, HC * HC], dtype=tl.float32)
        for s0 in tl.static_range(0, SPLITS, SPLITS_BLOCK):
            ok = t_ok[:, None] & (s0 + sb < SPLITS)[None, :]
            p = row + s0 * SLOT
            ss = ss + tl.sum(tl.load(p + ROWS, mask=ok, other=0.0, cache_modifier=".cg"), axis=1)
            pre_dot = pre_dot + tl.sum(tl.load(p[:, :, None] + j[None, None, :], mask=ok[:, :, None], other=0.0,
                                               cache_modifier=".cg"), axis=1)
            post_dot = post_dot + tl.sum(tl.load(p[:, :, None] + HC + j[None, None, :], mask=ok[:, :, None],
                                                 other=0.0, cache_modifier=".cg"), axis=1)
            comb_dot = comb_dot + tl.sum(tl.load(p[:, :, None] + 2 * HC + jj[None, None, :], mask=ok[:, :, None],
                                                 other=0.0, cache_modifier=".cg"), axis=1)

        inv_rms = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(ss, K.to(tl.float32)) + RMS_EPS))       # [BLOCK_T]
        a0, a1, a2, b_pre, b_post, b_comb = _hc_params(base_ptr, scale_ptr, HC)
        pre = _sigmoid(a0 * (pre_dot * inv_rms[:, None]) + b_pre[None, :]) + HC_EPS
        post = 2.0 * _sigmoid(a1 * (post_dot * inv_rms[:, None]) + b_post[None, :])
        comb = tl.reshape(comb_dot, [BLOCK_T, HC, HC])                                   # [t, j, k]
        logits = a2 * (comb * inv_rms[:, None, None]) + b_comb[None, :, :]
        shape: tl.constexpr = (BLOCK_T, HC, HC)
        e = tl.exp(logits - tl.max(logits, axis=2)[:, :, None])
        m = tl.div_rn(e, tl.broadcast_to(tl.sum(e, axis=2)[:, :, None], shape)) + HC_EPS
        m = tl.div_rn(m, tl.broadcast_to(tl.sum(m, axis=1)[:, None, :] + HC_EPS, shape))
        for _ in range(1, iters):
            m = tl.div_rn(m, tl.broadcast_to(tl.sum(m, axis=2)[:, :, None] + HC_EPS, shape))
            m = tl.div_rn(m, tl.broadcast_to(tl.sum(m, axis=1)[:, None, :] + HC_EPS, shape))
        tl.store(pre_ptr + t[:, None] * HC + j[None, :], pre, mask=t_ok[:, None])
        tl.store(post_ptr + t[:, None] * HC + j[None, :], post, mask=t_ok[:, None])
        tl.store(comb_ptr + t[:, None, None] * (HC * HC) + j[None, :, None] * HC + j[None, None, :], m,
                 mask=t_ok[:, None, None])
        tl.atomic_xchg(cnt_ptr + tb, 0, sem="relaxed", scope="gpu")                      # zero for the next launch


def fused_blocks(tokens: int) -> int:
    """Token blocks (= counters used) of a fused call of `tokens` rows."""
    return triton.cdiv(tokens, FUSED_BLOCK_T)


def fused_counters(tokens: int, device: torch.device | str) -> Tensor:
    """Zeroed int32 arrival counters for fused calls of up to `tokens` rows; allocate outside
    CUDA-graph capture and reuse: every launch leaves them zero."""
    return torch.zeros(max(1, fused_blocks(tokens)), dtype=torch.int32, device=device)


def launch_fused(x: Tensor, f: Tensor, base: Tensor, scale: Tensor, pre: Tensor, post: Tensor, comb: Tensor, *,
                 hc: int, rms_eps: float, hc_eps: float, sinkhorn_iters: int, counters: Tensor | None,
                 opts: dict, split_k: int = FUSED_SPLIT_K) -> None:
    """Launch `_hc_fused_coefficients_kernel` on x [T, hc·H] (unit column stride), f [rows, hc·H]
    fp32 contiguous; writes pre / post / comb. `counters`: `fused_counters` of at least
    `fused_blocks(T)` entries, or None (a zeroed buffer for this call only). `split_k`: columns
    per program (a multiple of FUSED_SUB_K; other values than the default are for sweeps)."""
    T, K = x.shape
    blocks = fused_blocks(T)
    if counters is None:
        counters = torch.zeros(blocks, dtype=torch.int32, device=x.device)
    elif counters.dtype != torch.int32 or counters.dim() != 1 or counters.numel() < blocks \
            or counters.device != x.device:
        raise ValueError(f"hc_coefficients: counters must be 1-D int32 with ≥ {blocks} entries on {x.device}, got "
                         f"{counters.dtype} {tuple(counters.shape)} on {counters.device}")
    rows = hc * (2 + hc)
    slot = 1 << rows.bit_length()                         # ≥ rows + 1 (Σx² after the dots)
    splits = triton.cdiv(K, split_k)
    partials = torch.empty(T, splits, slot, dtype=torch.float32, device=x.device)
    _hc_fused_coefficients_kernel[(blocks, splits)](
        x, f, partials, counters, base, scale, pre, post, comb, T, K, x.stride(0), sinkhorn_iters,
        HC=hc, ROWS_PAD=max(16, 1 << (rows - 1).bit_length()), SLOT=slot, SPLITS=splits,
        SPLITS_BLOCK=min(FUSED_SPLITS_BLOCK, 1 << (splits - 1).bit_length()), SPLIT_K=split_k,
        SUB_K=FUSED_SUB_K, BLOCK_T=FUSED_BLOCK_T, RMS_EPS=float(rms_eps), HC_EPS=float(hc_eps), **opts)

"""Prefill attention as ONE FlashMLA sparse launch over the BF16 workspace (issue 21; opt-in
`SGLANG_DSV41_ATTN_PREFILL=flashmla`), and the same kernel at decode (opt-in
`SGLANG_DSV41_ATTN_DECODE=flashmla`, `decode_attend`: every batch without the prefill workspace).

The workspace path (`attention_prefill`: each kv source's packed entries decoded once per
forward into BF16 rows) normally feeds our Triton `sparse_sink_attention`. Here the same
workspace feeds `sgl_kernel.flash_mla.flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v,
attn_sink, topk_length)` (SGLang 0.5.17's sgl-kernel; the kernel takes ONE BF16 key tensor
[s_kv, 1, d] and int32 indices [s_q, 1, topk] into it, −1 = no key). So the layer's SWA rows
are gathered in front of the workspace and every query's two key lists become one index list:

    kv      = [ SWA block (M = N + R·(W−1) rows) | workspace (R·width rows) ]
    SWA block row of request b, position q:  starts_b + b·(W−1) + (q − prefix_b + W − 1)
    query t, window column c (position p_t − W + 1 + c, `swa_key_positions` order):
             row t + b·(W−1) + c          (the layout's invariant p_t = prefix_b + t − starts_b)
    compressed key (workspace row r, −1 = none):  M + r

Each (request, position) has exactly one SWA row (rows of position < 0 hold slot 0 and are
never indexed), so the block is a gather of M rows, not N·W. The list is compacted valid-first
and padded with −1 to a multiple of TOPK_BLOCK (128); `topk_length` = its valid count. No
de-duplication (§3.4.5): a key listed twice counts twice, as in the Triton kernel.

Math (the kernel's, per query and head; K = V = the BF16 row, scale = the model's D^−1/2, the
sink a raw logit as in `kernels.sparse_attention`):
    s_j = scale·q·k_j,  P_j = e^{s_j − m},  o = Σ_j bf16(P_j)·v_j / Σ_j P_j · 1/(1 + e^{sink − lse})
The kernel rounds P to BF16 before P·V (the Triton kernel keeps ≈16 bits), so the output
differs from the Triton workspace path by at most `flashmla_bound` (module constant
P_ROUNDING: 2^−9 relative per weight, summed over weights that add to ≤ 1 of the denominator,
doubled for the normaliser's rounding) plus one BF16 ulp of the output scale each side.

Decode (`decode_attend`): no workspace exists, so `kernels.key_gather.gather_key_rows` copies each
query's SWA rows and decodes its packed entries (exact) into rows t·T + c of one BF16 tensor, zero-
padded to KERNEL_DIM, T = W + K rounded up to TOPK_BLOCK, with indices t·T + c (−1 = no key) in
column order, no `topk_length`. Same math and bound as the prefill launch.

Plan (`plan_flashmla`, at start-up, logged by `attention_ops.KernelAttentionOps.planned`):
`native` when heads per rank ∈ KERNEL_HEADS and head_dim == KERNEL_DIM; `padded` when heads or
head_dim are smaller (q padded with zero heads to the next of KERNEL_HEADS, q and kv with zero
dims to KERNEL_DIM: the dot products and the kept outputs are unchanged); `bf16` (the Triton
workspace path) for more heads, head_dim > KERNEL_DIM or a device that is not Hopper/Blackwell.
Never a per-call fallback. Missing `sgl_kernel.flash_mla` with the opt-in set raises at start-up.
"""
from __future__ import annotations

import dataclasses
import importlib

import torch
from torch import Tensor

#: the kernel tiles heads by 64 (its SM90 prefill kernel is `head64`) …
HEAD_BLOCK = 64
#: … and is built for these head counts (64: SM90 `head64`; 128: SM100 `head128`, two SM90 head tiles)
KERNEL_HEADS = (64, 128)
#: … and the index list by two of its 64-index blocks (SM90 phase1: "topk % (2*B_TOPK) == 0")
TOPK_BLOCK = 128
#: the head dim of the kernel's BF16 key rows (d_qk 512 with d_v 512, or 576)
KERNEL_DIM = 512
#: relative error of one BF16-rounded softmax weight P ∈ (0, 1] (round to nearest, 8 mantissa bits)
P_ROUNDING = 2.0 ** -9
#: compute capabilities with a FlashMLA sparse prefill kernel (SM90 Hopper, SM100 Blackwell)
CAPABILITIES = (9, 10)
KERNEL_MODULE = "sgl_kernel.flash_mla"


@dataclasses.dataclass(frozen=True)
class FlashMLAPlan:
    """`mode` ∈ {native, padded, bf16}; the padded shape the kernel sees; `reason` for the log."""

    mode: str
    heads: int
    kernel_heads: int
    head_dim: int
    reason: str


def plan_flashmla(heads: int, head_dim: int, capability: tuple[int, int] | None) -> FlashMLAPlan:
    """The start-up plan (module doc); `capability` None = not a CUDA device."""
    kernel_heads = next((k for k in KERNEL_HEADS if heads <= k), 0)
    if capability is None or capability[0] not in CAPABILITIES:
        return FlashMLAPlan("bf16", heads, heads, head_dim,
                            f"compute capability {capability} has no FlashMLA sparse prefill kernel")
    if head_dim > KERNEL_DIM or not kernel_heads:
        return FlashMLAPlan("bf16", heads, heads, head_dim,
                            f"{heads} heads × {head_dim}: the kernel takes ≤ {KERNEL_HEADS[-1]} heads × ≤ {KERNEL_DIM}")
    if kernel_heads == heads and head_dim == KERNEL_DIM:
        return FlashMLAPlan("native", heads, heads, head_dim, f"{heads} heads × {head_dim}")
    return FlashMLAPlan("padded", heads, kernel_heads, head_dim,
                        f"{heads} heads × {head_dim} padded with zeros to {kernel_heads} × {KERNEL_DIM}")


def load_kernel():
    """`flash_mla_sparse_fwd` of the installed sgl-kernel; RuntimeError when it does not import."""
    try:
        return importlib.import_module(KERNEL_MODULE).flash_mla_sparse_fwd
    except (ImportError, AttributeError) as e:
        raise RuntimeError(f"sglang-dsv41: the flashmla choice (SGLANG_DSV41_ATTN_PREFILL or _ATTN_DECODE) needs {KERNEL_MODULE}."
                           f"flash_mla_sparse_fwd (sgl-kernel of SGLang 0.5.17), which failed to load ({e})") from e


def swa_gather(token_req: Tensor, starts: Tensor, swa_slots: Tensor) -> tuple[Tensor, Tensor]:
    """(SWA slots [M = N + R·(W−1)] of the SWA block, rows [N, W] of each query's window in it,
    −1 where `swa_slots` is −1) for an extend batch of R = len(`starts`) requests whose query t
    has window slots `swa_slots[t]` (`swa_key_positions` order) and request `token_req[t]`
    (module doc; needs the `BatchLayout` invariant: a request's tokens are consecutive from
    `starts[b]` at consecutive positions). Tensor-only, no host sync."""
    N, W = swa_slots.shape
    R = starts.numel()
    dev = swa_slots.device
    base = torch.arange(N, device=dev) + token_req.to(torch.int64) * (W - 1)       # row of window column 0
    cols = torch.arange(W, device=dev)
    rows = torch.where(swa_slots >= 0, base[:, None] + cols[None, :], -1)
    gather = torch.zeros(N + R * (W - 1), dtype=torch.int64, device=dev)
    gather[base + W - 1] = swa_slots[:, W - 1].to(torch.int64)                    # each token's own row
    if W > 1 and R:
        first = starts.to(torch.int64).clamp(max=max(N - 1, 0))                   # a request without tokens: unused rows
        tail = (starts.to(torch.int64) + torch.arange(R, device=dev) * (W - 1))[:, None] + cols[None, :W - 1]
        gather[tail] = swa_slots[first, :W - 1].to(torch.int64).clamp(min=0)      # the prefix tail before each request
    return gather, rows


def combined_indices(swa_rows: Tensor, comp_rows: Tensor | None, swa_block: int) -> tuple[Tensor, Tensor]:
    """(int32 [N, 1, T] kernel indices, int32 [N] valid counts): the window rows then the
    workspace rows + `swa_block`, compacted valid-first (order within kept), −1 after,
    T = (W + K) rounded up to TOPK_BLOCK."""
    parts = [swa_rows]
    if comp_rows is not None:
        parts.append(torch.where(comp_rows >= 0, comp_rows + swa_block, -1))
    idx = torch.cat(parts, dim=1).to(torch.int64)
    N, width = idx.shape
    T = -(-width // TOPK_BLOCK) * TOPK_BLOCK
    valid = idx >= 0
    dest = torch.where(valid, torch.cumsum(valid, dim=1) - 1, T)                 # invalid → a spill column
    out = torch.full((N, T + 1), -1, dtype=torch.int64, device=idx.device)
    out.scatter_(1, dest, torch.where(valid, idx, -1))
    return out[:, None, :T].to(torch.int32).contiguous(), valid.sum(dim=1).to(torch.int32)


@dataclasses.dataclass(frozen=True)
class FlashMLAInputs:
    """What one layer's launch needs beside q, sink and the layer's SWA cache (`prefill_inputs`)."""

    workspace: Tensor          # BF16 [R·width, head_dim]
    swa_gather: Tensor         # int64 [M] SWA slots of the SWA block
    indices: Tensor            # int32 [N, 1, T]
    lengths: Tensor            # int32 [N]


def prefill_inputs(workspace: Tensor, token_req: Tensor, starts: Tensor, swa_slots: Tensor,
                   comp_rows: Tensor | None) -> FlashMLAInputs:
    """`FlashMLAInputs` of a batch (module doc): `comp_rows` [N, K] workspace rows (−1 = none)."""
    gather, rows = swa_gather(token_req, starts, swa_slots)
    indices, lengths = combined_indices(rows, comp_rows, gather.numel())
    return FlashMLAInputs(workspace, gather, indices, lengths)


def key_rows(swa_cache: Tensor, inputs: FlashMLAInputs, dim: int = KERNEL_DIM) -> Tensor:
    """BF16 [M + R·width, 1, dim]: the SWA block then the workspace, zero-padded to `dim`."""
    rows = torch.cat((swa_cache[inputs.swa_gather].to(torch.bfloat16), inputs.workspace), dim=0)
    if rows.shape[1] < dim:
        rows = torch.nn.functional.pad(rows, (0, dim - rows.shape[1]))
    return rows[:, None, :].contiguous()


def _kernel_query(plan: FlashMLAPlan, q: Tensor, sink: Tensor) -> tuple[Tensor, Tensor]:
    """(q BF16, sinks fp32) as the kernel takes them under `plan` (zero heads / dims when padded)."""
    if plan.mode not in ("native", "padded"):
        raise ValueError(f"attention_flashmla: plan {plan.mode!r} does not launch FlashMLA")
    N, H, D = q.shape
    qb = q.to(torch.bfloat16)
    sinks = sink.to(torch.float32)
    if plan.mode == "padded":
        qb = torch.nn.functional.pad(qb, (0, KERNEL_DIM - D, 0, plan.kernel_heads - H))
        sinks = torch.nn.functional.pad(sinks, (0, plan.kernel_heads - H))
    return qb.contiguous(), sinks.contiguous()


def attend(kernel, plan: FlashMLAPlan, q: Tensor, sink: Tensor, swa_cache: Tensor, inputs: FlashMLAInputs,
           scale: float, use_lengths: bool = True) -> Tensor:
    """o [N, H, D] BF16 of one launch of `kernel` (`flash_mla_sparse_fwd` or a stand-in with its
    signature) under `plan` (native / padded), `scale` the model's softmax scale."""
    N, H, D = q.shape
    qb, sinks = _kernel_query(plan, q, sink)
    out = kernel(qb, key_rows(swa_cache, inputs), inputs.indices, scale, KERNEL_DIM,
                 sinks, inputs.lengths if use_lengths else None)[0]
    return out[:, :H, :D]


def decode_attend(kernel, plan: FlashMLAPlan, q: Tensor, sink: Tensor, swa_cache: Tensor, swa_slots: Tensor,
                  comp_cache, comp_entries: Tensor | None, scale: float) -> Tensor:
    """o [N, H, D] BF16 of one launch of `kernel` over each query's own keys (module doc, "Decode"):
    window rows `swa_slots` [N, W] of `swa_cache`, packed entries `comp_entries` [N, K] of the
    `PackedSource` `comp_cache` (None: window only)."""
    from sglang_dsv41.kernels.key_gather import gather_key_rows

    N, H, D = q.shape
    qb, sinks = _kernel_query(plan, q, sink)
    kv, indices = gather_key_rows(swa_cache, swa_slots, comp_cache, comp_entries, KERNEL_DIM, TOPK_BLOCK)
    return kernel(qb, kv, indices, scale, KERNEL_DIM, sinks, None)[0][:, :H, :D]


def flashmla_bound(key_max: Tensor, out_scale: Tensor) -> Tensor:
    """Largest |FlashMLA − Triton| allowed per element (module doc): 2·P_ROUNDING·max|k| of the
    query's keys (`key_max` broadcastable) + one BF16 ulp of the output scale for each kernel's
    final rounding (2 ulps; `out_scale` = max |o| of the query and head)."""
    ulp = torch.exp2(torch.floor(torch.log2(out_scale.clamp(min=2.0 ** -126))) - 7)
    return 2 * P_ROUNDING * key_max + 2 * ulp


__all__ = ["CAPABILITIES", "FlashMLAInputs", "FlashMLAPlan", "HEAD_BLOCK", "KERNEL_DIM", "KERNEL_HEADS", "P_ROUNDING",
           "TOPK_BLOCK", "attend", "combined_indices", "decode_attend", "flashmla_bound", "key_rows", "load_kernel",
           "plan_flashmla", "prefill_inputs", "swa_gather"]

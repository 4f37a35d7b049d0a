"""Sparse attention with a sink over slot-addressed caches — Triton (spec `model.md` §3.4.5).

Drop-in for the dense gather + `reference.attention.attend_with_sink` of
`runtime.attention.attention_sublayer`: the keys of query t are the rows of `swa_cache` at
`swa_slots[t]` (its SWA window, −1 = no key) followed by the rows of `comp_cache` at
`comp_slots[t]` (its selected compressed entries, −1 = none; ratio-0 layers pass None).

Invariant (for every query t and head h; K = V = the cached BF16 row, one KV head):
    s_j  = scale · (q[t, h] · k_j)                  over the valid keys j of both lists
    o    = Σ_j e^{s_j} k_j / (Σ_j e^{s_j} + e^{sink[h]})      (sink = raw logit; −∞ = plain softmax)
evaluated with fp32 accumulation and rounded once to the output dtype (BF16 → RNE on GPU). No
de-duplication between the two lists (§3.4.5); a slot listed twice counts twice. A query with
no valid key and sink −∞ has no defined output: it comes out NaN (`validate=True` raises instead;
the model never produces it — the SWA window always holds the token itself).

Numerics: logits are BF16×BF16 tensor-core dots with fp32 accumulation (exact products); the
online softmax runs in the log2 domain in fp32; P·V uses P split into a BF16 high part and a BF16
remainder (two tensor-core dots), so P keeps ~16 mantissa bits instead of the 8 of the usual
flash-attention P cast. The fp32 result is within ~2^-17·max|k| of the exact value, so the
BF16 output differs from the float64 oracle (`attend_with_sink`) by at most one BF16 ulp of the
output scale (the largest |o| of that query and head), where the exact value lies next to a
rounding midpoint. Batch invariance: a query's result depends only on its own inputs and on
`num_splits` (the summation order); `plan_config` picks splits from N, so for bitwise equality
across batch compositions pass a `config` with a fixed `num_splits` (e.g. 1).

Kernel structure (Hopper-oriented; block sizes from D, H and W + K via `plan_config`, never
Flash constants): one program = one query × a block of `block_h` heads × one split of the key
tiles. A key tile is `block_n` slots of one list; its rows are gathered once and serve every
head of the block. Every tile is split by dimension parity (column i of an `_e` / `_o` tile
is dim 2i / 2i+1; D must be even): QK^T is q_e·k_eᵀ then q_o·k_oᵀ in one fp32 accumulation
chain ([block_h, block_d/2] × [block_d/2, block_n] dots), P·V updates acc_e and acc_o
([block_h, block_n] × [block_n, block_d/2]); q is loaded and the output stored with stride-2
pointers, BF16 cache rows are read as int32 words (dims 2i, 2i+1) and split by truncation, packed
FP4 bytes decode to the two tiles directly (low / high nibble) — no interleave, join or reshape
anywhere. Non-power-of-two D is masked (block_d = next_pow2(D) ≥ 32). The sink is folded into the running denominator (m₀ = sink, l₀ = 1). Decode
with few queries splits the key tiles of a query over `num_splits` programs (flash-decoding);
each writes (m, l, unnormalised acc) to fp32 scratch and a second kernel merges them and adds
the sink. Splits never hold fewer than ⌈2H/block_n⌉ tiles, so the scratch written per split
(H·D·4 B) never exceeds the key bytes it read. Decode (N = batch) and extend (N = many tokens)
are the same launch (prefill over BF16 workspace rows: `plan_prefill_config`). At the Flash
config (block_h 32, block_n 32, 8 warps, 2 stages) the sm_90
build uses 255 registers per thread with no spills and 70 KB of shared memory, BF16
`mma.sync` dots, cp.async-pipelined BF16 rows (block_h 64 would reach wgmma but spills); the
tests compile it for sm_90. Launch planning (`SparseAttentionConfig`, `plan_config`, `plan_decode_config`,
`plan_prefill_config`, `merge_tile` and their constants) lives in `kernels/sparse_attention_plan.py`,
re-exported here.

Memory traffic per query (bytes read from HBM, upper bound; D = head_dim, H = heads,
n_valid ≤ W + K valid keys, idx = 4 or 8 bytes per slot):
    H·D·2 (q) + (W + K)·idx (slot lists) + n_valid·D·2 (key rows) + H·4 (sink),
    written: H·D·2 (out); with s > 1 splits also s·H·(D + 2)·4 written and read back (L2-resident).
The ⌈H/block_h⌉ head blocks of a query re-read the same key rows, normally from L2. Flash
(D 512, H 64, W 128, K 512, int32 slots): 64 KiB q + 2.5 KiB slots + 640 KiB keys + 64 KiB
out ≈ 0.77 MB per decode query. With packed compressed entries (`PackedSource` of the latent
rows, contracts §1/§2: the global KV stays 896 B/token, no BF16 copy) a compressed key costs
D/2 + D/16 = 288 B
(E2M1 nibbles + E4M3 scales, decoded exactly in the kernel: `packed_rows.load_latent_pair_tiles`,
two byte gathers per payload byte, decoded once per tile) instead of 1024 B: 128 KiB SWA + 144
KiB compressed ≈ 0.41 MB per decode query. sm_90 build of the packed Flash plan: the compressed
key loop is ~2,000 instructions per warp and tile against ~1,200 for BF16 rows (the per-dim
decode it replaced: ~4,800 and 950 B/thread of spills), 48 B/thread of stack (168 B with
split-KV). Extend queries of one request share most rows (neighbouring
windows, overlapping selections), so HBM traffic is below N × this bound.

Why a kernel of our own (checked against what SGLang 0.5.17's wheel ships):
* sgl_kernel `flash_mla_with_kvcache(indices=, attn_sink=, extra_k_cache=, …)` (FlashMLA sparse
  decode, used by 0.5.17's DeepSeek-V4 backend) has exactly these semantics (two caches, per-query
  index lists, sink) but its sparse path requires the FP8 paged cache layout (`is_fp8_kvcache`
  must be True: 448 E4M3 + 64 BF16 dims + scales per row); our slot rows are plain BF16 (the
  exact storage of profile NONE), and head_dim must be 512/576 — it cannot read them.
* sgl_kernel `flash_mla_sparse_fwd` (FlashMLA sparse prefill: BF16 kv, per-query indices, sink)
  reads one kv tensor, so the SWA rows and the kv source's latents would first be copied into a
  per-chunk workspace (what upstream does after dequantising), and it fixes d_qk ∈ {512, 576},
  d_v = 512, h_q ∈ {64, 128} with top-k padded to a multiple of 64/128: no tiny shape and no
  tensor-parallel head shard (< 64 heads per rank).
* SGLang's Triton `decode_attention_fwd` (grouped MQA over `kv_indptr`/`kv_indices`, page size 1,
  `sinks`) reads one k_buffer per call through CSR lists (−1 holes would need a compaction pass);
  two caches mean two calls and an LSE merge that counts the sink once, and its extend kernel
  takes a shared per-request prefix plus a causal extend part, not a per-token key list.
* flashinfer 0.6.15's `trtllm_batch_decode_sparse_mla_dsv4` runs on SM100/SM103/SM120 only (not
  Hopper) with its packed cache formats; its FA2/FA3 MHA paths stop at head_dim 256.
If the runtime adopts the FP8 "v4" cache layout, FlashMLA's sparse decode is the kernel to wrap.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .packed_rows import PackedSource, latent_entry_bytes, load_latent_pair_tiles
from .sparse_attention_checks import bf16_pairs, check_inputs, validate_values
from .sparse_attention_plan import (ACC_ELEMS_PER_PROGRAM, DECODE_SMALL_BLOCK_H, DECODE_SMALL_BLOCK_H_MAX_QUERIES,
                                    DECODE_SPLIT_MAX_QUERIES, KEY_TILE_BYTES, MAX_SPLITS, MERGE_ELEMS_PER_PROGRAM,
                                    MERGE_MAX_BLOCK_D, MERGE_MIN_ELEMS_PER_PROGRAM, PREFILL_BF16_BLOCKS,
                                    SparseAttentionConfig, merge_tile, plan_config, plan_decode_config,
                                    plan_prefill_config)

_LOG2E = 1.4426950408889634


def device_sm_count(device: torch.device) -> int:
    """Multiprocessors of `device` (1 on CPU: the interpreter)."""
    return _sm_count(device)


# ---- kernels --------------------------------------------------------------------------------

@triton.jit
def _dot(a, b, acc, DOT_FP32: tl.constexpr):
    """acc + a·b, fp32-accumulated, BF16 operands; DOT_FP32 (interpreter only) upcasts them first —
    the same values, since Triton 3.6's interpreter multiplies BF16 dot operands as raw uint16."""
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc=acc, input_precision="ieee")
    return tl.dot(a, b, acc=acc)


@triton.jit
def _attend_pairs(acc_e, acc_o, m_i, l_i, q_e, q_o, k_e, k_o, valid, qk_scale_log2, DOT_FP32: tl.constexpr):
    """One online-softmax step (log2 domain) over a key tile split by dimension parity: `k_e` /
    `k_o` [BLOCK_N, BLOCK_P] bf16 hold dims 2i / 2i+1 of keys `valid` [BLOCK_N] (invalid keys
    hold zeros); q_e/q_o and acc_e/acc_o likewise. q·k is one fp32 accumulation chain over the
    even dims, then the odd ones."""
    s = _dot(q_o, tl.trans(k_o), _dot(q_e, tl.trans(k_e), None, DOT_FP32), DOT_FP32) * qk_scale_log2
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)              # nothing seen yet: no rescale
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    p_hi = p.to(tl.bfloat16)
    p_lo = (p - p_hi.to(tl.float32)).to(tl.bfloat16)
    acc_e = _dot(p_lo, k_e, _dot(p_hi, k_e, acc_e * alpha[:, None], DOT_FP32), DOT_FP32)
    acc_o = _dot(p_lo, k_o, _dot(p_hi, k_o, acc_o * alpha[:, None], DOT_FP32), DOT_FP32)
    return acc_e, acc_o, m_new, l_i


@triton.jit
def _load_slots(slots_ptr, first, n_keys, offs_n):
    """int64 slots (or entries) first..first+BLOCK_N−1 of one list; −1 past its end."""
    idx = first + offs_n
    return tl.load(slots_ptr + idx, mask=idx < n_keys, other=-1).to(tl.int64)


@triton.jit
def _tile_source(tile, swa_tiles, tile_keys, swa_ptr, swa_row_stride, swa_slots, n_swa, comp_ptr, comp_row_stride,
                 comp_slots, n_comp):
    """(rows, row stride, slot list, first key, list length) of key tile `tile` of the sequence the SWA tiles,
    then the compressed ones (`tile_keys` keys a tile): one loop over both lists holds one copy of its step."""
    if tile < swa_tiles:
        rows_ptr, row_stride, slots, first, n_keys = swa_ptr, swa_row_stride, swa_slots, tile * tile_keys, n_swa
    else:
        rows_ptr, row_stride, slots, first, n_keys = (comp_ptr, comp_row_stride, comp_slots,
                                                      (tile - swa_tiles) * tile_keys, n_comp)
    return rows_ptr, row_stride, slots, first, n_keys


@triton.jit
def _loadbf16_pairs(pairs_ptr, row_stride, slot, valid, offs_p, p_mask):
    """(even, odd) bf16 [BLOCK_N, BLOCK_P] of the BF16 rows at `slot`, read as int32 words (the
    cache viewed as int32: word i of a row = dims 2i (low half) and 2i+1 (high half), little
    endian); one contiguous load per row, halves split by integer truncation and bitcast."""
    w = tl.load(pairs_ptr + slot[:, None] * row_stride + offs_p[None, :], mask=valid[:, None] & p_mask[None, :],
                other=0)
    return (w.to(tl.int16).to(tl.bfloat16, bitcast=True),
            (w >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True))


@triton.jit
def _sparse_sink_attn_kernel(
        q_ptr, q_stride_n, q_stride_h,
        swa_ptr, swa_row_stride, swa_slots_ptr, swa_slots_stride, n_swa,
        comp_ptr, comp_row_stride, comp_slots_ptr, comp_slots_stride, n_comp,
        comp_offset, comp_ratio,
        sink_ptr, out_ptr, out_stride_n, out_stride_h,
        part_acc_ptr, part_ml_ptr,
        H, D, qk_scale_log2, tiles_per_split,
        BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
        HAS_COMP: tl.constexpr, COMP_PACKED: tl.constexpr, COMP_SHARE: tl.constexpr, NUM_SPLITS: tl.constexpr,
        DOT_FP32: tl.constexpr):
    """Every tile is split by dimension parity (dims 2i | 2i+1, column i of the `_e` | `_o`
    tiles); BF16 rows (`swa_ptr`, `comp_ptr` unless COMP_PACKED) are int32 views of the caches,
    row strides in int32 words; packed rows (COMP_PACKED) are uint8."""
    t = tl.program_id(0)
    hb = tl.program_id(1)
    split = tl.program_id(2)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_p = tl.arange(0, BLOCK_D // 2)
    offs_n = tl.arange(0, BLOCK_N)
    h_mask = offs_h < H
    p_mask = offs_p < D // 2
    hp_mask = h_mask[:, None] & p_mask[None, :]
    q_even = q_ptr + t.to(tl.int64) * q_stride_n + offs_h[:, None] * q_stride_h + 2 * offs_p[None, :]
    q_e = tl.load(q_even, mask=hp_mask, other=0.0)
    q_o = tl.load(q_even + 1, mask=hp_mask, other=0.0)

    if NUM_SPLITS == 1:
        # sink folded into the running state: m₀ = sink (log2 units), l₀ = e^{sink−m₀} = 1
        sink = tl.load(sink_ptr + offs_h, mask=h_mask, other=0.0) * 1.4426950408889634
        m_i = sink
        l_i = tl.where(sink == float("-inf"), 0.0, 1.0)
    else:
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
    acc_e = tl.zeros([BLOCK_H, BLOCK_D // 2], tl.float32)
    acc_o = tl.zeros([BLOCK_H, BLOCK_D // 2], tl.float32)

    swa_tiles = tl.cdiv(n_swa, BLOCK_N)
    tile_lo = split * tiles_per_split
    tile_hi = tile_lo + tiles_per_split
    swa_slots = swa_slots_ptr + t.to(tl.int64) * swa_slots_stride
    for tile in range(tile_lo, tl.minimum(tile_hi, swa_tiles)):
        slot = _load_slots(swa_slots, tile * BLOCK_N, n_swa, offs_n)
        valid = slot >= 0
        k_e, k_o = _loadbf16_pairs(swa_ptr, swa_row_stride, slot, valid, offs_p, p_mask)
        acc_e, acc_o, m_i, l_i = _attend_pairs(acc_e, acc_o, m_i, l_i, q_e, q_o, k_e, k_o, valid, qk_scale_log2,
                                               DOT_FP32)
    if HAS_COMP:
        comp_slots = comp_slots_ptr + t.to(tl.int64) * comp_slots_stride
        comp_tiles = tl.cdiv(n_comp, BLOCK_N)
        for tile in range(tl.maximum(tile_lo - swa_tiles, 0), tl.minimum(tile_hi - swa_tiles, comp_tiles)):
            slot = _load_slots(comp_slots, tile * BLOCK_N, n_comp, offs_n)
            valid = slot >= 0
            if COMP_PACKED:   # slot = entry index e; its latent bytes start at row e·ratio, byte 0
                k_e, k_o = load_latent_pair_tiles(comp_ptr, slot * comp_ratio * comp_row_stride, valid, D,
                                                  comp_row_stride, comp_offset, COMP_SHARE, BLOCK_D // 2,
                                                  not DOT_FP32)
            else:
                k_e, k_o = _loadbf16_pairs(comp_ptr, comp_row_stride, slot, valid, offs_p, p_mask)
            acc_e, acc_o, m_i, l_i = _attend_pairs(acc_e, acc_o, m_i, l_i, q_e, q_o, k_e, k_o, valid,
                                                   qk_scale_log2, DOT_FP32)

    if NUM_SPLITS == 1:
        out_even = out_ptr + t.to(tl.int64) * out_stride_n + offs_h[:, None] * out_stride_h + 2 * offs_p[None, :]
        tl.store(out_even, (acc_e / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=hp_mask)
        tl.store(out_even + 1, (acc_o / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=hp_mask)
    else:
        # scratch: acc [N, S, H, D], (m, l) [N, S, 2, H], all fp32
        row = t.to(tl.int64) * NUM_SPLITS + split
        part_even = part_acc_ptr + (row * H + offs_h[:, None]) * D + 2 * offs_p[None, :]
        tl.store(part_even, acc_e, mask=hp_mask)
        tl.store(part_even + 1, acc_o, mask=hp_mask)
        tl.store(part_ml_ptr + row * 2 * H + offs_h, m_i, mask=h_mask)
        tl.store(part_ml_ptr + row * 2 * H + H + offs_h, l_i, mask=h_mask)


@triton.jit
def _merge_splits_kernel(part_acc_ptr, part_ml_ptr, sink_ptr, out_ptr, out_stride_n, out_stride_h, H, D,
                         BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """o = Σ_s acc_s·2^{m_s−m} / (2^{sink−m} + Σ_s l_s·2^{m_s−m}), m = max(sink, m_s); one program per
    (query, head block, column block)."""
    t = tl.program_id(0)
    hb = tl.program_id(1)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    h_mask = offs_h < H
    mask = h_mask[:, None] & (offs_d < D)[None, :]
    sink = tl.load(sink_ptr + offs_h, mask=h_mask, other=0.0) * 1.4426950408889634
    base = t.to(tl.int64) * NUM_SPLITS
    m = sink
    for s in range(NUM_SPLITS):
        m = tl.maximum(m, tl.load(part_ml_ptr + (base + s) * 2 * H + offs_h, mask=h_mask, other=float("-inf")))
    m_ref = tl.where(m == float("-inf"), 0.0, m)
    l_tot = tl.exp2(sink - m_ref)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for s in range(NUM_SPLITS):
        row = base + s
        w = tl.exp2(tl.load(part_ml_ptr + row * 2 * H + offs_h, mask=h_mask, other=float("-inf")) - m_ref)
        l_tot += w * tl.load(part_ml_ptr + row * 2 * H + H + offs_h, mask=h_mask, other=0.0)
        acc += w[:, None] * tl.load(part_acc_ptr + (row * H + offs_h[:, None]) * D + offs_d[None, :],
                                    mask=mask, other=0.0)
    o = acc / l_tot[:, None]
    tl.store(out_ptr + t.to(tl.int64) * out_stride_n + offs_h[:, None] * out_stride_h + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=mask)


# ---- host side ------------------------------------------------------------------------------

_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (cached); 1 on CPU (the interpreter: no splitting)."""
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def sparse_sink_attention(q: Tensor, swa_cache: Tensor, swa_slots: Tensor,
                          comp_cache: Tensor | PackedSource | None, comp_slots: Tensor | None, sink: Tensor,
                          scale: float, *, out: Tensor | None = None, config: SparseAttentionConfig | None = None,
                          validate: bool = False) -> Tensor:
    """Attention of q [N, H, D] bf16 over the rows of `swa_cache` at `swa_slots` [N, W] plus the
    compressed keys `comp_slots` [N, K] of `comp_cache` (−1 = no key), with sink logits `sink`
    [H] fp32 and softmax scale `scale` (spec §3.4.5; invariant and traffic in the module docstring).
    Returns [N, H, D] bf16, or fills `out` (bf16, or fp32 for the unrounded result).

    `swa_cache` is [S, D] bf16 rows (row stride free, unit last stride); slots int32/int64.
    `comp_cache` is either such a BF16 cache (`comp_slots` = its rows) or a `PackedSource` of the
    latent rows (part "latent", contracts §1/§2; `comp_slots` = entry indices e): the kernel then reads
    entry e's latent nibbles and E4M3 scales and decodes them exactly, so the result is bit for
    bit the BF16 path's on a cache holding the decoded latents. No host synchronisation unless
    `validate=True`, which checks slot/entry ranges, the sink, and empty key sets with a −∞ sink,
    raising ValueError. `config` overrides `plan_config` (tests, tuning). CPU tensors need the
    kernels defined under `TRITON_INTERPRET=1`."""
    check_inputs(q, swa_cache, swa_slots, comp_cache, comp_slots, sink, scale, out)
    N, H, D = q.shape
    W = swa_slots.shape[1]
    K = comp_slots.shape[1] if comp_slots is not None else 0
    has_comp = comp_cache is not None and K > 0
    if validate:
        validate_values(swa_cache, swa_slots, comp_cache, comp_slots, sink)
    if q.device.type != "cuda" and not _is_interpreted():
        raise ValueError(f"sparse_sink_attention: tensors on {q.device} need a CUDA device, or TRITON_INTERPRET=1 "
                         "set before this module is imported (Triton's CPU interpreter)")
    out = torch.empty_like(q) if out is None else out
    if N == 0:
        return out
    cfg = config or plan_config(N, H, D, W, K, _sm_count(q.device))
    if cfg.block_d < D:
        raise ValueError(f"sparse_sink_attention: config.block_d={cfg.block_d} < head_dim {D}")
    head_blocks = triton.cdiv(H, cfg.block_h)
    tiles = triton.cdiv(W, cfg.block_n) + (triton.cdiv(K, cfg.block_n) if has_comp else 0)
    splits = min(cfg.num_splits, tiles)
    tiles_per_split = triton.cdiv(tiles, splits)
    splits = triton.cdiv(tiles, tiles_per_split)
    f32 = dict(dtype=torch.float32, device=q.device)   # split scratch; unused (= out) when splits == 1
    part_acc = torch.empty(N, splits, H, D, **f32) if splits > 1 else out
    part_ml = torch.empty(N, splits, 2, H, **f32) if splits > 1 else out
    packed = has_comp and isinstance(comp_cache, PackedSource)
    swa_pairs = bf16_pairs(swa_cache, "swa")
    comp_cache_arg = (comp_cache.rows if packed else bf16_pairs(comp_cache, "comp")) if has_comp else swa_pairs
    comp_slots_arg = comp_slots if has_comp else swa_slots
    comp_offset, comp_share, comp_ratio = ((comp_cache.offset, comp_cache.share, comp_cache.ratio) if packed
                                           else (0, 1, 1))
    _sparse_sink_attn_kernel[(N, head_blocks, splits)](
        q, q.stride(0), q.stride(1),
        swa_pairs, swa_pairs.stride(0), swa_slots, swa_slots.stride(0), W,
        comp_cache_arg, comp_cache_arg.stride(0), comp_slots_arg, comp_slots_arg.stride(0), K,
        comp_offset, comp_ratio,
        sink, out, out.stride(0), out.stride(1),
        part_acc, part_ml,
        H, D, float(scale) * _LOG2E, tiles_per_split,
        BLOCK_H=cfg.block_h, BLOCK_D=cfg.block_d, BLOCK_N=cfg.block_n,
        HAS_COMP=has_comp, COMP_PACKED=packed, COMP_SHARE=comp_share, NUM_SPLITS=splits, DOT_FP32=_is_interpreted(),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if splits > 1:
        merge_h, merge_d = merge_tile(N, H, cfg.block_d, _sm_count(q.device))
        _merge_splits_kernel[(N, triton.cdiv(H, merge_h), triton.cdiv(D, merge_d))](
            part_acc, part_ml, sink, out, out.stride(0), out.stride(1), H, D,
            BLOCK_H=merge_h, BLOCK_D=merge_d, NUM_SPLITS=splits, num_warps=4)
    return out


def _is_interpreted() -> bool:
    """Whether this module's kernels were defined under Triton's CPU interpreter."""
    return not isinstance(_sparse_sink_attn_kernel, triton.runtime.jit.JITFunction)


def bytes_read_per_query(num_heads: int, head_dim: int, window: int, topk: int, valid_keys: int,
                         slot_bytes: int = 4, *, valid_comp_keys: int = 0, packed_comp: bool = False) -> int:
    """HBM bytes one query reads (module docstring): q, slot lists, valid key rows, sink.
    `valid_keys` counts every valid key; with `packed_comp` the `valid_comp_keys` of them that are
    compressed entries cost `latent_entry_bytes(D)` (D/2 nibbles + D/16 E4M3 scales: 288 B at
    Flash) instead of a 2·D-byte BF16 row."""
    if not 0 <= valid_comp_keys <= valid_keys:
        raise ValueError(f"bytes_read_per_query: valid_comp_keys {valid_comp_keys} not in [0, {valid_keys}]")
    comp_row = latent_entry_bytes(head_dim) if packed_comp else head_dim * 2
    key_bytes = (valid_keys - valid_comp_keys) * head_dim * 2 + valid_comp_keys * comp_row
    return num_heads * head_dim * 2 + (window + topk) * slot_bytes + key_bytes + num_heads * 4


__all__ = ["ACC_ELEMS_PER_PROGRAM", "DECODE_SMALL_BLOCK_H", "DECODE_SMALL_BLOCK_H_MAX_QUERIES",
           "DECODE_SPLIT_MAX_QUERIES", "KEY_TILE_BYTES", "MAX_SPLITS", "MERGE_ELEMS_PER_PROGRAM", "MERGE_MAX_BLOCK_D",
           "MERGE_MIN_ELEMS_PER_PROGRAM", "PREFILL_BF16_BLOCKS", "PackedSource", "SparseAttentionConfig",
           "bytes_read_per_query", "device_sm_count", "merge_tile", "plan_config", "plan_decode_config",
           "plan_prefill_config", "sparse_sink_attention"]

"""FP4 indexer scores for a whole packed batch in one Triton launch (spec `model.md` §3.4.4; semantics =
`sglang_dsv41.reference.indexer`). The selection over these scores: `kernels.indexer_select`.

For query t of request r = token_req[t] and entry j of r (slot entry_slots[r, j]):

    S[t, j] = Σ_h w[t,h]·ReLU(q[t,h]·k[slot])   if j < n_visible[t] and the slot exists, else −∞

`index_scores` is one Triton launch for the batch: a program takes a tile of BLOCK_T queries of
one request (the MQA product has BLOCK_T·Hi rows) and J_STEPS tiles of BLOCK_J entries; each key
tile is gathered from its slots once for all heads and all queries of the tile, multiplied on
tensor cores (BF16 operands: FP4 values E2M1·2^s are exact in BF16), accumulated in fp32, then
ReLU, head weights and the head sum are fused. Entry tiles past every query of the tile's
visibility are not loaded or multiplied, only written −∞. No host sync (unless `check_inputs`).

Numerics (upstream's rounding points, issue 18: `fp4_index_logits_paged` rounds "bf16 dot ->
relu -> * bf16 weight -> bf16 -> sum -> bf16"): S = bf16(Σ_h bf16(w_h·ReLU(bf16(dot_h)))). The
FP4×FP4 products are exact, so each dot is exact while its partial sums fit fp32's 24 bits
(per-32 scale exponents of q and k spanning < 2^13, no underflow) — true for indexer data — and
w·ReLU(d) (BF16 × BF16) is exact in fp32. `head_sum_exact=True` (default) sums the BF16 terms
with a pairwise error-free extraction sum (`double_fp32.exact_sum`, float64-grade: ≲ 2⁻⁴⁸·max
term before the rounding to fp32, order-independent; no float64 on the GPU) like the reference's
float64 sum: scores equal the reference's bit for bit unless the exact sum lies within that error
of an fp32 rounding boundary that is also a BF16 one. `head_sum_exact=False` sums in fp32
(cheaper in prefill; upstream's own order-dependent fp32 sum), equal to the reference unless the
exact sum lies within the fp32 sum's error of a BF16 rounding boundary.
Scores are canonicalised (−0 → +0).

Bytes read per query (Flash, Di = 128, bf16 index-key rows; decode = one query per request, a
tile of one query): per visible entry 8 B slot id + 256 B key row, 4 B score write = 268 B,
plus the query (Hi·Di·4 B) and head weights once per program from L2. A prefill tile of BLOCK_T
queries shares the slot/key reads: (8 + 256)/BLOCK_T + 4 B per entry and query. With packed
entries (`PackedSource` of the index-key rows, contracts §1/§2) a key costs Di/2 + Di/32 = 68 B
(E2M1 nibbles + UE8M0 exponents, the entry's key part, decoded exactly in the kernel by
`packed_rows.load_key_pair_tiles`, dims split by parity: q·k = q_even·k_even + q_odd·k_odd, two
exact MMAs): 8 + 68 + 4 = 80 B per visible entry at decode.

Written from the spec, not ported: stock SGLang 0.5.17 has no FP4 indexer scoring for SM90 (spec
`runtime.md` §C).

Triton's interpreter (TRITON_INTERPRET=1 before triton is imported) runs the same kernel on CPU
tensors (tests); its BF16 `tl.dot` gives wrong results (Triton 3.6), so operands are fp32 there
(products of FP4 values are exact either way). Without the interpreter, CPU tensors raise.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.interpreter import InterpretedFunction

from . import double_fp32 as DF
from .indexer_tables import query_tiles
from .packed_rows import PackedSource, key_entry_bytes, load_key_pair_tiles


@triton.jit
def _round_bf16(x):
    """fp32 → nearest BF16 (ties to even) kept in fp32, by bit arithmetic (the same compiled and in
    the interpreter); NaN stays NaN."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return tl.where(x != x, x, rounded.to(tl.float32, bitcast=True))


@triton.jit
def _dot_operand(x, DOT_BF16: tl.constexpr):
    """x as a dot operand: BF16 compiled (FP4 values are exact in BF16), fp32 in the interpreter."""
    if DOT_BF16:
        y = x.to(tl.bfloat16)
    else:
        y = x.to(tl.float32)
    return y


@triton.jit
def _dot_keys(q, keys, acc, DOT_BF16: tl.constexpr):
    """acc + q·keysᵀ in fp32 (acc None: a fresh sum); every product of FP4 values is exact."""
    if DOT_BF16:
        out = tl.dot(q, tl.trans(keys.to(tl.bfloat16)), acc, out_dtype=tl.float32)
    else:
        out = tl.dot(q, tl.trans(keys.to(tl.float32)), acc, input_precision="ieee", out_dtype=tl.float32)
    return out


@triton.jit
def _index_scores_kernel(q_ptr, w_ptr, key_ptr, slot_ptr, nvis_ptr, order_ptr, tile_req_ptr,
                         tile_lo_ptr, tile_hi_ptr, out_ptr, num_slots, num_entries,
                         stride_qn, stride_qh, stride_wn, stride_ks, stride_sr, stride_on,
                         key_offset, key_ratio,
                         HI: tl.constexpr, DI: tl.constexpr, BLOCK_T: tl.constexpr,
                         BLOCK_J: tl.constexpr, J_STEPS: tl.constexpr, DOT_BF16: tl.constexpr,
                         HEAD_SUM_EXACT: tl.constexpr, KEY_PACKED: tl.constexpr, KEY_SHARE: tl.constexpr,
                         FILL_DEAD: tl.constexpr):
    """One tile of queries of one request × J_STEPS·BLOCK_J entries (see the module docstring).
    Entry tiles no query of the tile sees are written −∞ when FILL_DEAD, else left as they are; a
    program with no live tile loads no query."""
    tile = tl.program_id(0)
    req = tl.load(tile_req_ptr + tile)
    lo = tl.load(tile_lo_ptr + tile)
    hi = tl.load(tile_hi_ptr + tile)
    t = tl.arange(0, BLOCK_T)
    t_live = lo + t < hi
    qid = tl.load(order_ptr + lo + t, mask=t_live, other=0)
    nvis = tl.load(nvis_ptr + qid, mask=t_live, other=0)
    tile_vis = tl.max(nvis, axis=0)
    # entry tiles of this program: the first `live` hold some visible entry, the rest only −∞
    j_first = tl.program_id(1) * J_STEPS * BLOCK_J
    live = tl.minimum(tl.maximum(tl.cdiv(tile_vis - j_first, BLOCK_J), 0), J_STEPS)
    # rows of the MQA product: m = t·HI + h (none loaded when no tile is live)
    m = tl.arange(0, BLOCK_T * HI)
    m_live = (lo + m // HI < hi) & (live > 0)
    qid_m = tl.load(order_ptr + lo + m // HI, mask=m_live, other=0)
    d = tl.arange(0, DI)
    q_rows = q_ptr + qid_m[:, None] * stride_qn + (m % HI)[:, None] * stride_qh
    w = tl.load(w_ptr + qid_m * stride_wn + m % HI, mask=m_live, other=0.0).to(tl.float32)
    if KEY_PACKED:   # dims split by parity: column i of the _e / _o tiles is dim 2i / 2i+1
        p = tl.arange(0, DI // 2)
        q_e = _dot_operand(tl.load(q_rows + 2 * p[None, :], mask=m_live[:, None], other=0.0), DOT_BF16)
        q_o = _dot_operand(tl.load(q_rows + 2 * p[None, :] + 1, mask=m_live[:, None], other=0.0), DOT_BF16)
    else:
        q = _dot_operand(tl.load(q_rows + d[None, :], mask=m_live[:, None], other=0.0), DOT_BF16)
    for step in range(0, live):
        j = j_first + step * BLOCK_J + tl.arange(0, BLOCK_J)
        j_in = j < num_entries
        # slot ids < 2^31 (rows of the cache): compared in int32, addresses in int64
        slot = tl.load(slot_ptr + req * stride_sr + j, mask=j_in & (j < tile_vis), other=-1).to(tl.int32)
        has = (slot >= 0) & (slot < num_slots)                  # packed: slot = entry e < S // ratio
        row = slot.to(tl.int64)
        if KEY_PACKED:   # entry e's key part (index-key rows): payload + UE8M0 scales from its byte 0
            k_e, k_o = load_key_pair_tiles(key_ptr, row * key_ratio * stride_ks, has, DI, stride_ks,
                                           key_offset, KEY_SHARE, DI // 2, DOT_BF16)
            acc = _dot_keys(q_o, k_o, _dot_keys(q_e, k_e, None, DOT_BF16), DOT_BF16)
        else:
            keys = tl.load(key_ptr + row[:, None] * stride_ks + d[None, :], mask=has[:, None], other=0.0)
            acc = _dot_keys(q, keys, None, DOT_BF16)
        relu = tl.maximum(_round_bf16(acc), 0.0)                    # upstream: bf16(dot), ReLU
        terms = _round_bf16(relu * w[:, None])                     # BF16 × BF16: exact in fp32, → BF16
        if HEAD_SUM_EXACT:   # error-free extraction sum of the BF16 terms (float64-grade)
            terms3 = tl.reshape(terms, (BLOCK_T, HI, BLOCK_J))
            s_h, s_l = DF.exact_sum(terms3, 1, HI)
            s = tl.reshape(s_h + s_l, (BLOCK_T, BLOCK_J))
        else:
            s = tl.sum(tl.reshape(terms, (BLOCK_T, HI, BLOCK_J)), axis=1)
        s = _round_bf16(s)                                          # upstream: bf16(Σ_h)
        s = tl.where(s == 0.0, 0.0, s)                         # −0 → +0
        valid = (j[None, :] < nvis[:, None]) & has[None, :]
        tl.store(out_ptr + qid[:, None] * stride_on + j[None, :], tl.where(valid, s, float("-inf")),
                 mask=t_live[:, None] & j_in[None, :])
    if FILL_DEAD:
        for step in range(live, J_STEPS):
            j = j_first + step * BLOCK_J + tl.arange(0, BLOCK_J)
            tl.store(out_ptr + qid[:, None] * stride_on + j[None, :],
                     tl.full((BLOCK_T, BLOCK_J), float("-inf"), tl.float32),
                     mask=t_live[:, None] & (j < num_entries)[None, :])


#: True when this kernel was built for Triton's interpreter (TRITON_INTERPRET=1 at import).
INTERPRETED = isinstance(_index_scores_kernel, InterpretedFunction)


def _check_interpreter_consistent() -> None:
    """The interpreter also needs triton.language built in interpreter mode (env set before the
    first `import triton`), otherwise its library functions cannot run inside our kernel."""
    if INTERPRETED and not isinstance(tl.max, InterpretedFunction):
        raise RuntimeError("TRITON_INTERPRET=1 was set after triton was imported: set it before the first "
                           "`import triton` (e.g. in the environment of the process)")


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def default_block_t(num_queries: int, num_requests: int, hi: int) -> int:
    """Queries per program (a constexpr): the next power of two of the queries per request, at least
    16/Hi (the MMA's rows) and at most 128/Hi — so at most log2(128/Hi) − log2(16/Hi) + 1 = 4 builds
    over every batch shape."""
    per_req = _pow2_at_least(-(-num_queries // max(num_requests, 1)))
    return min(max(per_req, max(1, 16 // hi)), max(1, 128 // hi))


def default_block_j(m_rows: int, packed_keys: bool) -> int:
    """Entries per program step (a constexpr): 32 for BF16 keys under full 128-row query tiles (a
    prefill's; the faster tiling measured in docs/performance.md "Session 34"), else 64. Every tiling
    gives the same scores (tests/test_kernels_indexer.py)."""
    return 32 if not packed_keys and m_rows >= 128 else 64


def _query_tiles_torch(token_req: Tensor, num_requests: int, block_t: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(order, tile_req, tile_lo, tile_hi) without a host sync: `order` lists queries grouped by
    request; tile i covers order[lo:hi) of request tile_req[i]; the grid size is the static bound
    min(N, (N + R·(BLOCK_T−1)) // BLOCK_T) ≥ Σ_r ⌈n_r/BLOCK_T⌉, spare tiles are empty (lo = hi).
    The torch formula of `indexer_tables.query_tiles` (one launch; `index_scores` runs that)."""
    n = token_req.numel()
    dev = token_req.device
    order = torch.argsort(token_req, stable=True)
    counts = torch.zeros(num_requests, dtype=torch.int64, device=dev).index_add_(
        0, token_req, torch.ones(n, dtype=torch.int64, device=dev))
    starts = torch.cumsum(counts, 0) - counts
    tiles = (counts + block_t - 1) // block_t
    tile_end = torch.cumsum(tiles, 0)
    grid = min(n, (n + num_requests * (block_t - 1)) // block_t)
    i = torch.arange(grid, device=dev)
    req = torch.searchsorted(tile_end, i, right=True).clamp(max=num_requests - 1)
    lo = starts[req] + (i - (tile_end[req] - tiles[req])) * block_t
    hi = torch.minimum(lo + block_t, starts[req] + counts[req])
    live = i < tile_end[-1]
    zero = torch.zeros_like(lo)
    return order, req, torch.where(live, lo, zero), torch.where(live, hi, zero)


def _check_scoring_inputs(num_keys: int, entry_slots: Tensor, token_req: Tensor, n_visible: Tensor) -> None:
    """Value checks (one host sync): request ids, visibility ≤ E, visible entries have slots
    (entry indices of a packed source) in [0, num_keys)."""
    R, E = entry_slots.shape
    S = num_keys
    ok_slot = (entry_slots >= 0) & (entry_slots < S)
    leading = torch.cumprod(ok_slot.to(torch.int32), dim=1).sum(dim=1)     # visible-able prefix per request
    req_ok = (token_req >= 0) & (token_req < R)
    flags = torch.stack([
        (~req_ok).any(),
        ((n_visible < 0) | (n_visible > E)).any(),
        ((entry_slots < -1) | (entry_slots >= S)).any(),
        (req_ok & (n_visible > leading[token_req.clamp(0, max(R - 1, 0))])).any(),
    ]).tolist()
    if flags[0]:
        raise ValueError(f"index_scores: token_req must lie in [0, {R}) (rows of entry_slots)")
    if flags[1]:
        raise ValueError(f"index_scores: n_visible must lie in [0, {E}] (columns of entry_slots)")
    if flags[2]:
        raise ValueError(f"index_scores: entry_slots must be −1 or a slot in [0, {S})")
    if flags[3]:
        raise ValueError("index_scores: a query sees an entry j < n_visible whose slot is −1")


def index_scores(q: Tensor, head_w: Tensor, key_cache: Tensor | PackedSource, entry_slots: Tensor,
                 token_req: Tensor, n_visible: Tensor, *, head_sum_exact: bool = True, check_inputs: bool = True,
                 block_t: int | None = None, block_j: int | None = None, j_steps: int | None = None,
                 num_warps: int | None = None, num_stages: int | None = None,
                 tile_cache: dict | None = None, grouped_queries: bool = False,
                 fill_invisible: bool = True, out: Tensor | None = None) -> Tensor:
    """[N, E] fp32 indexer scores for a packed batch; −∞ where j ≥ n_visible[t] or entry_slots is −1.
    `fill_invisible=False`: entry tiles that no query of a query tile sees are left unwritten (any
    value), so only columns j < n_visible[t] are defined — for consumers that read no further
    (CUDA-graph layouts' bounded rankings, whose rows are as wide as the served context). `out`: an
    [N, E] fp32 tensor with unit last stride to write (else a new one).

    q [N, Hi, Di] fp32/bf16 FP4-valued (RoPE'd); head_w [N, Hi] fp32 (already ×Di^−½·Hi^−½);
    key_cache [S, Di] bf16 (or fp32) FP4-valued rows with entry_slots [R, E] int their rows — or
    a `PackedSource` of the index-key rows (part "key", contracts §1/§2/§5) with entry_slots the
    entry indices e (`entry_index.entry_index_table`): the kernel then reads entry e's key nibbles and UE8M0
    scales and decodes them exactly, giving
    the BF16-key path's scores bit for bit on the decoded keys. −1 = none. token_req [N] request
    of each query (any order); n_visible [N] = ⌊(p+1)/ratio⌋. `check_inputs` validates values (one
    host sync; turn off inside CUDA graphs). Block sizes and launch options default from the
    shapes; overrides are for tuning (benchmarks/indexer.py). `tile_cache`: a dict the caller keeps
    for one set of queries (the same token_req and request count, e.g. one forward's batch): the
    query tiles are made once per block size and reused from it (no tensor op). `grouped_queries`:
    token_req is non-decreasing (a `BatchLayout`'s), so the tiles' query order is the identity
    (`indexer_tables.query_tiles`: one launch either way, plus torch's argsort when not grouped).
    """
    packed = isinstance(key_cache, PackedSource)
    if packed:
        key_cache.require_part("key", "index_scores")
    key_tensor = key_cache.rows if packed else key_cache
    if q.dim() != 3 or head_w.shape != q.shape[:2] or key_tensor.dim() != 2 or entry_slots.dim() != 2:
        raise ValueError(f"index_scores: shapes q {tuple(q.shape)}, head_w {tuple(head_w.shape)}, key_cache "
                         f"{tuple(key_tensor.shape)}, entry_slots {tuple(entry_slots.shape)} (want [N,Hi,Di], "
                         "[N,Hi], [S,Di], [R,E])")
    N, HI, DI = q.shape
    R, E = entry_slots.shape
    key_width = key_cache.index_head_dim if packed else key_cache.shape[1]
    if key_width != DI or token_req.shape != (N,) or n_visible.shape != (N,):
        raise ValueError(f"index_scores: key width {key_width} / token_req {tuple(token_req.shape)} / "
                         f"n_visible {tuple(n_visible.shape)} do not match q {tuple(q.shape)}")
    if HI & (HI - 1) or DI & (DI - 1) or DI < 16:
        raise ValueError(f"index_scores: Hi ({HI}) and Di ({DI}) must be powers of two, Di ≥ 16")
    for name, t in (("entry_slots", entry_slots), ("token_req", token_req), ("n_visible", n_visible)):
        if t.dtype.is_floating_point or t.dtype == torch.bool:
            raise TypeError(f"index_scores: {name} must be an integer tensor, got {t.dtype}")
    if q.dtype not in (torch.float32, torch.bfloat16) or (
            not packed and key_cache.dtype not in (torch.float32, torch.bfloat16)):
        raise TypeError(f"index_scores: q {q.dtype} / key_cache {key_tensor.dtype} must be fp32 or bf16 "
                        "(or a PackedSource)")
    dev = q.device
    if dev.type != "cuda" and not INTERPRETED:
        raise RuntimeError(f"index_scores: {dev} tensors need Triton's interpreter (set TRITON_INTERPRET=1 "
                           "before triton is first imported); the compiled kernel runs on CUDA")
    _check_interpreter_consistent()
    if any(t.device != dev for t in (head_w, key_tensor, entry_slots, token_req, n_visible)):
        raise ValueError("index_scores: all inputs must be on one device")
    if not packed and key_cache.stride(1) != 1:
        raise ValueError("index_scores: key_cache rows must be contiguous (stride 1 along Di)")
    num_keys = key_cache.num_entries if packed else key_cache.shape[0]
    if out is None:
        out = torch.empty(N, E, dtype=torch.float32, device=dev)
    elif out.shape != (N, E) or out.dtype != torch.float32 or out.device != dev or out.stride(1) != 1:
        raise ValueError(f"index_scores: out must be [{N}, {E}] fp32 on {dev} with unit last stride")
    if N == 0 or E == 0:
        return out
    if R == 0:
        raise ValueError("index_scores: queries but no request rows in entry_slots")
    token_req = token_req.to(torch.int64)
    n_visible = n_visible.to(torch.int64)
    if check_inputs:
        _check_scoring_inputs(num_keys, entry_slots, token_req, n_visible)
    if block_t is None:
        block_t = default_block_t(N, R, HI)
    if block_j is None:
        block_j = default_block_j(block_t * HI, packed)
    if block_t & (block_t - 1) or block_t * HI < 16 or block_j & (block_j - 1) or block_j < 16:
        raise ValueError(f"index_scores: block_t ({block_t}) and block_j ({block_j}) must be powers of two "
                         "with block_t·Hi ≥ 16 and block_j ≥ 16")
    tiles = None if tile_cache is None else tile_cache.get((R, block_t))
    if tiles is None:
        tiles = query_tiles(token_req, R, block_t, grouped=grouped_queries)
        if tile_cache is not None:
            tile_cache[(R, block_t)] = tiles
    order, tile_req, tile_lo, tile_hi = tiles
    j_tiles = -(-E // block_j)
    if j_steps is None:  # loop over entry tiles inside a program only beyond ~8192 programs;
        # a constexpr with five values (1 … 16): at most five builds per query tile, not one per length
        j_steps = 1
        while j_steps < 16 and tile_req.numel() * j_tiles > 8192 * j_steps:
            j_steps *= 2
    q = q.contiguous()
    head_w = head_w.to(torch.float32).contiguous()
    entry_slots = entry_slots.contiguous()
    grid = (tile_req.numel(), -(-j_tiles // j_steps))
    if grid[1] > 65535:  # CUDA's limit on the second grid dimension
        raise ValueError(f"index_scores: {grid[1]} entry programs for E = {E}; raise block_j or j_steps")
    m_rows = block_t * HI
    launch = dict(HI=HI, DI=DI, BLOCK_T=block_t, BLOCK_J=block_j, J_STEPS=j_steps,
                  DOT_BF16=not INTERPRETED, HEAD_SUM_EXACT=head_sum_exact, KEY_PACKED=packed,
                  KEY_SHARE=key_cache.share if packed else 1, FILL_DEAD=fill_invisible)
    if not INTERPRETED:  # launch options of the compiled kernel (the interpreter has none)
        launch["num_warps"] = num_warps or (4 if m_rows * block_j <= 4096 else 8)
        if num_stages is not None:
            launch["num_stages"] = num_stages
    key_layout = (key_cache.offset, key_cache.ratio) if packed else (0, 1)
    args = (q, head_w, key_tensor, entry_slots, n_visible.contiguous(), order, tile_req, tile_lo, tile_hi, out,
            num_keys, E, q.stride(0), q.stride(1), head_w.stride(0), key_tensor.stride(0),
            entry_slots.stride(0), out.stride(0), *key_layout)
    _index_scores_kernel[grid](*args, **launch)
    return out


def score_bytes_per_query(n_visible: int, num_entries: int, hi: int, di: int, *, key_bytes: int = 2,
                          slot_bytes: int = 8, q_bytes: int = 4, packed_keys: bool = False) -> int:
    """HBM bytes of one query scored in a tile of its own (decode): its visible entries' slot ids
    and key rows (`key_bytes` per element; `packed_keys`: the entry's Di/2 nibble bytes + Di/32
    UE8M0 bytes, 68 B at Di = 128), its query and head weights, and its whole score row written."""
    key_row = key_entry_bytes(di) if packed_keys else di * key_bytes
    return n_visible * (slot_bytes + key_row) + hi * (di * q_bytes + 4) + num_entries * 4

"""Sparse attention and indexer selection of one layer, one implementation per device (spec §3.4.4, §3.4.5).

`ops_for(device, acc, deterministic)` picks the implementation once per model (any other device raises):

| device | `attend` | `select` |
|---|---|---|
| CPU  | `attention_ops_torch.TorchAttentionOps`: rows gathered + `attend_with_sink` (float64, rounded once to BF16) | per request, `indexer_select.run_indexer_cpu` (float64 scores, stable sort) |
| CUDA | Triton `kernels.sparse_attention.sparse_sink_attention` | whole batch: `attention_math.index_query`, Triton `kernels.indexer.index_scores`, `indexer_select.select_for_role` (`kernels.indexer_select`) |

CPU is bit-identical to `ReferenceModel` (tests/test_runtime_forward.py). On CUDA the kernels
must import (and not be built for the interpreter) or `ops_for` raises; attention differs from
the CPU value by up to one BF16 ulp per sublayer (kernel docstring).

Contracts (both implementations):
* `attend(q, sink, swa_cache, swa_slots, packed, comp_entries)`: q [N, H, D] BF16 values (fp32, or
  torch.bfloat16 where the backend holds them so: `runtime/triton_backend.py` BF16_OUT);
  `swa_cache` [S_swa, D] rows addressed by SWA slot, `swa_slots` [N, W] the query's window;
  `packed` the layer's kv source (`kv_layout.PackedSourceRows`: packed FP4 latent and index-key
  rows, contract §1–§2)
  and `comp_entries` [N, K] its selected entry indices (both None for ratio-0 layers); −1 = no
  key; no de-duplication between the two lists (§3.4.5). Returns [N, H, D] BF16 values: fp32 /
  float64 on CPU, the kernel's torch.bfloat16 on CUDA (its one reader, `output_projection`, rounds
  them to BF16 again).
  CUDA: within one BF16 ulp of the output scale (max |o| of that query and head) of the CPU
  value on the same inputs (kernel docstring); batch-invariant only in
  deterministic mode (`ATTENTION_KEY_SPLITS`; the serving default splits the keys of small
  batches, `plan_decode_config`).
* `select(be, cfg, role, w, prefix, x, q_lora, layout, caches, inv_freq, act_quant, published)`:
  (selection [N, index_topk] request-local compressed positions, ascending, −1 padded;
  candidate blocks [N, candidate_topk_blocks] for the candidate source, else None).
  `published` = the candidate source's blocks for the same N queries (consumers only). Keys of
  compressed position j of request r: entry slot(j·r + r − 1) // r of the source's packed rows.
  CUDA: at decode (graphed or not), below PREFILL_MIN_QUERIES tokens and in deterministic mode, scores equal
  the reference's bit for bit (the exact double-fp32 head sum), so the same inputs give the same selection
  (exact tie rule of `select_topk`); a prefill batch of more tokens, eager or graphed, sums heads in fp32
  (`KernelAttentionOps.head_sum_exact`).

Packed entries on CUDA: both kernels read them natively (`kernels.packed_rows.PackedSource` of
the layer's kv source — attention its latent rows, the indexer its index-key rows — entry
indices instead of slots; exact in-kernel E2M1 × E4M3 / UE8M0 decode), so no BF16 copy of the
compressed cache is ever made.

The CUDA path has no per-request loop and no host synchronisation (slot tables are built on
the device; the only loop is over query chunks of the [N, E] score matrix, whose sizes are known
on the host: `SCORE_ELEMENTS_PER_CHUNK`).
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
from types import ModuleType
from typing import Mapping, Protocol

import torch
from torch import Tensor

from ..config import LayerRole, TextConfig
from ..numerics.geometry import softmax_scale, visible_counts
from . import attention_flashmla as FM
from . import attention_prefill as AP
from .attention_math import index_query
from .attention_ops_torch import FP32_TORCH_OPS, TORCH_OPS
from .backend import ComputeBackend, kernel_choice
from .batch import BatchLayout
from .cache import RuntimeCaches
from .indexer_select import select_for_role
from .kv_layout import PackedSourceRows

#: The kernel modules the CUDA path needs (installed from `kernels/`, see pyproject.toml).
KERNEL_MODULES = {"sparse_attention": "sglang_dsv41.kernels.sparse_attention",
                  "indexer": "sglang_dsv41.kernels.indexer",
                  "indexer_select": "sglang_dsv41.kernels.indexer_select",
                  "entry_index": "sglang_dsv41.kernels.entry_index"}
#: the `wide` prefill choice's kernel module (`attention_prefill`), imported on first use
WIDE_PREFILL_MODULE = "sglang_dsv41.kernels.sparse_attention_prefill"
#: Score-matrix elements (fp32) per query chunk of the CUDA indexer: 2^25 = 128 MiB, plus a
#: restricted copy for candidate consumers and the top-k temporaries of `select_topk` (which
#: chunks itself at 2^24 entries). A decode batch of 64 at 512 K entries is one chunk; an
#: 8192-token prefill chunk at 64 K entries is 16 chunks of 512 queries.
SCORE_ELEMENTS_PER_CHUNK = 1 << 25
#: Key-tile splits per query of the CUDA attention kernel in deterministic mode. 1 keeps the kernel
#: batch-invariant: a query's output depends only on its own q, keys and sink, never on how many
#: queries share the launch. With the float64 head sum of the indexer (and the exact top-k, fused or
#: torch: the same bits), the whole CUDA forward then gives the same bits for a request whether it
#: runs alone, chunked, batched or on a prefix-cache hit (with W8A16 FP8 linears, `backend.fp8_gemm_for`).
ATTENTION_KEY_SPLITS = 1
#: Kernel choices of the CUDA path (issue 21, measured on the H200: docs/performance.md "Session 12").
#: SGLANG_DSV41_ATTN_SPLITS overrides the mode's plan: "one" (ATTENTION_KEY_SPLITS: batch invariant;
#: the default under `--enable-deterministic-inference`) | "decode" (`plan_decode_config`: split-KV over
#: the multiprocessors for ≤ DECODE_SPLIT_MAX_QUERIES queries, the serving default; a query's bits
#: then depend on its batch's size). SGLANG_DSV41_INDEXER_HEAD_SUM = "auto" (the serving default:
#: "fp32" for eager batches of ≥ attention_prefill.PREFILL_MIN_QUERIES tokens, "fp64" otherwise) |
#: "fp64" (the deterministic default: scores equal the reference's bit for bit) | "fp32" (every batch:
#: within the kernel's stated bound; ties near a rounding boundary may select differently; timings in
#: docs/performance.md "Session 35"). SGLANG_DSV41_ATTN_PREFILL: the
#: prefill workspace (`attention_prefill.prefill_choice`: `wide` serving, `packed` deterministic).
ATTENTION_SPLITS_ENV, ATTENTION_SPLITS = "SGLANG_DSV41_ATTN_SPLITS", ("one", "decode")
#: SGLANG_DSV41_ATTN_DECODE: batches without the prefill workspace (decode) through our Triton kernel
#: on the packed rows (`triton`, the deterministic default), the same kernel on BF16 rows its entries are
#: first decoded into (`gather`: `kernels.key_gather.gather_latent_rows`, the same math), `auto` (the
#: serving default: BF16 rows for batches of at most GATHER_DECODE_MAX_QUERIES queries, read by `wide` from
#: WIDE_DECODE_MIN_QUERIES queries on and by `gather`'s kernel below; `triton` above; docs/performance.md
#: "Session 39"), or one FlashMLA launch (`flashmla`, opt-in: `attention_flashmla.decode_attend`) for batches of
#: FLASHMLA_DECODE_QUERIES queries, the Triton kernel otherwise — 4.6× faster at 256 queries, but the
#: serving contract measured 98.2–98.6 % top-1 with it against its 99 % (docs/performance.md "Session 23"),
#: or `wide` (serving mode only): the BF16 rows read by the prefill's `wide` kernel with its key tiles
#: split over the multiprocessors (`kernels.sparse_attention_prefill.plan_decode`) at every batch size.
ATTENTION_DECODE_ENV, ATTENTION_DECODES = "SGLANG_DSV41_ATTN_DECODE", ("auto", "triton", "gather", "flashmla", "wide")
#: query counts of a batch the flashmla decode launches FlashMLA for: one query runs the split-KV Triton
#: kernel (26 against 30 µs per Flash layer on the H200); past the largest decode graph the per-query
#: gathered rows (N × 640 KB) are not worth their memory
FLASHMLA_DECODE_QUERIES = range(2, 257)
#: `auto` decodes through BF16 rows up to this many queries (the largest decode graph; the rows are
#: N × K × D × 2 bytes, 128 MiB at 256 Flash queries), on the packed rows above
GATHER_DECODE_MAX_QUERIES = 256
#: `auto` (serving mode) reads those rows with the `wide` kernel from this many queries on
WIDE_DECODE_MIN_QUERIES = 2
INDEXER_HEAD_SUM_ENV, INDEXER_HEAD_SUMS = "SGLANG_DSV41_INDEXER_HEAD_SUM", ("auto", "fp64", "fp32")
logger = logging.getLogger(__name__)


class AttentionOps(Protocol):
    """One device's implementation of the two operations (module docstring)."""

    description: str

    def attend(self, q: Tensor, sink: Tensor, swa_cache: Tensor, swa_slots: Tensor,
               packed: PackedSourceRows | None, comp_entries: Tensor | None,
               workspace: object | None = None, memo: dict | None = None) -> Tensor: ...

    def prefill_workspace(self, layout: BatchLayout, packed: PackedSourceRows, source: int, ratio: int,
                          selection: Tensor, scratch, swa_slots: Tensor | None = None) -> object | None: ...

    def select(self, be: ComputeBackend, cfg: TextConfig, role: LayerRole, w: Mapping[str, Tensor], prefix: str,
               x: Tensor, q_lora: Tensor, layout: BatchLayout, caches: RuntimeCaches, inv_freq: Tensor,
               act_quant: bool, published: Tensor | None,
               entry_tables: dict | None = None,
               query_tiles: dict | None = None,
               key_workspaces: dict | None = None) -> tuple[Tensor, Tensor | None]: ...


def head_sum_is_exact(choice: str, num_queries: int) -> bool:
    """Whether the indexer sums a batch's heads exactly (double-fp32: the reference's bits) under head-sum `choice`:
    `fp64` always, `fp32` never, `auto` below PREFILL_MIN_QUERIES tokens — a size rule known on the host, so no
    sync; decode (graphed or not, ≤ 256 queries) stays exact, and a prefill graph of ≥ PREFILL_MIN_QUERIES tokens
    sums as the eager forward of the same batch."""
    if choice == "auto":
        return num_queries < AP.PREFILL_MIN_QUERIES
    return choice == "fp64"


class KernelAttentionOps:
    """CUDA: the Triton kernels over the slot caches (no per-request loop, no host sync).
    `deterministic` (`--enable-deterministic-inference`) picks the mode's defaults where the
    variables are unset: one key split (batch invariant) instead of the serving default
    `plan_decode_config`, and the packed rows at prefill instead of the serving default's BF16
    workspace (`attention_prefill.prefill_choice`), and the indexer's fp64 head sum at every batch
    instead of the serving default `auto` (fp32 from PREFILL_MIN_QUERIES tokens, `head_sum_exact`); explicit `splits` /
    `head_sum` / `prefill` override both. Kernel modules (tests pass stand-ins): `indexer` scores,
    `indexer_select` selects, `entry_index` makes the entry-index tables (the last two imported from
    KERNEL_MODULES when not given)."""

    def __init__(self, sparse_attention: ModuleType, indexer: ModuleType, splits: str | None = None,
                 head_sum: str | None = None, prefill: str | None = None, deterministic: bool = False,
                 decode: str | None = None, *, indexer_select: ModuleType | None = None,
                 entry_index: ModuleType | None = None) -> None:
        self.sparse_attention = sparse_attention
        self.indexer = indexer
        self.indexer_select = indexer_select or importlib.import_module(KERNEL_MODULES["indexer_select"])
        self.entry_index = entry_index or importlib.import_module(KERNEL_MODULES["entry_index"])
        self.deterministic = deterministic
        self.splits = splits or kernel_choice(ATTENTION_SPLITS_ENV, ATTENTION_SPLITS,
                                              "one" if deterministic else "decode")
        self.head_sum = head_sum or kernel_choice(INDEXER_HEAD_SUM_ENV, INDEXER_HEAD_SUMS,
                                                  "fp64" if deterministic else "auto")
        self.prefill = prefill or AP.prefill_choice(deterministic)
        #: CUDA-graph layouts' rankings told the visible counts (SGLANG_DSV41_TOPK_BOUNDED, default on)
        self.bounded_static = self.indexer_select.bounded_rankings()
        self.decode = decode or kernel_choice(ATTENTION_DECODE_ENV, ATTENTION_DECODES,
                                              "triton" if deterministic else "auto")
        if self.splits not in ATTENTION_SPLITS or self.head_sum not in INDEXER_HEAD_SUMS \
                or self.prefill not in AP.PREFILL_CHOICES or self.decode not in ATTENTION_DECODES:
            raise ValueError(f"KernelAttentionOps: splits {self.splits!r} / head_sum {self.head_sum!r} / prefill "
                             f"{self.prefill!r} / decode {self.decode!r} not in {ATTENTION_SPLITS} / "
                             f"{INDEXER_HEAD_SUMS} / {AP.PREFILL_CHOICES} / {ATTENTION_DECODES}")
        if self.decode in ("flashmla", "wide") and deterministic:
            raise ValueError(f"{ATTENTION_DECODE_ENV}={self.decode} is not available with "
                             "--enable-deterministic-inference (its launch depends on the batch size)")
        if self.prefill == "flashmla" and deterministic:
            raise ValueError("KernelAttentionOps: the flashmla prefill is not available in deterministic mode")
        #: `attention_flashmla.FlashMLAPlan` and kernel, set by `planned` (a `flashmla` choice launches
        #: nothing until a model has planned it for its head shape)
        self.flashmla_plan: FM.FlashMLAPlan | None = None
        self.flashmla_kernel = None
        self._wide: ModuleType | None = None
        self.prefill_keys = AP.key_choice()
        self.description = (f"Triton kernels (sparse_sink_attention with {self.splits!r} key splits and "
                            f"index_scores reading packed FP4 entries ({self.prefill_keys!r} keys at prefill); "
                            f"{self.head_sum} head sum + "
                            f"select_for_role, whole batch; {self.prefill!r} prefill rows; {self.decode!r} decode)")

    def head_sum_exact(self, num_queries: int) -> bool:
        """`head_sum_is_exact` for this choice."""
        return head_sum_is_exact(self.head_sum, num_queries)

    def planned(self, heads: int, head_dim: int, device: torch.device) -> KernelAttentionOps:
        """These ops for a model of `heads` heads per rank × `head_dim` on `device`, planned once at
        start-up: with the `flashmla` choice a copy holding its `attention_flashmla.plan_flashmla`
        (native / padded; the kernel loaded here, RuntimeError when sgl-kernel lacks it) or, for a
        shape or device the kernel cannot take, a copy with the `bf16` (Triton workspace) choice —
        logged either way; the `flashmla` decode choice likewise (the Triton kernel when the plan is
        `bf16`); other choices: self."""
        if self.prefill != "flashmla" and self.decode != "flashmla":
            return self
        cap = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
        plan = FM.plan_flashmla(heads, head_dim, cap)
        able = plan.mode != "bf16"
        prefill = ("flashmla" if able else "wide") if self.prefill == "flashmla" else self.prefill
        decode = ("flashmla" if able else "triton") if self.decode == "flashmla" else self.decode
        chosen = KernelAttentionOps(self.sparse_attention, self.indexer, self.splits, self.head_sum, prefill,
                                    self.deterministic, decode, indexer_select=self.indexer_select,
                                    entry_index=self.entry_index)
        if not able:
            logger.warning("sglang-dsv41: flashmla: planned the Triton kernels instead (%s)", plan.reason)
        else:
            chosen.flashmla_plan, chosen.flashmla_kernel = plan, FM.load_kernel()
            chosen.description += f"; FlashMLA flash_mla_sparse_fwd {plan.mode} ({plan.reason})"
            logger.info("sglang-dsv41: attention: FlashMLA flash_mla_sparse_fwd for %s, %s (%s)",
                        " and ".join(n for n, c in (("prefill", prefill), ("decode", decode)) if c == "flashmla"),
                        plan.mode, plan.reason)
        return chosen

    def attend(self, q: Tensor, sink: Tensor, swa_cache: Tensor, swa_slots: Tensor,
               packed: PackedSourceRows | None, comp_entries: Tensor | None,
               workspace: tuple[Tensor, Tensor] | FM.FlashMLAInputs | None = None,
               memo: dict | None = None) -> Tensor:
        """One launch: SWA rows by SWA slot, compressed keys read from the packed rows by entry
        index (`PackedSource` of the latent rows with the source's latent offset / share / ratio,
        contract §5), or — `workspace` = (BF16 rows, rows [N, K]) from `prefill_workspace` — from
        the BF16 workspace by row, launched with `plan_prefill_config` (one split, as either mode's
        plan at the workspace's ≥ PREFILL_MIN_QUERIES queries); `workspace` =
        `attention_flashmla.FlashMLAInputs` (the `flashmla` choice): one FlashMLA launch instead. The `wide`
        decode choice (and `auto` in serving mode from WIDE_DECODE_MIN_QUERIES queries): a decode batch's BF16 rows read
        by `kernels.sparse_attention_prefill` under its `plan_decode`.
        `memo` (one forward's dict): the gathered BF16 rows are made once per (kv source, entries
        tensor) and reused by the later layers that pass both again."""
        if swa_cache.dtype != torch.bfloat16:
            raise RuntimeError(f"sglang-dsv41: the CUDA attention kernel reads BF16 SWA cache rows, got "
                               f"{swa_cache.dtype} (serve with the model dtype bfloat16 and --kv-cache-dtype auto)")
        N, H, D = q.shape
        if isinstance(workspace, FM.FlashMLAInputs):
            return FM.attend(self.flashmla_kernel, self.flashmla_plan, q, sink, swa_cache, workspace,
                             softmax_scale(D))
        if workspace is None and self.decode == "flashmla" and N in FLASHMLA_DECODE_QUERIES:
            if self.flashmla_plan is None:
                raise RuntimeError("sglang-dsv41: the flashmla decode was not planned for the model's heads "
                                   "(build the ops with ops_for(..., heads, head_dim))")
            comp = None if packed is None or comp_entries is None else self._packed_latents(packed)
            return FM.decode_attend(self.flashmla_kernel, self.flashmla_plan, q, sink, swa_cache, swa_slots, comp,
                                    comp_entries if comp is not None else None, softmax_scale(D))
        K = 0 if comp_entries is None else comp_entries.shape[1]
        comp_cache = None
        if workspace is not None:
            comp_cache, comp_entries = workspace
            if comp_entries.shape != (N, K):
                raise ValueError(f"attend: workspace rows {tuple(comp_entries.shape)}, expected {(N, K)}")
        elif packed is not None and comp_entries is not None:
            comp_cache = self._packed_latents(packed)
            if self.decode in ("gather", "wide") or (self.decode == "auto" and N <= GATHER_DECODE_MAX_QUERIES):
                comp_cache, comp_entries = _gathered_rows(comp_cache, comp_entries, packed, memo)
        wide_prefill = workspace is not None and self.prefill in ("wide", "heads")
        if comp_cache is not None and (wide_prefill or (workspace is None and self._decodes_wide(N))):
            swa_slots = _slots_as(swa_slots, comp_entries.dtype, memo)      # the wide kernel's one slot type
        if wide_prefill:                                                   # `wide` plans itself
            wide = self._wide_kernel()
            heads = {"config": wide.plan_heads(H, D)} if self.prefill == "heads" else {}
            return wide.prefill_sink_attention(
                q.to(torch.bfloat16), swa_cache, swa_slots, comp_cache, comp_entries, sink.to(torch.float32),
                softmax_scale(D), **heads)
        if workspace is None and self._decodes_wide(N):         # key splits planned by the kernel's module
            wide = self._wide_kernel()
            return wide.prefill_sink_attention(
                q.to(torch.bfloat16), swa_cache, swa_slots, comp_cache, comp_entries if comp_cache is not None else None,
                sink.to(torch.float32), softmax_scale(D),
                config=wide.plan_decode(N, H, D, swa_slots.shape[1], K, self.sparse_attention.device_sm_count(q.device)))
        if workspace is not None:
            plan = self.sparse_attention.plan_prefill_config(N, H, D, swa_slots.shape[1], K)
        elif self.splits == "decode":
            plan = self.sparse_attention.plan_decode_config(
                N, H, D, swa_slots.shape[1], K, sm_count=self.sparse_attention.device_sm_count(q.device))
        else:
            plan = dataclasses.replace(self.sparse_attention.plan_config(N, H, D, swa_slots.shape[1], K, sm_count=1),
                                       num_splits=ATTENTION_KEY_SPLITS)
        o = self.sparse_attention.sparse_sink_attention(
            q.to(torch.bfloat16), swa_cache, swa_slots, comp_cache, comp_entries if comp_cache is not None else None,
            sink.to(torch.float32), softmax_scale(D), config=plan)
        return o

    def _decodes_wide(self, num_queries: int) -> bool:
        """Does a decode batch of `num_queries` go to the `wide` kernel (`wide`; `auto` in serving mode
        between WIDE_DECODE_MIN_QUERIES and GATHER_DECODE_MAX_QUERIES)?"""
        if self.decode == "auto":
            return not self.deterministic and WIDE_DECODE_MIN_QUERIES <= num_queries <= GATHER_DECODE_MAX_QUERIES
        return self.decode == "wide"

    def _wide_kernel(self) -> ModuleType:
        """`kernels.sparse_attention_prefill` (the `wide` prefill choice), imported on first use."""
        if self._wide is None:
            self._wide = importlib.import_module(WIDE_PREFILL_MODULE)
        return self._wide

    def _packed_latents(self, packed: PackedSourceRows):
        """The kernels' `PackedSource` of the latent part of `packed` (contract §5)."""
        src = packed.source.latent
        return self.sparse_attention.PackedSource(
            rows=packed.latent_rows, offset=src.offset, share=src.share, ratio=src.ratio,
            head_dim=packed.layout.head_dim, index_head_dim=packed.layout.index_head_dim, part="latent")

    def prefill_workspace(self, layout: BatchLayout, packed: PackedSourceRows, source: int, ratio: int,
                          selection: Tensor, scratch,
                          swa_slots: Tensor | None = None) -> tuple[Tensor, Tensor] | FM.FlashMLAInputs | None:
        """(BF16 workspace of kv source `source`, rows [N, K] of `selection`) when this batch runs
        the prefill workspace path (`attention_prefill.applies`), else None. The workspace is
        decoded once per source and forward (`scratch.workspaces`; later layers reading the same
        source reuse it: nothing writes its rows after the source layer) over the batch's
        entry-index table of that ratio (`scratch.entry_tables`, built here when no indexer layer
        of the ratio has yet). With a planned `flashmla` choice: `attention_flashmla.FlashMLAInputs`
        of the same workspace and the layer's window `swa_slots` [N, W]."""
        width = layout.max_seq_len // ratio
        if not AP.applies(self.prefill, layout.num_tokens, layout.num_requests, width):
            return None
        rows = scratch.workspaces.get(source)
        if rows is None:
            table = self.entry_table(layout, ratio, width, scratch.entry_tables, whole=True)
            rows = scratch.workspaces[source] = AP.latent_workspace(packed.latent_rows, packed.source.latent,
                                                                    packed.layout.head_dim, table)
        comp_rows = AP.workspace_rows(layout.token_req, selection, width)
        if self.prefill == "flashmla":
            if self.flashmla_plan is None:
                raise RuntimeError("sglang-dsv41: the flashmla prefill was not planned for the model's heads "
                                   "(build the ops with ops_for(..., heads, head_dim))")
            if swa_slots is None:
                raise ValueError("prefill_workspace: the flashmla prefill needs the layer's window swa_slots")
            return FM.prefill_inputs(rows, layout.token_req, layout.starts, swa_slots, comp_rows)
        return rows, comp_rows

    def entry_table(self, layout: BatchLayout, ratio: int, width: int, tables: dict | None, *, whole: bool) -> Tensor:
        """The forward's entry-index table of `ratio`, built once and kept in `tables` (the forward's
        cache: indexer layers and workspaces of a ratio share it). `whole`: every column written (−1 past
        a request's entries), as a workspace that decodes them all needs; else the columns past
        n_entries may be left unwritten (`entry_index_table(fill=False)`: a CUDA-graph layout's table is
        as wide as the served context). A whole table serves both; a partial one only partial readers."""
        table = None if tables is None else tables.get(ratio)
        if table is None and not whole and tables is not None:
            table = tables.get((ratio, "entries"))
        if table is None:
            table = self.entry_index.entry_index_table(layout.req_to_token, layout.req_rows,
                                                       layout.seq_lens // ratio, ratio, width, fill=whole)
            if tables is not None:
                tables[ratio if whole else (ratio, "entries")] = table
        return table

    def select(self, be: ComputeBackend, cfg: TextConfig, role: LayerRole, w: Mapping[str, Tensor], prefix: str,
               x: Tensor, q_lora: Tensor, layout: BatchLayout, caches: RuntimeCaches, inv_freq: Tensor,
               act_quant: bool, published: Tensor | None,
               entry_tables: dict | None = None,
               query_tiles: dict | None = None,
               key_workspaces: dict | None = None) -> tuple[Tensor, Tensor | None]:
        """Whole batch: compressed position j of request r is packed entry slot(j·ratio + ratio − 1)
        // ratio (`entry_index_table`, −1 beyond ⌊seq_len/ratio⌋); the kernel reads each entry's
        FP4 key nibbles and UE8M0 scales from the packed rows (contract §5), so no BF16 key copy
        is made; query t sees j < ⌊(p_t+1)/ratio⌋.
        Input checks are off (no host sync): the table and visibilities are built from the
        checked `BatchLayout`, so every visible entry exists by construction.

        Static layouts (CUDA graphs): the width is the static bound `req_to_token` width // ratio,
        not the batch's longest request. Cost of the padding columns: the kernel loads and
        multiplies only entry tiles some query of the tile can see (`tile_vis`); the rankings are
        told each query's visible count (`select_for_role(bounded=True)`) and read no column past
        it, so the scoring kernel leaves the later tiles unwritten (`fill_invisible=False`; the
        candidate-block keys past a row's visible blocks are masked before their ranking), and so
        does the entry table past each request's entries unless a workspace reads them (`entry_table`). The
        candidate-block keys still scale with the static width (docs/runtime.md "CUDA-graph padding").
        `query_tiles`: the forward's cache of the scoring kernel's query tiles (`ForwardScratch`),
        one per query chunk, shared by every indexer layer (`index_scores(tile_cache=)`).
        Prefill batches (`attention_prefill.key_workspace_applies`) read the keys from a BF16
        workspace decoded once per kv source and forward (`key_workspaces`, the forward's cache),
        with the same scores."""
        src, ratio = role.kv_source, role.ratio
        assert src is not None
        K = self.indexer
        query = index_query(be, cfg, w, prefix, x, q_lora, layout.positions, inv_freq, act_quant)
        n_visible = visible_counts(layout.positions, ratio)
        width = layout.max_seq_len // ratio
        N = layout.num_tokens
        bounded = layout.static and self.bounded_static
        key_workspace = AP.key_workspace_applies(self.prefill_keys, N, layout.num_requests, width)
        # bounded scores read j < n_visible ≤ n_entries only; a key workspace decodes every column
        entry_table = self.entry_table(layout, ratio, width, entry_tables, whole=not bounded or key_workspace)
        packed = caches.packed(src)
        key_src = packed.source.key
        if key_workspace:
            hit = None if key_workspaces is None else key_workspaces.get(src)
            if hit is None:          # once per kv source and forward: indexer layers of a source share it
                hit = AP.key_workspace(packed.key_rows, key_src, packed.layout.index_head_dim, entry_table)
                if key_workspaces is not None:
                    key_workspaces[src] = hit
            key_cache, entry_table = hit
        else:
            key_cache = K.PackedSource(rows=packed.key_rows, offset=key_src.offset, share=key_src.share,
                                       ratio=key_src.ratio, head_dim=packed.layout.head_dim,
                                       index_head_dim=packed.layout.index_head_dim, part="key")
        rows = max(1, SCORE_ELEMENTS_PER_CHUNK // max(width, 1))
        exact = self.head_sum_exact(N)
        selections, blocks = [], []
        for start in range(0, max(N, 1), rows):
            part = slice(start, min(start + rows, N))
            scores = K.index_scores(query.q[part], query.head_weights[part], key_cache, entry_table,
                                    layout.token_req[part], n_visible[part], head_sum_exact=exact,
                                    check_inputs=False,
                                    tile_cache=None if query_tiles is None else query_tiles.setdefault(
                                        (part.start, part.stop), {}), grouped_queries=True,
                                    fill_invisible=not bounded)
            selection, chunk_blocks = select_for_role(self.indexer_select, cfg, role, scores, n_visible[part],
                                                      None if published is None else published[part],
                                                      check_nan=False, bounded=bounded)
            selections.append(selection)
            blocks.append(chunk_blocks)
        if len(selections) == 1:
            return selections[0], blocks[0]
        return torch.cat(selections), (torch.cat(blocks) if role.candidate_source else None)


def _gathered_rows(comp_cache, comp_entries: Tensor, packed: PackedSourceRows, memo: dict | None):
    """`key_gather.gather_latent_rows`, looked up in / stored to `memo` by (source, entries tensor):
    the rows depend only on those while the forward runs (the source layer writes its entries before
    any reader; the entries tensor is kept alive by the forward's scratch)."""
    from sglang_dsv41.kernels.key_gather import gather_latent_rows

    if memo is None:
        return gather_latent_rows(comp_cache, comp_entries)
    key = ("gathered", packed.source.layer, id(comp_entries))
    hit = memo.get(key)
    if hit is None or hit[0] is not comp_entries:
        hit = memo[key] = (comp_entries, gather_latent_rows(comp_cache, comp_entries))
    return hit[1]


def _slots_as(swa_slots: Tensor, dtype: torch.dtype, memo: dict | None) -> Tensor:
    """`swa_slots` as `dtype` (the compressed rows' integer type: one loop of the wide kernel reads both
    lists), cast once per forward through `memo` (the window tensor is the forward's, shared by its layers)."""
    if swa_slots.dtype == dtype:
        return swa_slots
    if memo is None:
        return swa_slots.to(dtype)
    key = ("slots_as", dtype, id(swa_slots))
    hit = memo.get(key)
    if hit is None or hit[0] is not swa_slots:
        hit = memo[key] = (swa_slots, swa_slots.to(dtype))
    return hit[1]


@functools.cache
def kernel_ops(deterministic: bool = False) -> KernelAttentionOps:
    """The Triton implementation (one per mode, `KernelAttentionOps`); raises RuntimeError if a
    kernel module cannot be imported or was built for Triton's CPU interpreter (TRITON_INTERPRET=1),
    which cannot serve CUDA."""
    modules = {}
    for key, name in KERNEL_MODULES.items():
        try:
            modules[key] = importlib.import_module(name)
        except ImportError as e:
            raise RuntimeError(f"sglang-dsv41: CUDA tensors need the Triton kernel module {name}, which failed "
                               f"to import ({e}); install sglang-dsv41 with its kernels and Triton") from e
    if modules["sparse_attention"]._is_interpreted() or modules["indexer"].INTERPRETED:
        raise RuntimeError("sglang-dsv41: the Triton kernels were built for the CPU interpreter (TRITON_INTERPRET=1 "
                           "was set when they were imported); unset it to run on CUDA")
    return KernelAttentionOps(modules["sparse_attention"], modules["indexer"], deterministic=deterministic,
                              indexer_select=modules["indexer_select"], entry_index=modules["entry_index"])


def ops_for(device: torch.device, acc: torch.dtype = torch.float64, deterministic: bool = False,
            heads: int | None = None, head_dim: int | None = None) -> AttentionOps:
    """CPU → `TorchAttentionOps` summing in `acc`; CUDA → `KernelAttentionOps` of the mode
    (`deterministic`: batch-invariant plan; raises if the kernels cannot load), planned for
    `heads` per rank × `head_dim` when given (`KernelAttentionOps.planned`: the flashmla prefill);
    any other device raises."""
    if device.type == "cpu":
        return TORCH_OPS if acc == torch.float64 else FP32_TORCH_OPS
    if device.type == "cuda":
        ops = kernel_ops(bool(deterministic))
        return ops if heads is None or head_dim is None else ops.planned(heads, head_dim, device)
    raise RuntimeError(f"sglang-dsv41: no attention implementation for device '{device}' (CPU: torch "
                       "reference path; CUDA: Triton kernels)")


"""Prefill attention over a BF16 workspace of the batch's compressed entries (issue 21; CUDA serving default).

The CUDA attention kernel reads each selected compressed key from the packed FP4 rows and
decodes it in the kernel (`kernels.packed_rows`), once per query and head block: at an 8K-token
Flash prefill that is 8,192 queries × 512 keys × 2 head blocks ≈ 8.4 M decodes of 288-B entries,
while the request holds only 4,096 distinct entries. With `SGLANG_DSV41_ATTN_PREFILL=bf16` the
kv source's visible entries of every request of the batch are decoded once per layer and forward
into a BF16 workspace (`latent_workspace`: [R·width, head_dim], row b·width + j = compressed
position j of request b, zeros where there is none) and the kernel reads BF16 rows from it
(`workspace_rows`) — its BF16-row path, the pre-packing format (upstream's Hopper prefill does
the same: gather into a BF16 workspace, then `flash_mla_sparse_fwd`), launched with
`kernels.sparse_attention.plan_prefill_config`.

Values: the decoded entries are BF16-exact (E2M1 × E4M3, `kv_layout.decode_latents`), so the
kernel sees the same keys; it is another binary of the same kernel, which agrees with the packed
path within 2 BF16 ulps of the output scale, not bit for bit (`flash_layer.kernel_components`
checks it on the H200).

The choice (`prefill_choice`): SGLANG_DSV41_ATTN_PREFILL when set, else `wide` in the serving
mode (measured faster at 8K: docs/performance.md "Session 13" for the workspace, "Session 33" for
`wide`'s kernel on it) and `packed` under
`--enable-deterministic-inference` (whether a batch takes the workspace depends on its size, so
a request's bits would depend on its batch). Only the CUDA attention (`KernelAttentionOps`) reads
it; the CPU path never has a workspace.

Memory: one BF16 workspace per kv source and forward, R·width·head_dim·2 B ≤ WORKSPACE_MAX_ENTRIES
rows (128 MiB at Flash; 4 kv sources: ≤ 512 MiB per forward and rank). On CUDA the rows are decoded by
one `kernels.entry_decode` launch per workspace, with no temporaries.

`wide` (the serving default since session 33): the same workspace read by `kernels.sparse_attention_prefill.prefill_sink_attention`
(the products transposed so that a program takes every head of its query on 64-key tiles: one
gather of each key row per query instead of one per 16-head block); the same oracle bound, not the
`bf16` path's bits.

`heads` (opt-in): the same workspace read by the same module under `plan_heads`
(`kernels.sparse_attention_prefill_heads`: heads as the MMA's rows, the split P·V as one product over
duplicated key rows; docs/performance.md "Session 45"); the same oracle bound.

`flashmla` (opt-in, `attention_flashmla`): the same workspace, read by one
`sgl_kernel.flash_mla.flash_mla_sparse_fwd` launch over [SWA rows | workspace] instead of the
Triton kernel; refused with deterministic inference.

Indexer keys (`SGLANG_DSV41_INDEXER_PREFILL_KEYS`, `key_choice`): under the same size rule
(`key_workspace_applies`: ≥ PREFILL_MIN_QUERIES tokens, ≤ WORKSPACE_MAX_ENTRIES rows)
the indexer's keys of a kv source are decoded once per forward into a BF16 workspace
(`key_workspace`: [R·width, index_head_dim], row b·width + j = compressed position j of request b)
and `kernels.indexer.index_scores` reads BF16 rows (`bf16`, the default; `packed`: the kernel
decodes the packed entries of every tile, once per query tile). FP4 keys are exact in BF16 and the
kernel's BF16-key path gives its packed path's scores bit for bit, so the choice changes no value
in either mode: at an 8K Flash prefill it took the scoring from 4.36 to 2.72 ms on an H100
(docs/performance.md "Session 33").

When it applies (`applies`): the choice is a WORKSPACE_CHOICES one, the batch has ≥ PREFILL_MIN_QUERIES
tokens, and the workspace holds ≤ WORKSPACE_MAX_ENTRIES rows (R requests × the width max_seq_len / ratio);
otherwise the packed path runs. These are size rules known on the host, no host sync. Static layouts (CUDA
graphs) take the same rules with their static bounds — R the runner's request slots, max_seq_len the
`req_to_token` width (the context length) — so a prefill graph of ≥ PREFILL_MIN_QUERIES tokens captures the
workspace when those bounds fit, as the eager forward of the same batch would (docs/prefill_graphs.md
"Buckets of 512 tokens and more"); decode graphs (≤ 256 queries) never reach PREFILL_MIN_QUERIES.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .backend import kernel_choice
from .kv_layout import SourceColumns, decode_keys, decode_latents, read_entries

PREFILL_ENV, PREFILL_CHOICES = "SGLANG_DSV41_ATTN_PREFILL", ("packed", "bf16", "wide", "heads", "flashmla")
#: the choices that decode the workspace (`wide`: the same workspace, read by
#: `kernels.sparse_attention_prefill` — every head of a query in one program; `heads`: the same module
#: under `plan_heads`, heads as the MMA's rows; `flashmla`: read by one FlashMLA launch: `attention_flashmla`)
WORKSPACE_CHOICES = ("bf16", "wide", "heads", "flashmla")
#: the indexer's keys of a prefill batch (`key_choice`): a BF16 workspace (`bf16`) or the packed entries
KEY_PREFILL_ENV, KEY_PREFILL_CHOICES = "SGLANG_DSV41_INDEXER_PREFILL_KEYS", ("bf16", "packed")
#: fewer queries than this: the packed rows (the decode per entry would not be amortised)
PREFILL_MIN_QUERIES = 512
#: largest workspace (rows): 2^17 × 512 dims × 2 B = 128 MiB at Flash per kv source and forward
WORKSPACE_MAX_ENTRIES = 1 << 17
#: entries decoded per step by the CPU torch codec (bounds the fp32 temporaries of `decode_latents`: 16 K × 512 × 4 B × 2)
DECODE_CHUNK = 1 << 14


def key_choice() -> str:
    """SGLANG_DSV41_INDEXER_PREFILL_KEYS when set (an unknown value raises), else `bf16` (module doc)."""
    return kernel_choice(KEY_PREFILL_ENV, KEY_PREFILL_CHOICES, "bf16")


def key_workspace_applies(choice: str, num_queries: int, num_requests: int, width: int) -> bool:
    """Whether a batch's indexer reads the BF16 key workspace (module doc)."""
    if choice not in KEY_PREFILL_CHOICES:
        raise ValueError(f"{KEY_PREFILL_ENV}={choice!r}: expected one of {KEY_PREFILL_CHOICES}")
    return choice == "bf16" and num_queries >= PREFILL_MIN_QUERIES and 0 < num_requests * width <= WORKSPACE_MAX_ENTRIES


def key_workspace(key_rows: Tensor, source: SourceColumns, index_head_dim: int,
                  entry_table: Tensor) -> tuple[Tensor, Tensor]:
    """(BF16 [R·width, index_head_dim] decoded index keys, int64 rows [R, width]): row b·width + j =
    the key of packed entry entry_table[b, j] of kv source `source` (part "key"), and rows[b, j] that
    row, or −1 where the table has none (zeros in the workspace); decoded by `_decoded_rows`."""
    out = _decoded_rows(key_rows, source, index_head_dim, entry_table, "key")
    R, width = entry_table.shape
    rows = torch.arange(R * width, device=entry_table.device).view(R, width)
    return out, torch.where(entry_table >= 0, rows, -1)


def prefill_choice(deterministic: bool) -> str:
    """SGLANG_DSV41_ATTN_PREFILL when set (an unknown value raises), else `packed` when
    `deterministic`, else `wide` (module doc). `flashmla` with `deterministic` raises: deterministic
    inference keeps the Triton kernels (the FlashMLA binary's summation order is not ours to fix)."""
    choice = kernel_choice(PREFILL_ENV, PREFILL_CHOICES, "packed" if deterministic else "wide")
    if choice == "flashmla" and deterministic:
        raise ValueError(f"{PREFILL_ENV}=flashmla is not available with --enable-deterministic-inference "
                         "(unset it, or choose packed / bf16 / wide / heads)")
    return choice


def applies(choice: str, num_queries: int, num_requests: int, width: int) -> bool:
    """Whether a batch runs the workspace path (module doc); an unknown choice raises."""
    if choice not in PREFILL_CHOICES:
        raise ValueError(f"{PREFILL_ENV}={choice!r}: expected one of {PREFILL_CHOICES}")
    return (choice in WORKSPACE_CHOICES and num_queries >= PREFILL_MIN_QUERIES
            and 0 < num_requests * width <= WORKSPACE_MAX_ENTRIES)


def latent_workspace(latent_rows: Tensor, source: SourceColumns, head_dim: int, entry_table: Tensor) -> Tensor:
    """BF16 [R·width, head_dim]: row b·width + j = the decoded latent of packed entry
    entry_table[b, j] of kv source `source` (zeros for −1), decoded by `_decoded_rows`."""
    return _decoded_rows(latent_rows, source, head_dim, entry_table, "latent")


def _decoded_rows(packed_rows: Tensor, columns: SourceColumns, dim: int, entry_table: Tensor, part: str) -> Tensor:
    """BF16 [R·width, dim]: row i = the decoded `part` ("latent" or "key", at `columns` of `packed_rows`) of
    packed entry entry_table.flat[i] (zeros for −1). CUDA rows: one launch of `kernels.entry_decode` (the
    same bits); CPU rows (tests; the CPU forward has no workspace): the torch codec in chunks of
    DECODE_CHUNK entries (bounds the fp32 temporaries)."""
    if packed_rows.is_cuda:
        from sglang_dsv41.kernels.entry_decode import decode_entry_rows

        return decode_entry_rows(packed_rows, entry_table, offset=columns.offset, share=columns.share,
                                 ratio=columns.ratio, dims=dim, part=part)
    decode = decode_keys if part == "key" else decode_latents
    flat = entry_table.reshape(-1)
    out = torch.empty(flat.numel(), dim, dtype=torch.bfloat16, device=packed_rows.device)
    for start in range(0, flat.numel(), DECODE_CHUNK):
        chunk = flat[start:start + DECODE_CHUNK]
        out[start:start + chunk.numel()] = decode(read_entries(packed_rows, columns, chunk), dim)
    return out


def workspace_rows(token_req: Tensor, selection: Tensor, width: int) -> Tensor:
    """[N, K] workspace rows of the selected compressed positions `selection` (request-local,
    −1 = none) of tokens whose request index is `token_req` [N]: b·width + j, −1 kept."""
    rows = token_req.to(torch.int64)[:, None] * width + selection
    return torch.where(selection >= 0, rows, -1)


__all__ = ["DECODE_CHUNK", "KEY_PREFILL_CHOICES", "KEY_PREFILL_ENV", "PREFILL_CHOICES", "PREFILL_ENV",
           "PREFILL_MIN_QUERIES", "WORKSPACE_CHOICES", "WORKSPACE_MAX_ENTRIES",
           "applies", "key_choice", "key_workspace", "key_workspace_applies", "latent_workspace", "prefill_choice",
           "workspace_rows"]

"""The torch implementation of `attention_ops.AttentionOps` (spec §3.4.4, §3.4.5): attention on gathered rows and
decoded packed entries, the indexer per request, summed in `acc` (float64: bit-identical to `ReferenceModel`;
fp32: the CPU serving path). `attention_ops.ops_for` picks it for CPU tensors. `attend_with_sink` runs on any
device: the DSpark draft layer calls it on CUDA too (`dspark_stages`), where it checks without a host sync.
"""
from __future__ import annotations

from typing import Mapping

import torch
from torch import Tensor

from ..config import LayerRole, TextConfig
from ..numerics.geometry import softmax_scale
from ..numerics.rounding import bf16
from .attention_math import index_query
from .backend import ComputeBackend
from .batch import BatchLayout
from .cache import RuntimeCaches
from .indexer_select import run_indexer_cpu
from .kv_layout import PackedSourceRows, entry_positions

EMPTY_SOFTMAX = "attend_with_sink: a query has no valid key and a −∞ sink (empty softmax)"


def attend_with_sink(q: Tensor, keys: Tensor, sink: Tensor, valid: Tensor, acc: torch.dtype = torch.float64) -> Tensor:
    """o_h = Σ_j e^{s_j} k_j / (Σ_j e^{s_j} + e^{sink_h}), scale D^−1/2, K = V (spec §3.4.5):
    q [T, H, D], keys [T, S, D], valid [T, S]; evaluated in `acc` (float64: rounded once), then BF16."""
    T, S, D = keys.shape
    qf, kf = q.to(acc), keys.to(acc)
    logits = torch.einsum("thd,tsd->ths", qf, kf) * softmax_scale(D)
    logits = torch.where(valid[:, None, :], logits, -torch.inf)
    sink_logit = sink.to(acc)[None, :].expand(T, -1)
    m = torch.maximum(logits.amax(dim=2), sink_logit)
    if m.device.type == "cpu":
        if not bool(torch.isfinite(m).all()):
            raise ValueError(EMPTY_SOFTMAX)
    else:  # no host sync: CUDA-graph capturable, still fails loudly (device-side assert)
        torch._assert_async(torch.isfinite(m).all(), EMPTY_SOFTMAX)
    p = torch.exp(logits - m[:, :, None])
    denom = p.sum(dim=2) + torch.exp(sink_logit - m)
    return bf16(torch.einsum("ths,tsd->thd", p, kf) / denom[:, :, None])


def gather_rows(buffer: Tensor, slots: Tensor) -> tuple[Tensor, Tensor]:
    """(rows of `buffer` at `slots` [..., n] as fp32, zero where slot −1; valid mask [..., n])."""
    valid = slots >= 0
    rows = buffer[torch.where(valid, slots, torch.zeros_like(slots))].to(torch.float32)
    return torch.where(valid[..., None], rows, 0.0), valid


class TorchAttentionOps:
    """CPU: attention and index scores in torch on gathered rows and decoded packed entries,
    summed in `acc` (float64: bit-identical to `ReferenceModel`; fp32: the serving path)."""

    def __init__(self, acc: torch.dtype = torch.float64) -> None:
        self.acc = acc
        self.description = f"torch path ({'float64 sums, bit-identical to ReferenceModel' if acc == torch.float64 else 'fp32'})"

    def attend(self, q: Tensor, sink: Tensor, swa_cache: Tensor, swa_slots: Tensor,
               packed: PackedSourceRows | None, comp_entries: Tensor | None,
               workspace: tuple[Tensor, Tensor] | None = None, memo: dict | None = None) -> Tensor:
        if workspace is not None:
            raise ValueError("the torch attention reads the packed rows (no prefill workspace on CPU)")
        keys, valid = gather_rows(swa_cache, swa_slots)
        if packed is not None and comp_entries is not None:
            c_valid = comp_entries >= 0
            c_keys = torch.where(c_valid[..., None], packed.latents(comp_entries), 0.0)
            keys, valid = torch.cat((keys, c_keys), dim=1), torch.cat((valid, c_valid), dim=1)
        return attend_with_sink(q, keys, sink, valid, self.acc)

    def prefill_workspace(self, layout: BatchLayout, packed: PackedSourceRows, source: int, ratio: int,
                          selection: Tensor, scratch, swa_slots: Tensor | None = None) -> None:
        """The CPU path reads the packed rows directly: never a workspace."""
        return None

    def select(self, be: ComputeBackend, cfg: TextConfig, role: LayerRole, w: Mapping[str, Tensor], prefix: str,
               x: Tensor, q_lora: Tensor, layout: BatchLayout, caches: RuntimeCaches, inv_freq: Tensor,
               act_quant: bool, published: Tensor | None,
               entry_tables: dict | None = None,
               query_tiles: dict | None = None,
               key_workspaces: dict | None = None) -> tuple[Tensor, Tensor | None]:
        """Per request: `run_indexer_cpu` over the decoded index keys of compressed positions
        0..⌊seq_len/ratio⌋−1 (what the reference state holds); tokens past every request (the
        ghost tail of a padded ragged verify graph, `batch.static_ragged_verify_layout`) select
        nothing."""
        src, ratio = role.kv_source, role.ratio
        assert src is not None
        packed = caches.packed(src)
        selections, blocks = [], []
        for b in range(layout.num_requests):
            rows = layout.token_range(b)
            n_entries = int(layout.seq_lens[b]) // ratio
            entry_slots = layout.request_slots(b, entry_positions(torch.arange(n_entries, device=x.device), ratio))
            keys = packed.keys(entry_slots // ratio)
            query = index_query(be, cfg, w, prefix, x[rows], q_lora[rows], layout.positions[rows], inv_freq,
                                act_quant)
            selection, published_blocks = run_indexer_cpu(cfg, role, query, layout.positions[rows], keys,
                                                          None if published is None else published[rows], self.acc)
            selections.append(selection)
            blocks.append(published_blocks)
        ghosts = layout.num_tokens - int(layout.extend_lens.sum())     # a static ragged verify's tail padding
        if ghosts:
            selections.append(selections[-1].new_full((ghosts, *selections[-1].shape[1:]), -1))
            if role.candidate_source:
                blocks.append(blocks[-1].new_full((ghosts, *blocks[-1].shape[1:]), -1))
        return torch.cat(selections), (torch.cat(blocks) if role.candidate_source else None)


TORCH_OPS = TorchAttentionOps()
FP32_TORCH_OPS = TorchAttentionOps(torch.float32)

"""The DeepSeek-V4.1 forward of a packed batch over the runtime caches — no SGLang objects (spec §3).

`TorchForward.hidden_states(input_ids, layout, caches)` follows the reference model
(`reference/model.py`) step by step and calls the reference's math on tensors; only how the
per-request state is stored differs (`runtime/cache.py`: packed global KV rows, window-bounded
SWA rows, request-scoped ratio-2 pair state — instead of a per-request `RequestState`):

1. ids remapped like `ReferenceModel.remap_ids` (vision: ids ≥ 1,000,000 → image_token_id,
   §3.1); Engram rows are hashed per request (`EngramHasher.row_ids(..., extend_lens)`, §3.3.1)
   with the K ids before its chunk: from the host for an extend (`layout.engram_history`), else
   from the request's history ring, which every forward advances (`runtime/engram_history.py`) —
   so the history survives chunked prefill, decode, prefix-cache hits and preemption;
2. R⁰ = embedding broadcast to the hc streams; per layer: Engram → attn-hc → attention
   (`runtime/attention.py`) → ffn-hc → MoE (`reference.moe.moe_sublayer`), with the lagged pre
   (`reference.mhc`, §3.2); Engram, attention heads and routed experts are sharded under tensor
   parallelism, bit-identical to TP 1 (`runtime/tensor_parallel.py`);
3. final collapse and `norm` (§3.7); the LM head is applied by the caller.

On CUDA the same steps run on kernels, each with its bound stated where it lives: the
hyper-connections through `runtime/mhc_ops.py` (fused Triton mHC), and the reference helpers
inside `dense_ops.dense_math` (FP8 W8A16 / BF16 tensor-core products) and
`fused_ops.fused_elementwise` (one-launch rounding, quantisation, norms, RoPE, SwiGLU, top-k).
CPU tensors always take the reference's exact code.

Kept free of SGLang imports so the batching / caching invariants are unit-tested directly
against `ReferenceModel` (`tests/test_runtime_forward.py`).
"""
from __future__ import annotations

import contextlib
import functools
from typing import Iterator, Mapping

import torch
from torch import Tensor

from ..config import DeepseekV41Config
from ..engram_hash import MULTIMODAL_PAD_ID_BASE, EngramHasher
from ..reference.attention import layer_inv_freq
from ..reference.engram import engram_gate, gated_residual
from ..reference.model import language_model_ids
from ..reference.ops import F32, linear_fp8, matmul_fp32_exact, rms_norm
from ..reference.state import NumericsProfile
from .attention import ForwardScratch, attention_sublayer
from .batch import BatchLayout
from .cache import RuntimeCaches
from .dense_ops import backend_for, dense_math
from .engram_history import history_tail
from .fused_ops import fused_elementwise
from .mhc_ops import hc_coefficients, hc_collapse, hc_residual_update, hc_sublayer_input
from .tensor_parallel import SINGLE, TensorParallel


@contextlib.contextmanager
def fp32_default_dtype() -> Iterator[None]:
    """The reference math assumes torch's default float dtype (fp32); SGLang builds and loads
    models under its model dtype, so pin fp32 for the duration of a forward / weight load."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


class TorchForward:
    """Weights + constants of one model; `hidden_states` runs a batch (see the module doc).

    `weights`: DeepSeek-native names → dequantised fp32 tensors (`checkpoint.loader`), on the
    device the forward runs on; `hasher`: the Engram hasher (None without Engram layers).
    """

    def __init__(self, cfg: DeepseekV41Config, weights: Mapping[str, Tensor], hasher: EngramHasher | None,
                 numerics: NumericsProfile = NumericsProfile(), tp: TensorParallel = SINGLE) -> None:
        if cfg.text.engram_layer_ids and hasher is None:
            raise ValueError("the model has Engram layers: an EngramHasher is required (spec §3.3.1)")
        self.cfg = cfg
        self.text = cfg.text
        self.roles = self.text.layer_roles()
        self.weights = weights
        self.dense_backend = backend_for(weights)   # CUDA: tensor-core dense products (dense_ops); CPU: None = exact
        self.hasher = hasher
        self.numerics = numerics
        self.tp = tp
        tp.plan(self.text)     # raises now for a TP size the model cannot be sharded with
        device = weights["embed.weight"].device
        #: per-ratio RoPE inverse frequencies on the model device, made once (no host → device
        #: copy inside a forward: CUDA graphs cannot capture one)
        self.inv_freq = {r: layer_inv_freq(self.text, r).to(device) for r in sorted({x.ratio for x in self.roles})}

    def remap_ids(self, ids: Tensor) -> Tensor:
        """Language-model ids (spec §3.1 item 3), the reference's rule."""
        return language_model_ids(ids, self.cfg)

    def remap_ids_on_device(self, ids: Tensor) -> Tensor:
        """`remap_ids` without a host sync (static / CUDA-graph layouts): the same mapping; an id
        outside the vocabulary fails a device-side assertion (`torch._assert_async`) instead of
        raising on the host."""
        ids = ids.to(torch.int64).reshape(-1)
        if self.cfg.has_vision:
            ids = torch.where(ids >= MULTIMODAL_PAD_ID_BASE, torch.full_like(ids, self.cfg.image_token_id), ids)
        vocab = self.text.vocab_size
        torch._assert_async(((ids >= 0) & (ids < vocab)).all(), f"sglang-dsv41: token id outside [0, {vocab})")
        return ids

    def engram_history(self, layout: BatchLayout, caches: RuntimeCaches) -> Tensor:
        """int64 [B, K] remapped ids before each request's chunk (NO_TOKEN where the position is
        < 0): the layout's host history (remapped here), else the request rows' ring (CPU: a stale
        row raises)."""
        ring = caches.engram_history
        if layout.engram_history is None:
            return ring.read(layout.req_rows, layout.prefix_lens, check=layout.host_checks)
        host = layout.engram_history
        if host.shape[1] != ring.history_len:
            raise RuntimeError(f"sglang-dsv41: Engram history of {host.shape[1]} ids, the model needs {ring.history_len}")
        remap = self.remap_ids_on_device if layout.static else self.remap_ids
        return torch.where(host >= 0, remap(host.clamp(min=0)).reshape(host.shape), host)

    def engram_rows(self, ids: Tensor, layout: BatchLayout, caches: RuntimeCaches) -> list[Tensor]:
        """Row ids per Engram layer (history: `engram_history`; pad id before position 0), then
        the request rows' ring advanced to the end of this batch (padding tokens write nothing)."""
        assert self.hasher is not None
        history = self.engram_history(layout, caches)
        tail = history_tail(history, ids, layout.starts, layout.prefix_lens, layout.extend_lens)
        caches.engram_history.advance(layout.req_rows, layout.seq_lens, tail,
                                      live=layout.live_tokens[layout.last_tokens] if layout.static else None)
        history = torch.where(history >= 0, history, torch.full_like(history, self.hasher.pad_token_id))
        if layout.static:
            return self._decode_engram_rows(ids, layout.positions, history)
        return self.hasher.row_ids(ids, layout.positions, history, layout.extend_lens)

    def _decode_engram_rows(self, ids: Tensor, positions: Tensor, history: Tensor) -> list[Tensor]:
        """`EngramHasher.row_ids` for one token per request (static decode layouts) without its
        host-side checks (`_segments` sums extend_lens on the host, `compressed_window` validates
        ids): the n-gram window of token b is (ids[b], history[b, K−1], history[b, K−2], …) —
        `EngramHasher.window`'s rule with local index 0 (same index clamp) — then the same
        blocking, pad id, token map and per-layer hash (`layer_row_ids`). Bit-identical to
        `row_ids` (tests/test_runtime_cuda_graph.py compares the logits)."""
        h = self.hasher
        assert h is not None
        K, M = h.history_len, h.max_ngram
        shifts = torch.arange(M, device=ids.device)
        back = -shifts                                                    # local index 0 − s
        from_hist = history[:, (back + K).clamp(min=0, max=K - 1)]      # [B, M]
        tok = torch.where((back >= 0)[None, :], ids[:, None], from_hist)
        if h.image_token_id is not None:
            tok = torch.where(tok >= MULTIMODAL_PAD_ID_BASE, torch.full_like(tok, h.image_token_id), tok)
        blocked = positions[:, None] < shifts[None, :]
        if h.image_token_id is not None:
            blocked = blocked | (torch.cumsum((tok == h.image_token_id).to(torch.int32), dim=1) > 0)
        tok = torch.where(blocked, torch.full_like(tok, h.pad_token_id), tok)
        compressed = h.token_map.to(tok.device)[tok]
        return [h.layer_row_ids(compressed, layer) for layer in h.layers]

    def _engram_update_on_device(self, layer: int, R: Tensor, row_ids: Tensor, image_rows: Tensor | None,
                                 linear) -> Tensor:
        """`reference.engram.engram_residual_update` (spec §3.3.2) without its host-side range
        check of the row ids (`engram_embedding` reads min/max on the host), for static layouts:
        the same table lookup, `wkv` linear, `engram_gate` and `gated_residual` (fp32, then
        BF16; bit-identical: tests/test_runtime_cuda_graph.py). Sharded tables go through
        `TensorParallel.engram_rows(..., check=False)` (masked lookup + exact all-reduce)."""
        t, w, p = self.text, self.weights, f"layers.{layer}.engram."
        tokens, hc, hidden = R.shape
        table, ids = self.tp.engram_rows(t, layer, row_ids, w, check=False)
        emb = table[ids.to(torch.int64)].reshape(tokens, -1)
        kv = linear(emb, w[p + "wkv.weight"]).to(F32)
        keys = kv[:, : hc * hidden].reshape(tokens, hc, hidden)
        value = kv[:, hc * hidden:]
        gate = engram_gate(R, keys, w[p + "q_weight"], w[p + "k_weight"], t.rms_norm_eps)
        updated = gated_residual(R, gate, value)
        if image_rows is not None:
            updated = torch.where(image_rows.to(torch.bool)[:, None, None], R.to(F32), updated)
        return updated.to(R.dtype)

    def _hc(self, layer: int, sub: str, R: Tensor):
        w, t = self.weights, self.text
        p = f"layers.{layer}.hc_{sub}_"
        return hc_coefficients(R, w[p + "fn"], w[p + "base"], w[p + "scale"], rms_eps=t.rms_norm_eps,
                               hc_eps=t.hc_eps, sinkhorn_iters=t.hc_sinkhorn_iters)

    @torch.no_grad()
    def hidden_states(self, input_ids: Tensor, layout: BatchLayout, caches: RuntimeCaches) -> Tensor:
        """Final normed hidden states [N, hidden] (BF16 values in fp32) of every batch token;
        writes every cache row of the batch's slots."""
        with dense_math(self.dense_backend), fused_elementwise():   # both leave CPU tensors to the reference code
            return self._hidden_states(input_ids, layout, caches)

    def _hidden_states(self, input_ids: Tensor, layout: BatchLayout, caches: RuntimeCaches) -> Tensor:
        t, w, act_quant = self.text, self.weights, self.numerics.act_quant
        if caches.profile is not self.numerics.cache:
            raise ValueError(f"caches hold profile {caches.profile}, the model computes {self.numerics.cache}")
        ids = self.remap_ids_on_device(input_ids) if layout.static else self.remap_ids(input_ids)
        N = ids.shape[0]
        if N != layout.num_tokens:
            raise ValueError(f"{N} input ids for a layout of {layout.num_tokens} tokens")
        if N == 0:
            return torch.zeros(0, t.hidden_size, dtype=F32, device=ids.device)
        image_rows = (ids == self.cfg.image_token_id) if self.cfg.has_vision else None
        engram_rows = self.engram_rows(ids, layout, caches) if self.hasher is not None else []
        linear = functools.partial(linear_fp8, act_quant=act_quant)

        R = w["embed.weight"][ids].unsqueeze(1).expand(N, t.hc_mult, t.hidden_size).contiguous()
        scratch = ForwardScratch(inv_freq=dict(self.inv_freq))
        carried_pre: Tensor | None = None
        for role in self.roles:
            i = role.layer
            if role.engram:
                rows_i = engram_rows[t.engram_layer_ids.index(i)]
                if layout.static:
                    R = self._engram_update_on_device(i, R, rows_i, image_rows, linear)
                else:
                    R = self.tp.engram_residual_update(t, i, R, rows_i, w, image_rows=image_rows, linear=linear)
            co = self._hc(i, "attn", R)
            x = hc_sublayer_input(R, carried_pre, w[f"layers.{i}.attn_norm.weight"], t.rms_norm_eps)
            y = attention_sublayer(t, role, w, x, layout, caches, scratch, act_quant, self.tp)
            R, carried_pre = hc_residual_update(R, y, co), co.pre
            co = self._hc(i, "ffn", R)
            x = hc_sublayer_input(R, carried_pre, w[f"layers.{i}.ffn_norm.weight"], t.rms_norm_eps)
            y = self.tp.moe_sublayer(t, w, f"layers.{i}.", x, image_rows=image_rows, act_quant=act_quant)
            R, carried_pre = hc_residual_update(R, y, co), co.pre
        assert carried_pre is not None
        return rms_norm(hc_collapse(R, carried_pre), w["norm.weight"], t.rms_norm_eps)

    def logits(self, hidden: Tensor) -> Tensor:
        """fp32 logits [N, vocab] of the BF16 head, correctly rounded (spec §3.7)."""
        with dense_math(self.dense_backend):
            return matmul_fp32_exact(hidden, self.weights["head.weight"])

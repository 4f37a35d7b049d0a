"""`DeepseekV41ForCausalLM`: DeepSeek-V4.1 as an SGLang 0.5.17 model class — the torch path.

SGLang interface: `__init__(config, quant_config, prefix)`, `load_weights(iterable of (name,
tensor))` and `forward(input_ids, positions, forward_batch) -> LogitsProcessorOutput`. The forward
of a packed batch (extend, decode or mixed; any number of requests) follows the reference model
(`reference/model.py`, spec §3) step by step and calls the reference's math on tensors:

1. ids remapped like the reference (vision: ids ≥ 1,000,000 → image_token_id, §3.1); each
   token's id is stored in its slot (`RuntimeCaches.token_ids`); Engram rows are hashed per
   request with the n-gram history read from the slots of the request's previous positions
   (`EngramHasher.row_ids(..., extend_lens)`, §3.3.1);
2. R⁰ = embedding broadcast to the hc streams; per layer: Engram → attn-hc → attention
   (`runtime/attention.py`) → ffn-hc → MoE (`reference.moe.moe_sublayer`) with the lagged pre
   (`reference.mhc`, §3.2);
3. collapse, `norm`, LM head with correctly rounded fp32 logits (`ops.matmul_fp32_exact`, §3.7)
   through SGLang's `LogitsProcessor` (which handles last-token pruning and logprobs).

Numerics = the reference's default `NumericsProfile()` (BF16 caches, FP8 activation quantisation);
weights are dequantised at load with the reference loader's §2.4 rules (`checkpoint.loader`).
Tensor parallel size 1 only on this path (checked at construction); TP shards would split the
weights mapping and all-reduce the two sublayer outputs, with the caches unchanged.
"""
from __future__ import annotations

import contextlib
import functools
import logging
from pathlib import Path
from typing import Iterable, Iterator

import torch
from torch import Tensor, nn

from ..checkpoint.loader import load_reference_weights_from_tensors
from ..checkpoint.names import tensor_inventory
from ..config import DeepseekV41Config
from ..engram_hash import MULTIMODAL_PAD_ID_BASE, EngramHasher, _load_fast_tokenizer, compressed_token_map
from ..reference import moe as moe_mod
from ..reference.engram import engram_residual_update
from ..reference.mhc import hc_coefficients, hc_collapse, hc_residual_update, hc_sublayer_input
from ..reference.ops import F32, linear_fp8, matmul_fp32_exact, rms_norm
from ..reference.state import NumericsProfile
from .attention import ForwardScratch, attention_sublayer
from .batch import BatchLayout, layout_from_forward_batch
from .cache import RuntimeCaches

logger = logging.getLogger(__name__)


class ExactFp32HeadMethod:
    """LM-head "quant method" for SGLang's LogitsProcessor: logits = h·headᵀ accumulated in fp64
    and rounded once to fp32 (`ops.matmul_fp32_exact`), bit-identical to the reference's head."""

    def apply(self, layer: nn.Module, hidden_states: Tensor, bias: Tensor | None = None) -> Tensor:
        if bias is not None:
            raise ValueError("the DeepSeek-V4.1 LM head has no bias")
        return matmul_fp32_exact(hidden_states, layer.weight)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Nothing to repack: the head is held dequantised (BF16 values in fp32)."""


class LMHead(nn.Module):
    """Holds `head.weight` [vocab, hidden]; SGLang's LogitsProcessor calls `quant_method.apply`."""

    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(vocab, hidden, dtype=F32), requires_grad=False)
        self.quant_method = ExactFp32HeadMethod()


@contextlib.contextmanager
def fp32_default_dtype() -> Iterator[None]:
    """The reference math assumes torch's default float dtype (fp32); SGLang builds models under
    its model dtype, so pin fp32 for the duration of a forward / weight load."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


class DeepseekV41ForCausalLM(nn.Module):
    """SGLang model class for architecture `DeepseekV41ForCausalLM` (torch path, TP 1)."""

    def __init__(self, config, quant_config=None, prefix: str = "") -> None:
        super().__init__()
        from sglang.srt.layers.logits_processor import LogitsProcessor
        from sglang.srt.runtime_context import get_parallel

        if not hasattr(config, "parsed"):
            raise TypeError(f"expected the sglang-dsv41 config class, got {type(config).__name__} "
                            "(is the sglang-dsv41 plugin loaded?)")
        tp = get_parallel().tp_size
        if tp != 1:
            raise RuntimeError(f"sglang-dsv41 torch path supports tensor parallel size 1, got --tp {tp}")
        self.config = config
        self.cfg: DeepseekV41Config = config.parsed()
        self.text = self.cfg.text
        self.roles = self.text.layer_roles()
        self.numerics = NumericsProfile()
        self.quant_config = None   # weights are dequantised by our loader, not SGLang's FP8 path
        self.model_path = Path(getattr(config, "_name_or_path", "") or ".")
        self.weights: dict[str, Tensor] = {}
        self.lm_head = LMHead(self.text.vocab_size, self.text.hidden_size)
        self.logits_processor = LogitsProcessor(config)
        self.register_buffer("_device_anchor", torch.zeros(1, dtype=F32), persistent=False)
        self.hasher: EngramHasher | None = None
        self.caches: RuntimeCaches | None = None

    @property
    def device(self) -> torch.device:
        return self._device_anchor.device

    # ---- weights (spec §2) --------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """Read every stored tensor, check names/dtypes/shapes against the inventory and
        dequantise with the reference loader's rules; vision and DSpark tensors are skipped."""
        stored = {name: tensor for name, tensor in weights}
        with fp32_default_dtype():
            logical = load_reference_weights_from_tensors(stored, self.cfg, vision=False, dspark=False)
        del stored
        self.weights = {k: v.to(device=self.device, dtype=F32) for k, v in logical.items()}
        with torch.no_grad():
            self.lm_head.weight.copy_(self.weights["head.weight"])
        if self.text.engram_layer_ids:
            token_map, _ = compressed_token_map(_load_fast_tokenizer(self.model_path))
            self.hasher = EngramHasher.from_config(self.cfg, token_map).to(self.device)
        missing = [s.name for s in tensor_inventory(self.cfg, vision=False, dspark=False) if s.name not in self.weights]
        if missing:
            raise KeyError(f"sglang-dsv41: weights missing after load: {missing[:5]}")
        logger.info("sglang-dsv41: loaded %d tensors (torch path, dequantised fp32)", len(self.weights))

    # ---- caches -------------------------------------------------------------------------------
    def _caches_for(self, pool) -> RuntimeCaches:
        if self.caches is None or self.caches.pool_id != id(pool):
            self.caches = RuntimeCaches.from_pool(pool, self.text, self.numerics.cache)
            logger.info(self.caches.describe())
        return self.caches

    # ---- forward ------------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, input_ids: Tensor, positions: Tensor, forward_batch, *args, **kwargs):
        from sglang.srt.model_executor.forward_context import get_req_to_token_pool, get_token_to_kv_pool

        if not self.weights:
            raise RuntimeError("sglang-dsv41: forward before load_weights")
        with fp32_default_dtype():
            caches = self._caches_for(get_token_to_kv_pool())
            layout = layout_from_forward_batch(forward_batch, positions.to(self.device),
                                               get_req_to_token_pool().req_to_token)
            hidden = self._hidden_states(input_ids.to(self.device), layout, caches)
            return self.logits_processor(input_ids, hidden, self.lm_head, forward_batch)

    def _remap_ids(self, ids: Tensor) -> Tensor:
        """Language-model ids (spec §3.1 item 3), as `ReferenceModel.remap_ids`."""
        ids = ids.to(torch.int64).reshape(-1)
        if self.cfg.has_vision:
            ids = torch.where(ids >= MULTIMODAL_PAD_ID_BASE, torch.full_like(ids, self.cfg.image_token_id), ids)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.text.vocab_size):
            raise ValueError(f"token ids outside the vocabulary [0, {self.text.vocab_size})")
        return ids

    def _engram_rows(self, ids: Tensor, layout: BatchLayout, caches: RuntimeCaches) -> list[Tensor]:
        """Row ids per Engram layer; history = each request's last K ids before its chunk, read
        from the slots of its earlier positions (pad where the position is < 0)."""
        assert self.hasher is not None
        K = self.hasher.history_len
        back = layout.prefix_lens[:, None] - K + torch.arange(K, device=ids.device)[None, :]   # [B, K]
        present = back >= 0
        req = torch.arange(layout.num_requests, device=ids.device)[:, None].expand_as(back)
        slots = layout.slots_at(req, back.clamp(min=0))
        history = torch.where(present, caches.token_ids[slots], torch.full_like(slots, self.hasher.pad_token_id))
        return self.hasher.row_ids(ids, layout.positions, history, layout.extend_lens)

    def _hc(self, layer: int, sub: str, R: Tensor):
        w, t = self.weights, self.text
        p = f"layers.{layer}.hc_{sub}_"
        return hc_coefficients(R, w[p + "fn"], w[p + "base"], w[p + "scale"], rms_eps=t.rms_norm_eps,
                               hc_eps=t.hc_eps, sinkhorn_iters=t.hc_sinkhorn_iters)

    def _hidden_states(self, input_ids: Tensor, layout: BatchLayout, caches: RuntimeCaches) -> Tensor:
        """Final normed hidden states [N, hidden] (BF16 values, fp32) of every batch token."""
        t, w, act_quant = self.text, self.weights, self.numerics.act_quant
        ids = self._remap_ids(input_ids)
        N = ids.shape[0]
        if N == 0:
            return torch.zeros(0, t.hidden_size, dtype=F32, device=self.device)
        caches.token_ids[layout.out_slots] = ids
        image_rows = (ids == self.cfg.image_token_id) if self.cfg.has_vision else None
        engram_rows = self._engram_rows(ids, layout, caches) if self.hasher is not None else []
        linear = functools.partial(linear_fp8, act_quant=act_quant)

        R = w["embed.weight"][ids].unsqueeze(1).expand(N, t.hc_mult, t.hidden_size).contiguous()
        scratch = ForwardScratch()
        carried_pre: Tensor | None = None
        for role in self.roles:
            i = role.layer
            if role.engram:
                p = f"layers.{i}.engram."
                R = engram_residual_update(R, engram_rows[t.engram_layer_ids.index(i)], w[p + "embed.weight"],
                                           w[p + "wkv.weight"], w[p + "q_weight"], w[p + "k_weight"],
                                           t.rms_norm_eps, image_rows=image_rows, linear=linear)
            co = self._hc(i, "attn", R)
            x = hc_sublayer_input(R, carried_pre, w[f"layers.{i}.attn_norm.weight"], t.rms_norm_eps)
            y = attention_sublayer(t, role, w, x, layout, caches, scratch, act_quant)
            R, carried_pre = hc_residual_update(R, y, co), co.pre
            co = self._hc(i, "ffn", R)
            x = hc_sublayer_input(R, carried_pre, w[f"layers.{i}.ffn_norm.weight"], t.rms_norm_eps)
            y = moe_mod.moe_sublayer(t, w, f"layers.{i}.", x, image_rows=image_rows, act_quant=act_quant)
            R, carried_pre = hc_residual_update(R, y, co), co.pre
        assert carried_pre is not None
        return rms_norm(hc_collapse(R, carried_pre), w["norm.weight"], t.rms_norm_eps)


EntryClass = DeepseekV41ForCausalLM

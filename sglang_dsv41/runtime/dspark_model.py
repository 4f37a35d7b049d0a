"""`DeepseekV41ForCausalLMDSpark`: the V4.1 DSpark draft as the model class SGLang 0.5.17's DSPARK
worker (`speculative/dspark_components/dspark_worker_v2.py`) loads in its draft `TpModelWorker`
(spec `model.md` §4; integration.md §3.3). Glue only; the math is `runtime/dspark_draft.py`.

What the worker calls, and what it gets:

* `__init__(config, quant_config, prefix)` — `config` is our `DeepseekV41HFConfig` (the draft
  architecture is chosen by the `ModelConfig._config_draft_model` hook, `runtime/dspark_hooks.py`);
  `load_weights(weights)` keeps the `mtp.*` tensors of the whole checkpoint
  (`dspark_weights.dspark_runtime_weights`) and builds `DSparkDraft`.
* `attach_shared_modules(embed_tokens=, lm_head=)` — the target's embedding module (`.weight`
  [V, H]) and LM head (`.weight` [V, H]); referenced, never copied or owned.
* `forward_embed(ids)` exists, so the worker passes token ids, not embeddings.
* `forward(input_ids, positions, forward_batch)` — one draft block per request in TARGET_VERIFY
  layout: ids [anchor, noise×(γ−1)] per request, positions P..P+γ−1 with P = `seq_lens`, the
  committed length; returns `LogitsProcessorOutput(next_token_logits=None, hidden_states=x)`
  with x [bs·γ, H] the collapsed pre-norm hidden (BF16 values). Context keys come from the
  draft pool's `DSparkContextKV` (`dspark_context_of`) through SGLang's `req_to_token`.
  γ is the worker's (SGLang resolves it from `--speculative-dspark-block-size` /
  `--speculative-num-draft-tokens`, warning when it differs from the checkpoint's
  `dspark_block_size`): the model reads it from the batch shape (rows / requests) and keeps no γ
  of its own; `trained_block_size` is the checkpoint's, for the load log only.
* `compute_base_logits(x)` → (fp32 logits [N, V] = head·RMSNorm_norm(x), confidence tap = x); the
  product runs through the target LM head's own method when it has one (`model.BackendHeadMethod`:
  the target's backend, which holds the head weight), else on the draft's backend.
* `markov_head.sample_block(...)`, `markov_head.get_prev_embeddings(...)` (`dspark_heads.MarkovHead`).
* `compute_confidence(anchor_tokens=, sampled_tokens=, x_post_hc=)` → [bs, γ] in (0, 1).
  `confidence_head` is the head only when SGLang's ragged-verify mode is not `static` (the mode
  that never plans verify lengths; SGLang's own V4 draft does the same), else None.
* `write_target_hidden_kv(target_hidden=, pool=, positions=, cache_loc=, cache_loc_2d=None,
  commit_lens=None)` — the stored kv of committed target tokens (features = the target's aux
  hidden states [N, n·H]) into the context store at their full slots; with `commit_lens`, row j
  of request b is written only when j < commit_lens[b] (rejected drafts write nothing).
"""
from __future__ import annotations

import itertools
import logging
from typing import Iterable

import torch
from torch import Tensor, nn

from ..checkpoint.names import tensor_inventory
from ..config import DeepseekV41Config
from ..numerics.profile import NumericsProfile
from .dspark_draft import DSparkDraft
from .dspark_kv import DSparkContextKV
from .dspark_weights import dspark_runtime_weights, dspark_specs, require_dspark
from .dummy_weights import DUMMY_SEED, dummy_load_requested, dummy_seed, dummy_stored_tensors, meta_stored_tensors
from .forward import fp32_default_dtype
from .hf_config import DRAFT_ARCHITECTURE, parsed_config
from .vocab_parallel import VocabParallelEmbedding

__all__ = ["DRAFT_ARCHITECTURE", "DeepseekV41ForCausalLMDSpark", "dspark_context_of"]

logger = logging.getLogger(__name__)
F32 = torch.float32


def dspark_context_of(pool) -> DSparkContextKV:
    """The draft context store a draft pool holds (the store itself, or its `dspark_context`)."""
    store = pool if isinstance(pool, DSparkContextKV) else getattr(pool, "dspark_context", None)
    if not isinstance(store, DSparkContextKV):
        raise RuntimeError(f"sglang-dsv41 DSpark: the draft KV pool ({type(pool).__name__}) holds no DSpark context "
                           "store; the draft worker's pool must be built by sglang-dsv41 (docs/dspark.md)")
    return store


def adaptive_verification_mode() -> bool:
    """True unless SGLang's ragged-verify mode is `static` (its default)."""
    from sglang.srt.speculative.ragged_verify import RaggedVerifyMode, read_ragged_verify_mode

    return read_ragged_verify_mode() is not RaggedVerifyMode.STATIC


class DeepseekV41ForCausalLMDSpark(nn.Module):
    """SGLang draft model class for a V4.1 checkpoint's bundled DSpark stages (module doc)."""

    def __init__(self, config, quant_config=None, prefix: str = "") -> None:
        super().__init__()
        self.config = config
        self.cfg: DeepseekV41Config = parsed_config(config)
        require_dspark(self.cfg)
        text = self.cfg.text
        #: the checkpoint's `dspark_block_size` (the block the draft was trained for); the block a
        #: forward runs is the worker's γ, read from the batch shape (module doc)
        self.trained_block_size = text.dspark_block_size
        self.num_stages = text.num_nextn_predict_layers
        self.numerics = NumericsProfile()
        self.quant_config = None
        self.adaptive_verification = adaptive_verification_mode()
        self.register_buffer("_device_anchor", torch.zeros(1, dtype=F32), persistent=False)
        self.draft: DSparkDraft | None = None
        self._shared: dict[str, nn.Module] = {}
        #: set by `prune_to_ctx_kv_injection` on a PD prefill: context rows only, no block forward
        self.context_only = False

    @property
    def device(self) -> torch.device:
        return self._device_anchor.device

    # ---- weights and shared modules -----------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        from .model import deterministic_inference

        stored = {name: tensor for name, tensor in weights}
        on_cuda = self.device.type == "cuda"
        with fp32_default_dtype():
            on_device = dspark_runtime_weights(stored, self.cfg, self.device, experts_mxfp4=on_cuda)
            del stored
            self.draft = DSparkDraft(self.cfg, on_device, self.numerics, deterministic=deterministic_inference())
        logger.info("sglang-dsv41: DSpark draft loaded (%d stages, trained block %d, runs the server's γ; %d "
                    "tensors, backend %s, adaptive verification %s)", self.num_stages, self.trained_block_size,
                    len(on_device), self.draft.backend.name,
                    "on" if self.adaptive_verification else "off (ragged-verify mode static)")

    def post_load_weights(self) -> None:
        """SGLang's dummy loader calls this instead of `load_weights`: with `--load-format dummy`
        (or a dummy draft load format) the draft gets valid random `mtp.*` tensors in the stored
        formats, generated on its device (`runtime/dummy_weights.py`); the target's tensors, which
        the draft only checks, go in as meta tensors. Any other loader must have loaded the draft."""
        if self.draft is not None:
            return
        if not dummy_load_requested(draft=True):
            raise RuntimeError("sglang-dsv41 DSpark draft: post_load_weights without load_weights outside "
                               "--load-format dummy; this loader cannot fill the draft")
        self.load_dummy_weights(dummy_seed())

    def load_dummy_weights(self, seed: int = DUMMY_SEED) -> None:
        """`load_weights` with valid random DSpark tensors on the draft's device (`post_load_weights`)."""
        draft = dspark_specs(self.cfg)
        names = {s.name for s in draft}
        rest = [s for s in tensor_inventory(self.cfg, vision=False, dspark=True) if s.name not in names]
        self.load_weights(itertools.chain(dummy_stored_tensors(self.cfg, self.device, seed=seed, specs=draft),
                                          meta_stored_tensors(rest)))

    def _loaded(self) -> DSparkDraft:
        if self.draft is None:
            raise RuntimeError("sglang-dsv41 DSpark draft used before load_weights")
        return self.draft

    def attach_shared_modules(self, *, embed_tokens: nn.Module, lm_head: nn.Module) -> None:
        t = self.cfg.text
        for name, module in (("embed_tokens", embed_tokens), ("lm_head", lm_head)):
            w = getattr(module, "weight", None)
            # vocabulary-parallel target modules hold their rank's rows (`runtime/vocab_parallel.py`)
            rows = len(module.vocab) if isinstance(module, VocabParallelEmbedding) else \
                t.vocab_size if name == "embed_tokens" or w is None else w.shape[0]
            if not isinstance(w, Tensor) or tuple(w.shape) != (rows, t.hidden_size) or \
                    getattr(module, "org_vocab_size", t.vocab_size) != t.vocab_size:
                raise ValueError(f"DSpark {name} must hold a weight [{rows}, {t.hidden_size}] of a "
                                 f"{t.vocab_size}-token vocabulary, got {None if w is None else tuple(w.shape)}")
        self._shared = {"embed_tokens": embed_tokens, "lm_head": lm_head}

    def _embedding(self) -> Tensor | VocabParallelEmbedding:
        """The target's embedding as `DSparkDraft.block_hidden` takes it: the vocabulary-parallel
        module (complete rows on every rank) or a plain weight."""
        module = self._shared.get("embed_tokens")
        return module if isinstance(module, VocabParallelEmbedding) else self._shared_weight("embed_tokens")

    def _shared_weight(self, name: str) -> Tensor:
        if name not in self._shared:
            raise RuntimeError(f"sglang-dsv41 DSpark draft needs the target's {name}: call attach_shared_modules first")
        return self._shared[name].weight

    @property
    def lm_head(self) -> nn.Module | None:
        """The target's LM head once attached (SGLang's draft sampler reads its size and dtype)."""
        return self._shared.get("lm_head")

    def prune_to_ctx_kv_injection(self) -> None:
        """SGLang's DSpark worker calls this on a PD prefill server, which only writes the prompt's
        context rows (`write_target_hidden_kv`; they travel to the decode in kv_data, docs/pd.md
        "PD + DSpark"). The V4.1 draft keeps its weights (the context rows need each stage's
        projections; its heads are small) and refuses a block forward from then on."""
        self.context_only = True
        logger.info("sglang-dsv41: DSpark draft on a PD prefill: context rows only")

    @property
    def markov_head(self):
        return self._loaded().markov_head

    @property
    def confidence_head(self):
        return self._loaded().confidence_head if self.adaptive_verification else None

    @property
    def enable_confidence_head(self) -> bool:
        return self.confidence_head is not None

    # ---- context KV ---------------------------------------------------------------------------
    @torch.no_grad()
    def write_target_hidden_kv(self, *, target_hidden: Tensor, pool, positions: Tensor, cache_loc: Tensor,
                               cache_loc_2d: Tensor | None = None, commit_lens: Tensor | None = None) -> None:
        draft = self._loaded()
        store = dspark_context_of(pool)
        slots = cache_loc.to(device=draft.device, dtype=torch.int64).reshape(-1)
        if target_hidden.shape[0] != slots.shape[0] or positions.reshape(-1).shape[0] != slots.shape[0]:
            raise ValueError(f"DSpark context write: {target_hidden.shape[0]} hidden rows, "
                             f"{positions.numel()} positions, {slots.shape[0]} slots")
        if commit_lens is not None:
            if cache_loc_2d is None:
                raise ValueError("DSpark context write: commit_lens needs cache_loc_2d (the verify window layout)")
            bs, width = cache_loc_2d.shape
            col = torch.arange(width, device=slots.device)[None, :]
            keep = (col < commit_lens.to(device=slots.device, dtype=torch.int64).reshape(bs, 1)).reshape(-1)
            slots = torch.where(keep, slots, -1)
        with fp32_default_dtype():
            rows = draft.context_rows(target_hidden.to(device=draft.device, dtype=F32), positions.reshape(-1))
        for s, values in enumerate(rows):
            store.write_rows(s, slots, values)

    # ---- block forward ------------------------------------------------------------------------
    def forward_embed(self, input_ids: Tensor) -> Tensor:
        """Target embedding rows of `input_ids` [N] → [N, H] (fp32, BF16 values)."""
        embed, ids = self._embedding(), input_ids.to(torch.int64)
        return (embed(ids) if isinstance(embed, VocabParallelEmbedding) else embed[ids]).to(F32)

    def block_hidden(self, input_ids: Tensor, positions: Tensor, req_rows: Tensor, prefix_lens: Tensor,
                     req_to_token: Tensor, store: DSparkContextKV) -> Tensor:
        """[bs·γ, H] hidden of bs = len(req_rows) blocks, γ = len(input_ids) / bs (SGLang-free entry of
        `forward`)."""
        draft = self._loaded()
        if self.context_only:
            raise RuntimeError("sglang-dsv41 DSpark: a block forward on a PD prefill server (the draft there "
                               "writes context rows only)")
        bs, N, W = req_rows.shape[0], input_ids.shape[0], self.cfg.text.sliding_window
        g = N // bs if bs else 0
        if N != bs * g or (bs and g < 1):
            raise ValueError(f"DSpark draft forward: {N} ids for {bs} requests are not one block of γ ≥ 1 rows "
                             "per request")
        if positions.device.type == "cpu":      # host check; CUDA paths add no sync
            want = prefix_lens.to(torch.int64).repeat_interleave(g) + torch.arange(g).repeat(bs)
            if not torch.equal(positions.to(torch.int64), want):
                raise ValueError("DSpark draft forward: block positions are not P..P+γ−1 of each request's "
                                 "committed length P (seq_lens)")
        windows = [store.window(s, req_rows, req_to_token, prefix_lens.to(req_to_token.device), W)
                   for s in range(store.stages)]
        with fp32_default_dtype():
            return draft.block_hidden(self._embedding(), input_ids, positions, windows)

    @torch.no_grad()
    def forward(self, input_ids: Tensor, positions: Tensor, forward_batch, input_embeds: Tensor | None = None,
                **kwargs):
        from sglang.srt.layers.logits_processor import LogitsProcessorOutput
        from sglang.srt.model_executor.forward_context import get_req_to_token_pool, get_token_to_kv_pool

        if input_embeds is not None:
            raise RuntimeError("sglang-dsv41 DSpark draft embeds its own block ids (forward_embed); got input_embeds")
        if forward_batch.forward_mode.name != "TARGET_VERIFY":
            raise RuntimeError(f"sglang-dsv41 DSpark draft runs blocks in TARGET_VERIFY mode only, got "
                               f"{forward_batch.forward_mode.name}")
        hidden = self.block_hidden(input_ids, positions, forward_batch.req_pool_indices, forward_batch.seq_lens,
                                   get_req_to_token_pool().req_to_token, dspark_context_of(get_token_to_kv_pool()))
        return LogitsProcessorOutput(next_token_logits=None, hidden_states=hidden)

    # ---- heads --------------------------------------------------------------------------------
    @torch.no_grad()
    def compute_base_logits(self, x: Tensor) -> tuple[Tensor, Tensor]:
        weight = self._shared_weight("lm_head")
        method = getattr(self._shared["lm_head"], "quant_method", None)
        with fp32_default_dtype():
            if method is None:
                return self._loaded().base_logits(x, weight), x
            # the target's head method: its backend holds the head (CUDA dense cache), same math
            return method.apply(self._shared["lm_head"], self._loaded().final_norm(x)), x

    @torch.no_grad()
    def compute_confidence(self, *, anchor_tokens: Tensor, sampled_tokens: Tensor, x_post_hc: Tensor) -> Tensor:
        """[bs, γ] confidences; γ = the block the worker drafted (`sampled_tokens` [bs, γ])."""
        bs, H = anchor_tokens.reshape(-1).shape[0], self.cfg.text.hidden_size
        if bs == 0:
            return torch.zeros(0, sampled_tokens.shape[-1], dtype=F32, device=x_post_hc.device)
        sampled = sampled_tokens.reshape(bs, -1)
        g = sampled.shape[1]
        if x_post_hc.numel() != bs * g * H:
            raise ValueError(f"DSpark confidence: hidden {tuple(x_post_hc.shape)} for {bs} blocks of {g} drafts")
        prev = torch.cat((anchor_tokens.reshape(bs, 1), sampled[:, : g - 1]), dim=1)
        return self._loaded().confidence(x_post_hc.reshape(bs, g, H), prev)


EntryClass = DeepseekV41ForCausalLMDSpark

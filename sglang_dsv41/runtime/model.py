"""`DeepseekV41ForCausalLM`: DeepSeek-V4.1 as an SGLang 0.5.17 model class — the torch path.

SGLang interface: `__init__(config, quant_config, prefix)`, `load_weights(iterable of (name,
tensor))`, `forward(input_ids, positions, forward_batch) -> LogitsProcessorOutput`. This module is
the glue only:

* weights: parameters created at construction in stored form (FP8 32×32 tiles, stacked MXFP4
  experts, Engram E4M3 rows; BF16/FP32 rest as their §2.4 values) with per-layer quantisation
  methods and `weight_loader`s (`runtime/quant_methods.py`, `runtime/weight_modules.py`);
  `load_weights` streams the checkpoint into them, checking each tensor against the inventory;
  vision tensors go to the vision tower (`runtime/vision.py`; none is built, and they are
  skipped, when the checkpoint has no `vision_config` or the server runs `--language-model-only`);
  DSpark tensors are skipped (the draft loads its own);
* images (docs/vision.md): `pad_input_ids` writes each image's hash pad value over its span; an
  extend's image-span rows (`runtime/vision_batch.py`) replace those tokens' embeddings before the
  hyper-connection expansion, while the raw ids (pads read as `image_token_id`) drive the image
  routing bias and Engram blocking;
* caches: the `RuntimeCaches` our pool (`runtime/kv_pool.py`, built by SGLang at start-up) holds
  over its buffers;
* forward: the batch layout from the `ForwardBatch` and SGLang's `req_to_token`
  (`runtime/batch.py`; the static decode layout while SGLang's CUDA-graph runner captures,
  `sglang_graph_capture`), `TorchForward.hidden_states` (`runtime/forward.py`, an `nn.Module`
  built here at construction; its implementations picked once by device at load: on CPU the fp32 backend,
  or the exact float64 one under `--enable-deterministic-inference`; on CUDA the Triton kernels,
  which must load at `load_weights`), then SGLang's
  `LogitsProcessor` (last-token pruning, logprobs) with an LM head whose logits come from the
  model's compute backend (`BackendHeadMethod`).

Engram placement (runtime.md §A.7): read once at construction from the launcher's variables
(`engram_host.engram_placement_from_env`: `SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE=1` → the tables
of this rank's rows in pinned host memory, read through UVA; only the per_rank layout — a
`shared` layout is refused at start-up).

Numerics profile `NumericsProfile()` (BF16 caches, FP8 activation quantisation); the numerics
contract against the reference: docs/runtime.md. Tensor parallel (`runtime/tensor_parallel.py`,
SGLang's TP group and collectives): each rank loads only its attention groups, routed experts,
Engram rows and vocabulary block of the embedding and LM head; the head gathers its logits itself
(`runtime/vocab_parallel.py`), so they are complete on every rank and SGLang's LogitsProcessor
must not all-gather them (`skip_all_gather=True`).
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable, Iterable

import torch
from torch import Tensor, nn

from ..checkpoint.names import tensor_inventory
from ..config import DeepseekV41Config
from ..engram_hash import EngramHasher, _load_fast_tokenizer, compressed_token_map
from ..numerics.profile import NumericsProfile
from . import metrics
from . import prefill_graph
from .batch import layout_from_forward_batch, static_extend_layout
from .cache import RuntimeCaches
from .dummy_weights import DUMMY_SEED, dummy_load_requested, dummy_seed, dummy_stored_tensors
from .engram_host import engram_placement_from_env
from .forward import TorchForward, fp32_default_dtype
from .hf_config import parsed_config
from .kv_pool import pool_caches
from .prefill_graph import PrefillGraphBody
from .tensor_parallel import TensorParallel
from .vision import VisionTower, is_vision_tensor
from .vision_batch import SpanCache, batch_image_rows

logger = logging.getLogger(__name__)


F32 = torch.float32


class BackendHeadMethod:
    """LM-head "quant method" for SGLang's LogitsProcessor: fp32 logits = h·headᵀ through the
    model's compute backend, vocabulary-parallel and gathered on every rank
    (`TorchForward.logits`, `runtime/vocab_parallel.py`; set at load, before any forward)."""

    def __init__(self) -> None:
        self.logits: Callable[[Tensor], Tensor] | None = None

    def apply(self, layer: nn.Module, hidden_states: Tensor, bias: Tensor | None = None) -> Tensor:
        if bias is not None:
            raise ValueError("the DeepSeek-V4.1 LM head has no bias")
        if self.logits is None:
            raise RuntimeError("sglang-dsv41: LM head used before load_weights chose the compute backend")
        return self.logits(hidden_states)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Nothing to repack: the head is held dequantised (BF16 values in fp32)."""


class LMHead(nn.Module):
    """SGLang's LogitsProcessor calls `quant_method.apply(lm_head, hidden)`; `weight` is this
    rank's block of the model's `head.weight` (one parameter, owned by `TorchForward.head`)."""

    def __init__(self, weight: nn.Parameter, vocab_size: int) -> None:
        super().__init__()
        self.weight = weight
        self.quant_method = BackendHeadMethod()
        self.org_vocab_size = vocab_size               # read by SGLang's DSpark draft sampler


class DeepseekV41ForCausalLM(nn.Module):
    """SGLang model class for architecture `DeepseekV41ForCausalLM` (torch path, any TP size
    dividing o_groups). Its parameters are created at construction, in stored form
    (`runtime/weight_modules.py`), on SGLang's target device; `load_weights` streams the
    checkpoint into them."""

    def __init__(self, config, quant_config=None, prefix: str = "") -> None:
        super().__init__()
        from sglang.srt.layers.logits_processor import LogitsProcessor

        self.config = config
        self.cfg: DeepseekV41Config = parsed_config(config)
        self.tp = TensorParallel.from_sglang()
        self.tp.plan(self.cfg.text)    # raises for a --tp the model cannot be sharded with
        self.numerics = NumericsProfile()
        self.engram_placement = engram_placement_from_env()   # raises now for a layout we do not implement
        self.quant_config = None   # our quantisation methods are per layer (`runtime/quant_methods.py`)
        self.model_path = Path(getattr(config, "_name_or_path", "") or ".")
        self.register_buffer("_device_anchor", torch.zeros(1, dtype=F32), persistent=False)
        on_cuda = self.device.type == "cuda"
        with fp32_default_dtype():
            hasher = None
            if self.cfg.text.engram_layer_ids:
                token_map, _ = compressed_token_map(_load_fast_tokenizer(self.model_path))
                hasher = EngramHasher.from_config(self.cfg, token_map).to(self.device)
            self.torch_forward = TorchForward.for_loading(
                self.cfg, hasher, numerics=self.numerics, tp=self.tp, experts_mxfp4=on_cuda, dense_fp8=on_cuda,
                engram_placement=self.engram_placement, deterministic=deterministic_inference())
            #: the vision tower (None: no vision_config, or --language-model-only)
            self.vision_tower = VisionTower(self.cfg) if self.cfg.has_vision and not language_model_only() else None
        self._spans = SpanCache()
        #: SGLang's --mm-enable-dp-encoder: the images of a batch split over the TP ranks (vision_batch.py);
        #: at TP 1 there is nothing to split (SGLang warns so itself)
        self._encoder_dp = self.tp if self.vision_tower is not None and self.tp.size > 1 and dp_encoder() else None
        self.lm_head = LMHead(self.torch_forward.head.weight, self.cfg.text.vocab_size)
        self.logits_processor = LogitsProcessor(config, skip_all_gather=True)   # the head gathers its logits
        self.caches: RuntimeCaches | None = None
        #: ids of Engram history an extend brings from the host (`runtime/engram_history.py`); 0 = none
        text = self.cfg.text
        self.engram_history_len = text.engram_max_ngram_size - 1 if text.engram_layer_ids else 0
        self._staged_history: tuple[list[int], Tensor] | None = None
        #: DSpark target layers to capture (`set_dspark_layers_to_capture`); empty = none
        self.dspark_capture_layers: tuple[int, ...] = ()
        #: whether `load_weights` has streamed weights in (SGLang's dummy loader never calls it)
        self._streamed = False
        if on_cuda and self.tp.size == 1 and prefill_graph.selected():
            #: the language model SGLang's `full` prefill-graph runner captures (runtime/prefill_graph.py)
            self.model = PrefillGraphBody(self, self.engram_history_len)
        self._replayed = False

    @property
    def device(self) -> torch.device:
        return self._device_anchor.device

    # ---- weights (spec §2) --------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """Stream the stored tensors into the parameters by name (`TorchForward.load_weights`:
        every tensor checked against the inventory), then `post_load_weights`. Also the path of
        SGLang's `update_weights_from_disk` (a reload: a subset of the tensors is accepted)."""
        vision: list[tuple[str, Tensor]] = []

        def text_only():
            for name, tensor in weights:
                if self.vision_tower is not None and is_vision_tensor(name):
                    vision.append((name, tensor))
                else:
                    yield name, tensor

        with fp32_default_dtype():
            loaded = self.torch_forward.load_weights(text_only())
            if self.vision_tower is not None:
                loaded |= self.vision_tower.load_weights(vision)
                self._spans = SpanCache()
        self._loaded(len(loaded))
        self._streamed = True

    def load_dummy_weights(self, seed: int = DUMMY_SEED) -> float:
        """Stream valid random weights in the stored formats, generated on the model's device, through
        `load_weights` (`runtime/dummy_weights.py`: every tensor of the inventory, vision included
        when the tower is built); returns the seconds it took."""
        t0 = time.perf_counter()
        specs = tensor_inventory(self.cfg, vision=self.vision_tower is not None, dspark=False)
        self.load_weights(dummy_stored_tensors(self.cfg, self.device, seed=seed, specs=specs))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        took = time.perf_counter() - t0
        logger.info("sglang-dsv41: dummy weights: valid random values in the stored formats generated on %s "
                    "in %.1f s (seed %d)", self.device, took, seed)
        return took

    def post_load_weights(self) -> None:
        """Process the parameters into their runtime form and pick the compute backend. SGLang's
        remote loaders call this after filling the parameters themselves; its dummy loader too,
        and then (nothing streamed yet, `--load-format dummy`) the parameters get valid random
        values in the stored formats instead (`load_dummy_weights`)."""
        if not self._streamed and dummy_load_requested():
            self.load_dummy_weights(dummy_seed())
            return
        with fp32_default_dtype():
            self.torch_forward.post_load_weights()
        self._loaded(None)

    def _loaded(self, count: int | None) -> None:
        tf = self.torch_forward
        self.lm_head.quant_method.logits = tf.logits
        held = sum(p.numel() * p.element_size() for p in self.parameters())
        logger.info("sglang-dsv41: %s; %s; parameters hold %.3f GiB%s; Engram tables: %s placement; compute "
                    "backend %s; attention + indexer on %s: %s", self.tp.describe(),
                    "weights filled by the loader" if count is None else f"streamed {count} stored tensors",
                    held / 2**30, "; routed experts MXFP4 for the Triton kernel" if self.device.type == "cuda" else "",
                    self.engram_placement, tf.backend.name, self.device, tf.attention_ops.description)
        if self.vision_tower is not None:
            logger.info("sglang-dsv41: vision tower loaded (%d ViT layers on %s, attention: %s; %s)",
                        self.cfg.vision.num_hidden_layers, self.device, self.vision_tower.attn.describe(),
                        f"encoder data-parallel over {self.tp.size} ranks" if self._encoder_dp is not None
                        else "every rank encodes every image")
        metrics.publish_engram((t for t in tf.weights.values() if hasattr(t, "placement")),
                               self.engram_placement, self.tp.rank)

    # ---- DSpark target side (docs/dspark.md) --------------------------------------------------
    def set_dspark_layers_to_capture(self, layer_ids) -> None:
        """SGLang's DSPARK worker: capture the stream-mean attention input of `layer_ids` (the
        checkpoint's `dspark_target_layer_ids`, in order) and return it as aux hidden states."""
        ids = tuple(int(i) for i in layer_ids)
        if ids != tuple(self.cfg.text.dspark_target_layer_ids):
            raise ValueError(f"DSpark capture layers {list(ids)} differ from this checkpoint's "
                             f"dspark_target_layer_ids {list(self.cfg.text.dspark_target_layer_ids)}")
        self.dspark_capture_layers = ids
        if self.torch_forward is not None:
            self.torch_forward.set_capture_layers(ids)

    def get_input_embeddings(self) -> nn.Module:
        """The module owning `embed.weight` [vocab, hidden] (shared with the DSpark draft)."""
        if self.torch_forward is None:
            raise RuntimeError("sglang-dsv41: get_input_embeddings before load_weights")
        return self.torch_forward.embed

    @torch.no_grad()
    def commit_dspark_verify(self, req_pool_indices: Tensor, prefix_lens: Tensor, commit_lens: Tensor) -> None:
        """SGLang's DSPARK worker after acceptance (hook `dspark_hooks.commit_after_verify_hook`):
        each request keeps anchor + accepted drafts, c = `commit_lens` tokens of its verify block
        at `prefix_lens`; the Engram history advances to P + c (`EngramHistoryRing.commit_verify`)."""
        if self.caches is None:
            raise RuntimeError("sglang-dsv41: DSpark verify commit before any forward built the caches")
        self.caches.engram_history.commit_verify(req_pool_indices, prefix_lens, commit_lens,
                                                 check=self.device.type == "cpu")

    # ---- caches -------------------------------------------------------------------------------
    def _caches_for(self, pool) -> RuntimeCaches:
        """The `RuntimeCaches` our pool built at construction (`runtime/kv_pool.py`); checked and
        published once per pool."""
        if self.caches is None or self.caches.pool_id != id(pool):
            self.caches = pool_caches(pool, self.numerics.cache)
            logger.info(self.caches.describe())
            metrics.publish_caches(self.caches, self.tp.rank)
        return self.caches

    # ---- Engram history of extends (`runtime/engram_history.py`) ------------------------------------
    def stage_engram_history(self, starts: list[int], history: Tensor) -> None:
        """Called by the `ForwardBatch.init_new` hook for the extend batch about to run: its
        requests' chunk starts and their host-built history [B, K]."""
        self._staged_history = (list(starts), history)

    def take_engram_history(self, forward_batch) -> Tensor | None:
        """The staged history of this extend / mixed batch (None for decode or without Engram);
        raises when what was staged belongs to another batch."""
        if not self.engram_history_len or forward_batch.forward_mode.name not in ("EXTEND", "MIXED"):
            return None
        staged, self._staged_history = self._staged_history, None
        starts = [int(s) - int(e) for s, e in zip(forward_batch.seq_lens_cpu.tolist(),
                                                   forward_batch.extend_seq_lens_cpu)]
        if staged is None or staged[0] != starts:
            raise RuntimeError(f"sglang-dsv41: no Engram history was staged for this extend batch (chunk starts "
                               f"{starts}, staged {None if staged is None else staged[0]}): is the "
                               "ForwardBatch.init_new hook installed?")
        return staged[1]

    # ---- images (docs/vision.md) ----------------------------------------------------------------
    def pad_input_ids(self, input_ids: list[int], mm_inputs) -> list[int]:
        """SGLang's scheduler: each image span → its item's pad value (≥ 1,000,000, from the image
        hash), so radix-cache and HiCache keys encode image content."""
        from sglang.srt.managers.mm_utils import MultiModalityDataPaddingPatternMultimodalTokens

        return MultiModalityDataPaddingPatternMultimodalTokens().pad_input_tokens(input_ids, mm_inputs)

    # ---- forward ------------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, input_ids: Tensor, positions: Tensor, forward_batch, *args, **kwargs):
        image_embeds = batch_image_rows(forward_batch, self.vision_tower, self._spans, self._encoder_dp)
        if getattr(forward_batch, "input_embeds", None) is not None:
            raise RuntimeError("sglang-dsv41 torch path: input_embeds requests are not supported "
                               "(text token ids only in this phase)")
        if self.device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32:
            raise RuntimeError("sglang-dsv41 torch path needs fp32 matmuls: do not enable TF32")
        history = self.take_engram_history(forward_batch)
        body = self._modules.get("model")      # the prefill-graph language model, when attached
        replay = body is not None and image_embeds is None and prefill_graph.replaying(body)
        if replay:
            self._prepare_replay(body, history, forward_batch)
            hidden = body.forward(input_ids, positions, forward_batch)      # SGLang's graph replay
        else:
            hidden = self.hidden_states_of(input_ids, positions, forward_batch, image_embeds, history)
        if forward_batch.forward_mode.name in ("EXTEND", "MIXED"):
            metrics.count_extend("graph" if replay else "eager", self.tp.rank)
        return self.logits_processor(input_ids, hidden, self.lm_head, forward_batch,
                                     aux_hidden_states=self.torch_forward.captured)

    def hidden_states_of(self, input_ids: Tensor, positions: Tensor, forward_batch, image_embeds,
                         history: Tensor | None, static_extend: bool = False) -> Tensor:
        """The final hidden states of `forward_batch`'s tokens: the layout (`runtime/batch.py`: the
        static decode layout while SGLang's decode-graph runner captures, the static extend layout
        for a prefill-graph capture (`static_extend`), else the eager one), then the forward."""
        from sglang.srt.model_executor.forward_context import get_req_to_token_pool, get_token_to_kv_pool

        with fp32_default_dtype():
            caches = self._caches_for(get_token_to_kv_pool())
            req_to_token = get_req_to_token_pool().req_to_token
            positions = positions.to(self.device)
            if static_extend:
                fb = forward_batch
                layout = static_extend_layout(fb.req_pool_indices, fb.seq_lens, fb.extend_seq_lens, positions,
                                              fb.out_cache_loc, req_to_token, engram_history=history)
            else:
                layout = layout_from_forward_batch(forward_batch, positions, req_to_token,
                                                   static=self.device.type == "cuda" and sglang_graph_capture(),
                                                   engram_history=history)
            if self.torch_forward.capture_layers != self.dspark_capture_layers:
                self.torch_forward.set_capture_layers(self.dspark_capture_layers)
            return self.torch_forward.hidden_states(input_ids.to(self.device), layout, caches, image_embeds)

    def _prepare_replay(self, body: PrefillGraphBody, history: Tensor | None, forward_batch) -> None:
        """Before a prefill-graph replay: the Engram history into the graph's buffer, and every
        layer's HiCache load-back landed (`runtime/prefill_graph.py`)."""
        from sglang.srt.model_executor.forward_context import get_token_to_kv_pool

        if not self._replayed:
            self._replayed = True
            logger.info("sglang-dsv41: first prefill CUDA-graph replay (%d request(s), %d tokens)",
                        forward_batch.batch_size, len(forward_batch.input_ids))
        body.stage_history(history)
        caches = self._caches_for(get_token_to_kv_pool())
        for layer in range(len(caches.swa)):
            caches.wait_for_layer(layer, global_rows=True)


def language_model_only() -> bool:
    """`--language-model-only` (registered by the plugin: `enable_multimodal = False`)."""
    from sglang.srt.server_args import get_global_server_args

    return getattr(get_global_server_args(), "enable_multimodal", None) is False


def dp_encoder() -> bool:
    """SGLang's `--mm-enable-dp-encoder` (the encoder replicated, images split over the TP ranks)."""
    from sglang.srt.server_args import get_global_server_args

    return bool(getattr(get_global_server_args(), "mm_enable_dp_encoder", False))


def deterministic_inference() -> bool:
    """SGLang's `--enable-deterministic-inference`: on CPU the exact float64 backend (bit-identical
    to the reference, batch invariant, ~10× slower: docs/performance.md); default the fp32 path. On
    CUDA the batch-invariant choices: W8A16 FP8 linears (`backend.fp8_gemm_for`), BF16-weight rows in
    128-row blocks (`backend.bf16_gemm_for`), one attention key split and the packed rows at prefill
    (`attention_ops.KernelAttentionOps`); default `w8a8_fold`, whole-batch BF16 GEMMs, split-KV decode
    attention and the BF16 prefill workspace."""
    from sglang.srt.server_args import get_global_server_args

    return bool(getattr(get_global_server_args(), "enable_deterministic_inference", False))


def sglang_graph_capture() -> bool:
    """True while SGLang's CUDA-graph runner warms up or captures (its `model_capture_mode`): the
    forward then runs the static decode layout (`runtime/batch.py`: no host sync, shapes from the
    padded batch size, padding tokens masked). Replays do not call the forward."""
    from sglang.srt.model_executor.runner_utils.capture_mode import get_is_capture_mode

    return bool(get_is_capture_mode())


EntryClass = DeepseekV41ForCausalLM

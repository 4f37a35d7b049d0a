"""The DeepSeek-V4.1 forward of a packed batch over the runtime caches — no SGLang objects (spec §3).

`TorchForward.hidden_states(input_ids, layout, caches)` follows the model step by step; the
per-request state lives in `runtime/cache.py` (packed global KV rows, window-bounded SWA rows,
request-scoped ratio-2 pair state):

1. ids remapped (vision: ids ≥ 1,000,000 → image_token_id, §3.1); Engram rows hashed per request
   (`EngramHasher.row_ids(..., extend_lens)`, §3.3.1) with the K ids before its chunk: from the
   host for an extend (`layout.engram_history`), else from the request's history ring
   (`runtime/engram_history.py`);
2. R⁰ = embedding broadcast to the hc streams, held in `mhc.residual_dtype` (BF16 on CUDA:
   exact, R holding BF16 values, §3.2); per layer: Engram → attn-hc → attention
   (`runtime/attention.py`) → ffn-hc → MoE (`runtime/moe_ops.py`), with the lagged pre (§3.2);
   attention heads (`wq_b` / `wo_a` SGLang column-parallel linears), `wo_b` and the shared expert
   (SGLang's row / column-parallel linears),
   routed experts and Engram rows are sharded under tensor parallelism
   (`runtime/tensor_parallel.py`);
3. final collapse and `norm` (§3.7); the LM head is applied by the caller (`logits`). Embedding
   and LM head are vocabulary-parallel (`runtime/vocab_parallel.py`).

The implementations are chosen once, by the weights' device: the compute backend
(`runtime/backend.py`), attention + indexer (`attention_ops.ops_for`), mHC (`mhc_ops.mhc_for`),
MoE (`moe_ops.moe_for`) and the side stream of independent work (`overlap.side_stream_for`). The
only SGLang objects are layer classes — every linear
(`runtime/parallel_linear.py`), the embedding and the LM head (`runtime/vocab_parallel.py`) —
and the TP group's collectives; no server state, so the batching / caching invariants are
unit-tested directly against `ReferenceModel` (`tests/test_runtime_forward.py`).
"""
from __future__ import annotations

import contextlib
from typing import Iterable, Iterator, Mapping

import torch
from torch import Tensor, nn

from ..checkpoint.names import stored_inventory
from ..checkpoint.reader import CheckpointFormatError
from ..config import DeepseekV41Config
from ..engram_hash import MULTIMODAL_PAD_ID_BASE, EngramHasher
from ..numerics.geometry import language_model_ids
from ..numerics.profile import NumericsProfile
from ..numerics.rope import layer_inv_freq
from .attention import ForwardScratch
from .attention_ops import ops_for
from .backend import ComputeBackend, backend_for
from .batch import BatchLayout
from .cache import RuntimeCaches
from .engram_history import history_tail
from .engram_rows import static_row_ids
from .indexer_stats import IndexerSelectionStats
from .layers import DeepseekV41DecoderLayer, ForwardStep, OwnedTensors, RMSNorm
from .parallel_linear import linear_values, with_parallel_linears
from .mhc_ops import mhc_for
from .moe_ops import moe_for
from .overlap import ModelOverlap, side_stream_for
from .tensor_parallel import SINGLE, TensorParallel
from .vocab_parallel import ParallelLMHead, VocabParallelEmbedding, with_vocab_layers
from .weight_modules import loading_weights, parameter_target

F32 = torch.float32


def merge_image_rows(embeds: Tensor, ids: Tensor, image_embeds: tuple[Tensor, Tensor], image_id: int) -> Tensor:
    """`embeds` with rows `positions` replaced by `rows` (positions must hold `image_id`)."""
    positions, rows = image_embeds
    if positions.shape[0] != rows.shape[0]:
        raise ValueError(f"{positions.shape[0]} image positions for {rows.shape[0]} image rows")
    if not bool((ids[positions] == image_id).all()):
        raise ValueError(f"sglang-dsv41: image rows placed on positions not holding the image token {image_id}")
    out = embeds.clone()
    out[positions] = rows.to(out.dtype)
    return out


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


class TorchForward(nn.Module):
    """The DeepSeek-V4.1 text model: embedding, `DeepseekV41DecoderLayer`s, final norm and LM-head
    weight, each owning its parameters (`runtime/layers.py`); `hidden_states` runs a batch (see
    the module doc).

    `weights`: DeepSeek-native names → runtime values (`runtime/weights.py`) on the device the
    forward runs on, taken over by the layers (no copies); a value no layer owns raises.
    `hasher`: the Engram hasher (None without Engram layers).
    """

    def __init__(self, cfg: DeepseekV41Config, weights: Mapping[str, object], hasher: EngramHasher | None,
                 numerics: NumericsProfile = NumericsProfile(), tp: TensorParallel = SINGLE,
                 backend: ComputeBackend | None = None, deterministic: bool = True) -> None:
        super().__init__()
        if cfg.text.engram_layer_ids and hasher is None:
            raise ValueError("the model has Engram layers: an EngramHasher is required (spec §3.3.1)")
        self.cfg = cfg
        self.text = cfg.text
        self.roles = self.text.layer_roles()
        plan = tp.plan(self.text)     # raises now for a TP size the model cannot be sharded with
        weights = with_vocab_layers(with_parallel_linears(weights, cfg, plan), cfg, plan)
        self.embed: VocabParallelEmbedding = self._vocab_layer(weights, "embed", VocabParallelEmbedding, tp)
        self.layers = nn.ModuleList(DeepseekV41DecoderLayer(weights, self.text, role) for role in self.roles)
        self.norm = RMSNorm(weights, "norm.", self.text.rms_norm_eps)
        self.head: ParallelLMHead = self._vocab_layer(weights, "head", ParallelLMHead, tp)
        owners = [m for m in self.modules() if isinstance(m, OwnedTensors)]
        unowned = sorted(set(weights) - {"embed", "head"} - set().union(*(m.consumed for m in owners)))
        if unowned:
            raise ValueError(f"{len(unowned)} weight(s) no layer owns, e.g. {unowned[:4]}")
        self.hasher = hasher
        self.numerics = numerics
        self.tp = tp
        self._fixed_backend, self.deterministic = backend, deterministic
        self.selection_stats = IndexerSelectionStats(self.text.index_topk, tp.rank)
        #: DSpark target layers whose attention input each forward captures (`set_capture_layers`), and
        #: the last forward's captures [N, H] each, in that order (None before one ran / without capture)
        self.capture_layers: tuple[int, ...] = ()
        self.captured: list[Tensor] | None = None
        #: the weight modules (`runtime/weight_modules.py`) of a model built for streaming
        self.weight_modules = [w for m in owners for w in m.weight_modules() if not getattr(w, "prebuilt", False)]
        self.weight_modules += [w for w in (self.embed, self.head) if not getattr(w, "prebuilt", False)]
        self._loaded_once = not self.weight_modules
        self.ready = False
        self.overlap: ModelOverlap | None = None
        if self._loaded_once:
            self.finish_loading()

    @staticmethod
    def _vocab_layer(weights: Mapping[str, object], key: str, cls: type, tp: TensorParallel) -> nn.Module:
        layer = weights.get(key)
        if not isinstance(layer, cls):
            raise ValueError(f"{key}.weight: no {cls.__name__} layer among the weights (got {type(layer).__name__})")
        layer.attach(tp)
        return layer

    @classmethod
    def for_loading(cls, cfg: DeepseekV41Config, hasher: EngramHasher | None, *,
                    numerics: NumericsProfile = NumericsProfile(), tp: TensorParallel = SINGLE,
                    experts_mxfp4: bool, dense_fp8: bool, engram_placement: str = "device",
                    backend: ComputeBackend | None = None, deterministic: bool = True) -> "TorchForward":
        """The model with this rank's parameters created in stored form on the current default
        device (`runtime/weight_modules.py`), ready for `load_weights` (or dummy values +
        `post_load_weights`)."""
        placeholders = loading_weights(cfg, tp.plan(cfg.text), experts_mxfp4=experts_mxfp4, dense_fp8=dense_fp8,
                                       engram_placement=engram_placement, compute_device=torch.empty(0).device)
        return cls(cfg, placeholders, hasher, numerics, tp, backend, deterministic)

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """Stream stored checkpoint tensors into the parameters through their `weight_loader`s
        (`weight_modules.parameter_target`), then `post_load_weights`. Vision / DSpark tensors are
        skipped; an unknown, mis-typed or mis-shaped tensor, or on the first load a missing one,
        raises one `CheckpointFormatError` naming every offender. Returns the names loaded."""
        if not self.weight_modules:
            raise RuntimeError("this model was built from runtime values; build it with TorchForward.for_loading")
        params = dict(self.named_parameters())
        known, wanted = stored_inventory(self.cfg), stored_inventory(self.cfg, vision=False, dspark=False)
        seen: set[str] = set()
        problems: list[str] = []
        for name, tensor in weights:
            if name not in wanted:
                if name not in known:
                    problems.append(f"unexpected tensor {name} (not in the inventory for this config)")
                continue
            target, extra = parameter_target(name)
            param = params[target]
            try:
                param.weight_loader(param, tensor, *extra)
            except CheckpointFormatError as err:
                problems.append(str(err))
            seen.add(name)
        missing = sorted(set(wanted) - seen) if not self._loaded_once else []
        if missing:
            problems.append(f"missing {len(missing)} tensor(s): {', '.join(missing[:12])}")
        if problems:
            raise CheckpointFormatError("checkpoint does not match its config:\n  " + "\n  ".join(problems))
        self._loaded_once = True
        self.post_load_weights()
        return seen

    def post_load_weights(self) -> None:
        """Process every weight module (idempotent), then `finish_loading`."""
        for module in self.weight_modules:
            module.process()
        self.finish_loading()

    def finish_loading(self) -> None:
        """Rebuild what reads the weights: the layers' name → value maps, `weights`, the compute
        backend (its dense-weight cache) and the implementations picked by device."""
        owners = [m for m in self.modules() if isinstance(m, OwnedTensors)]
        for m in owners:
            m.refresh()
        owned = {n: v for m in owners for n, v in m.tensors.items()}
        #: the stacked linears (`runtime/stacked_linear.py`): not checkpoint tensors, but what the
        #: dense-weight cache registers first (their members' values are row views of them)
        stacks = linear_values({n: v for n, v in owned.items() if hasattr(v, "stacked_rows")})
        #: every owned value by its checkpoint name (the same objects the layers hold; a linear
        #: layer's runtime values under `{prefix}.weight` / `.scale`, `parallel_linear.linear_values`)
        self.weights: dict[str, object] = linear_values({n: v for n, v in owned.items()
                                                         if not hasattr(v, "stacked_rows")})
        self.weights.update({"embed.weight": self.embed.weight, "head.weight": self.head.weight})
        device = self.weights["embed.weight"].device
        fixed = self._fixed_backend
        if fixed is None:
            self.backend = backend_for(device, {**stacks, **self.weights}, self.deterministic)
        else:                           # a backend built from the members' values learns the stacks
            self.backend = fixed
            cache = getattr(getattr(fixed, "dense", None), "cache", None)
            if cache is not None:
                cache.register(stacks)
        self.attention_ops = ops_for(device, self.backend.acc, self.deterministic,
                                     len(self.tp.plan(self.text).heads), self.text.head_dim)
        self.mhc = mhc_for(device, self.backend.acc, self.deterministic)
        self.moe = moe_for(device)
        if self.overlap is None or self.overlap.device != device:     # one side stream per model and device
            self.overlap = side_stream_for(device)
        #: per-ratio RoPE inverse frequencies on the model device, made once (no host → device
        #: copy inside a forward: CUDA graphs cannot capture one)
        self.inv_freq = {r: layer_inv_freq(self.text, r).to(device) for r in sorted({x.ratio for x in self.roles})}
        self.ready = True

    def set_capture_layers(self, layer_ids) -> None:
        """Capture the stream-mean attention input (after Engram) of `layer_ids`, in that order (spec §4)."""
        ids = tuple(int(i) for i in layer_ids)
        bad = [i for i in ids if not 0 <= i < len(self.layers)]
        if bad or len(set(ids)) != len(ids):
            raise ValueError(f"DSpark capture layers {list(ids)}: need distinct layer ids in 0..{len(self.layers) - 1}")
        self.capture_layers = ids

    def remap_ids(self, ids: Tensor) -> Tensor:
        """Language-model ids (spec §3.1 item 3), the reference's rule."""
        return language_model_ids(ids, self.cfg)

    def remap_ids_on_device(self, ids: Tensor) -> Tensor:
        """`remap_ids` without a host sync (`value_checks` off: static / CUDA-graph layouts, CUDA
        serving): the same mapping; an id
        outside the vocabulary fails a device-side assertion (`torch._assert_async`) instead of
        raising on the host."""
        ids = ids.to(torch.int64).reshape(-1)
        if self.cfg.has_vision:
            ids = torch.where(ids >= MULTIMODAL_PAD_ID_BASE, torch.full_like(ids, self.cfg.image_token_id), ids)
        vocab = self.text.vocab_size
        torch._assert_async(((ids >= 0) & (ids < vocab)).all(), f"sglang-dsv41: token id outside [0, {vocab})")
        return ids

    def value_checks(self, layout: BatchLayout) -> bool:
        """Whether this forward validates ids on the host (each check a host sync): on CPU
        (`layout.host_checks`) and in deterministic mode; off for static layouts and in CUDA
        serving, where the same invariants hold on the device instead — ids by
        `remap_ids_on_device`'s device-side assertion, the Engram token map by its index (an id
        outside it fails the index's device-side bound check), Engram row ids by construction
        (`EngramHasher.layer_row_ids`: remainder mod a column prime + its offset, the primes
        checked against the tables' sizes in `EngramHasher.from_config`)."""
        return layout.host_checks or (self.deterministic and not layout.static)

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
        remap = self.remap_ids if self.value_checks(layout) else self.remap_ids_on_device
        return torch.where(host >= 0, remap(host.clamp(min=0)).reshape(host.shape), host)

    def engram_rows(self, ids: Tensor, layout: BatchLayout, caches: RuntimeCaches) -> list[Tensor]:
        """Row ids per Engram layer (history: `engram_history`; pad id before position 0), then
        the request rows' ring advanced to the end of this batch (padding tokens write nothing);
        a DSpark verify batch stages its ids instead (`EngramHistoryRing.stage_verify`). Forwards
        checked on the device that read the ring: `ComputeBackend.engram_ring_rows`."""
        assert self.hasher is not None
        if layout.engram_history is None and not layout.verify_width and not self.value_checks(layout):
            return self.backend.engram_ring_rows(self.hasher, ids, layout, caches.engram_history)
        history = self.engram_history(layout, caches)
        if layout.verify_width:
            local = torch.arange(ids.shape[0], device=ids.device) - layout.starts[layout.token_req]
            caches.engram_history.stage_verify(layout.req_rows[layout.token_req], local, ids, layout.live_tokens)
        else:
            tail = history_tail(history, ids, layout.starts, layout.prefix_lens, layout.extend_lens)
            caches.engram_history.advance(layout.req_rows, layout.seq_lens, tail,
                                          live=layout.live_requests if layout.static else None)
        history = torch.where(history >= 0, history, torch.full_like(history, self.hasher.pad_token_id))
        if not self.value_checks(layout):
            return static_row_ids(self.hasher, ids, layout, history)
        return self.hasher.row_ids(ids, layout.positions, history, layout.extend_lens)

    @torch.no_grad()
    def hidden_states(self, input_ids: Tensor, layout: BatchLayout, caches: RuntimeCaches,
                      image_embeds: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """Final normed hidden states [N, hidden] (BF16 values in fp32) of every batch token;
        writes every cache row of the batch's slots. `image_embeds` = (batch positions int64 [M],
        rows [M, hidden]): those positions' embeddings are replaced by the vision tower's span
        rows before the hyper-connection expansion (spec §3.1 item 4); each must carry an image id."""
        if not self.ready:
            raise RuntimeError("sglang-dsv41: forward before the weights were loaded (load_weights / post_load_weights)")
        try:
            hidden = self._hidden_states(input_ids, layout, caches, image_embeds)
        except BaseException:
            self.backend.finish(ok=False)
            if self.overlap is not None and self.overlap.side is not None:
                with contextlib.suppress(Exception):     # the forward's own error is the one raised
                    self.overlap.side.join_all()          # no forked work outlives its arguments
            raise
        self.backend.finish()
        return hidden

    def _hidden_states(self, input_ids: Tensor, layout: BatchLayout, caches: RuntimeCaches,
                       image_embeds: tuple[Tensor, Tensor] | None = None) -> Tensor:
        t = self.text
        if caches.profile is not self.numerics.cache:
            raise ValueError(f"caches hold profile {caches.profile}, the model computes {self.numerics.cache}")
        checks = self.value_checks(layout)
        ids = self.remap_ids(input_ids) if checks else self.remap_ids_on_device(input_ids)
        N = ids.shape[0]
        if N != layout.num_tokens:
            raise ValueError(f"{N} input ids for a layout of {layout.num_tokens} tokens")
        if N == 0:
            self.captured = [torch.zeros(0, t.hidden_size, dtype=F32, device=ids.device) for _ in self.capture_layers]
            return torch.zeros(0, t.hidden_size, dtype=F32, device=ids.device)
        step = ForwardStep(self.backend, self.attention_ops, self.mhc, self.moe, self.tp, self.numerics.act_quant,
                           layout, caches, ForwardScratch(inv_freq=dict(self.inv_freq)),
                           (ids == self.cfg.image_token_id) if self.cfg.has_vision else None, value_checks=checks,
                           side=self.overlap.for_tokens(N))
        if self.hasher is not None:
            step.engram_rows = dict(zip(t.engram_layer_ids, self.engram_rows(ids, layout, caches)))
            for layer in self.layers:
                if layer.engram is not None:
                    layer.engram.prefetch(step)
        E = self.embed(ids)
        if image_embeds is not None:
            E = merge_image_rows(E, ids, image_embeds, self.cfg.image_token_id)
        R = self.mhc.streams(E, t.hc_mult)
        step.captured = dict.fromkeys(self.capture_layers) if self.capture_layers else None
        carried_pre: Tensor | None = None
        for layer in self.layers:
            R, carried_pre = layer(R, carried_pre, step)
        step.side.join_all()
        assert carried_pre is not None
        if not layout.static:                           # a graph capture must not sync with the host
            self.selection_stats.observe(step.scratch.selections, N)
        self.captured = [step.captured[i] for i in self.capture_layers] if step.captured is not None else None
        return self.norm(self.mhc.collapse(R, carried_pre), self.backend)

    def forward(self, input_ids: Tensor, layout: BatchLayout, caches: RuntimeCaches) -> Tensor:
        return self.hidden_states(input_ids, layout, caches)

    def logits(self, hidden: Tensor) -> Tensor:
        """fp32 logits [N, vocab] of the BF16 head (spec §3.7), complete on every rank
        (`runtime/vocab_parallel.py`)."""
        return self.head.logits(hidden, self.backend)

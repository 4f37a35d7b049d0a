"""The DeepSeek-V4.1 layers as `nn.Module`s that own their parameters (spec §3; issue 13 item 2).

Each layer owns the tensors under its checkpoint prefix (`OwnedTensors`): tensors become
parameters (no grad; dtype as loaded: fp32, E4M3 with fp32 tile scales, uint8), the bytes of a
stored Engram table become buffers, so `named_parameters()` / `named_buffers()` list every tensor
the model holds (the prepared MXFP4 expert packs of the CUDA path are held as the layer's
`experts_mxfp4` attribute). The math is the runtime's (`attention.py`, `moe_ops.py`, `mhc_ops.py`,
`engram_gate.py`) on the implementations the model picked once, at construction (`ForwardStep`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch
from torch import Tensor, nn

from ..config import LayerRole, TextConfig
from .attention import ForwardScratch, attention_sublayer
from .backend import ComputeBackend
from .batch import BatchLayout
from .cache import RuntimeCaches
from .engram_gate import engram_update
from .engram_table import StoredEngramTable
from .mhc_ops import HcCoefficients, stream_mean
from .overlap import INLINE, InlineStream, Pending, SideStream
from .parallel_linear import is_parallel_linear
from .stacked_linear import SHARED_STACKED, STACKED, stack_attention_inputs, stack_shared_expert
from .tensor_parallel import TensorParallel


@dataclass
class ForwardStep:
    """What the layers of one forward read: the implementations chosen at construction, the
    batch (`layout`, `caches`), this forward's scratch and its per-token inputs."""

    backend: ComputeBackend
    attention_ops: object
    mhc: object
    moe: Callable[..., Tensor]
    tp: TensorParallel
    act_quant: bool
    layout: BatchLayout
    caches: RuntimeCaches
    scratch: ForwardScratch
    image_rows: Tensor | None
    engram_rows: dict[int, Tensor] = field(default_factory=dict)
    #: DSpark capture (`set_dspark_layers_to_capture`): layer id → its stream-mean attention input
    captured: dict[int, Tensor] | None = None
    #: host-side value checks (host syncs) of this forward: `TorchForward.value_checks`
    value_checks: bool = True
    #: where independent work is forked (`runtime/overlap.py`): a side stream, or INLINE
    side: SideStream | InlineStream = INLINE
    #: Engram rows forked at the start of the forward (`Engram.prefetch`), by layer id
    engram_prefetch: dict[int, Pending] = field(default_factory=dict)


def _owned(value: object) -> object:
    if isinstance(value, nn.Parameter) or not isinstance(value, Tensor):
        return value
    return nn.Parameter(value, requires_grad=False)


class OwnedTensors(nn.Module):
    """Owns the values of `weights` whose names start with `prefix`, registered under submodules
    that follow the rest of the name (`wq_a.weight` → `self.wq_a.weight`); a weight module
    (`runtime/weight_modules.py`, keyed by its prefix: `wq_a`) is registered there itself.
    `tensors` maps the full names to what the functional math reads (the same storage): a linear
    layer under its prefix (`layers.0.attn.wq_a`, applied through its quantisation method, never
    its weight by name), other values under their names; `refresh()` rebuilds it from the weight
    modules after their weights were processed."""

    def __init__(self, weights: Mapping[str, object], prefix: str) -> None:
        super().__init__()
        self.prefix = prefix
        self.tensors: dict[str, object] = {}
        self._weight_modules: dict[str, nn.Module] = {}
        for name, value in weights.items():
            if isinstance(value, nn.Module):
                if (name + ".").startswith(prefix):
                    self._weight_modules[name] = value
                    self._place(name[len(prefix):], value)
                    if is_parallel_linear(value):
                        self.tensors[name] = value
            elif name.startswith(prefix):
                self.tensors[name] = self._register(name[len(prefix):], value)
        self._plain = dict(self.tensors)
        #: the keys of `weights` this layer took over
        self.consumed = set(self._plain) | set(self._weight_modules)

    def weight_modules(self) -> list[nn.Module]:
        return list(self._weight_modules.values())

    def refresh(self) -> None:
        """Rebuild `tensors` after the weight modules processed their weights."""
        tensors = dict(self._plain)
        for name, module in self._weight_modules.items():
            if not is_parallel_linear(module):
                tensors.update({f"{name}.{leaf}": v for leaf, v in module.runtime_values().items()})
        self.tensors = tensors

    def _owner(self, path: list[str]) -> nn.Module:
        owner: nn.Module = self
        for part in path:
            child = owner._modules.get(part)
            if child is None:
                child = nn.Module()
                owner.add_module(part, child)
            owner = child
        return owner

    def _place(self, relative: str, module: nn.Module) -> None:
        *path, leaf = relative.split(".")
        self._owner(path).add_module(leaf, module)

    def _register(self, relative: str, value: object) -> object:
        *path, leaf = relative.split(".")
        owner = self._owner(path)
        owned = _owned(value)
        if isinstance(owned, nn.Parameter):
            owner.register_parameter(leaf, owned)
        elif isinstance(owned, StoredEngramTable):
            holder = nn.Module()
            holder.register_buffer("values", owned.values, persistent=False)
            holder.register_buffer("scales", owned.scales, persistent=False)
            owner.add_module(leaf, holder)
        else:
            setattr(owner, leaf, owned)            # prepared MXFP4 experts (kernel-layout packs)
        return owned

    def __getitem__(self, name: str) -> object:
        return self.tensors[self.prefix + name]

    def weight_module(self, name: str) -> nn.Module:
        """The weight module under `prefix + name` (e.g. `wo_b`); a missing one raises."""
        module = self._weight_modules.get(self.prefix + name)
        if module is None:
            raise KeyError(f"{self.prefix}{name}: no weight module (the model builds it as a parallel linear)")
        return module


class RMSNorm(OwnedTensors):
    """`{prefix}weight`; y = bf16(x·rsqrt(mean(x²) + ε)·w) on the model's backend."""

    def __init__(self, weights: Mapping[str, object], prefix: str, eps: float) -> None:
        super().__init__(weights, prefix)
        self.eps = eps

    def forward(self, x: Tensor, backend: ComputeBackend) -> Tensor:
        return backend.rms_norm(x, self["weight"], self.eps)


class HyperConnection(OwnedTensors):
    """One mHC hyper-connection (`{prefix}fn`, `base`, `scale`; spec §3.2)."""

    def __init__(self, weights: Mapping[str, object], prefix: str, cfg: TextConfig) -> None:
        super().__init__(weights, prefix)
        self.cfg = cfg

    def forward(self, R: Tensor, step: ForwardStep) -> HcCoefficients:
        t = self.cfg
        return step.mhc.coefficients(R, self["fn"], self["base"], self["scale"], rms_eps=t.rms_norm_eps,
                                     hc_eps=t.hc_eps, sinkhorn_iters=t.hc_sinkhorn_iters)

    def sublayer_input(self, R: Tensor, carried_pre: Tensor | None, norm: RMSNorm, step: ForwardStep) -> Tensor:
        """RMSNorm(bf16(Σ_j pre_j·R_j)) with the lagged pre (stream 0 when None)."""
        return step.mhc.sublayer_input(R, carried_pre, norm["weight"], norm.eps)

    def sublayer_inputs(self, R: Tensor, carried_pre: Tensor | None, norm: RMSNorm,
                        step: ForwardStep) -> tuple[Tensor, Tensor | None]:
        """(`sublayer_input`, its values quantised per 1×32 for the sublayer's first FP8 linears where the
        backend asks — `ComputeBackend.quantised_handoff` — else None)."""
        if step.act_quant and step.backend.quantised_handoff(R.shape[0]):
            return step.mhc.sublayer_inputs(R, carried_pre, norm["weight"], norm.eps)
        return self.sublayer_input(R, carried_pre, norm, step), None

    def residual_update(self, R: Tensor, y: Tensor, co: HcCoefficients, step: ForwardStep) -> Tensor:
        return step.mhc.residual_update(R, y, co)


class Attention(OwnedTensors):
    """The attention sublayer with its compressor and indexer (`layers.{i}.attn.*`; spec §3.4)."""

    def __init__(self, weights: Mapping[str, object], cfg: TextConfig, role: LayerRole) -> None:
        super().__init__(weights, f"layers.{role.layer}.attn.")
        self.cfg, self.role = cfg, role

    def refresh(self) -> None:
        """`OwnedTensors.refresh`, then the stacked `wq_a | wkv` layer where both hold E4M3 tiles
        (`runtime/stacked_linear.py`; its storage reused across refreshes)."""
        previous = self.tensors.get(self.prefix + STACKED)
        super().refresh()
        stack_attention_inputs(self.tensors, self.prefix, previous)

    def forward(self, x: Tensor, step: ForwardStep, x_quantised: Tensor | None = None) -> Tensor:
        return attention_sublayer(step.backend, step.attention_ops, self.cfg, self.role, self.tensors, x, step.layout,
                                  step.caches, step.scratch, step.act_quant, step.tp, self.weight_module("wo_b"),
                                  side=step.side, x_quantised=x_quantised)


class MoE(OwnedTensors):
    """Router, shared expert (SGLang parallel linears: column-parallel w1 / w3, row-parallel w2,
    reduced with the routed partial in one all-reduce) and the routed experts held here
    (`layers.{i}.ffn.*`; spec §3.6)."""

    def __init__(self, weights: Mapping[str, object], cfg: TextConfig, layer: int) -> None:
        super().__init__(weights, f"layers.{layer}.ffn.")
        self.cfg, self.layer_prefix = cfg, f"layers.{layer}."

    def refresh(self) -> None:
        """`OwnedTensors.refresh`, then the stacked shared `w1 | w3` where both hold E4M3 tiles
        (`runtime/stacked_linear.py`; its storage reused across refreshes)."""
        previous = self.tensors.get(self.prefix + SHARED_STACKED)
        super().refresh()
        stack_shared_expert(self.tensors, self.prefix, previous)

    def forward(self, x: Tensor, step: ForwardStep, x_quantised: Tensor | None = None) -> Tensor:
        """`x_quantised`: x's values quantised per 1×32, for the stacked shared expert's `w1 | w3`."""
        experts, reduce = step.tp.experts_and_reduce(self.cfg)
        w1, w2, w3 = (self.weight_module(f"shared_experts.{n}") for n in ("w1", "w2", "w3"))
        w13 = self.tensors.get(self.prefix + SHARED_STACKED)

        def shared(h: Tensor) -> tuple[Tensor, bool]:
            return step.tp.shared_expert(w1, w2, w3, h, step.backend, step.act_quant, self.cfg.swiglu_limit, w13,
                                         x_quantised if h is x else None)

        return step.moe(step.backend, self.cfg, self.tensors, self.layer_prefix, x, step.image_rows, step.act_quant,
                        experts, reduce, shared, side=step.side)


class Engram(OwnedTensors):
    """The Engram residual update of one layer (`layers.{i}.engram.*`; spec §3.3.2)."""

    def __init__(self, weights: Mapping[str, object], cfg: TextConfig, layer: int) -> None:
        super().__init__(weights, f"layers.{layer}.engram.")
        self.cfg, self.layer = cfg, layer

    def rows(self, step: ForwardStep) -> Tensor:
        """This forward's table rows of the layer (the gather the update reads)."""
        table, ids = step.tp.engram_rows(self.cfg, self.layer, step.engram_rows[self.layer], self.tensors,
                                         check=step.value_checks)
        return table[ids.to(torch.int64)]

    def prefetch(self, step: ForwardStep) -> None:
        """Fork the gather to the side stream now (TP 1: a sharded gather all-reduces, which stays on
        the main stream); `forward` joins it."""
        if step.side.overlaps and step.tp.size == 1:
            step.engram_prefetch[self.layer] = step.side.fork(self.rows, step)

    def forward(self, R: Tensor, step: ForwardStep) -> Tensor:
        pending = step.engram_prefetch.pop(self.layer, None)
        rows = self.rows(step) if pending is None else step.side.join(pending)
        return engram_update(step.backend, R, rows, self["wkv"], self["q_weight"], self["k_weight"],
                             self.cfg.rms_norm_eps, step.act_quant, step.image_rows)


class DeepseekV41DecoderLayer(nn.Module):
    """Engram → hc-pre → attention → hc-post → hc-pre → MoE → hc-post, with the lagged pre (§3.2);
    each sublayer's mHC coefficients are forked to `step.side` (`runtime/overlap.py`)."""

    def __init__(self, weights: Mapping[str, object], cfg: TextConfig, role: LayerRole) -> None:
        super().__init__()
        i = self.layer = role.layer
        self.engram = Engram(weights, cfg, i) if role.engram else None
        self.attn_norm = RMSNorm(weights, f"layers.{i}.attn_norm.", cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(weights, f"layers.{i}.ffn_norm.", cfg.rms_norm_eps)
        self.hc_attn = HyperConnection(weights, f"layers.{i}.hc_attn_", cfg)
        self.hc_ffn = HyperConnection(weights, f"layers.{i}.hc_ffn_", cfg)
        self.attn = Attention(weights, cfg, role)
        self.ffn = MoE(weights, cfg, i)

    def forward(self, R: Tensor, carried_pre: Tensor | None, step: ForwardStep) -> tuple[Tensor, Tensor]:
        if self.engram is not None:
            R = self.engram(R, step)
        if step.captured is not None and self.layer in step.captured:
            step.captured[self.layer] = stream_mean(R)          # DSpark feature: input after Engram (§4)
        co = step.side.fork(self.hc_attn, R, step)           # read first by the residual update (lagged pre)
        x, xq = self.hc_attn.sublayer_inputs(R, carried_pre, self.attn_norm, step)
        y = self.attn(x, step, xq)
        co = step.side.join(co)
        R = self.hc_attn.residual_update(R, y, co, step)
        co_ffn = step.side.fork(self.hc_ffn, R, step)
        x, xq = self.hc_ffn.sublayer_inputs(R, co.pre, self.ffn_norm, step)
        y = self.ffn(x, step, xq)
        co_ffn = step.side.join(co_ffn)
        R = self.hc_ffn.residual_update(R, y, co_ffn, step)
        return R, co_ffn.pre

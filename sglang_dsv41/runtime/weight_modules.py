"""The model's weights as parameters created before loading, and the checkpoint → parameter names
(spec `model.md` §2.1–§2.2; issue 13 item 1).

`loading_weights(cfg, plan, ...)` builds, for this rank, one placeholder per logical tensor of the
text model (`checkpoint.names.tensor_inventory`), keyed as the layers take them over
(`runtime/layers.py` `OwnedTensors`): a plain fp32 `Parameter` under its checkpoint name, or a
module under its prefix — every linear an SGLang linear layer with our quantisation method
(`runtime/parallel_linear.py`: `RowParallelLinear` for `wo_b` / shared `w2`, `ColumnParallelLinear`
for `wq_b`, `wo_a`, shared `w1` / `w3`, `ReplicatedLinear` for the rest; FP8 tiles or BF16), SGLang's `VocabParallelEmbedding` / `ParallelLMHead` for `embed` /
`head` (`runtime/vocab_parallel.py`),
`RoutedExperts` (one per layer, stacked MXFP4) and `EngramTable` (stored E4M3 rows). After
loading, `runtime_values()` of each module gives what the layer math reads, under the names
`runtime/weights.py` gives them.

`parameter_target(name)` maps a stored checkpoint tensor to (parameter name, extra loader
arguments): hyper-connections `hc_attn_fn` → `hc_attn.fn`; routed experts
`ffn.experts.{e}.w1|w3|w2.weight|scale` → `ffn.experts.w13_|w2_weight|scale` with (shard, e);
every other name is its parameter's name.
"""
from __future__ import annotations

import re

import torch
from torch import Tensor, nn

from ..checkpoint.codecs import TILE, scale_bytes
from ..checkpoint.names import Kind, TensorSpec, tensor_inventory
from ..config import DeepseekV41Config
from .engram_host import HostBuffer, HostEngramTable
from .engram_table import StoredEngramTable
from .quant_methods import UNIT_SCALE_BYTE, Mxfp4ExpertsMethod, check_stored, new_parameter, plain_parameter
from .parallel_linear import is_model_linear, parallel_fp8_linear
from .tensor_parallel import ShardPlan
from .vocab_parallel import vocab_layer

E4M3, U8 = torch.float8_e4m3fn, torch.uint8
_EXPERT = re.compile(r"^(?P<prefix>layers\.\d+\.)ffn\.experts\.(?P<e>\d+)\.(?P<w>w[123])\.(?P<leaf>weight|scale)$")
_HC = re.compile(r"\.hc_(attn|ffn)_")


def parameter_target(name: str) -> tuple[str, tuple]:
    """(parameter name, extra weight_loader arguments) of stored tensor `name` (module doc)."""
    m = _EXPERT.match(name)
    if m:
        stacked = "w2" if m["w"] == "w2" else "w13"
        return f"{m['prefix']}ffn.experts.{stacked}_{m['leaf']}", (m["w"], int(m["e"]))
    return _HC.sub(r".hc_\1.", name), ()


class RoutedExperts(nn.Module):
    """The routed experts of one layer held by this rank (`Mxfp4ExpertsMethod`)."""

    def __init__(self, w1: TensorSpec, w2: TensorSpec, expert_ids: list[int], n_routed_experts: int,
                 prepare: bool) -> None:
        super().__init__()
        self.quant_method = Mxfp4ExpertsMethod(prepare)
        self.quant_method.create_weights(self, w1, w2, expert_ids, n_routed_experts)

    def process(self) -> None:
        self.quant_method.process_weights_after_loading(self)

    def runtime_values(self) -> dict[str, object]:
        return self.quant_method.runtime_values(self)


class EngramTable(nn.Module):
    """This rank's rows of an Engram table as stored: `weight` E4M3 [rows, d], `scale` UE8M0
    bytes [rows, d/32]. Placement "host" (runtime.md §A.7) allocates both in `HostBuffer`s, pinned
    for a CUDA runtime, so the lookup table wraps them without a copy. No `quant_method`
    attribute: SGLang's post-load loop would move host tensors to the device."""

    def __init__(self, spec: TensorSpec, rows: range | None, placement: str, compute_device: torch.device) -> None:
        super().__init__()
        if placement not in ("device", "host"):
            raise ValueError(f"engram_placement must be 'device' or 'host', got {placement!r}")
        r = rows if rows is not None else range(spec.shape[0])
        d = spec.shape[1]
        self.placement, self.compute_device, self.table = placement, torch.device(compute_device), None
        self.buffers_: tuple[HostBuffer, ...] = ()
        values, scales = self._allocate((len(r), d), (len(r), d // TILE))
        want_w, want_s = spec.stored()

        def load(param: nn.Parameter, loaded: Tensor) -> None:
            check_stored(want_s if param is self.scale else want_w, loaded)
            rows_of = scale_bytes(loaded) if param is self.scale else loaded
            param.data.copy_(rows_of[r.start:r.stop])

        self.weight = new_parameter(values, load)
        self.scale = new_parameter(scales, load)

    def _allocate(self, vshape: tuple[int, int], sshape: tuple[int, int]) -> tuple[Tensor, Tensor]:
        if self.placement == "device":
            return torch.empty(vshape, dtype=E4M3), torch.full(sshape, UNIT_SCALE_BYTE, dtype=U8)
        out = []
        for shape, dtype in ((vshape, E4M3), (sshape, U8)):
            buf = HostBuffer(shape[0] * shape[1])
            if self.compute_device.type == "cuda":
                buf.register_with_cuda()
            self.buffers_ += (buf,)
            out.append(buf.tensor.view(dtype).view(shape))
        out[1].fill_(UNIT_SCALE_BYTE)
        return out[0], out[1]

    def process(self) -> None:
        values, scales = self.weight.data, self.scale.data
        if self.placement == "device":
            self.table = StoredEngramTable(values, scales)
            return
        for buf in self.buffers_:
            if buf.huge_pages_requested and buf.nbytes and buf.huge_pages_collapsed is None:
                buf.collapse_huge_pages()
        self.table = HostEngramTable(values, scales, compute_device=self.compute_device, buffers=self.buffers_)

    def runtime_values(self) -> dict[str, object]:
        if self.table is None:
            raise RuntimeError("Engram table read before its weights were processed")
        return {"weight": self.table}


def _module_key(name: str) -> str:
    return name.rsplit(".", 1)[0]


def loading_weights(cfg: DeepseekV41Config, plan: ShardPlan, *, experts_mxfp4: bool, dense_fp8: bool,
                    engram_placement: str, compute_device: torch.device) -> dict[str, object]:
    """Placeholders of this rank's weights (module doc), created on the current default device."""
    out: dict[str, object] = {}
    experts: dict[str, dict[str, TensorSpec]] = {}
    for spec in tensor_inventory(cfg, vision=False, dspark=False):
        rows = plan.rows_of(spec.name)
        if spec.name in ("embed.weight", "head.weight"):
            out[_module_key(spec.name)] = vocab_layer(spec, plan)
        elif spec.kind is Kind.FP4:
            m = _EXPERT.match(spec.name)
            assert m is not None, spec.name
            experts.setdefault(m["prefix"], {}).setdefault(m["w"], spec)
        elif is_model_linear(spec):
            out[_module_key(spec.name)] = parallel_fp8_linear(spec, plan, dense_fp8)
        elif spec.kind is Kind.ENGRAM:
            out[_module_key(spec.name)] = EngramTable(spec, rows, engram_placement, compute_device)
        else:
            out[spec.name] = plain_parameter(spec, rows)
    for prefix, specs in experts.items():
        out[prefix + "ffn.experts"] = RoutedExperts(specs["w1"], specs["w2"], list(plan.experts),
                                                    cfg.text.n_routed_experts, experts_mxfp4)
    return out

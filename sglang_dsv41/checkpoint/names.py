"""The checkpoint's tensor inventory, derived from the config (spec `model.md` §2.1–§2.2).

Every tensor of a DeepSeek-V4.1 checkpoint, with its DeepSeek-native name, its *logical*
(dequantised) shape and its storage kind. The stored tensors follow from the kind:

| kind    | stored as                                                                 |
|---------|---------------------------------------------------------------------------|
| BF16    | `name` BF16                                                               |
| FP32    | `name` F32                                                                |
| FP8     | `name` F8_E4M3 [out, in] + `<prefix>.scale` F8_E8M0 [⌈out/32⌉, ⌈in/32⌉]     |
| FP4     | `name` U8 [out, in/2] (two E2M1 per byte) + `<prefix>.scale` F8_E8M0 [out, in/32] |
| ENGRAM  | `name` F8_E4M3 [rows, d] + `<prefix>.scale` F8_E8M0 [rows, d/32]            |

where `<prefix>` is the name without its last component (`attn.wq_a.weight` → `attn.wq_a.scale`,
`engram.embed.weight` → `engram.embed.scale`).

The inventory is computed from the config and the roles table, never from Flash constants, so
tiny, slice and the released checkpoint go through the same code. It is the single source of
truth for the synthetic-checkpoint writer, `verify`, the reference loader and the planner.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Iterator

from ..config import DeepseekV41Config, TextConfig

TILE = 32  # FP8 2-D tile edge and MXFP4 / Engram scale group (quantization_config.weight_block_size)


class Kind(enum.Enum):
    BF16 = "bf16"
    FP32 = "fp32"
    FP8 = "fp8"
    FP4 = "fp4"
    ENGRAM = "engram"


# safetensors dtype strings we write; readers also accept the alternatives listed.
STORED_DTYPE = {"bf16": "BF16", "fp32": "F32", "fp8": "F8_E4M3", "scale": "F8_E8M0", "fp4": "U8"}
ACCEPTED_FP4_DTYPES = ("U8", "I8", "F4")
ACCEPTED_FLOAT_DTYPES = ("BF16", "F32", "F16")


@dataclass(frozen=True)
class StoredTensor:
    name: str
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype string

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * (4 if self.dtype == "F32" else 2 if self.dtype in ("BF16", "F16") else 1)


@dataclass(frozen=True)
class TensorSpec:
    """One logical tensor. `shape` is the dequantised shape [out, in] (or [rows, d])."""

    name: str
    shape: tuple[int, ...]
    kind: Kind
    group: str  # component for the planner: experts | engram | dense | embed | vision | dspark | norms

    @property
    def scale_name(self) -> str | None:
        if self.kind in (Kind.FP8, Kind.FP4, Kind.ENGRAM):
            return self.name.rsplit(".", 1)[0] + ".scale"
        return None

    def stored(self) -> tuple[StoredTensor, ...]:
        """The tensors this spec occupies in the safetensors files."""
        if self.kind is Kind.BF16:
            return (StoredTensor(self.name, self.shape, "BF16"),)
        if self.kind is Kind.FP32:
            return (StoredTensor(self.name, self.shape, "F32"),)
        out, inp = self.shape
        assert self.scale_name is not None
        if self.kind is Kind.FP8:
            return (
                StoredTensor(self.name, (out, inp), "F8_E4M3"),
                StoredTensor(self.scale_name, (math.ceil(out / TILE), math.ceil(inp / TILE)), "F8_E8M0"),
            )
        if self.kind is Kind.FP4:
            return (
                StoredTensor(self.name, (out, inp // 2), "U8"),
                StoredTensor(self.scale_name, (out, inp // TILE), "F8_E8M0"),
            )
        return (  # ENGRAM
            StoredTensor(self.name, (out, inp), "F8_E4M3"),
            StoredTensor(self.scale_name, (out, inp // TILE), "F8_E8M0"),
        )

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _layer_specs(t: TextConfig, prefix: str, layer: int, *, dspark: bool, n_experts: int) -> Iterator[TensorSpec]:
    """Per-decoder-layer tensors. `dspark` stages drop compressor/indexer/Engram/bias_vl."""
    H, hd, q = t.hidden_size, t.head_dim, t.q_lora_rank
    g_dense = "dspark" if dspark else "dense"
    g_exp = "dspark" if dspark else "experts"
    p = prefix
    yield TensorSpec(f"{p}attn_norm.weight", (H,), Kind.FP32, "norms")
    yield TensorSpec(f"{p}ffn_norm.weight", (H,), Kind.FP32, "norms")
    for sub in ("attn", "ffn"):
        yield TensorSpec(f"{p}hc_{sub}_fn", (t.hc_dim, t.hc_mult * H), Kind.FP32, "norms")
        yield TensorSpec(f"{p}hc_{sub}_base", (t.hc_dim,), Kind.FP32, "norms")
        yield TensorSpec(f"{p}hc_{sub}_scale", (3,), Kind.FP32, "norms")
    yield TensorSpec(f"{p}attn.wq_a.weight", (q, H), Kind.FP8, g_dense)
    yield TensorSpec(f"{p}attn.wkv.weight", (hd, H), Kind.FP8, g_dense)
    yield TensorSpec(f"{p}attn.q_norm.weight", (q,), Kind.FP32, "norms")
    yield TensorSpec(f"{p}attn.kv_norm.weight", (hd,), Kind.FP32, "norms")
    yield TensorSpec(f"{p}attn.wq_b.weight", (t.num_attention_heads * hd, q), Kind.FP8, g_dense)
    yield TensorSpec(f"{p}attn.wo_a.weight", (t.o_groups * t.o_lora_rank, t.heads_per_group * hd), Kind.FP8, g_dense)
    yield TensorSpec(f"{p}attn.wo_b.weight", (H, t.o_groups * t.o_lora_rank), Kind.FP8, g_dense)
    yield TensorSpec(f"{p}attn.attn_sink", (t.num_attention_heads,), Kind.FP32, "norms")
    if not dspark:
        role = t.layer_roles()[layer]
        if role.computes_latents:
            yield TensorSpec(f"{p}attn.compressor.wkv.weight", (hd, H), Kind.BF16, "dense")
            if role.ratio == 2:
                yield TensorSpec(f"{p}attn.compressor.wgate.weight", (hd, H), Kind.BF16, "dense")
            yield TensorSpec(f"{p}attn.compressor.norm.weight", (hd,), Kind.FP32, "norms")
        if role.runs_indexer:
            yield TensorSpec(f"{p}attn.indexer.wq_b.weight", (t.index_n_heads * t.index_head_dim, q), Kind.FP8, "dense")
            yield TensorSpec(f"{p}attn.indexer.weights_proj.weight", (t.index_n_heads, H), Kind.BF16, "dense")
        if role.computes_latents:
            yield TensorSpec(f"{p}attn.indexer.wk.weight", (t.index_head_dim, hd), Kind.BF16, "dense")
            yield TensorSpec(f"{p}attn.indexer.k_norm.weight", (t.index_head_dim,), Kind.FP32, "norms")
    I = t.moe_intermediate_size
    yield TensorSpec(f"{p}ffn.gate.weight", (n_experts, H), Kind.BF16, g_dense)
    yield TensorSpec(f"{p}ffn.gate.bias", (n_experts,), Kind.FP32, "norms")
    if not dspark:
        yield TensorSpec(f"{p}ffn.gate.bias_vl", (n_experts,), Kind.FP32, "norms")
    for e in range(n_experts):
        yield TensorSpec(f"{p}ffn.experts.{e}.w1.weight", (I, H), Kind.FP4, g_exp)
        yield TensorSpec(f"{p}ffn.experts.{e}.w2.weight", (H, I), Kind.FP4, g_exp)
        yield TensorSpec(f"{p}ffn.experts.{e}.w3.weight", (I, H), Kind.FP4, g_exp)
    Is = I * t.n_shared_experts
    yield TensorSpec(f"{p}ffn.shared_experts.w1.weight", (Is, H), Kind.FP8, g_dense)
    yield TensorSpec(f"{p}ffn.shared_experts.w2.weight", (H, Is), Kind.FP8, g_dense)
    yield TensorSpec(f"{p}ffn.shared_experts.w3.weight", (Is, H), Kind.FP8, g_dense)
    if not dspark and layer in t.engram_layer_ids:
        rows = t.engram_num_embeddings[t.engram_layer_ids.index(layer)]
        d = t.engram_head_dim
        yield TensorSpec(f"{p}engram.embed.weight", (rows, d), Kind.ENGRAM, "engram")
        yield TensorSpec(f"{p}engram.wkv.weight", ((t.hc_mult + 1) * H, t.engram_num_columns * d), Kind.FP8, "dense")
        yield TensorSpec(f"{p}engram.q_weight", (t.hc_mult, H), Kind.BF16, "dense")
        yield TensorSpec(f"{p}engram.k_weight", (t.hc_mult, H), Kind.BF16, "dense")


def _vision_specs(cfg: DeepseekV41Config) -> Iterator[TensorSpec]:
    v = cfg.vision
    assert v is not None
    H, D, p = cfg.text.hidden_size, v.hidden_size, v.patch_size
    k2 = v.downsample_ratio ** 2
    yield TensorSpec("vision.patch_embed.proj.weight", (D, 3 * p * p), Kind.BF16, "vision")
    yield TensorSpec("vision.patch_embed.proj.bias", (D,), Kind.BF16, "vision")
    for b in range(v.num_hidden_layers):
        q = f"vision.blocks.{b}."
        yield TensorSpec(q + "norm1.weight", (D,), Kind.FP32, "vision")
        yield TensorSpec(q + "norm2.weight", (D,), Kind.FP32, "vision")
        yield TensorSpec(q + "attn.wqkv.weight", (3 * D, D), Kind.BF16, "vision")
        yield TensorSpec(q + "attn.wqkv.bias", (3 * D,), Kind.BF16, "vision")
        yield TensorSpec(q + "attn.wo.weight", (D, D), Kind.BF16, "vision")
        yield TensorSpec(q + "attn.wo.bias", (D,), Kind.BF16, "vision")
        yield TensorSpec(q + "mlp.w1.weight", (2 * v.intermediate_size, D), Kind.BF16, "vision")
        yield TensorSpec(q + "mlp.w2.weight", (D, v.intermediate_size), Kind.BF16, "vision")
    yield TensorSpec("vision.norm.weight", (D,), Kind.FP32, "vision")
    yield TensorSpec("aligner.w1.weight", (H, D * k2), Kind.BF16, "vision")
    yield TensorSpec("aligner.w1.bias", (H,), Kind.BF16, "vision")
    yield TensorSpec("aligner.w2.weight", (H, H), Kind.BF16, "vision")
    yield TensorSpec("aligner.w2.bias", (H,), Kind.BF16, "vision")
    for n in ("image_start", "image_end", "image_newline"):
        yield TensorSpec(n, (H,), Kind.BF16, "vision")


def _dspark_specs(t: TextConfig) -> Iterator[TensorSpec]:
    S, H = t.num_nextn_predict_layers, t.hidden_size
    for s in range(S):
        yield from _layer_specs(t, f"mtp.{s}.", -1, dspark=True, n_experts=t.dspark_n_routed_experts)
    if S:
        yield TensorSpec("mtp.0.main_proj.weight", (H, len(t.dspark_target_layer_ids) * H), Kind.FP8, "dspark")
        yield TensorSpec("mtp.0.main_norm.weight", (H,), Kind.FP32, "norms")
        last = f"mtp.{S - 1}."
        yield TensorSpec(last + "norm.weight", (H,), Kind.FP32, "norms")
        yield TensorSpec(last + "markov_head.embed.weight", (t.vocab_size, t.dspark_markov_rank), Kind.BF16, "dspark")
        yield TensorSpec(last + "markov_head.head.weight", (t.vocab_size, t.dspark_markov_rank), Kind.BF16, "dspark")
        yield TensorSpec(last + "confidence_head.proj.weight", (1, H + t.dspark_markov_rank), Kind.FP32, "dspark")


def tensor_inventory(cfg: DeepseekV41Config, *, vision: bool = True, dspark: bool = True) -> list[TensorSpec]:
    """All logical tensors of a checkpoint for `cfg`, in a stable order (global, layers, vision, DSpark)."""
    t = cfg.text
    specs: list[TensorSpec] = [
        TensorSpec("embed.weight", (t.vocab_size, t.hidden_size), Kind.BF16, "embed"),
        TensorSpec("head.weight", (t.vocab_size, t.hidden_size), Kind.BF16, "embed"),
        TensorSpec("norm.weight", (t.hidden_size,), Kind.FP32, "norms"),
    ]
    for i in range(t.num_hidden_layers):
        specs.extend(_layer_specs(t, f"layers.{i}.", i, dspark=False, n_experts=t.n_routed_experts))
    if vision and cfg.vision is not None:
        specs.extend(_vision_specs(cfg))
    if dspark:
        specs.extend(_dspark_specs(t))
    return specs


def stored_inventory(cfg: DeepseekV41Config, **kw: bool) -> dict[str, StoredTensor]:
    """name → stored tensor (weights and their `.scale` companions)."""
    out: dict[str, StoredTensor] = {}
    for spec in tensor_inventory(cfg, **kw):
        for st in spec.stored():
            out[st.name] = st
    return out

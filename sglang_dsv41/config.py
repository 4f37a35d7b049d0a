"""DeepSeek-V4.1 `config.json`: parse, validate, and derive the per-layer roles table.

Spec: `shared/spec/model.md` §1 (file structure §1.1, fields §1.2, roles §1.3).

Invariants
----------
* The raw file has three parts: top level, `text_config`, `vision_config` (optional: absent
  means a text-only checkpoint) and `quantization_config`. We keep them apart (no flattening);
  SGLang's own flattening is the runtime's business.
* Every structural fact the model needs (ratios, kv/index sources, candidate source, Engram
  layers, DSpark capture layers) is read from the config and checked for consistency here, so a
  malformed checkpoint fails at start-up with a message naming the field — never half-way
  through a forward.
* `layer_roles()` is derived from the lists, never hard-coded for Flash: the tiny preset and
  Flash go through the same rules (spec §1.3 "Rules").
"""
from __future__ import annotations

import json
import math
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping


class ConfigError(ValueError):
    """A config.json that cannot describe a valid DeepSeek-V4.1 model."""


def _req(d: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in d:
        raise ConfigError(f"{where}: missing required field '{key}'")
    return d[key]


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


@dataclass(frozen=True)
class RopeScaling:
    """YaRN parameters (spec §3.4.2). Used only by compressed (ratio 1/2) layers."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    rope_type: str = "yarn"

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> "RopeScaling | None":
        if d is None:
            return None
        rtype = d.get("rope_type", d.get("type", "yarn"))
        _check(rtype == "yarn", f"text_config.rope_scaling.rope_type must be 'yarn', got {rtype!r}")
        return cls(
            factor=float(_req(d, "factor", "text_config.rope_scaling")),
            original_max_position_embeddings=int(
                _req(d, "original_max_position_embeddings", "text_config.rope_scaling")
            ),
            beta_fast=float(d.get("beta_fast", 32.0)),
            beta_slow=float(d.get("beta_slow", 1.0)),
        )


@dataclass(frozen=True)
class QuantConfig:
    """`quantization_config` (spec §1.2, §2.3): FP8 32×32 UE8M0 tiles, FP4 routed experts."""

    quant_method: str = "fp8"
    weight_block_size: tuple[int, int] = (32, 32)
    scale_fmt: str = "ue8m0"
    expert_dtype: str = "fp4"
    activation_scheme: str = "dynamic"

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> "QuantConfig":
        _check(d is not None, "config.json: missing 'quantization_config'")
        q = cls(
            quant_method=str(d.get("quant_method", "fp8")),
            weight_block_size=tuple(int(x) for x in d.get("weight_block_size", (32, 32))),  # type: ignore[arg-type]
            scale_fmt=str(d.get("scale_fmt", "ue8m0")),
            expert_dtype=str(d.get("expert_dtype", "fp4")),
            activation_scheme=str(d.get("activation_scheme", "dynamic")),
        )
        _check(q.quant_method == "fp8", f"quantization_config.quant_method must be 'fp8', got {q.quant_method!r}")
        _check(q.weight_block_size == (32, 32),
               f"quantization_config.weight_block_size must be [32, 32] (V4.1 tiles), got {list(q.weight_block_size)}")
        _check(q.scale_fmt == "ue8m0", f"quantization_config.scale_fmt must be 'ue8m0', got {q.scale_fmt!r}")
        _check(q.expert_dtype == "fp4", f"quantization_config.expert_dtype must be 'fp4', got {q.expert_dtype!r}")
        return q


@dataclass(frozen=True)
class VisionConfig:
    """`vision_config` (spec §1.2, §5)."""

    num_hidden_layers: int
    hidden_size: int
    num_attention_heads: int
    intermediate_size: int
    patch_size: int = 14
    rope_theta: float = 10000.0
    downsample_ratio: int = 3
    max_image_tokens: int = 1024
    min_pixels: int = 295936
    max_wh_ratio: float | None = None
    rms_norm_eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "VisionConfig":
        w = "vision_config"
        v = cls(
            num_hidden_layers=int(_req(d, "num_hidden_layers", w)),
            hidden_size=int(_req(d, "hidden_size", w)),
            num_attention_heads=int(_req(d, "num_attention_heads", w)),
            intermediate_size=int(_req(d, "intermediate_size", w)),
            patch_size=int(d.get("patch_size", 14)),
            rope_theta=float(d.get("rope_theta", 10000.0)),
            downsample_ratio=int(d.get("downsample_ratio", 3)),
            max_image_tokens=int(d.get("max_image_tokens", 1024)),
            min_pixels=int(d.get("min_pixels", 295936)),
            max_wh_ratio=None if d.get("max_wh_ratio") is None else float(d["max_wh_ratio"]),
        )
        _check(v.hidden_size % v.num_attention_heads == 0,
               f"{w}: hidden_size {v.hidden_size} not divisible by num_attention_heads {v.num_attention_heads}")
        _check(v.head_dim % 4 == 0, f"{w}: head_dim {v.head_dim} must be a multiple of 4 (2-D RoPE halves)")
        _check(v.max_image_tokens >= 3, f"{w}: max_image_tokens must be ≥ 3 (start, one row, end)")
        return v


@dataclass(frozen=True)
class TextConfig:
    """`text_config` (spec §1.2). Field names follow the checkpoint's config.json."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    moe_intermediate_size: int
    compress_ratios: tuple[int, ...]
    kv_source_layer_ids: tuple[int, ...]
    index_source_layer_ids: tuple[int, ...]
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    candidate_source_layer_id: int
    candidate_topk_blocks: int
    candidate_block_size: int
    engram_layer_ids: tuple[int, ...]
    engram_num_embeddings: tuple[int, ...]
    engram_max_ngram_size: int
    engram_vocab_size: int
    engram_n_heads: int
    engram_head_dim: int
    engram_pad_token_id: int
    engram_compressed_vocab_size: int
    num_nextn_predict_layers: int
    dspark_block_size: int
    dspark_noise_token_id: int
    dspark_target_layer_ids: tuple[int, ...]
    dspark_markov_rank: int
    dspark_n_routed_experts: int
    dspark_num_experts_per_tok: int
    num_key_value_heads: int = 1
    hidden_act: str = "silu"
    swiglu_limit: float = 10.0
    rms_norm_eps: float = 1e-20
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 1048576
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_scaling: RopeScaling | None = None
    scoring_func: str = "sqrtsoftplus"
    topk_method: str = "noaux_tc"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    first_k_dense_replace: int = 0
    num_hash_layers: int = 0
    sliding_window: int = 128
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6

    # ---- derived sizes -------------------------------------------------------------------
    @property
    def qk_nope_head_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.o_groups

    @property
    def num_layers(self) -> int:
        return self.num_hidden_layers

    @property
    def hc_dim(self) -> int:
        """Rows of each `hc_*_fn`: 2·hc + hc² (pre, post, combine)."""
        return (2 + self.hc_mult) * self.hc_mult

    @property
    def engram_num_columns(self) -> int:
        """Hash columns per Engram layer: (max_ngram − 1) n-gram sizes × n_heads."""
        return (self.engram_max_ngram_size - 1) * self.engram_n_heads

    @property
    def decoder_start_layer(self) -> int:
        """First ratio-1 layer: the "decoder" half begins here (spec §1.3, §3.5)."""
        for i, r in enumerate(self.compress_ratios[: self.num_hidden_layers]):
            if r == 1:
                return i
        return self.num_hidden_layers

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "TextConfig":
        w = "text_config"
        kwargs: dict[str, Any] = {}
        tuple_fields = {
            "compress_ratios", "kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids",
            "engram_num_embeddings", "dspark_target_layer_ids",
        }
        for f in fields(cls):
            if f.name == "rope_scaling":
                kwargs["rope_scaling"] = RopeScaling.from_dict(d.get("rope_scaling"))
                continue
            required = f.default is MISSING and f.default_factory is MISSING
            if f.name not in d:
                if required:
                    raise ConfigError(f"{w}: missing required field '{f.name}'")
                continue
            value = d[f.name]
            if f.name in tuple_fields:
                _check(isinstance(value, (list, tuple)), f"{w}.{f.name} must be a list, got {value!r}")
                value = tuple(int(x) for x in value)
            elif f.name == "engram_compressed_vocab_size":
                _check(isinstance(value, int), f"{w}.engram_compressed_vocab_size must be an integer, got {value!r}")
            kwargs[f.name] = value
        cfg = cls(**kwargs)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        w = "text_config"
        L = self.num_hidden_layers
        _check(L >= 1, f"{w}.num_hidden_layers must be ≥ 1")
        _check(self.num_key_value_heads == 1,
               f"{w}.num_key_value_heads must be 1 (V4.1 attention is single-KV-head MQA), got {self.num_key_value_heads}")
        _check(0 < self.qk_rope_head_dim < self.head_dim and self.qk_rope_head_dim % 2 == 0,
               f"{w}: qk_rope_head_dim {self.qk_rope_head_dim} must be even and < head_dim {self.head_dim}")
        _check(self.num_attention_heads % self.o_groups == 0,
               f"{w}: num_attention_heads {self.num_attention_heads} not divisible by o_groups {self.o_groups}")
        _check(self.hidden_act == "silu", f"{w}.hidden_act must be 'silu', got {self.hidden_act!r}")
        _check(self.scoring_func == "sqrtsoftplus", f"{w}.scoring_func must be 'sqrtsoftplus', got {self.scoring_func!r}")
        _check(self.topk_method == "noaux_tc", f"{w}.topk_method must be 'noaux_tc', got {self.topk_method!r}")
        _check(self.first_k_dense_replace == 0, f"{w}.first_k_dense_replace must be 0 (every layer is MoE)")
        _check(self.num_hash_layers == 0,
               f"{w}.num_hash_layers={self.num_hash_layers}: hash-routed layers are a V4 feature, not supported for V4.1")
        _check(not self.tie_word_embeddings, f"{w}.tie_word_embeddings must be false (untied head)")
        _check(1 <= self.num_experts_per_tok <= self.n_routed_experts,
               f"{w}: num_experts_per_tok {self.num_experts_per_tok} not in 1..n_routed_experts")
        _check(self.n_shared_experts == 1, f"{w}.n_shared_experts must be 1, got {self.n_shared_experts}")
        _check(self.hc_mult >= 1 and self.hc_sinkhorn_iters >= 1, f"{w}: hc_mult and hc_sinkhorn_iters must be ≥ 1")
        _check(self.sliding_window >= 1, f"{w}.sliding_window must be ≥ 1")

        S = self.num_nextn_predict_layers
        _check(len(self.compress_ratios) in (L, L + S),
               f"{w}.compress_ratios has {len(self.compress_ratios)} entries; expected num_hidden_layers "
               f"({L}) or num_hidden_layers + num_nextn_predict_layers ({L + S})")
        ratios = self.compress_ratios[:L]
        _check(all(r in (0, 1, 2) for r in ratios),
               f"{w}.compress_ratios: V4.1 uses only ratios 0, 1, 2; got {sorted(set(ratios))}")
        _check(all(r == 0 for r in self.compress_ratios[L:]),
               f"{w}.compress_ratios: DSpark stage entries must be 0 (SWA-only)")

        def in_range(name: str, ids: tuple[int, ...]) -> None:
            _check(all(0 <= i < L for i in ids), f"{w}.{name} {list(ids)} has ids outside 0..{L - 1}")
            _check(list(ids) == sorted(set(ids)), f"{w}.{name} {list(ids)} must be strictly increasing")

        in_range("kv_source_layer_ids", self.kv_source_layer_ids)
        in_range("index_source_layer_ids", self.index_source_layer_ids)
        in_range("engram_layer_ids", self.engram_layer_ids)
        in_range("dspark_target_layer_ids", self.dspark_target_layer_ids)

        for i in self.kv_source_layer_ids:
            _check(ratios[i] > 0, f"{w}: kv source layer {i} has compress ratio 0")
        for i in self.index_source_layer_ids:
            _check(ratios[i] > 0, f"{w}: index source layer {i} has compress ratio 0")
        for i, r in enumerate(ratios):
            if r == 0:
                continue
            _check(self._nearest(self.kv_source_layer_ids, i, r) is not None,
                   f"{w}: layer {i} (ratio {r}) has no kv source of ratio {r} at or before it")
            _check(self._nearest(self.index_source_layer_ids, i, r) is not None,
                   f"{w}: layer {i} (ratio {r}) has no indexer of ratio {r} at or before it")
        for i in self.kv_source_layer_ids:
            _check(i in self.index_source_layer_ids,
                   f"{w}: kv source layer {i} must be in index_source_layer_ids (it writes the index keys)")

        c = self.candidate_source_layer_id
        if c >= 0:
            _check(c < L and c in self.kv_source_layer_ids,
                   f"{w}.candidate_source_layer_id {c} must be a kv source layer")
            _check(self.candidate_topk_blocks >= 1 and self.candidate_block_size >= 1,
                   f"{w}: candidate_topk_blocks and candidate_block_size must be ≥ 1")
        _check(self.index_topk >= 1, f"{w}.index_topk must be ≥ 1")
        _check(self.index_head_dim > self.qk_rope_head_dim,
               f"{w}: index_head_dim {self.index_head_dim} must exceed qk_rope_head_dim {self.qk_rope_head_dim}")

        _check(len(self.engram_num_embeddings) == len(self.engram_layer_ids),
               f"{w}: engram_num_embeddings has {len(self.engram_num_embeddings)} entries for "
               f"{len(self.engram_layer_ids)} engram layers")
        _check(self.engram_max_ngram_size >= 2, f"{w}.engram_max_ngram_size must be ≥ 2")
        _check(self.engram_compressed_vocab_size >= 1, f"{w}.engram_compressed_vocab_size must be ≥ 1")
        for i in self.engram_layer_ids:
            _check(i < self.decoder_start_layer or self.decoder_start_layer == L,
                   f"{w}: engram layer {i} lies in the decoder half (starts at {self.decoder_start_layer})")

        if S:
            _check(len(self.dspark_target_layer_ids) == S,
                   f"{w}: dspark_target_layer_ids has {len(self.dspark_target_layer_ids)} entries for "
                   f"{S} DSpark stages (num_nextn_predict_layers)")
            _check(1 <= self.dspark_num_experts_per_tok <= self.dspark_n_routed_experts,
                   f"{w}: dspark_num_experts_per_tok not in 1..dspark_n_routed_experts")
            _check(self.dspark_block_size >= 1, f"{w}.dspark_block_size must be ≥ 1")
            _check(0 <= self.dspark_noise_token_id < self.vocab_size,
                   f"{w}.dspark_noise_token_id {self.dspark_noise_token_id} outside the vocabulary")

    # ---- roles ---------------------------------------------------------------------------
    def _nearest(self, ids: tuple[int, ...], layer: int, ratio: int) -> int | None:
        """Nearest id ≤ layer in `ids` whose compress ratio equals `ratio`."""
        best = None
        for i in ids:
            if i <= layer and self.compress_ratios[i] == ratio:
                best = i
        return best

    def layer_roles(self) -> tuple["LayerRole", ...]:
        return tuple(LayerRole.derive(self, i) for i in range(self.num_hidden_layers))


@dataclass(frozen=True)
class LayerRole:
    """One row of the roles table (spec §1.3).

    * `rope`: "A" = base `rope_theta`, no YaRN (ratio 0); "B" = `compress_rope_theta` + YaRN.
    * `kv_source`: layer whose compressed cache (and index keys) this layer reads; None at ratio 0.
    * `computes_latents`: writes compressed latents + index keys (a kv source).
    * `runs_indexer`: scores compressed positions itself.
    * `candidate_source`: publishes candidate blocks (and does a full top-k itself).
    * `candidate_consumer`: an indexer that scores only inside the candidate source's blocks.
    * `selection_from`: layer whose top-k selection this layer uses (itself if it indexes).
    """

    layer: int
    ratio: int
    rope: str
    kv_source: int | None
    computes_latents: bool
    runs_indexer: bool
    candidate_source: bool
    candidate_consumer: bool
    selection_from: int | None
    engram: bool
    dspark_capture: bool
    decoder: bool

    @classmethod
    def derive(cls, cfg: TextConfig, i: int) -> "LayerRole":
        r = cfg.compress_ratios[i]
        indexer = i in cfg.index_source_layer_ids
        cand = cfg.candidate_source_layer_id
        return cls(
            layer=i,
            ratio=r,
            rope="A" if r == 0 else "B",
            kv_source=None if r == 0 else cfg._nearest(cfg.kv_source_layer_ids, i, r),
            computes_latents=i in cfg.kv_source_layer_ids,
            runs_indexer=indexer,
            candidate_source=i == cand,
            candidate_consumer=indexer and 0 <= cand < i and i not in cfg.kv_source_layer_ids,
            selection_from=None if r == 0 else cfg._nearest(cfg.index_source_layer_ids, i, r),
            engram=i in cfg.engram_layer_ids,
            dspark_capture=i in cfg.dspark_target_layer_ids,
            decoder=i >= cfg.decoder_start_layer,
        )


@dataclass(frozen=True)
class DeepseekV41Config:
    """The whole config.json. `vision` is None for a text-only checkpoint."""

    text: TextConfig
    quant: QuantConfig
    vision: VisionConfig | None
    bos_token_id: int = 0
    eos_token_id: int | tuple[int, ...] = 1
    pad_token_id: int = 2
    image_token_id: int = 129264
    dtype: str = "bfloat16"
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    ARCHITECTURE = "DeepseekV41ForCausalLM"
    MODEL_TYPE = "deepseek_v41"

    @property
    def has_vision(self) -> bool:
        return self.vision is not None and self.vision.num_hidden_layers > 0

    @property
    def eos_ids(self) -> tuple[int, ...]:
        e = self.eos_token_id
        return tuple(e) if isinstance(e, tuple) else (e,)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "DeepseekV41Config":
        archs = d.get("architectures")
        _check(archs == [cls.ARCHITECTURE],
               f"config.json: architectures must be [{cls.ARCHITECTURE!r}], got {archs!r} "
               "(a V4 checkpoint is not a V4.1 checkpoint)")
        _check(d.get("model_type") == cls.MODEL_TYPE,
               f"config.json: model_type must be {cls.MODEL_TYPE!r}, got {d.get('model_type')!r}")
        text = _req(d, "text_config", "config.json")
        _check(isinstance(text, Mapping), "config.json: text_config must be an object")
        vis = d.get("vision_config")
        eos = d.get("eos_token_id", 1)
        cfg = cls(
            text=TextConfig.from_dict(text),
            quant=QuantConfig.from_dict(d.get("quantization_config")),
            vision=None if vis is None else VisionConfig.from_dict(vis),
            bos_token_id=int(d.get("bos_token_id", 0)),
            eos_token_id=tuple(int(x) for x in eos) if isinstance(eos, list) else int(eos),
            pad_token_id=int(d.get("pad_token_id", 2)),
            image_token_id=int(d.get("image_token_id", 129264)),
            dtype=str(d.get("dtype", d.get("torch_dtype", "bfloat16"))),
            raw=dict(d),
        )
        t = cfg.text
        _check(0 <= cfg.image_token_id < t.vocab_size,
               f"config.json: image_token_id {cfg.image_token_id} outside vocab_size {t.vocab_size}")
        _check(cfg.dtype == "bfloat16", f"config.json: dtype must be 'bfloat16', got {cfg.dtype!r}")
        if cfg.vision is not None:
            _check(cfg.vision.downsample_ratio >= 1, "vision_config.downsample_ratio must be ≥ 1")
        return cfg

    @classmethod
    def from_file(cls, path: str | Path) -> "DeepseekV41Config":
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        try:
            d = json.loads(p.read_text())
        except FileNotFoundError:
            raise ConfigError(f"no config.json at {p}") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{p}: not valid JSON ({e})") from None
        return cls.from_dict(d)


def yarn_ramp_bounds(rope_dim: int, base: float, original_seq_len: int,
                     beta_fast: float, beta_slow: float) -> tuple[int, int]:
    """(low, high) frequency-index bounds of the YaRN ramp (spec §3.4.2); Flash: (15, 25)."""

    def corr(rot: float) -> float:
        return rope_dim * math.log(original_seq_len / (rot * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(corr(beta_fast)), 0)
    high = min(math.ceil(corr(beta_slow)), rope_dim - 1)
    return low, high

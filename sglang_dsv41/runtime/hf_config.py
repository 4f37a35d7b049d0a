"""The transformers config class SGLang sees for a DeepSeek-V4.1 checkpoint (runtime.md §B
"Config for an unknown model_type"; phase-2 contracts §2–§3).

SGLang 0.5.17 loads `config.json` through `AutoConfig` (`HfModelConfigParser`), then derives the
KV-pool shape, context length, dtype and multimodality from the resulting object's attributes.
Stock transformers does not know `model_type = "deepseek_v41"`, so the plugin registers
`DeepseekV41HFConfig` under that name (`AutoConfig.register` + SGLang's `_CONFIG_REGISTRY`).

Invariants
----------
* The checkpoint's `config.json` is validated by our own `DeepseekV41Config.from_dict` when the
  object is built: a malformed V4.1 config fails at start-up with a message naming the field.
* The whole original dict is kept, unchanged, in `dsv41_config_json`; the model class re-parses
  it (`DeepseekV41HFConfig.parsed()`), so every V4.1 number comes from our parser, never from
  attributes SGLang may rewrite.
* The attributes SGLang reads describe the model as it is (`sglang_attributes`): L decoder layers
  (`num_hidden_layers = L`), every one with sliding-window attention of window W over one KV head
  of `head_dim = D` whose keys are its values (spec §3.4.5): `num_key_value_heads = 1`,
  `hybrid_layer_pattern = [1]·L`, `sliding_window = W`, and `is_hybrid_swa = True` (SGLang's
  opt-in for custom hybrid-SWA architectures), so SGLang takes its hybrid-SWA path (SWA slot
  allocator, FULL + SWA radix tree). The compressed global KV is not a layer: it is a buffer of
  our pool (`runtime/kv_pool.py`), which SGLang sizes and builds through the hooks of
  `runtime/sglang_pool.py` — no fake layer, no fake head dim, no zero-width V.
* `sliding_window` is the window SGLang's SWA pool frees slots outside of and the SWA radix
  cache requires before matching a prefix (positions p−W..p−1 of a hit at p are kept, exactly
  the keys our attention reads, spec §3.4.5). Our attention applies the window itself; SGLang's
  attention backend never reads the pool.
* Deliberately **not** exposed (they would switch on SGLang paths written for other models):
  `text_config` / `vision_config` (multimodal detection, phase 1 is text-only),
  `quantization_config` (SGLang's FP8 machinery; the torch path dequantises itself, spec §2.4),
  `rope_scaling` / `rope_theta` (transformers' RoPE normalisation), `index_topk` /
  `kv_lora_rank` (DSA/MLA detection), `num_nextn_predict_layers` (MTP/EAGLE detection).
* The DSpark fields SGLang's DSPARK path reads from the top level (`dspark_attributes`, only for
  a checkpoint with DSpark stages): `dspark_block_size`, `dspark_noise_token_id`,
  `dspark_target_layer_ids`, `dspark_markov_rank` — `checkpoint_bundles_dspark_draft` then finds
  the bundled draft and `parse_dspark_draft_config` its γ, mask token, capture layers and Markov
  rank (docs/dspark.md). Nothing else in SGLang 0.5.17 reads them.
"""
from __future__ import annotations

import copy
from typing import Any

from transformers import PretrainedConfig

from ..config import DeepseekV41Config, TextConfig

MODEL_TYPE = DeepseekV41Config.MODEL_TYPE
ARCHITECTURE = DeepseekV41Config.ARCHITECTURE
#: The architecture of a V4.1 DSpark draft `ModelConfig` (set by the `_config_draft_model` hook).
DRAFT_ARCHITECTURE = "DeepseekV41ForCausalLMDSpark"

#: SGLang-facing attributes copied from `text_config` (everything else stays in the raw dict).
_TEXT_FIELDS = ("vocab_size", "hidden_size", "num_attention_heads", "max_position_embeddings",
                "tie_word_embeddings")
#: Top-level keys that must not become attributes (see the module docstring).
_HIDDEN_TOP_LEVEL = ("text_config", "vision_config", "quantization_config")


def parsed_config(config) -> DeepseekV41Config:
    """The parsed `DeepseekV41Config` of the HF config SGLang hands a model class; any other config
    class means the plugin did not register ours."""
    if not hasattr(config, "parsed"):
        raise TypeError(f"expected the sglang-dsv41 config class, got {type(config).__name__} "
                        "(is the sglang-dsv41 plugin loaded?)")
    return config.parsed()


def sglang_attributes(text: TextConfig) -> dict[str, Any]:
    """The attention shape SGLang reads (module docstring): L sliding-window layers, one KV head of D."""
    layers = text.num_hidden_layers
    return {
        "num_hidden_layers": layers,
        "is_hybrid_swa": True,
        "hybrid_layer_pattern": [1] * layers,
        "sliding_window": text.sliding_window,
        "num_key_value_heads": 1,
        "head_dim": text.head_dim,
    }


def dspark_attributes(text: TextConfig) -> dict[str, Any]:
    """The top-level `dspark_*` fields of SGLang's bundled-draft convention (module doc); none
    for a checkpoint without DSpark stages."""
    if text.num_nextn_predict_layers < 1:
        return {}
    return {
        "dspark_block_size": text.dspark_block_size,
        "dspark_noise_token_id": text.dspark_noise_token_id,
        "dspark_target_layer_ids": list(text.dspark_target_layer_ids),
        "dspark_markov_rank": text.dspark_markov_rank,
    }


class DeepseekV41HFConfig(PretrainedConfig):
    """`model_type = "deepseek_v41"` for transformers/SGLang; validation by `DeepseekV41Config`."""

    model_type = MODEL_TYPE
    # A V4.1 config has no meaningful defaults: transformers must never build one from nothing.
    has_no_defaults_at_init = True

    def __post_init__(self, **kwargs: Any) -> None:
        raw = kwargs.pop("dsv41_config_json", None)
        if raw is None:
            raw = self._raw_from_kwargs(kwargs)
        parsed = DeepseekV41Config.from_dict(raw)           # loud ConfigError on a bad config
        for key in _HIDDEN_TOP_LEVEL:
            kwargs.pop(key, None)
        for name in _TEXT_FIELDS:
            kwargs[name] = getattr(parsed.text, name)
        kwargs.update(sglang_attributes(parsed.text))
        kwargs.update(dspark_attributes(parsed.text))
        kwargs["dsv41_config_json"] = copy.deepcopy(raw)
        kwargs.setdefault("bos_token_id", parsed.bos_token_id)
        kwargs.setdefault("eos_token_id", raw.get("eos_token_id", parsed.eos_token_id))
        kwargs.setdefault("pad_token_id", parsed.pad_token_id)
        kwargs["image_token_id"] = parsed.image_token_id
        super().__post_init__(**kwargs)
        self.architectures = [ARCHITECTURE]

    def _raw_from_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The original config.json dict, rebuilt from the constructor arguments."""
        raw = {k: copy.deepcopy(v) for k, v in kwargs.items() if not k.startswith("_")}
        raw["architectures"] = list(self.architectures or [])
        raw["model_type"] = MODEL_TYPE
        dtype = self.dtype if self.dtype is not None else kwargs.get("torch_dtype")
        raw["dtype"] = str(dtype).replace("torch.", "") if dtype is not None else raw.get("dtype")
        raw.pop("torch_dtype", None)
        if raw.get("dtype") is None:
            raw.pop("dtype")
        for key in ("transformers_version", "output_hidden_states", "return_dict",
                    "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id",
                    "problem_type", "name_or_path"):
            raw.pop(key, None)
        return raw

    def parsed(self) -> DeepseekV41Config:
        """Our validated config, parsed from the untouched config.json dict."""
        return DeepseekV41Config.from_dict(self.dsv41_config_json)

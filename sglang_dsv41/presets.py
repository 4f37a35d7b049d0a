"""config.json dictionaries for the shapes this project builds checkpoints for.

* `flash_config_dict()`: the released DeepSeek-V4.1-Flash config (spec `model.md` §1.2, values
  from the public mirrors; `eos_token_id` 1 — see docs/reference.md for the [1, 2] variant).
* `tiny_config_dict(compressed_vocab)`: spec §7's tiny config, which keeps every code path
  (both ratios, shared-cache readers, candidate consumer, two Engram layers, vision, DSpark) at
  ≈ 1.6 M parameters. `engram_compressed_vocab_size` depends on the tiny tokenizer and is passed in.
* `tiny_tp8_config_dict(compressed_vocab)`: the tiny config with 8 attention heads in 8 output
  groups (one head per group) — the smallest shape the bit-exact tensor parallelism of
  `runtime/tensor_parallel.py` (whole output groups per rank, ≥ 1 routed expert per rank) can
  shard at TP 4 and TP 8; everything else is the tiny config (8 routed experts: EP 8 = one per rank).
* `slice_config_dict(layers, engram_rows)`: Flash widths with few layers (GPU performance work).

These are data, not code paths: the model reads whatever config.json the checkpoint holds.
"""
from __future__ import annotations

import copy
from typing import Any

QUANTIZATION_CONFIG: dict[str, Any] = {
    "quant_method": "fp8",
    "activation_scheme": "dynamic",
    "weight_block_size": [32, 32],
    "scale_fmt": "ue8m0",
    "expert_dtype": "fp4",
}

_FLASH_TEXT: dict[str, Any] = {
    "model_type": "deepseek_v41_text",
    "vocab_size": 129280,
    "hidden_size": 5120,
    "num_hidden_layers": 40,
    "num_attention_heads": 64,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 1280,
    "o_lora_rank": 1024,
    "o_groups": 8,
    "hidden_act": "silu",
    "swiglu_limit": 10.0,
    "rms_norm_eps": 1e-20,
    "attention_bias": False,
    "tie_word_embeddings": False,
    "max_position_embeddings": 1048576,
    "rope_theta": 10000,
    "rope_scaling": {
        "rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
        "original_max_position_embeddings": 65536,
    },
    "compress_rope_theta": 160000,
    "n_routed_experts": 384,
    "num_experts_per_tok": 6,
    "n_shared_experts": 1,
    "moe_intermediate_size": 2304,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "first_k_dense_replace": 0,
    "sliding_window": 128,
    "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0],
    "kv_source_layer_ids": [2, 8, 14, 20],
    "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
    "index_n_heads": 32,
    "index_head_dim": 128,
    "index_topk": 512,
    "candidate_source_layer_id": 20,
    "candidate_topk_blocks": 2048,
    "candidate_block_size": 8,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "engram_layer_ids": [1, 14],
    "engram_num_embeddings": [384006168, 384016682],
    "engram_max_ngram_size": 4,
    "engram_vocab_size": 16000000,
    "engram_n_heads": 8,
    "engram_head_dim": 256,
    "engram_pad_token_id": 2,
    "engram_compressed_vocab_size": 99092,
    "num_nextn_predict_layers": 3,
    "dspark_block_size": 5,
    "dspark_noise_token_id": 128799,
    "dspark_target_layer_ids": [37, 38, 39],
    "dspark_markov_rank": 256,
    "dspark_n_routed_experts": 128,
    "dspark_num_experts_per_tok": 3,
}

_FLASH_VISION: dict[str, Any] = {
    "model_type": "deepseek_v41_vision",
    "num_hidden_layers": 32,
    "hidden_size": 1024,
    "num_attention_heads": 16,
    "intermediate_size": 2816,
    "patch_size": 14,
    "rope_theta": 10000,
    "downsample_ratio": 3,
    "max_image_tokens": 1024,
    "min_pixels": 295936,
    "max_wh_ratio": None,
}

_TINY_TEXT: dict[str, Any] = {
    "model_type": "deepseek_v41_text",
    "vocab_size": 1024,
    "hidden_size": 64,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 96,
    "qk_rope_head_dim": 32,
    "q_lora_rank": 32,
    "o_lora_rank": 32,
    "o_groups": 2,
    "hidden_act": "silu",
    "swiglu_limit": 10.0,
    "rms_norm_eps": 1e-20,
    "attention_bias": False,
    "tie_word_embeddings": False,
    "max_position_embeddings": 4096,
    "rope_theta": 10000,
    "rope_scaling": {
        "rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
        "original_max_position_embeddings": 256,
    },
    "compress_rope_theta": 160000,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "moe_intermediate_size": 32,
    "first_k_dense_replace": 0,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "sliding_window": 8,
    "compress_ratios": [0, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0],
    "kv_source_layer_ids": [1, 3, 4],
    "index_source_layer_ids": [1, 3, 4, 6],
    "index_n_heads": 2,
    "index_head_dim": 64,
    "index_topk": 4,
    "candidate_source_layer_id": 4,
    "candidate_topk_blocks": 3,
    "candidate_block_size": 4,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "engram_layer_ids": [1, 3],
    "engram_num_embeddings": [434, 606],
    "engram_max_ngram_size": 4,
    "engram_vocab_size": 61,
    "engram_n_heads": 2,
    "engram_head_dim": 32,
    "engram_pad_token_id": 2,
    "engram_compressed_vocab_size": None,  # filled from the tiny tokenizer
    "num_nextn_predict_layers": 3,
    "dspark_block_size": 5,
    "dspark_noise_token_id": 999,
    "dspark_target_layer_ids": [5, 6, 7],
    "dspark_markov_rank": 16,
    "dspark_n_routed_experts": 4,
    "dspark_num_experts_per_tok": 2,
}

_TINY_VISION: dict[str, Any] = {
    "model_type": "deepseek_v41_vision",
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 2,
    "intermediate_size": 64,
    "patch_size": 14,
    "rope_theta": 10000,
    "downsample_ratio": 3,
    "max_image_tokens": 32,
    "min_pixels": 7056,
    "max_wh_ratio": None,
}


def _wrap(text: dict[str, Any], vision: dict[str, Any] | None, image_token_id: int) -> dict[str, Any]:
    d: dict[str, Any] = {
        "architectures": ["DeepseekV41ForCausalLM"],
        "model_type": "deepseek_v41",
        "dtype": "bfloat16",
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        "image_token_id": image_token_id,
        "quantization_config": copy.deepcopy(QUANTIZATION_CONFIG),
        "text_config": copy.deepcopy(text),
    }
    if vision is not None:
        d["vision_config"] = copy.deepcopy(vision)
    return d


def flash_config_dict() -> dict[str, Any]:
    return _wrap(_FLASH_TEXT, _FLASH_VISION, 129264)


def tiny_config_dict(compressed_vocab: int) -> dict[str, Any]:
    d = _wrap(_TINY_TEXT, _TINY_VISION, 1000)
    d["text_config"]["engram_compressed_vocab_size"] = int(compressed_vocab)
    return d


#: What `tiny_tp8_config_dict` changes in the tiny text config (nothing else differs).
TINY_TP8_TEXT_CHANGES: dict[str, Any] = {"num_attention_heads": 8, "o_groups": 8}


def tiny_tp8_config_dict(compressed_vocab: int) -> dict[str, Any]:
    """`tiny_config_dict` with `TINY_TP8_TEXT_CHANGES`: TP sizes 1, 2, 4 and 8 divide both the
    head count and o_groups (runtime/tensor_parallel.py), and the 8 routed experts give each
    of 8 ranks one expert."""
    d = tiny_config_dict(compressed_vocab)
    d["text_config"].update(copy.deepcopy(TINY_TP8_TEXT_CHANGES))
    return d


def slice_config_dict(layers: int = 22, engram_rows: int = 1 << 20) -> dict[str, Any]:
    """Flash widths, `layers` main layers (default 22: layers 0..21 hold Engram at 1 and 14,
    ratio-2 sources 2/8/14 with readers, the ratio-1 source 20 and a reader 21).

    The candidate consumer needs an index layer after 20 (Flash: 24): with `layers ≥ 25` the
    first consumer is included. Engram tables are cut to about `engram_rows` rows per layer by
    choosing `engram_vocab_size` so the primes sum near that (recorded in the config, so the
    hash math stays the released one for that table size).
    """
    if layers < 3:
        raise ValueError("a slice needs at least 3 layers (Engram layer 1 and ratio-2 source 2)")
    d = _wrap(_FLASH_TEXT, _FLASH_VISION, 129264)
    t = d["text_config"]
    t["num_hidden_layers"] = layers
    t["compress_ratios"] = _FLASH_TEXT["compress_ratios"][:layers] + [0, 0, 0]
    keep = lambda ids: [i for i in ids if i < layers]  # noqa: E731
    t["kv_source_layer_ids"] = keep(t["kv_source_layer_ids"])
    t["index_source_layer_ids"] = keep(t["index_source_layer_ids"])
    if t["candidate_source_layer_id"] >= layers:
        t["candidate_source_layer_id"] = -1
    t["engram_layer_ids"] = keep(t["engram_layer_ids"])
    t["dspark_target_layer_ids"] = [layers - 3, layers - 2, layers - 1]
    columns = (t["engram_max_ngram_size"] - 1) * t["engram_n_heads"]
    t["engram_vocab_size"] = max(engram_rows // columns, 64)
    t["engram_num_embeddings"] = None  # filled by the Engram prime layout (checkpoint.synth)
    return d

"""A random-weight Llama shaped like the tiny V4.1 checkpoint, for the framework-overhead baseline of
issue 21 ("the tiny-checkpoint server against a stock-SGLang tiny Llama with the same layer count",
docs/performance.md "Tiny server against a tiny Llama").

Same hidden size, layer count, head count, vocabulary, context and tokenizer files as `--like`
(the tiny checkpoint), a dense SwiGLU MLP of `--intermediate` (default 2 × hidden), BF16 weights
from `torch.manual_seed(0)`. Stock SGLang serves it with its own `LlamaForCausalLM`; the same client
(`serving_e2e.py client`) drives both servers with the same random ids.

    python benchmarks/tiny_llama.py --like /tmp/tiny --out /tmp/llama8
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def llama_config(like: dict, layers: int | None, intermediate: int | None) -> dict:
    """The LlamaConfig fields of a Llama with `like`'s (a V4.1 config.json) text widths."""
    t = like.get("text_config", like)
    hidden = t["hidden_size"]
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
            "intermediate_size": intermediate or 2 * hidden, "num_hidden_layers": layers or t["num_hidden_layers"],
            "num_attention_heads": t["num_attention_heads"], "num_key_value_heads": t["num_attention_heads"],
            "head_dim": t.get("head_dim") or hidden // t["num_attention_heads"], "vocab_size": t["vocab_size"],
            "max_position_embeddings": t["max_position_embeddings"], "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16",
            "bos_token_id": like.get("bos_token_id"), "eos_token_id": like.get("eos_token_id"),
            "tie_word_embeddings": False}


def write(like_dir: Path, out: Path, layers: int | None = None, intermediate: int | None = None) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    fields = llama_config(json.loads((like_dir / "config.json").read_text()), layers, intermediate)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**fields)).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (like_dir / name).exists():
            shutil.copy(like_dir / name, out / name)
    return fields


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--like", type=Path, required=True, help="the tiny V4.1 checkpoint directory")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--layers", type=int, help="default: the checkpoint's layer count")
    ap.add_argument("--intermediate", type=int, help="MLP width (default 2 × hidden)")
    a = ap.parse_args(argv)
    print(json.dumps(write(a.like, a.out, a.layers, a.intermediate)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

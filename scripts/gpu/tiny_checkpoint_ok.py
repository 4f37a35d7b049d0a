"""`python3 scripts/gpu/tiny_checkpoint_ok.py DIR`: exit 0 when DIR holds the tiny checkpoint that
`make-checkpoint --preset tiny` (seed 0) writes today, so `tiny_checkpoint` (scripts/gpu/lib.sh)
reuses it; else print why and exit 1 (lib.sh then writes it again with --overwrite).

Complete means: the index records this generator version (make_checkpoint writes the index after
every shard, so a run killed mid-way leaves none), config.json is the tiny preset's (with the
Engram compressed vocabulary size it records), every shard the index names exists, and the first
stored tensor equals seed 0's. No tokenizer is loaded: the check takes about a torch import.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def problem(path: Path, seed: int = 0) -> str | None:
    """Why `path` is not the complete tiny checkpoint of `seed` (None: it is)."""
    import torch
    from safetensors import safe_open

    from sglang_dsv41 import presets
    from sglang_dsv41.checkpoint.names import tensor_inventory
    from sglang_dsv41.checkpoint.synth import GENERATOR_VERSION, INDEX_FILE, generator_version, stored_tensors
    from sglang_dsv41.config import DeepseekV41Config

    try:
        version = generator_version(path)
        if version != GENERATOR_VERSION:
            return f"generator version {version} (today's: {GENERATOR_VERSION})"
        config = json.loads((path / "config.json").read_text())
        # the tokenizer was written before the index: the compressed vocabulary size it recorded stands
        want = json.loads(json.dumps(presets.tiny_config_dict(config["text_config"]["engram_compressed_vocab_size"])))
        if config != want:
            return "config.json is not the tiny preset's"
        weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
        missing = sorted(f for f in set(weight_map.values()) if not (path / f).is_file())
        if missing:
            return f"shards missing: {', '.join(missing)}"
        cfg = DeepseekV41Config.from_dict(want)
        for name, expected in stored_tensors(tensor_inventory(cfg)[0], cfg, seed):
            with safe_open(str(path / weight_map[name]), "pt") as f:
                if not torch.equal(f.get_tensor(name), expected):
                    return f"{name} is not seed {seed}'s"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"unreadable: {e}"
    return None


def main(argv: list[str]) -> int:
    path = Path(argv[0])
    why = problem(path)
    if why is None:
        print(f"tiny checkpoint: reusing {path}")
        return 0
    print(f"tiny checkpoint: {path} is not reusable ({why}); writing it again")
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Synthetic checkpoints in the released format (spec `model.md` §1, §2, §7).

`make_checkpoint(preset, out, seed)` writes a complete HF-style model directory:
tokenizer files, `config.json`, sharded `model-000NN-of-000MM.safetensors` and
`model.safetensors.index.json`, with every tensor of `names.stored_inventory(cfg)` under its
real name, dtype and shape (FP8 + 32×32 UE8M0 tiles, packed MXFP4 + per-32 scales, Engram
E4M3 rows, BF16 / FP32 plain tensors).

Invariants
----------
* Deterministic: each tensor is drawn from its own generator seeded by sha256(seed, name), so
  the same seed gives byte-identical files, independent of sharding or of which tensors are
  generated first; a different seed changes every tensor.
* Streaming: the shard layout is planned from the inventory's sizes before any data exists;
  shards are then generated and written one at a time (never the whole checkpoint in RAM).
* Numerically sane random model: linear weights ~ N(0, 1/fan_in); norm weights ≈ 1; small
  `hc_*_fn` (mix logits O(0.5)), `hc_*_base` favouring the identity stream mix, `hc_*_scale` ≈ 1;
  sinks and router biases ≈ 0; router logits O(1) so different tokens pick different experts;
  Engram q/k weights ≈ 1. Activations stay O(1) through the layers.
* Well conditioned (generator version 2, measured by tests/test_checkpoint_conditioning.py):
  the residual-writing projections — attention `wo_b`, routed and shared expert `w2` — carry
  the gain `OUTPUT_PROJECTION_GAIN` (1/64; a power of two, so the MXFP4 group exponents just
  shift), the value rows of `engram.wkv` carry `ENGRAM_VALUE_GAIN` (1/4), and the hc comb base
  favours the identity with +`HC_COMB_IDENTITY_LOGIT` (4). Each sublayer then writes a few per
  cent of the residual instead of as much as the residual itself: with version 1's unit gains a
  one-BF16-ulp change of one attention output grew 2–4× per layer (max |Δlogit| ≈ 8 for a
  one-ulp nudge in every attention sublayer); with these gains it stays near the BF16
  rounding floor (≈ 0.07), while routing, indexer, attention, sink, Engram and context still
  visibly change the logits. Real trained models are not as chaotic as a unit-gain random init.
* Routed-expert MXFP4 weights are drawn directly as codes (a fixed 256-entry table giving a
  bell-shaped E2M1 code distribution) with power-of-two group scales around 1/√fan_in — the
  same values a quantised Gaussian would give, at a speed that makes the full-width slice
  preset practical.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from torch import Tensor

from ..config import DeepseekV41Config
from .codecs import TILE, quantize_engram_rows, quantize_fp8_block, ue8m0_from_exponent
from .names import Kind, TensorSpec, tensor_inventory
from .tokenizer import build_tiny_tokenizer, build_tokenizer, engram_compressed_vocab_size

PRESETS = ("tiny", "tiny-tp8", "slice")
#: The tiny-sized presets: the tiny tokenizer and `presets.tiny_config_dict` / `tiny_tp8_config_dict`.
TINY_PRESETS = ("tiny", "tiny-tp8")
#: Version of the value rules below; part of every checkpoint's index metadata
#: (`GENERATOR_METADATA_KEY`) so a cached checkpoint made by older rules can be recognised.
GENERATOR_VERSION = 2
GENERATOR_METADATA_KEY = "sglang_dsv41_generator_version"
#: Gain of the projections that write into the residual (attention wo_b, expert / shared w2).
OUTPUT_PROJECTION_GAIN = 2.0 ** -6
#: Gain of the Engram value rows of engram.wkv (the keys only enter an RMS-normalised gate).
ENGRAM_VALUE_GAIN = 0.25
#: Logit added to the diagonal of the hc comb base (identity-favouring stream mix).
HC_COMB_IDENTITY_LOGIT = 4.0
DEFAULT_SHARD_BYTES = {"tiny": 1 << 20, "tiny-tp8": 1 << 20, "slice": 4 << 30}
INDEX_FILE = "model.safetensors.index.json"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

# E2M1 magnitude codes 0..7 with counts out of 128 ≈ a N(0, 1.5²) variable rounded to the grid
# {0, .5, 1, 1.5, 2, 3, 4, 6}; RMS of the decoded magnitudes ≈ 1.57.
_FP4_CODE_COUNTS = (17, 31, 27, 21, 19, 10, 2, 1)
_FP4_CODE_RMS = math.sqrt(sum(c * v * v for c, v in zip(_FP4_CODE_COUNTS, (0, .5, 1, 1.5, 2, 3, 4, 6))) / 128)


# ---------------------------------------------------------------------------------------------
# Per-tensor random values
# ---------------------------------------------------------------------------------------------
def tensor_seed(seed: int, name: str) -> int:
    """64-bit generator seed of one tensor: sha256 of (seed, name)."""
    digest = hashlib.sha256(f"sglang-dsv41/synth/{int(seed)}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def _generator(seed: int, name: str) -> np.random.Generator:
    """numpy PCG64 stream of one tensor (numpy's streams are stable across versions and fast)."""
    return np.random.Generator(np.random.PCG64(tensor_seed(seed, name)))


def _normal(g: np.random.Generator | torch.Generator, shape: tuple[int, ...]) -> Tensor:
    """Standard normal fp32: numpy stream on the host, or a torch generator's own device."""
    if isinstance(g, torch.Generator):
        return torch.randn(shape, generator=g, device=g.device, dtype=torch.float32)
    return torch.from_numpy(g.standard_normal(size=shape, dtype=np.float32))


def _hc_base(hc: int, g: np.random.Generator) -> Tensor:
    """[pre (hc), post (hc), comb (hc²)]: pre/post logits ≈ 0; comb favours the identity mix."""
    base = 0.1 * _normal(g, (hc * (2 + hc),))
    base[2 * hc:] += HC_COMB_IDENTITY_LOGIT * torch.eye(hc, device=base.device).flatten()
    return base


def logical_value(spec: TensorSpec, cfg: DeepseekV41Config, g: np.random.Generator) -> Tensor:
    """Random float32 value of a non-FP4 logical tensor (the initialisation rules of the module doc)."""
    name, shape = spec.name, spec.shape
    randn = lambda: _normal(g, shape)  # noqa: E731
    last = name.rsplit(".", 1)[-1]
    if "hc_" in name and name.endswith("_fn"):
        return randn() * (0.5 / math.sqrt(shape[1]))
    if "hc_" in name and name.endswith("_base"):
        return _hc_base(cfg.text.hc_mult, g)
    if "hc_" in name and name.endswith("_scale"):
        return 1.0 + 0.1 * randn()
    if name.endswith("attn_sink"):
        return 0.1 * randn()
    if name.endswith(("gate.bias", "gate.bias_vl")):
        return 0.02 * randn()
    if name.endswith(("norm.weight", "norm1.weight", "norm2.weight")) or last in ("q_weight", "k_weight"):
        return 1.0 + 0.02 * randn()
    if name in ("embed.weight", "image_start", "image_end", "image_newline") or name.endswith(
            ("markov_head.embed.weight", "engram.embed.weight")):
        return randn()
    if name.endswith("markov_head.head.weight"):
        return randn() * (0.5 / math.sqrt(shape[1]))
    if last == "bias":
        return 0.02 * randn()
    if name == "head.weight":  # logits std ≈ 2 for a unit-RMS final hidden state: peaked, not flat
        return randn() * (2.0 / math.sqrt(shape[1]))
    if name.endswith(("attn.wo_b.weight", "shared_experts.w2.weight")):
        return randn() * (OUTPUT_PROJECTION_GAIN / math.sqrt(shape[1]))
    if name.endswith("engram.wkv.weight"):   # rows [keys (hc·H) | value (H)], spec §3.3.2
        value = randn() / math.sqrt(shape[1])
        value[cfg.text.hc_mult * cfg.text.hidden_size:] *= ENGRAM_VALUE_GAIN
        return value
    if len(shape) == 2:
        return randn() / math.sqrt(shape[1])
    raise ValueError(f"no initialisation rule for {name} {shape}")


def _fp4_pair_table() -> np.ndarray:
    """uint16 random value → packed byte of two E2M1 codes: each byte of the random value picks
    one code through the 256-entry code table (bit 7 = sign, low 7 bits = magnitude draw)."""
    magnitude = np.repeat(np.arange(8, dtype=np.uint8), _FP4_CODE_COUNTS)
    code_of_byte = np.concatenate([magnitude, magnitude | 8])
    r = np.arange(1 << 16)
    return (code_of_byte[r & 0xFF] | (code_of_byte[r >> 8] << 4)).astype(np.uint8)


_FP4_PAIR_TABLE = _fp4_pair_table()


def _random_mxfp4(spec: TensorSpec, g: np.random.Generator) -> tuple[Tensor, Tensor]:
    """Packed E2M1 codes [out, in/2] + UE8M0 group scales [out, in/32], RMS ≈ gain/√in with
    gain `OUTPUT_PROJECTION_GAIN` for the residual-writing `w2`, 1 otherwise."""
    out_f, in_f = spec.shape
    draws = g.integers(0, 1 << 16, size=(out_f, in_f // 2), dtype=np.uint16)
    packed = torch.from_numpy(np.take(_FP4_PAIR_TABLE, draws))
    gain = OUTPUT_PROJECTION_GAIN if spec.name.endswith(".w2.weight") else 1.0
    # group exponents e0 + {−1, 0, +1}; E[4^offset] = 1.75 is folded into e0
    e0 = round(math.log2(gain / math.sqrt(in_f) / (_FP4_CODE_RMS * math.sqrt(1.75))))
    offset = torch.from_numpy(g.integers(-1, 2, size=(out_f, in_f // TILE), dtype=np.int32))
    return packed, ue8m0_from_exponent(offset + e0)


def _random_mxfp4_torch(spec: TensorSpec, g: torch.Generator) -> tuple[Tensor, Tensor]:
    """`_random_mxfp4`'s distribution drawn by a torch generator on its device."""
    out_f, in_f = spec.shape
    table = _FP4_PAIR_TABLES.get(g.device)
    if table is None:
        table = _FP4_PAIR_TABLES[g.device] = torch.from_numpy(_FP4_PAIR_TABLE).to(g.device)
    draws = torch.randint(0, 1 << 16, (out_f, in_f // 2), generator=g, device=g.device, dtype=torch.int32)
    gain = OUTPUT_PROJECTION_GAIN if spec.name.endswith(".w2.weight") else 1.0
    e0 = round(math.log2(gain / math.sqrt(in_f) / (_FP4_CODE_RMS * math.sqrt(1.75))))
    offset = torch.randint(-1, 2, (out_f, in_f // TILE), generator=g, device=g.device, dtype=torch.int32)
    return table[draws], ue8m0_from_exponent(offset + e0)


_FP4_PAIR_TABLES: dict[torch.device, Tensor] = {}


def torch_generator(seed: int, name: str, device: torch.device) -> torch.Generator:
    """torch generator of one tensor on `device`, seeded from `tensor_seed` (63 bits)."""
    g = torch.Generator(device=device)
    g.manual_seed(tensor_seed(seed, name) & ((1 << 63) - 1))
    return g


def stored_tensors(spec: TensorSpec, cfg: DeepseekV41Config, seed: int,
                   device: torch.device | None = None) -> list[tuple[str, Tensor]]:
    """The stored tensors of one logical tensor (weight, then `.scale` where quantised). Without
    `device`: numpy streams on the host (byte-identical checkpoints); with it: the same rules
    drawn by a torch generator on `device` (same distributions, other values; the dummy load)."""
    g = _generator(seed, spec.name) if device is None else torch_generator(seed, spec.name, torch.device(device))
    if spec.kind is Kind.FP4:
        packed, scale = _random_mxfp4(spec, g) if device is None else _random_mxfp4_torch(spec, g)
        return [(spec.name, packed), (spec.scale_name, scale)]  # type: ignore[list-item]
    value = logical_value(spec, cfg, g)
    if spec.kind is Kind.BF16:
        return [(spec.name, value.to(torch.bfloat16))]
    if spec.kind is Kind.FP32:
        return [(spec.name, value.contiguous())]
    quantize = quantize_fp8_block if spec.kind is Kind.FP8 else quantize_engram_rows
    w, scale = quantize(value)
    return [(spec.name, w), (spec.scale_name, scale)]  # type: ignore[list-item]


def random_tensors(cfg: DeepseekV41Config, seed: int) -> Iterator[tuple[str, Tensor]]:
    """Every stored tensor of `cfg`'s checkpoint, in inventory order, exactly as `make_checkpoint`
    writes them for `seed` (vision / DSpark included as the config defines them)."""
    for spec in tensor_inventory(cfg):
        yield from stored_tensors(spec, cfg, seed)


# ---------------------------------------------------------------------------------------------
# Config + tokenizer per preset
# ---------------------------------------------------------------------------------------------
def _engram_rows(t: dict[str, Any]) -> list[int]:
    from ..engram_hash import engram_primes, engram_table_rows

    primes = engram_primes(t["engram_vocab_size"], t["engram_n_heads"], t["engram_max_ngram_size"],
                           len(t["engram_layer_ids"]))
    return engram_table_rows(primes)


def slice_config_dict(layers: int | None, engram_rows: int | None,
                      compressed_vocab: int | None = None) -> dict[str, Any]:
    """`presets.slice_config_dict` with `engram_num_embeddings` from the Engram prime layout and,
    if given, `engram_compressed_vocab_size` (otherwise it keeps the preset's value until the
    slice tokenizer has been written and measured)."""
    from .. import presets

    kw: dict[str, int] = {}
    if layers is not None:
        kw["layers"] = layers
    if engram_rows is not None:
        kw["engram_rows"] = engram_rows
    d = presets.slice_config_dict(**kw)
    t = d["text_config"]
    t["engram_num_embeddings"] = _engram_rows(t)
    if compressed_vocab is not None:
        t["engram_compressed_vocab_size"] = int(compressed_vocab)
    return d


def write_tokenizer_and_config(preset: str, out: Path, *, layers: int | None,
                               engram_rows: int | None) -> DeepseekV41Config:
    """Write the preset's tokenizer files and `config.json` into `out`; return the parsed config."""
    from .. import presets

    if preset in TINY_PRESETS:
        if layers is not None or engram_rows is not None:
            raise ValueError("--layers / --engram-rows apply to the slice preset only")
        build_tiny_tokenizer(out)
        make_dict = presets.tiny_config_dict if preset == "tiny" else presets.tiny_tp8_config_dict
        d = make_dict(engram_compressed_vocab_size(out))
        t = d["text_config"]
        if _engram_rows(t) != list(t["engram_num_embeddings"]):
            raise ValueError(f"{preset} preset engram_num_embeddings {t['engram_num_embeddings']} disagree with the "
                             f"Engram prime layout {_engram_rows(t)}")
        if (d["image_token_id"], t["dspark_noise_token_id"], t["vocab_size"]) != (1000, 999, 1024):
            raise ValueError(f"{preset} preset ids disagree with the tiny tokenizer layout (image 1000, mask 999, 1024 ids)")
    elif preset == "slice":
        d = slice_config_dict(layers, engram_rows)
        t = d["text_config"]
        build_tokenizer(out, vocab_size=t["vocab_size"], mask_token_id=t["dspark_noise_token_id"],
                        image_token_id=d["image_token_id"])
        t["engram_compressed_vocab_size"] = engram_compressed_vocab_size(out)
    else:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    cfg = DeepseekV41Config.from_dict(d)
    (out / "config.json").write_text(json.dumps(d, indent=2) + "\n", encoding="utf-8")
    return cfg


# ---------------------------------------------------------------------------------------------
# Sharded writer
# ---------------------------------------------------------------------------------------------
def plan_shards(specs: list[TensorSpec], max_shard_bytes: int) -> list[list[TensorSpec]]:
    """Greedy, order-preserving shard plan; a weight and its scale always share a shard."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        nbytes = sum(st.nbytes for st in spec.stored())
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    return shards


def shard_file_name(index: int, count: int) -> str:
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def _clear_previous(out: Path, overwrite: bool) -> None:
    ours = [p for p in out.iterdir() if p.name in ("config.json", INDEX_FILE, "model.safetensors", *_TOKENIZER_FILES)
            or (p.name.startswith("model-") and p.name.endswith(".safetensors"))]
    if ours and not overwrite:
        raise FileExistsError(f"{out} already holds checkpoint files ({', '.join(sorted(p.name for p in ours)[:4])} …); "
                              "pass overwrite=True / --overwrite to replace them")
    for p in ours:
        p.unlink()


def make_checkpoint(preset: str, out: Path, seed: int, *, layers: int | None = None,
                    engram_rows: int | None = None, progress: bool = True,
                    max_shard_bytes: int | None = None, overwrite: bool = False) -> Path:
    """Write a synthetic `preset` checkpoint (tiny | tiny-tp8 | slice) for `seed` into `out`; return `out`."""
    from safetensors.torch import save_file
    from tqdm import tqdm

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    if preset in TINY_PRESETS and (layers is not None or engram_rows is not None):
        raise ValueError("--layers / --engram-rows apply to the slice preset only")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    _clear_previous(out, overwrite)
    cfg = write_tokenizer_and_config(preset, out, layers=layers, engram_rows=engram_rows)
    specs = tensor_inventory(cfg)
    shards = plan_shards(specs, max_shard_bytes or DEFAULT_SHARD_BYTES[preset])
    total = sum(st.nbytes for spec in specs for st in spec.stored())
    weight_map: dict[str, str] = {}
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"make-checkpoint {preset}", disable=not progress) as bar:
        for i, shard in enumerate(shards):
            fname = shard_file_name(i, len(shards))
            tensors: dict[str, Tensor] = {}
            for spec in shard:
                for name, t in stored_tensors(spec, cfg, seed):
                    tensors[name] = t
                    weight_map[name] = fname
                bar.update(sum(st.nbytes for st in spec.stored()))
            save_file(tensors, str(out / fname), metadata={"format": "pt"})
            del tensors
    index = {"metadata": {"total_size": total, GENERATOR_METADATA_KEY: GENERATOR_VERSION},
             "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    return out


def make_config_dir(preset: str, out: Path, *, layers: int | None = None, engram_rows: int | None = None,
                    overwrite: bool = False) -> Path:
    """`preset`'s tokenizer files and `config.json` only, no tensors: the model directory of a
    `--load-format dummy` server (`runtime/dummy_weights.py` generates the weights)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    _clear_previous(out, overwrite)
    write_tokenizer_and_config(preset, out, layers=layers, engram_rows=engram_rows)
    return out


def generator_version(path: Path) -> int | None:
    """The `GENERATOR_VERSION` recorded in a synthetic checkpoint's index (None: not ours / older
    than version 2, or no index)."""
    index = Path(path) / INDEX_FILE
    if not index.is_file():
        return None
    value = (json.loads(index.read_text(encoding="utf-8")).get("metadata") or {}).get(GENERATOR_METADATA_KEY)
    return int(value) if value is not None else None


def cli(argv: list[str]) -> int:
    """`sglang-dsv41 make-checkpoint --preset tiny|tiny-tp8|slice --out DIR --seed N [--layers L] [--engram-rows R]
    [--config-only]`."""
    ap = argparse.ArgumentParser(prog="sglang-dsv41 make-checkpoint",
                                 description="Write a synthetic DeepSeek-V4.1 checkpoint in the released format.")
    ap.add_argument("--preset", required=True, choices=PRESETS)
    ap.add_argument("--out", required=True, type=Path, help="output directory")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=None, help="slice: number of main layers (default 22)")
    ap.add_argument("--engram-rows", type=int, default=None, help="slice: approximate rows per Engram table")
    ap.add_argument("--shard-size-mb", type=float, default=None, help="maximum shard size in MiB")
    ap.add_argument("--overwrite", action="store_true", help="replace checkpoint files already in --out")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    ap.add_argument("--config-only", action="store_true",
                    help="write config.json + tokenizer only (for --load-format dummy servers)")
    a = ap.parse_args(argv)
    if a.config_only:
        try:
            out = make_config_dir(a.preset, a.out, layers=a.layers, engram_rows=a.engram_rows, overwrite=a.overwrite)
        except (ValueError, FileExistsError) as e:
            print(f"make-checkpoint: {e}", file=sys.stderr)
            return 1
        print(f"wrote {out}: config.json + tokenizer, no tensors (serve with --load-format dummy)")
        return 0
    shard_bytes = None if a.shard_size_mb is None else max(1, int(a.shard_size_mb * (1 << 20)))
    try:
        out = make_checkpoint(a.preset, a.out, a.seed, layers=a.layers, engram_rows=a.engram_rows,
                              progress=not a.quiet, max_shard_bytes=shard_bytes, overwrite=a.overwrite)
    except (ValueError, FileExistsError) as e:
        print(f"make-checkpoint: {e}", file=sys.stderr)
        return 1
    index = json.loads((out / INDEX_FILE).read_text())
    n_files = len(set(index["weight_map"].values()))
    print(f"wrote {out}: {len(index['weight_map'])} tensors in {n_files} shards, "
          f"{index['metadata']['total_size'] / (1 << 20):.1f} MiB")
    return 0

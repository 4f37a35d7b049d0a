"""Valid random weights for SGLang's `--load-format dummy` (issue 21 item 3; docs/performance.md
"Full-width dummy server").

SGLang's dummy loader builds the model, fills every floating parameter with U(−1e-3, 1e-3) (the
same values for every parameter of one size) and calls `post_load_weights` without ever calling
`load_weights`. For this model that would leave FP8 tiles without meaningful scales, MXFP4 codes
and UE8M0 scales at their placeholder bytes, and a router whose logits are all equal, so every
token picks the same experts. Instead, `post_load_weights` of the target (`runtime/model.py`) and
of the DSpark draft (`runtime/dspark_model.py`) stream `dummy_stored_tensors` through their own
`load_weights`:

* every stored tensor of the inventory in its stored dtype and shape (FP8 E4M3 + 32×32 UE8M0 tile
  scales, packed MXFP4 + per-32 UE8M0 scales, Engram E4M3 rows + scales, BF16 / FP32 plain), by the
  value rules of `checkpoint/synth.py` (linear weights N(0, 1/fan_in), router logits O(1), biases
  ≈ 0: routing spreads over the experts, `runtime/routing_spread.py` measures it);
* drawn by a per-tensor torch generator on the model's device (the GPU when serving on CUDA), one
  tensor at a time: no host copy, peak extra memory one logical tensor in fp32;
* so every check and conversion of a real load (inventory, dtype, shape, TP slicing, MXFP4 kernel
  layout, Engram placement) runs unchanged.

Seed: `DUMMY_SEED` (0), or `SGLANG_DSV41_DUMMY_SEED`; per tensor `synth.tensor_seed`. Not SGLang's
`--random-seed`: SGLang draws that at random per launch when unset, and two servers that must hold
the same weights (a restart reading L3 KV, PD prefill and decode) would then differ.
"""
from __future__ import annotations

import os
from typing import Iterable, Iterator

import torch
from torch import Tensor

from ..checkpoint.loader import ACCEPTED_TORCH_DTYPES
from ..checkpoint.names import TensorSpec, tensor_inventory
from ..checkpoint.synth import stored_tensors
from ..config import DeepseekV41Config

DUMMY_SEED = 0
DUMMY_SEED_ENV = "SGLANG_DSV41_DUMMY_SEED"


def dummy_load_requested(*, draft: bool = False) -> bool:
    """True when SGLang loads this model with `--load-format dummy` (for the DSpark draft:
    `--speculative-draft-load-format`, else the target's format)."""
    from sglang.srt.server_args import get_global_server_args

    args = get_global_server_args()
    fmt = (getattr(args, "speculative_draft_load_format", None) if draft else None) or getattr(args, "load_format", None)
    return str(fmt) == "dummy"


def dummy_seed() -> int:
    """`SGLANG_DSV41_DUMMY_SEED` when set (an integer, else ValueError), else `DUMMY_SEED`: the same
    in every server and every launch (module doc)."""
    raw = os.environ.get(DUMMY_SEED_ENV, "").strip()
    if not raw:
        return DUMMY_SEED
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{DUMMY_SEED_ENV}={raw!r}: expected an integer") from None


def dummy_stored_tensors(cfg: DeepseekV41Config, device: torch.device | str, *, seed: int = DUMMY_SEED,
                         specs: Iterable[TensorSpec] | None = None) -> Iterator[tuple[str, Tensor]]:
    """(name, stored tensor) on `device` for every logical tensor of `specs` (default: the text
    model's inventory), in order, generated lazily (module doc)."""
    device = torch.device(device)
    if specs is None:
        specs = tensor_inventory(cfg, vision=False, dspark=False)
    with torch.no_grad():
        for spec in specs:
            yield from stored_tensors(spec, cfg, seed, device=device)


def meta_stored_tensors(specs: Iterable[TensorSpec]) -> Iterator[tuple[str, Tensor]]:
    """(name, meta tensor) of each stored tensor of `specs`: dtype and shape without data, for
    inventory checks of tensors the reader does not use (the draft checks the whole checkpoint
    but reads only `mtp.*`)."""
    for spec in specs:
        for st in spec.stored():
            yield st.name, torch.empty(st.shape, dtype=ACCEPTED_TORCH_DTYPES[st.dtype][0], device="meta")

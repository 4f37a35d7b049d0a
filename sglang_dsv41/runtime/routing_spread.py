"""Distinct routed experts per step under the dummy weights (issue 21 item 3).

How many experts a decode step reads sets its MoE weight bytes, so a benchmark on random weights
is only meaningful if routing spreads about as real routing does. Reference point: top-k over `E`
experts chosen independently and uniformly per token touches, for `T` tokens,
`uniform_distinct(T, E, k) = E · (1 − (1 − k/E)^T)` distinct experts (real routing, load-balanced
by the noaux bias, is close to that; skew only lowers it).

`dummy_router_spread(cfg, device)` measures the router of `runtime/dummy_weights.py` per MoE layer:
the layer's dummy `gate.weight` / `gate.bias` applied (spec §3.6: sqrt-softplus scores, top-k of
score + bias) to RMS-normalised dummy embedding rows of random token ids — the embedding is what
dominates every layer's FFN input in the dummy model (residual-writing projections carry gain
1/64, `checkpoint/synth.py`). Reported per batch size: distinct experts (mean over layers and
draws), the uniform expectation and their ratio.

    python -m sglang_dsv41.runtime.routing_spread CONFIG_DIR [--device cuda] [--batches 1 16 64]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch import Tensor

from ..checkpoint.names import TensorSpec, tensor_inventory
from ..checkpoint.synth import stored_tensors
from ..config import DeepseekV41Config
from .moe_ops import sqrt_softplus

F32 = torch.float32


def distinct_experts(topk_ids: Tensor) -> int:
    """Distinct expert ids in `topk_ids` [T, k] (−1 = none, ignored)."""
    ids = topk_ids[topk_ids >= 0]
    return int(ids.unique().numel())


def uniform_distinct(tokens: int, n_experts: int, top_k: int) -> float:
    """Expected distinct experts of `tokens` tokens each picking `top_k` of `n_experts` uniformly."""
    return n_experts * (1.0 - (1.0 - top_k / n_experts) ** tokens)


def route_topk(x: Tensor, gate_weight: Tensor, bias: Tensor, top_k: int) -> Tensor:
    """Top-k expert ids [T, k] of spec §3.6's router (selection on sqrt-softplus score + bias)."""
    scores = sqrt_softplus(x.to(F32) @ gate_weight.to(F32).t(), F32)
    return torch.topk(scores + bias.to(F32), top_k, dim=-1).indices


def _value(spec: TensorSpec, cfg: DeepseekV41Config, seed: int, device: torch.device) -> Tensor:
    (_, t), = stored_tensors(spec, cfg, seed, device=device)       # BF16 / FP32 plain tensors
    return t.to(F32)


def dummy_router_spread(cfg: DeepseekV41Config, device: torch.device | str = "cpu", *, seed: int = 0,
                        batches: tuple[int, ...] = (1, 8, 16, 64, 256), draws: int = 4) -> dict:
    """Distinct experts per step of the dummy routers (module doc)."""
    device = torch.device(device)
    t = cfg.text
    specs = {s.name: s for s in tensor_inventory(cfg, vision=False, dspark=False)}
    embed = _value(specs["embed.weight"], cfg, seed, device)
    layers = [i for i in range(t.num_hidden_layers) if f"layers.{i}.ffn.gate.weight" in specs]
    gates = [(_value(specs[f"layers.{i}.ffn.gate.weight"], cfg, seed, device),
              _value(specs[f"layers.{i}.ffn.gate.bias"], cfg, seed, device)) for i in layers]
    g = torch.Generator(device=device)
    g.manual_seed(seed + 1)
    rows = []
    for n in batches:
        counts = []
        for _ in range(draws):
            ids = torch.randint(0, t.vocab_size, (n,), generator=g, device=device)
            x = embed[ids]
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
            counts += [distinct_experts(route_topk(x, w, b, t.num_experts_per_tok)) for w, b in gates]
        mean = sum(counts) / len(counts)
        expect = uniform_distinct(n, t.n_routed_experts, t.num_experts_per_tok)
        rows.append({"tokens": n, "distinct_experts": mean, "min": min(counts), "uniform_expectation": expect,
                     "ratio": mean / expect})
    return {"n_routed_experts": t.n_routed_experts, "top_k": t.num_experts_per_tok, "moe_layers": layers,
            "draws": draws, "seed": seed, "per_batch": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config_dir", type=Path, help="directory with config.json")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16, 64, 256])
    ap.add_argument("--out", type=Path, help="write the JSON here too")
    a = ap.parse_args(argv)
    cfg = DeepseekV41Config.from_file(a.config_dir)
    res = dummy_router_spread(cfg, a.device, seed=a.seed, batches=tuple(a.batches))
    text = json.dumps(res, indent=2)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

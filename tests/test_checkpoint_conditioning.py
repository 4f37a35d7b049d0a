"""Conditioning of the tiny random checkpoint (`checkpoint.synth`, spec `model.md` §3, §7).

A GPU path whose attention output is within one BF16 ulp of the reference can only match the
reference's logits and greedy tokens if the model does not amplify such differences. This
module measures that on the real tiny checkpoint with the pure-PyTorch `ReferenceModel`:

* **injection**: every attention sublayer output y (after wo_b, BF16 values) of the chosen
  layers is nudged by one BF16 ulp with a random sign per element (`bf16_ulp_nudge`), through a
  wrapper around `reference.attention.attention_sublayer` — the reference code is not changed;
* **propagation**: the residual R after every hyper-connection update (a wrapper around
  `reference.model.hc_residual_update`) and the logits are compared with an unperturbed run.
  rel(k) = ‖ΔR_k‖ / ‖R_k‖ after sublayer k; the amplification of layer i is
  rel(after layer i) / rel(after layer i−1) for a one-ulp injection in an earlier layer;
* **liveness**: the same wrappers record routing, indexer scores, attention probabilities and
  Engram updates, so a well-conditioned checkpoint is also shown to use every path (routing
  spreads over experts, indexer top-k not decided by ties, attention neither uniform nor all on
  the sink, Engram changes the residual, greedy text is not a constant token).

Run as a script for the report: `python tests/test_checkpoint_conditioning.py [CKPT_DIR]`.
"""
from __future__ import annotations

import contextlib
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import pytest
import torch
from torch import Tensor

from sglang_dsv41.reference import attention as attention_mod
from sglang_dsv41.reference import indexer as indexer_mod
from sglang_dsv41.reference import model as model_mod
from sglang_dsv41.reference import moe as moe_mod
from sglang_dsv41.reference.model import ReferenceModel

PROMPT = ("The quick brown fox jumps over the lazy dog. It was a sunny day, and the children "
          "played in the park while their parents talked about the weather and the news.")

# Acceptance bounds (the GPU test compares logits and 64 greedy steps). Measured on the
# generator-version-2 tiny checkpoint (seed 0): amplification 1.45, all-layer max |Δlogit| 0.071
# (version 1: 1.96 and 8.3). The amplification of a *sub-ulp* residual perturbation is mostly
# BF16 re-rounding of the residual and FP4/FP8 rounding flips, which no weight scale removes;
# the floor of max |Δlogit| (every routing/indexer decision frozen) is ≈ 0.03.
MAX_LAYER_AMPLIFICATION = 1.6     # geometric-mean growth of a one-ulp perturbation per layer
MAX_ALL_LAYER_LOGIT_DELTA = 0.1   # max |Δlogit| with a one-ulp nudge in every attention sublayer


# ---------------------------------------------------------------------------------------------
# Instrumentation
# ---------------------------------------------------------------------------------------------
def bf16_ulp_nudge(y: Tensor, gen: torch.Generator) -> Tensor:
    """y (BF16 values in fp32) moved one BF16 ulp up or down (random sign per element, zeros
    kept): the bit pattern ±1, so the result is the neighbouring BF16 value."""
    bits = y.to(torch.bfloat16).view(torch.int16).to(torch.int32)
    step = torch.randint(0, 2, y.shape, generator=gen).to(torch.int32) * 2 - 1
    step = torch.where(bits & 0x7FFF == 0, torch.zeros_like(step), step)
    nudged = (bits + step).to(torch.int16).view(torch.bfloat16).to(torch.float32)
    return nudged.to(y.dtype)


@dataclass
class Trace:
    """What one instrumented forward recorded (all per call, in call order)."""

    residuals: list[Tensor] = field(default_factory=list)        # R after each hc update
    experts: list[Tensor] = field(default_factory=list)          # [T, k] routed experts per MoE
    index_topk: list[tuple[Tensor, Tensor, int]] = field(default_factory=list)  # scores, allowed, k
    attention: list[tuple[Tensor, Tensor]] = field(default_factory=list)       # key probs, sink prob
    engram: list[tuple[Tensor, Tensor]] = field(default_factory=list)          # R before, after


def _attention_probs(q: Tensor, keys: Tensor, sink: Tensor, valid: Tensor | None) -> tuple[Tensor, Tensor]:
    """(probabilities over valid keys [T, heads, S] excluding the sink, sink probability [T, heads])."""
    T, S, D = keys.shape
    logits = torch.einsum("thd,tsd->ths", q.double(), keys.double()) / math.sqrt(D)
    if valid is not None:
        logits = torch.where(valid[:, None, :], logits, -torch.inf)
    full = torch.cat((logits, sink.double()[None, :, None].expand(T, -1, 1)), dim=2).softmax(dim=2)
    return full[..., :S], full[..., S]


@contextlib.contextmanager
def instrumented(trace: Trace, nudge_layers: set[int] = frozenset(), seed: int = 0) -> Iterator[None]:
    """Wrap the reference's sublayer entry points (module attributes, restored on exit)."""
    gen = torch.Generator().manual_seed(seed)
    orig = {
        "attn": attention_mod.attention_sublayer, "attend": attention_mod.attend_with_sink,
        "update": model_mod.hc_residual_update, "engram": model_mod.engram_residual_update,
        "route": moe_mod.route, "topk": indexer_mod.top_k_lower_index_on_ties,
    }

    def attention_sublayer(cfg, role, w, layer, x, *args, **kwargs):  # type: ignore[no-untyped-def]
        y = orig["attn"](cfg, role, w, layer, x, *args, **kwargs)
        return bf16_ulp_nudge(y, gen) if layer in nudge_layers else y

    def attend_with_sink(q, keys, sink, valid=None):  # type: ignore[no-untyped-def]
        trace.attention.append(_attention_probs(q, keys, sink, valid))
        return orig["attend"](q, keys, sink, valid)

    def hc_residual_update(R, y, co):  # type: ignore[no-untyped-def]
        out = orig["update"](R, y, co)
        trace.residuals.append(out)
        return out

    def engram_residual_update(R, *args, **kwargs):  # type: ignore[no-untyped-def]
        out = orig["engram"](R, *args, **kwargs)
        trace.engram.append((R, out))
        return out

    def route(*args, **kwargs):  # type: ignore[no-untyped-def]
        r = orig["route"](*args, **kwargs)
        trace.experts.append(r.experts)
        return r

    def top_k(scores, allowed, k):  # type: ignore[no-untyped-def]
        trace.index_topk.append((scores, allowed, k))
        return orig["topk"](scores, allowed, k)

    patches = [(attention_mod, "attention_sublayer", attention_sublayer),
               (attention_mod, "attend_with_sink", attend_with_sink),
               (model_mod, "hc_residual_update", hc_residual_update),
               (model_mod, "engram_residual_update", engram_residual_update),
               (moe_mod, "route", route), (indexer_mod, "top_k_lower_index_on_ties", top_k)]
    saved = [(mod, name, getattr(mod, name)) for mod, name, _ in patches]
    try:
        for mod, name, fn in patches:
            setattr(mod, name, fn)
        yield
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)


def run(model: ReferenceModel, ids: list[int], nudge_layers: set[int] = frozenset(),
        seed: int = 0) -> tuple[Tensor, Trace]:
    """Prefill `ids` in one forward with instrumentation; returns (logits [T, vocab], trace)."""
    trace = Trace()
    with instrumented(trace, nudge_layers, seed):
        logits = model.forward(model.new_request(), ids).logits
    return logits, trace


# ---------------------------------------------------------------------------------------------
# Measurements
# ---------------------------------------------------------------------------------------------
def _rel(a: Tensor, b: Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@dataclass(frozen=True)
class Propagation:
    """One-ulp injection at one layer: relative residual deviation after every later layer."""

    layer: int
    rel_after_layer: list[float]   # index i: after layer i's ffn update (0 before the injection)
    max_logit_delta: float


def propagate(model: ReferenceModel, ids: list[int], base: tuple[Tensor, Trace], layer: int,
              seed: int = 0) -> Propagation:
    base_logits, base_trace = base
    logits, trace = run(model, ids, {layer}, seed)
    n = len(model.roles)
    rel = [_rel(trace.residuals[2 * i + 1], base_trace.residuals[2 * i + 1]) for i in range(n)]
    return Propagation(layer, rel, float((logits - base_logits).abs().max()))


def layer_amplification(props: list[Propagation]) -> dict[int, float]:
    """Per layer i: geometric mean over injections at layers L < i of rel(i) / rel(i−1)."""
    ratios: dict[int, list[float]] = {}
    for p in props:
        for i in range(p.layer + 1, len(p.rel_after_layer)):
            prev, cur = p.rel_after_layer[i - 1], p.rel_after_layer[i]
            if prev > 0:
                ratios.setdefault(i, []).append(math.log(max(cur, 1e-30) / prev))
    return {i: math.exp(sum(v) / len(v)) for i, v in sorted(ratios.items())}


def mean_amplification(props: list[Propagation]) -> float:
    """Geometric mean per-layer growth from just after the injection to the last layer."""
    logs, layers = 0.0, 0
    for p in props:
        last = len(p.rel_after_layer) - 1
        if p.layer < last and p.rel_after_layer[p.layer] > 0:
            logs += math.log(max(p.rel_after_layer[last], 1e-30) / p.rel_after_layer[p.layer])
            layers += last - p.layer
    return math.exp(logs / layers)


def all_layer_logit_delta(model: ReferenceModel, ids: list[int], base_logits: Tensor, seeds: range) -> float:
    """max |Δlogit| with every attention sublayer nudged by one ulp, worst over `seeds`."""
    every = set(range(len(model.roles)))
    return max(float((run(model, ids, every, s)[0] - base_logits).abs().max()) for s in seeds)


@dataclass(frozen=True)
class Liveness:
    """Evidence that the checkpoint uses every path (see the module doc)."""

    experts_used_min: int           # fewest distinct routed experts used by any MoE layer
    expert_share_max: float         # largest share of one expert in any MoE layer's routing slots
    index_tie_fraction: float       # queries (more visible than top-k) whose k-th/(k+1)-th scores tie
    attention_max_prob: float       # mean over queries/heads of the largest key probability × #keys
    sink_prob_mean: float           # mean sink probability
    engram_rel_update_min: float    # smallest ‖Engram(R) − R‖ / ‖R‖ over Engram layers
    context_logit_delta: float      # max |Δlogit| at the last token when only earlier tokens differ
    greedy_distinct: int            # distinct tokens in a 32-token greedy generation


def liveness(model: ReferenceModel, ids: list[int], trace: Trace) -> Liveness:
    n_experts = model.text.n_routed_experts
    used, shares = [], []
    for experts in trace.experts:
        counts = torch.bincount(experts.flatten(), minlength=n_experts)
        used.append(int((counts > 0).sum()))
        shares.append(float(counts.max() / counts.sum()))
    ties = queries = 0
    for scores, allowed, k in trace.index_topk:
        for t in range(scores.shape[0]):
            visible = scores[t][allowed[t]]
            if visible.numel() > k:
                top = visible.sort(descending=True).values
                queries += 1
                ties += bool(top[k - 1] == top[k])
    peaks, sinks = [], []
    for probs, sink in trace.attention:
        n_keys = (probs > 0).sum(dim=-1).clamp(min=1)
        peaks.append((probs.amax(dim=-1) * n_keys).flatten())
        sinks.append(sink.flatten())
    engram = [_rel(after, before) for before, after in trace.engram]
    other = model.tokenizer.encode("Yesterday seven purple engines sang loudly near a frozen river and")
    a = model.forward(model.new_request(), ids + ids[-1:]).logits[-1]
    b = model.forward(model.new_request(), other + ids[-1:]).logits[-1]
    greedy = model.generate(ids, 32)
    return Liveness(min(used), max(shares), ties / max(queries, 1), float(torch.cat(peaks).mean()),
                    float(torch.cat(sinks).mean()), min(engram), float((a - b).abs().max()), len(set(greedy)))


def report(model: ReferenceModel, ids: list[int]) -> str:
    base = run(model, ids)
    props = [propagate(model, ids, base, layer) for layer in range(len(model.roles))]
    lines = ["layer  rel. deviation after each layer (one-ulp nudge at this layer's attention)   max|Δlogit|"]
    for p in props:
        cells = " ".join(f"{r:8.1e}" if i >= p.layer else " " * 8 for i, r in enumerate(p.rel_after_layer))
        lines.append(f"{p.layer:5d}  {cells}   {p.max_logit_delta:.4f}")
    amp = layer_amplification(props)
    lines.append("per-layer amplification: " + ", ".join(f"L{i} {a:.2f}" for i, a in amp.items()))
    lines.append(f"geometric-mean amplification per layer: {mean_amplification(props):.3f}")
    lines.append(f"max |Δlogit|, one-ulp nudge in every attention sublayer (3 draws): "
                 f"{all_layer_logit_delta(model, ids, base[0], range(3)):.4f}")
    lines.append(f"logit std {float(base[0].std()):.3f}")
    lines.append(str(liveness(model, ids, base[1])))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model(tiny_checkpoint: Path) -> ReferenceModel:
    return ReferenceModel.from_checkpoint(tiny_checkpoint)


@pytest.fixture(scope="module")
def prompt(model: ReferenceModel) -> list[int]:
    return model.tokenizer.encode(PROMPT)


@pytest.fixture(scope="module")
def baseline(model: ReferenceModel, prompt: list[int]) -> tuple[Tensor, Trace]:
    return run(model, prompt)


def test_ulp_nudge_moves_every_nonzero_value_by_one_bf16_step() -> None:
    y = torch.tensor([1.0, -1.0, 0.0, 3.0e-3, -7.5, 1.0e4]).to(torch.bfloat16).float()
    nudged = bf16_ulp_nudge(y, torch.Generator().manual_seed(1))
    for a, b in zip(y.tolist(), nudged.tolist()):
        if a == 0.0:
            assert b == 0.0
            continue
        up = torch.nextafter(torch.tensor(a).bfloat16(), torch.tensor(math.inf).bfloat16()).item()
        down = torch.nextafter(torch.tensor(a).bfloat16(), torch.tensor(-math.inf).bfloat16()).item()
        assert b in (up, down) and b != a


def test_instrumentation_is_transparent(model: ReferenceModel, prompt: list[int],
                                        baseline: tuple[Tensor, Trace]) -> None:
    logits, trace = baseline
    assert torch.equal(logits, model.forward(model.new_request(), prompt).logits)
    assert attention_mod.attention_sublayer.__module__ == attention_mod.__name__   # restored
    n = len(model.roles)
    assert len(trace.residuals) == 2 * n and len(trace.experts) == n
    assert len(trace.engram) == len(model.text.engram_layer_ids)


def test_one_ulp_attention_perturbations_stay_small(model: ReferenceModel, prompt: list[int],
                                                    baseline: tuple[Tensor, Trace]) -> None:
    props = [propagate(model, prompt, baseline, layer) for layer in range(len(model.roles))]
    assert all(0 < p.rel_after_layer[p.layer] for p in props)      # the nudge reached the residual
    assert all(r == 0 for p in props for r in p.rel_after_layer[:p.layer])
    assert mean_amplification(props) <= MAX_LAYER_AMPLIFICATION, report(model, prompt)
    delta = all_layer_logit_delta(model, prompt, baseline[0], range(2))
    assert 0 < delta <= MAX_ALL_LAYER_LOGIT_DELTA, report(model, prompt)


def test_conditioned_checkpoint_still_uses_every_path(model: ReferenceModel, prompt: list[int],
                                                      baseline: tuple[Tensor, Trace]) -> None:
    live = liveness(model, prompt, baseline[1])
    assert live.experts_used_min >= model.text.n_routed_experts - 2, live     # routing spreads
    assert live.expert_share_max <= 0.5, live
    assert live.index_tie_fraction <= 0.5, live                             # top-k not decided by ties
    assert live.attention_max_prob >= 1.5, live                             # not uniform attention
    assert 0.01 <= live.sink_prob_mean <= 0.9, live                         # the sink matters
    assert live.engram_rel_update_min >= 0.05, live                         # Engram contributes
    assert live.context_logit_delta >= 0.25, live                           # earlier tokens matter
    assert live.greedy_distinct >= 8, live                                  # not a constant token


def test_tiny_cache_is_rebuilt_for_another_generator_version(tmp_path: Path) -> None:
    import json

    from sglang_dsv41.checkpoint.synth import GENERATOR_METADATA_KEY, GENERATOR_VERSION, INDEX_FILE, generator_version
    from sglang_dsv41.serve import tiny_checkpoint

    made = tiny_checkpoint(0, tmp_path)
    assert generator_version(made) == GENERATOR_VERSION
    index = json.loads((made / INDEX_FILE).read_text())
    del index["metadata"][GENERATOR_METADATA_KEY]                 # as a version-1 cache looked
    (made / INDEX_FILE).write_text(json.dumps(index))
    stale_shard = next(made.glob("model-*.safetensors"))
    stale_shard.write_bytes(b"stale")
    again = tiny_checkpoint(0, tmp_path)
    assert again == made and generator_version(again) == GENERATOR_VERSION
    assert stale_shard.stat().st_size > 5
    assert sorted(p.name for p in tmp_path.iterdir()) == [made.name]      # no leftovers


if __name__ == "__main__":
    torch.set_num_threads(1)
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else None
    if path is None:
        from sglang_dsv41.serve import tiny_checkpoint
        path = tiny_checkpoint(0)
    m = ReferenceModel.from_checkpoint(path)
    print(report(m, m.tokenizer.encode(PROMPT)))

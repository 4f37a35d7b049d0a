"""Independent work forked to a side stream (`runtime/overlap.py`, issue 21 item 2) — CPU checks.

* SGLANG_DSV41_OVERLAP: `on` (default) and `off`; an unknown value raises; a CPU model never gets
  a side stream; `for_tokens` forks only forwards of at most OVERLAP_MAX_TOKENS tokens;
* INLINE runs a forked call at once;
* the wiring, with a recording stand-in for the side stream on the CPU tiny model: each decoder
  layer forks its two mHC coefficient calls and joins each before its residual update, the
  attention forks its query heads and joins them before the attention kernel, every
  Engram layer's rows are forked when the forward starts (TP 1) and joined by that layer, nothing
  is left unjoined after `join_all`, and the logits equal the inline forward's bit for bit.

The CUDA side stream (eager and CUDA-graph replay equal to the inline forward, the shared expert
forked in the CUDA MoE) is pinned by tests/test_runtime_overlap_gpu.py.
"""
from __future__ import annotations

import pytest
import torch

from runtime_scenarios import one_shot_logits, prompt, runtime_engine
from sglang_dsv41.runtime import overlap as OV
from sglang_dsv41.runtime.attention_math import query_heads
from sglang_dsv41.runtime.layers import Engram, HyperConnection

CPU = torch.device("cpu")


def test_choice_from_the_environment(monkeypatch) -> None:
    from sglang_dsv41.runtime.backend import kernel_choice

    monkeypatch.delenv(OV.OVERLAP_ENV, raising=False)
    assert kernel_choice(OV.OVERLAP_ENV, OV.OVERLAP_CHOICES) == "on"          # the default since session 23
    assert OV.side_stream_for(CPU).side is None
    monkeypatch.setenv(OV.OVERLAP_ENV, "on")
    model = OV.side_stream_for(CPU)
    assert model.side is None and model.for_tokens(1) is OV.INLINE          # CPU: no streams
    monkeypatch.setenv(OV.OVERLAP_ENV, "sometimes")
    with pytest.raises(ValueError, match="SGLANG_DSV41_OVERLAP='sometimes'"):
        OV.side_stream_for(CPU)
    with pytest.raises(ValueError, match="expected one of"):
        OV.side_stream_for(CPU, "both")


def test_for_tokens_forks_only_small_forwards() -> None:
    side = Recorder()
    model = OV.ModelOverlap(CPU, side)
    assert model.for_tokens(1) is side and model.for_tokens(OV.OVERLAP_MAX_TOKENS) is side
    assert model.for_tokens(OV.OVERLAP_MAX_TOKENS + 1) is OV.INLINE


def test_inline_runs_at_once() -> None:
    calls = []
    pending = OV.INLINE.fork(lambda a, b: calls.append((a, b)) or a + b, 2, 3)
    assert calls == [(2, 3)] and pending.joined and OV.INLINE.join(pending) == 5


class Recorder:
    """A side stream stand-in: runs each forked call at once (CPU has no streams) and records the
    fork / join order by the kind of call."""

    overlaps = True

    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []
        self.open: list[OV.Pending] = []

    @staticmethod
    def kind(fn) -> str:
        owner = getattr(fn, "__self__", fn)
        if fn is query_heads:
            return "query"
        return "engram" if isinstance(owner, Engram) else "mhc" if isinstance(owner, HyperConnection) else "other"

    def fork(self, fn, *args) -> OV.Pending:
        pending = OV.Pending(fn(*args), args)
        pending.kind = self.kind(fn)
        self.events.append(("fork", pending.kind))
        self.open.append(pending)
        return pending

    def join(self, pending: OV.Pending):
        assert pending in self.open, "joined twice, or never forked"
        self.open.remove(pending)
        self.events.append(("join", pending.kind))
        return pending.result

    def join_all(self) -> None:
        self.events.append(("join_all", ""))
        self.open.clear()


def test_forward_forks_coefficients_and_engram_rows(tiny_checkpoint) -> None:
    engine = runtime_engine(tiny_checkpoint, CPU, deterministic=False)
    tokens = prompt(3, 24)
    inline = one_shot_logits(engine, CPU, tokens)
    side = Recorder()
    engine.overlap = OV.ModelOverlap(CPU, side)
    forked = one_shot_logits(engine, CPU, tokens)
    assert torch.equal(forked, inline)
    layers = engine.text.num_hidden_layers
    engram = len(engine.text.engram_layer_ids)
    assert engram >= 1
    assert side.events[:engram] == [("fork", "engram")] * engram               # at the start of the forward
    mhc = [e for e in side.events if e[1] == "mhc"]
    assert mhc == [("fork", "mhc"), ("join", "mhc")] * (2 * layers)            # each joined before the next fork
    per_layer = [e for e in side.events if e[1] in ("mhc", "query")][:6]
    assert per_layer == [("fork", "mhc"), ("fork", "query"), ("join", "query"), ("join", "mhc"),  # attention
                         ("fork", "mhc"), ("join", "mhc")]                                     # MoE (CPU: inline)
    assert side.events.count(("fork", "query")) == side.events.count(("join", "query")) == layers
    assert ("fork", "other") not in side.events
    assert side.events.count(("join", "engram")) == engram
    assert side.events[-1] == ("join_all", "") and not side.open


def test_large_forwards_run_inline(tiny_checkpoint) -> None:
    engine = runtime_engine(tiny_checkpoint, CPU, deterministic=False)
    side = Recorder()
    engine.overlap = OV.ModelOverlap(CPU, side, max_tokens=8)
    one_shot_logits(engine, CPU, prompt(4, 24))
    assert side.events == []


def test_a_failed_forward_joins_the_side_stream(tiny_checkpoint, monkeypatch) -> None:
    """Work forked before an error is joined before the error propagates (its arguments stay alive
    until then)."""
    engine = runtime_engine(tiny_checkpoint, CPU, deterministic=False)
    side = Recorder()
    engine.overlap = OV.ModelOverlap(CPU, side)

    def broken(x, step, x_quantised=None):
        raise RuntimeError("injected MoE failure")

    monkeypatch.setattr(engine.layers[1].ffn, "forward", broken)
    with pytest.raises(RuntimeError, match="injected MoE failure"):
        one_shot_logits(engine, CPU, prompt(5, 12))
    assert ("fork", "mhc") in side.events and side.events[-1] == ("join_all", "") and not side.open

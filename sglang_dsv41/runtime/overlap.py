"""Independent work of a layer on a second CUDA stream (issue 21, item 2: multi-stream overlap).

At decode a layer is a chain of small kernels, many latency-bound at a few tokens (the mHC
coefficient kernel runs one program for ≈ 20 µs at one token: docs/performance.md "Session 21").
Four pieces of the forward are not read until a known later point:

- the attention's query heads (`attention_math.query_heads`: wq_b and RoPE): read only by the
  attention kernel, after the SWA write, the compressor and the indexer;
- a sublayer's mHC coefficients (`HyperConnection`): the sublayer input takes the previous
  sublayer's lagged `pre` (spec `model.md` §3.2), so the coefficients are first read by the
  residual update after the sublayer;
- the shared expert (`moe_ops`): first read when the routed sum is finalised;
- an Engram layer's table rows (TP 1): their row ids are known when the forward starts.

`SideStream.fork(fn, *args)` runs `fn` with the side stream current, after everything already
queued on the current stream; `join(pending)` makes the current stream wait for the side stream
and returns `fn`'s result. The kernels and their inputs are the same either way, so every output
is bit-identical with and without overlap. A CUDA-graph capture records fork and join as graph
edges (the side stream joins the capture through the event it waits on).

Memory (PyTorch's caching allocator keeps blocks per stream): a `Pending` holds `fn`'s arguments
until its join, so the main stream cannot reuse their blocks while the side stream reads them;
blocks the side stream allocates are reused only by later side-stream work, which every fork
orders after the main stream's queued kernels (those that read the side's results included).
`fn` must read no other short-lived main-stream tensor. `join_all` ends a forward: nothing stays
on the side stream past it (a capture must end joined).

`INLINE` runs `fn` at once on the current stream (CPU, overlap off, large batches): the layers
call fork / join unconditionally. Chosen once per model by `side_stream_for` (SGLANG_DSV41_OVERLAP,
OVERLAP_CHOICES; default `on` since session 23: the whole 4-layer Flash-width decode step 0.88 /
0.90 / 0.94 / 0.98× at 1 / 8 / 64 / 256 tokens on the H200, bit-equal, `benchmarks/model_step.py`,
docs/performance.md "Session 23"), per forward by `for_tokens`: only forwards of at most
OVERLAP_MAX_TOKENS tokens (decode batches), where kernels leave the GPU idle.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

OVERLAP_ENV = "SGLANG_DSV41_OVERLAP"
#: SGLANG_DSV41_OVERLAP values; the first is the default
OVERLAP_CHOICES = ("on", "off")
#: forwards of more tokens run inline: prefill kernels fill the GPU on their own
OVERLAP_MAX_TOKENS = 256


@dataclass(eq=False)
class Pending:
    """A forked call: its result (host values usable at once, device values only after the
    join) and the arguments kept alive until the join."""

    result: Any
    keep_alive: tuple = ()
    joined: bool = False


class InlineStream:
    """No overlap: `fork` runs the call at once on the current stream."""

    overlaps = False

    def fork(self, fn: Callable[..., Any], *args: Any) -> Pending:
        return Pending(fn(*args), joined=True)

    def join(self, pending: Pending) -> Any:
        return pending.result

    def join_all(self) -> None:
        """Nothing runs elsewhere: every inline call finished when it was forked."""


INLINE = InlineStream()


class SideStream:
    """A second stream on `device` for forked calls (module docstring)."""

    overlaps = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def fork(self, fn: Callable[..., Any], *args: Any) -> Pending:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            result = fn(*args)
        return Pending(result, args)

    def join(self, pending: Pending) -> Any:
        if not pending.joined:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
            pending.joined, pending.keep_alive = True, ()
        return pending.result

    def join_all(self) -> None:
        torch.cuda.current_stream(self.device).wait_stream(self.stream)


class ModelOverlap:
    """What a model overlaps: its side stream (or None: never) and the token limit."""

    def __init__(self, device: torch.device, side: SideStream | None, max_tokens: int = OVERLAP_MAX_TOKENS) -> None:
        self.device, self.side, self.max_tokens = device, side, max_tokens

    def for_tokens(self, tokens: int) -> SideStream | InlineStream:
        """The stream a forward of `tokens` tokens forks to: the side stream up to `max_tokens`."""
        return self.side if self.side is not None and tokens <= self.max_tokens else INLINE


def side_stream_for(device: torch.device, choice: str | None = None) -> ModelOverlap:
    """`choice` (default SGLANG_DSV41_OVERLAP, else `on`): `on` gives a CUDA model a side stream;
    on CPU, or `off`, every forward runs inline. An unknown value raises."""
    from .backend import kernel_choice

    chosen = choice if choice is not None else kernel_choice(OVERLAP_ENV, OVERLAP_CHOICES)
    if chosen not in OVERLAP_CHOICES:
        raise ValueError(f"{OVERLAP_ENV}={chosen!r}: expected one of {OVERLAP_CHOICES}")
    return ModelOverlap(device, SideStream(device) if chosen == "on" and device.type == "cuda" else None)

"""Decode steps as SGLang's CUDA-graph runner feeds them, and a host-sync trap — shared by the
CPU and GPU tests of the static (capture-safe) decode forward.

`prefilled(engine, device)`: the four requests of `runtime_scenarios` (A, B, C whole; D = A's
first 32 slots + its own tail) prefilled in two batches — every kind of state a decode step
reads exists (pair state pending at even lengths, SWA windows, compressed entries, Engram history).

`decode_step(...)`: one decode token per live request, padded to `batch_size` the way SGLang
0.5.17's `DecodeCudaGraphRunner` pads (cuda_graph_buffer_registry's padding policies): padding
requests have req_pool_indices 0 (the padding row), seq_lens = the backend's fill value (1),
positions 0, out_cache_loc 0, and stale input ids (KEEP_PAD).

`no_host_sync()`: while armed, every torch call that synchronises a CUDA device with the host
or makes a shape depend on tensor values raises `HostSync` (item / tolist / bool / int / float /
index of a tensor, nonzero, unique, equal, masked_select, boolean-mask indexing, repeat_interleave
without output_size, .cpu() / .numpy()). `suspended()` disarms it inside test stand-ins of the
Triton kernels (the kernels themselves are audited by the GPU capture test).
"""
from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import Tensor

from runtime_scenarios import ROWS, SHARED_PREFIX, Slots, allocate_caches, prompts, run_batch
from sglang_dsv41.runtime.batch import BatchLayout, make_layout, static_decode_layout
from sglang_dsv41.runtime.cache import RuntimeCaches
from sglang_dsv41.runtime.forward import TorchForward

#: SGLang's padding values (decode runner, 0.5.17) — seq_len fill = our backend's fill value.
PAD_ROW, PAD_POSITION, PAD_SLOT, SEQ_LEN_FILL = 0, 0, 0, 1
STALE_INPUT_ID = 7


@dataclass
class Prefilled:
    slots: Slots
    caches: RuntimeCaches
    lengths: dict[str, int]          # tokens each request holds (= its next decode position)


def prefilled(engine: TorchForward, device: torch.device) -> Prefilled:
    p = prompts()
    slots = Slots(device)
    caches = allocate_caches(engine, slots)
    run_batch(engine, caches, slots, [(ROWS["A"], 0, p["A"]), (ROWS["B"], 0, p["B"])])
    slots.share(ROWS["D"], ROWS["A"], SHARED_PREFIX)
    run_batch(engine, caches, slots, [(ROWS["C"], 0, p["C"]), (ROWS["D"], SHARED_PREFIX, p["D"][SHARED_PREFIX:])])
    return Prefilled(slots, caches, {name: len(p[name]) for name in ROWS})


@dataclass
class DecodeStep:
    """Padded graph inputs ([batch_size] each) and the number of live requests in front."""

    input_ids: Tensor
    req_rows: Tensor
    seq_lens: Tensor
    positions: Tensor
    out_slots: Tensor
    live: int

    def unpadded_layout(self, req_to_token: Tensor) -> BatchLayout:
        """The eager (checked) layout of the live requests alone."""
        n = self.live
        return make_layout(self.req_rows[:n], self.seq_lens[:n] - 1, torch.ones_like(self.seq_lens[:n]),
                           self.positions[:n], self.out_slots[:n], req_to_token)

    def static_layout(self, req_to_token: Tensor) -> BatchLayout:
        return static_decode_layout(self.req_rows, self.seq_lens, self.positions, self.out_slots, req_to_token)

    def copy_into(self, static: "DecodeStep") -> None:
        """What the runner does before a replay: new inputs copied into the captured buffers."""
        for name in ("input_ids", "req_rows", "seq_lens", "positions", "out_slots"):
            getattr(static, name).copy_(getattr(self, name))


def decode_step(state: Prefilled, tokens: dict[str, int], batch_size: int) -> DecodeStep:
    """Allocate each live request's next slot (advancing `state`) and pad to `batch_size`."""
    names = list(tokens)
    if batch_size < len(names):
        raise ValueError(f"batch_size {batch_size} < {len(names)} live requests")
    dev = state.slots.device
    slots = [int(state.slots.extend(ROWS[n], state.lengths[n], 1)[0]) for n in names]
    positions = [state.lengths[n] for n in names]
    for n in names:
        state.lengths[n] += 1
    pad = batch_size - len(names)

    def t(values: list[int]) -> Tensor:
        return torch.tensor(values, dtype=torch.int64, device=dev)

    return DecodeStep(input_ids=t([tokens[n] for n in names] + [STALE_INPUT_ID] * pad),
                      req_rows=t([ROWS[n] for n in names] + [PAD_ROW] * pad),
                      seq_lens=t([p + 1 for p in positions] + [SEQ_LEN_FILL] * pad),
                      positions=t(positions + [PAD_POSITION] * pad),
                      out_slots=t(slots + [PAD_SLOT] * pad), live=len(names))


def step_tokens(step: int) -> dict[str, int]:
    """Fixed decode tokens of step `step` for the four requests."""
    return {name: 11 + 97 * step + 13 * i for i, name in enumerate(ROWS)}


def clone_caches(caches: RuntimeCaches) -> RuntimeCaches:
    return copy.deepcopy(caches)


def differences_outside_padding(a: RuntimeCaches, b: RuntimeCaches, page: int) -> list[str]:
    """Names of cache regions that differ between `a` and `b`, ignoring only the padding page
    (full / SWA slots 0..page−1: identity SWA map in stand-alone caches). Request-scoped pair
    state is compared for every row, the padding row 0 included."""
    diffs = []
    if not torch.equal(a.rows[page:], b.rows[page:]):
        diffs.append("packed compressed rows")
    for layer, (x, y) in enumerate(zip(a.swa, b.swa)):
        if not torch.equal(x[page:], y[page:]):
            diffs.append(f"swa[{layer}]")
    if not torch.equal(a.token_ids[page:], b.token_ids[page:]):
        diffs.append("token_ids")
    for field in ("pair_kv", "pair_score", "pair_position"):
        for src, x in getattr(a, field).items():
            y = getattr(b, field)[src]
            if not torch.equal(x, y):
                rows = torch.nonzero((x != y).reshape(x.shape[0], -1).any(dim=1)).flatten().tolist()
                diffs.append(f"{field}[{src}] rows {rows}")
    return diffs


# ---- host-sync trap --------------------------------------------------------------------------------

class HostSync(AssertionError):
    """A host synchronisation / data-dependent shape inside the audited region."""


_armed = False


def _trap(name: str, original):
    def wrapper(*args, **kwargs):
        if _armed:
            raise HostSync(f"{name} inside the static decode forward (host sync / data-dependent shape)")
        return original(*args, **kwargs)
    return wrapper


def _has_bool_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, Tensor) and i.dtype == torch.bool for i in items)


def _index_trap(name: str, original):
    def wrapper(self, index, *rest):
        if _armed and _has_bool_index(index):
            raise HostSync(f"boolean-mask {name} inside the static decode forward (data-dependent shape)")
        return original(self, index, *rest)
    return wrapper


def _repeat_interleave_trap(original):
    def wrapper(*args, **kwargs):
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        if _armed and isinstance(repeats, Tensor) and kwargs.get("output_size") is None:
            raise HostSync("repeat_interleave with tensor repeats and no output_size (host sync)")
        return original(*args, **kwargs)
    return wrapper


@contextlib.contextmanager
def no_host_sync() -> Iterator[None]:
    """Arm the trap (module docstring) for the duration of the block."""
    global _armed
    saved: list[tuple[object, str, object]] = []

    def patch(owner, name: str, make) -> None:
        original = getattr(owner, name)
        saved.append((owner, name, original))
        setattr(owner, name, make(original))

    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "unique",
                 "cpu", "numpy", "masked_select", "unique_consecutive"):
        patch(torch.Tensor, name, lambda orig, n=name: _trap(f"Tensor.{n}", orig))
    for name in ("nonzero", "unique", "equal", "masked_select", "unique_consecutive", "argwhere"):
        patch(torch, name, lambda orig, n=name: _trap(f"torch.{n}", orig))
    patch(torch.Tensor, "__getitem__", lambda orig: _index_trap("indexing", orig))
    patch(torch.Tensor, "__setitem__", lambda orig: _index_trap("index assignment", orig))
    patch(torch, "repeat_interleave", _repeat_interleave_trap)
    patch(torch.Tensor, "repeat_interleave", _repeat_interleave_trap)
    _armed = True
    try:
        yield
    finally:
        _armed = False
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """Disarm the trap inside a stand-in for a device kernel."""
    global _armed
    was, _armed = _armed, False
    try:
        yield
    finally:
        _armed = was


def static_decode_logits(engine: TorchForward, batch_size: int = 6, steps: int = 2) -> dict[str, Tensor]:
    """Live-request logits of `steps` static (CUDA-graph layout) decode steps padded to
    `batch_size`, after the standard prefill — the scenario `tests/tp_harness.run_tp` runs on
    every rank (CPU) to show the static forward at TP > 1 equals TP 1."""
    state = prefilled(engine, torch.device("cpu"))
    out: dict[str, Tensor] = {}
    for step in range(steps):
        inputs = decode_step(state, step_tokens(step), batch_size)
        hidden = engine.hidden_states(inputs.input_ids, inputs.static_layout(state.slots.table), state.caches)
        out[f"step{step}"] = engine.logits(hidden)[:inputs.live]
    return out

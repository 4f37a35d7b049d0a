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

`graph_decode_steps(engine)`: the static step captured in a CUDA graph and replayed (steps 0 and
1) against the eager static forward on identical cache copies — the per-rank scenario of the TP
capture test (tests/test_runtime_tp_cuda_graph_gpu.py; CPU: the same sequence with an eager
stand-in for the graph).
"""
from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import Tensor

from runtime_scenarios import ROWS, SHARED_PREFIX, Slots, allocate_caches, prompts, run_batch
from sglang_dsv41.runtime.batch import BatchLayout, make_layout, static_decode_layout
from sglang_dsv41.runtime.cache import RuntimeCaches
from sglang_dsv41.runtime.forward import TorchForward
from tp_harness import report_stage

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
    run_batch(engine, caches, slots, [(ROWS["C"], 0, p["C"]), (ROWS["D"], SHARED_PREFIX, p["D"][SHARED_PREFIX:])],
              context={ROWS["C"]: [], ROWS["D"]: p["D"]})          # D's prefix hit: history from the host
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
    """Names of cache regions that differ between `a` and `b`, ignoring only full / SWA slots
    0..page−1 (the padding page, or only its write sink; identity SWA map in stand-alone caches).
    Request-scoped pair state is compared for every row, the padding row 0 included."""
    diffs = []
    for name in ("latent_rows", "key_rows"):
        x, y = getattr(a, name)[page:], getattr(b, name)[page:]
        if not torch.equal(x, y):
            rows = (torch.nonzero((x != y).reshape(x.shape[0], -1).any(dim=1)).flatten() + page).tolist()
            diffs.append(f"packed compressed {name} rows {rows[:16]}{' …' if len(rows) > 16 else ''}")
    for layer, (x, y) in enumerate(zip(a.swa, b.swa)):
        if not torch.equal(x[page:], y[page:]):
            diffs.append(f"swa[{layer}]")
    for field in ("ids", "end"):
        if not torch.equal(getattr(a.engram_history, field), getattr(b.engram_history, field)):
            diffs.append(f"engram_history.{field}")
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


# ---- capture + replay of the static step at any TP size (tests/test_runtime_tp_cuda_graph_gpu.py) ---------------

#: padded batch size of the captured step: the four live requests + 2 padding requests (as the TP-1 GPU test)
GRAPH_BS = 6


STEP_BUFFERS = ("input_ids", "req_rows", "seq_lens", "positions", "out_slots")


def graph_input_buffers(step: DecodeStep) -> DecodeStep:
    """Fresh copies of `step`'s tensors: the static input buffers a graph is captured on."""
    return DecodeStep(**{name: getattr(step, name).clone() for name in STEP_BUFFERS}, live=step.live)


def _sync_ranks(engine: TorchForward, device: torch.device) -> None:
    """What SGLang's graph backend does before each warm-up and the capture: the device idle,
    then a barrier over the TP group (every rank at the same point)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    engine.tp.barrier()


class EagerReplay:
    """CPU stand-in for a captured graph (a dry run of the scenario's bookkeeping, not of capture):
    `replay()` runs `forward(caches)` eagerly into the fixed output tensor `out`."""

    def __init__(self, forward: Callable[[RuntimeCaches], Tensor], caches: RuntimeCaches, out: Tensor) -> None:
        self.forward, self.caches, self.out = forward, caches, out

    def replay(self) -> None:
        self.out.copy_(self.forward(self.caches))


def _captured(engine: TorchForward, device: torch.device, forward: Callable[[RuntimeCaches], Tensor],
              graph_caches: RuntimeCaches, out_shape: tuple[int, int]):
    """(graph, out): CUDA — two warm-ups on scratch cache copies on a side stream, then
    `forward(graph_caches)` captured on that stream (SGLang's FullCudaGraphBackend order: sync +
    barrier before each warm-up and before the capture; global capture mode; inside the TP group's
    `graph_capture` context, as SGLang's runner). Capture records
    kernels without running them, so `graph_caches` is untouched until the first replay. CPU —
    the same warm-ups and an `EagerReplay`."""
    side = torch.cuda.Stream(device) if device.type == "cuda" else None
    if side is not None:
        side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        for i in range(2):
            report_stage(f"warm-up {i}")
            _sync_ranks(engine, device)
            forward(clone_caches(graph_caches))
    if side is None:
        _sync_ranks(engine, device)
        stand_in = EagerReplay(forward, graph_caches, torch.empty(out_shape, dtype=torch.float32))
        return stand_in, stand_in.out
    torch.cuda.current_stream(device).wait_stream(side)
    _sync_ranks(engine, device)
    report_stage("capture")
    graph = torch.cuda.CUDAGraph()
    try:
        with engine.tp.graph_capture(side), torch.cuda.graph(graph, stream=side):
            out = forward(graph_caches)
    except Exception as e:   # noqa: BLE001 — re-raised with the diagnosis
        raise AssertionError(
            f"{engine.tp.describe()}: CUDA-graph capture of the static decode forward failed: {type(e).__name__}: {e}\n"
            "Look for a host sync (.item/int/bool/tolist/nonzero on a CUDA tensor), a host → device copy, a "
            "data-dependent shape, or a collective that cannot be captured (runtime/tensor_parallel.py)") from e
    return graph, out


def graph_decode_steps(engine: TorchForward, batch_size: int = GRAPH_BS) -> dict[str, object]:
    """The static decode step captured and replayed on `engine`'s device, against eager — one
    rank's part of the TP capture test (run by `tp_harness.run_tp` on every rank, or in-process
    at TP 1). After `prefilled`, from caches S (the prefilled state):

    * eager0: eager static forward of step 0 (padded to `batch_size`) on a copy E of S;
    * capture (`_captured`) of the same forward on its static input buffers over a copy G of S;
    * replay0: step 0's inputs copied into the buffers, replay over G (= S: capture ran nothing);
      cache_diffs0 = regions where G and E differ afterwards (expected: none);
    * replay1 / eager1: step 1's inputs (new slots, positions, tokens) — replay over G, then the
      eager forward over E; cache_diffs1 likewise.

    Logits are the full padded [batch_size, vocab] fp32 rows (CPU); `live` = live requests in
    front. Collectives run in the same order on every rank (prefill, eager, warm-ups, replays)."""
    device = engine.weights["embed.weight"].device
    report_stage("prefill")
    state = prefilled(engine, device)
    table = state.slots.table
    start = clone_caches(state.caches)
    eager_caches, graph_caches = clone_caches(start), clone_caches(start)
    first = decode_step(state, step_tokens(0), batch_size)
    static = graph_input_buffers(first)

    def eager(step: DecodeStep) -> Tensor:
        return engine.logits(engine.hidden_states(step.input_ids, step.static_layout(table), eager_caches))

    def captured_forward(caches: RuntimeCaches) -> Tensor:
        return engine.logits(engine.hidden_states(static.input_ids, static.static_layout(table), caches))

    report_stage("eager step 0")
    out: dict[str, object] = {"live": first.live, "eager0": eager(first).cpu()}
    graph, graph_out = _captured(engine, device, captured_forward, graph_caches,
                                 (batch_size, engine.text.vocab_size))
    report_stage("replay step 0")
    first.copy_into(static)
    graph.replay()
    out["replay0"] = graph_out.clone().cpu()
    out["cache_diffs0"] = differences_outside_padding(graph_caches, eager_caches, 0)
    report_stage("step 1")
    second = decode_step(state, step_tokens(1), batch_size)
    second.copy_into(static)
    graph.replay()
    out["replay1"] = graph_out.clone().cpu()
    out["eager1"] = eager(second).cpu()
    out["cache_diffs1"] = differences_outside_padding(graph_caches, eager_caches, 0)
    del graph, graph_out
    _sync_ranks(engine, device)
    report_stage("done")
    return out

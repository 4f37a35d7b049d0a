"""Packed-batch scenarios of the runtime forward, shared by the runtime tests on CPU and CUDA.

`run_scenario(engine, caches, device, decode)` drives `TorchForward.hidden_states` through five
SGLang-like batches over four requests (prompts of 49–61 tokens, so the tiny config's SWA window
8, index_topk 4 and candidate span 3 × 4 entries all bind):

1. A whole (49, ends at even position 48 → pending pair) + B's first chunk (0..12, ends even)
2. B chunk 13..31 (odd start: pair (12, 13) from B's pair state; ends odd) + A decode (49, odd:
   pair (48, 49) from A's pair state)                          — chunked prefill mixed with decode
3. C whole (61, ends even) + B chunk 32..55 (even start, ends odd) + A decode
4. D = A's first 32 slots shared (radix hit: page-aligned, even length) + its 20-token tail
   (ends odd), A, B, C decode
5. A, B, C, D decode

Slots come from `Slots`, a paged allocator like SGLang's (`PAGE_SIZE` tokens per page, page 0 =
padding, a request's positions p and p+1 in one page when p is even) — what packed compressed
entries need (contract §2); caches for it come from `allocate_caches` / `scenario_caches`.

`decode[name]` are the teacher-forced decode tokens (A: 4, B: 2, C: 2, D: 1). The result maps
each request to its logits at every position it computed, in position order (D from 32 on);
`full_tokens(name, decode)` is the token list a reference one-shot forward must see to produce
the same positions (reference logits[SHARED_PREFIX:] for D).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Mapping, Sequence

import torch

from sglang_dsv41.runtime.batch import BatchLayout, make_layout
from sglang_dsv41.runtime.cache import RuntimeCaches
from sglang_dsv41.runtime.engram_history import host_history
from sglang_dsv41.runtime.forward import TorchForward

ROWS = {"A": 1, "B": 2, "C": 3, "D": 4}
DECODE_STEPS = {"A": 4, "B": 2, "C": 2, "D": 1}
SHARED_PREFIX = 32          # page-aligned (what SGLang's radix cache hands out with page_size 4)
D_TAIL = 20
PAGE_SIZE = 4               # even: the two tokens of a ratio-2 entry share a page


def prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [0] + torch.randint(3, 990, (n - 1,), generator=g).tolist()


def prompts() -> dict[str, list[int]]:
    a = prompt(31, 49)
    return {"A": a, "B": prompt(32, 56), "C": prompt(33, 61), "D": a[:SHARED_PREFIX] + prompt(34, D_TAIL + 1)[1:]}


def full_tokens(name: str, decode: dict[str, list[int]]) -> list[int]:
    """Prompt + the decode tokens fed (the last decode token's logits are computed too)."""
    return prompts()[name] + decode[name][:DECODE_STEPS[name]]


def fixed_decode_tokens() -> dict[str, list[int]]:
    """Arbitrary but fixed decode tokens (runtime-vs-runtime comparisons)."""
    return {name: prompt(40 + i, n + 1)[1:] for i, (name, n) in enumerate(DECODE_STEPS.items())}


class Slots:
    """A minimal SGLang-like paged slot map: req_to_token rows and a page allocator (page 0 =
    padding, like SGLang's). Position p of a request goes to a fresh page when p % page_size == 0,
    else to the slot after position p − 1's; a host copy of the table avoids device reads."""

    def __init__(self, device: torch.device, rows: int = 8, max_context: int = 128,
                 page_size: int = PAGE_SIZE) -> None:
        self.host = torch.zeros(rows, max_context, dtype=torch.int32)
        self.table = self.host.to(device)
        self.page_size = page_size
        self.next_page = 1
        self.device = device

    def extend(self, row: int, start: int, n: int) -> torch.Tensor:
        for p in range(start, start + n):
            if p % self.page_size == 0:
                self.host[row, p] = self.next_page * self.page_size
                self.next_page += 1
            else:
                self.host[row, p] = self.host[row, p - 1] + 1
        self.table[row, start:start + n] = self.host[row, start:start + n].to(self.device)
        return self.table[row, start:start + n].clone()

    def share(self, dst_row: int, src_row: int, n: int) -> None:
        """What a radix-cache hit does: dst's first n positions use src's slots (n page-aligned)."""
        assert n % self.page_size == 0, f"prefix hit of {n} tokens is not page-aligned ({self.page_size})"
        self.host[dst_row, :n] = self.host[src_row, :n]
        self.table[dst_row, :n] = self.table[src_row, :n]

    def free_all(self) -> None:
        """Every page back to the allocator (tables keep stale entries, as SGLang's do)."""
        self.next_page = 1

    def num_slots(self) -> int:
        """Slots a cache needs for every page this map can hand out."""
        return (self.host.shape[0] * (self.host.shape[1] // self.page_size + 1) + 1) * self.page_size


def allocate_caches(engine: TorchForward, slots: Slots) -> RuntimeCaches:
    """Stand-alone caches sized for `slots` (identity SWA map), on the slot map's device."""
    return RuntimeCaches.allocate(engine.text, slots.num_slots(), slots.host.shape[0], device=slots.device,
                                  page_size=slots.page_size)


def run_batch(engine: TorchForward, caches: RuntimeCaches, slots: Slots,
              pieces: list[tuple[int, int, list[int]]],
              context: Mapping[int, Sequence[int]] | None = None) -> list[torch.Tensor]:
    """One packed batch: each piece (row, prefix_len, token ids) gets fresh slots for its tokens;
    returns each piece's fp32 logits [len, vocab] on the CPU. `context` (row → the row's ids up to
    at least its prefix) makes the batch carry the Engram history from the host, as SGLang's
    extends do (`runtime/engram_history.py`); without it the forward reads the history ring."""
    dev = slots.device
    history = None
    if context is not None:
        history = host_history([context[r] for r, _, _ in pieces], [p for _, p, _ in pieces],
                               engine.hasher.history_len)
    out_slots = [slots.extend(row, prefix, len(ids)) for row, prefix, ids in pieces]
    positions = torch.cat([torch.arange(prefix, prefix + len(ids), device=dev) for _, prefix, ids in pieces])
    layout = make_layout(torch.tensor([r for r, _, _ in pieces], device=dev),
                         torch.tensor([p for _, p, _ in pieces], device=dev),
                         torch.tensor([len(ids) for _, _, ids in pieces], device=dev), positions,
                         torch.cat(out_slots), slots.table, engram_history=history)
    ids = torch.tensor([t for _, _, piece in pieces for t in piece], device=dev)
    logits = engine.logits(engine.hidden_states(ids, layout, caches)).cpu()
    return list(torch.split(logits, [len(ids) for _, _, ids in pieces]))


def scenario_caches(engine: TorchForward, device: torch.device) -> RuntimeCaches:
    """Fresh caches sized for `run_scenario`'s slot map."""
    return allocate_caches(engine, Slots(device))


def run_scenario(engine: TorchForward, caches: RuntimeCaches, device: torch.device,
                 decode: dict[str, list[int]]) -> dict[str, torch.Tensor]:
    """The five batches of the module docstring (`caches` fresh, from `scenario_caches`); logits
    per request in position order."""
    p, slots = prompts(), Slots(device)
    if caches.num_slots < slots.num_slots() or caches.num_req_rows < slots.host.shape[0]:
        raise ValueError("run_scenario needs caches from scenario_caches (enough slots and request rows)")
    seq = {name: full_tokens(name, decode) for name in ROWS}
    done = {name: 0 for name in ROWS}
    got: dict[str, list[torch.Tensor]] = {name: [] for name in ROWS}

    def piece(name: str, n: int) -> tuple[int, int, list[int]]:
        start = done[name]
        done[name] += n
        return ROWS[name], start, seq[name][start:start + n]

    def batch(*spec: tuple[str, int], context: Mapping[int, Sequence[int]] | None = None) -> None:
        pieces = [piece(name, n) for name, n in spec]
        for (name, _), logits in zip(spec, run_batch(engine, caches, slots, pieces, context)):
            got[name].append(logits)

    batch(("A", len(p["A"])), ("B", 13))
    batch(("B", 19), ("A", 1))
    batch(("C", len(p["C"])), ("B", len(p["B"]) - 32), ("A", 1))
    slots.share(ROWS["D"], ROWS["A"], SHARED_PREFIX)
    done["D"] = SHARED_PREFIX
    batch(("D", D_TAIL), ("A", 1), ("B", 1), ("C", 1),      # D's history comes from the host (a prefix hit)
          context={ROWS[name]: seq[name][:done[name]] for name in ROWS})
    batch(("A", 1), ("B", 1), ("C", 1), ("D", 1))
    for name in ROWS:
        assert done[name] == len(seq[name]), f"scenario fed {done[name]} of {len(seq[name])} tokens of {name}"
    return {name: torch.cat(parts) for name, parts in got.items()}


def one_shot_logits(engine: TorchForward, device: torch.device, tokens: list[int]) -> torch.Tensor:
    """Logits [len, vocab] (CPU) of one request prefilled in one batch of its own, fresh caches."""
    slots = Slots(device, rows=2, max_context=len(tokens))
    return run_batch(engine, allocate_caches(engine, slots), slots, [(1, 0, tokens)])[0]


def prefill_then_decode(engine: TorchForward, device: torch.device, tokens: list[int]) -> list[torch.Tensor]:
    """One request alone, fresh caches: the prefill of tokens[:-1], then one decode step of the last token — each
    batch's logits (CPU) followed by the engine's DSpark captures after it (`set_capture_layers`)."""
    slots = Slots(device, rows=2, max_context=len(tokens))
    caches = allocate_caches(engine, slots)
    out = [run_batch(engine, caches, slots, [(1, 0, tokens[:-1])])[0], *(c.cpu() for c in engine.captured)]
    out.append(run_batch(engine, caches, slots, [(1, len(tokens) - 1, tokens[-1:])])[0])
    return out + [c.cpu() for c in engine.captured]


def greedy_generate(engine: TorchForward, device: torch.device, prompt_ids: list[int],
                    max_new_tokens: int) -> list[int]:
    """Greedy tokens (argmax, lowest id on ties) of one request alone: one-shot prefill, then one
    decode batch per token — `ReferenceModel.generate`'s schedule on the runtime forward."""
    slots = Slots(device, rows=2, max_context=len(prompt_ids) + max_new_tokens)
    caches = allocate_caches(engine, slots)
    logits = run_batch(engine, caches, slots, [(1, 0, list(prompt_ids))])[0]
    tokens = [int(torch.argmax(logits[-1]))]
    while len(tokens) < max_new_tokens:
        step = run_batch(engine, caches, slots, [(1, len(prompt_ids) + len(tokens) - 1, tokens[-1:])])[0]
        tokens.append(int(torch.argmax(step[-1])))
    return tokens


@dataclasses.dataclass(frozen=True)
class ContractMeasurement:
    """The end-to-end numerics contract's figures of a serving path against the reference on the
    scenario prompts (tests/test_runtime_numerics_contract.py)."""

    agree: int
    total: int
    worst_logit_diff: float
    greedy_equal: list[int]
    greedy_steps: int

    @property
    def top1(self) -> float:
        return self.agree / self.total

    def summary(self, label: str) -> str:
        return (f"{label} vs reference, teacher-forced over {self.total} positions: top-1 agreement "
                f"{self.top1:.2%}, max |Δlogit| {self.worst_logit_diff:.3g}; free-running greedy: "
                f"{self.greedy_equal} of {self.greedy_steps} tokens equal per prompt")


def measure_contract(engine: TorchForward, device: torch.device, reference, greedy_steps: int) -> ContractMeasurement:
    """Teacher-forced on the reference's own greedy tokens: top-1 agreement and max |Δlogit| over
    every position of every scenario prompt; plus free-running greedy agreement per prompt."""
    agree = total = 0
    worst = 0.0
    greedy_equal = []
    for prompt_ids in prompts().values():
        tokens = reference.generate(prompt_ids, greedy_steps)
        ids = prompt_ids + tokens[:-1]
        want = reference.forward(reference.new_request(), ids).logits
        got = one_shot_logits(engine, device, ids).cpu()
        agree += int((got.argmax(-1) == want.argmax(-1)).sum())
        total += len(ids)
        worst = max(worst, float((got - want).abs().max()))
        greedy_equal.append(sum(a == b for a, b in zip(greedy_generate(engine, device, prompt_ids, greedy_steps),
                                                       tokens)))
    return ContractMeasurement(agree, total, worst, greedy_equal, greedy_steps)


def runtime_engine(checkpoint: Path, device: torch.device, deterministic: bool = True) -> TorchForward:
    """The forward the server builds for `checkpoint` on `device`: parameters created in stored
    form, the stored tensors streamed in (`TorchForward.for_loading` + `load_weights`; CUDA:
    routed experts stay MXFP4 for the Triton kernel and FP8 dense weights E4M3; CPU: everything
    dequantised, the reference path). `deterministic`: as `--enable-deterministic-inference`
    (CPU: exact backend; CUDA: W8A16 FP8 linears at every row count)."""
    from sglang_dsv41.checkpoint.reader import CheckpointReader
    from sglang_dsv41.config import DeepseekV41Config
    from sglang_dsv41.engram_hash import EngramHasher, _load_fast_tokenizer, compressed_token_map
    from sglang_dsv41.runtime.forward import fp32_default_dtype

    cfg = DeepseekV41Config.from_file(checkpoint)
    token_map, _ = compressed_token_map(_load_fast_tokenizer(checkpoint))
    on_cuda = device.type == "cuda"
    with fp32_default_dtype(), torch.device(device), CheckpointReader(checkpoint) as reader:
        engine = TorchForward.for_loading(cfg, EngramHasher.from_config(cfg, token_map).to(device),
                                          experts_mxfp4=on_cuda, dense_fp8=on_cuda, deterministic=deterministic)
        engine.load_weights((name, reader.get(name)) for name in reader.names())
    return engine


def layout_to(layout: BatchLayout, device: torch.device) -> BatchLayout:
    """The same layout with every tensor on `device`."""
    return dataclasses.replace(layout, **{f.name: getattr(layout, f.name).to(device)
                                          for f in dataclasses.fields(layout)
                                          if isinstance(getattr(layout, f.name), torch.Tensor)})

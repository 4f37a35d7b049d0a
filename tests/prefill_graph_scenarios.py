"""Extend batches as a prefill CUDA-graph runner would feed them (docs/prefill_graphs.md) — shared
by the CPU test and the GPU probe of the static extend forward (`runtime/batch.static_extend_layout`).

`extend_step(state, pieces, bucket)`: after `cuda_graph_scenarios.prefilled`, each named request
extends by its piece's tokens (fresh slots, consecutive positions from its current length), the
batch padded to `bucket` tokens the way SGLang 0.5.17's prefill runners pad (the registry's ZERO
policy: input ids, positions and out_cache_loc of the padded tail are 0); `sentinels` unused
request slots after the live requests as the `full` runner pads them (row 0, seq_len 0, extend
length 0; `prefill_cuda_graph_runner.py:1173/1570-1577`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from cuda_graph_scenarios import PAD_ROW, Prefilled
from runtime_scenarios import ROWS, prompt
from sglang_dsv41.runtime.batch import BatchLayout, make_layout, static_extend_layout

#: the extend the tests run: A and C grow by runs of odd and even length (so both parities of a
#: ratio-2 pair straddle the chunk start), D by one token
PIECES = {"A": 5, "C": 8, "D": 1}
#: the bucket they are padded to (14 live tokens + 10 padding tokens)
BUCKET = 24


@dataclass
class ExtendStep:
    """Padded inputs ([bucket] per token, [B] per request) and the live token count in front."""

    input_ids: Tensor
    positions: Tensor
    out_slots: Tensor
    req_rows: Tensor
    seq_lens: Tensor
    extend_lens: Tensor
    live: int

    def unpadded_layout(self, req_to_token: Tensor) -> BatchLayout:
        """The eager (checked) layout of the live tokens and requests alone."""
        n, b = self.live, int((self.extend_lens > 0).sum())
        return make_layout(self.req_rows[:b], (self.seq_lens - self.extend_lens)[:b], self.extend_lens[:b],
                           self.positions[:n], self.out_slots[:n], req_to_token)

    def static_layout(self, req_to_token: Tensor) -> BatchLayout:
        return static_extend_layout(self.req_rows, self.seq_lens, self.extend_lens, self.positions, self.out_slots,
                                    req_to_token)

    def copy_into(self, static: "ExtendStep") -> None:
        """What a runner does before a replay: the new inputs copied into the captured buffers."""
        for name in ("input_ids", "positions", "out_slots", "req_rows", "seq_lens", "extend_lens"):
            getattr(static, name).copy_(getattr(self, name))


def extend_step(state: Prefilled, pieces: dict[str, int], bucket: int, seed: int = 70,
                sentinels: int = 0) -> ExtendStep:
    """Allocate each request's next `pieces[name]` slots (advancing `state`), pad to `bucket`
    tokens and append `sentinels` zero-length request slots."""
    dev = state.slots.device
    ids, positions, slots = [], [], []
    for i, (name, n) in enumerate(pieces.items()):
        start = state.lengths[name]
        slots += state.slots.extend(ROWS[name], start, n).tolist()
        positions += list(range(start, start + n))
        ids += prompt(seed + i, n + 1)[1:]
        state.lengths[name] = start + n
    live = len(ids)
    if bucket < live:
        raise ValueError(f"bucket {bucket} < {live} live tokens")
    pad = [0] * (bucket - live)

    def t(values: list[int]) -> Tensor:
        return torch.tensor(values, dtype=torch.int64, device=dev)

    empty = [0] * sentinels
    return ExtendStep(input_ids=t(ids + pad), positions=t(positions + pad), out_slots=t(slots + pad),
                      req_rows=t([ROWS[n] for n in pieces] + [PAD_ROW] * sentinels),
                      seq_lens=t([state.lengths[n] for n in pieces] + empty),
                      extend_lens=t(list(pieces.values()) + empty), live=live)


def graph_buffers(step: ExtendStep) -> ExtendStep:
    """Fresh copies of `step`'s tensors: the static input buffers a graph is captured on."""
    return ExtendStep(**{name: getattr(step, name).clone() for name in
                         ("input_ids", "positions", "out_slots", "req_rows", "seq_lens", "extend_lens")},
                      live=step.live)

"""Per-request Engram n-gram history (spec §3.3.1): the K = max_ngram − 1 ids before a request's
chunk, kept per SGLang request row instead of per cache slot.

Two sources, one invariant — the history of request b is the (remapped) ids at positions
prefix_len[b] − K .. prefix_len[b] − 1, −1 where the position is < 0:

* `host_history` builds it from the request's own token ids (prompt + output) when SGLang
  schedules an extend: every prefill, chunk, prefix hit, re-prefill after preemption or retract,
  and HiCache load-back starts from ids the scheduler already has, so nothing of it needs to live
  in (or be transferred with) the KV pool. SGLang attaches it to the ForwardBatch through the
  `ForwardBatch.init_new` hook (`runtime/sglang_hooks.py`).
* `EngramHistoryRing` holds, per request row, the last K ids up to the end of the request's last
  forward (`end`), written by every forward; a decode step reads it (CUDA-graph safe: shapes
  depend on the batch size only). A forward given no host history reads the ring, and on CPU
  refuses a row whose `end` is not the request's prefix length (a stale row).

DSpark verify (docs/dspark.md): a verify forward over [anchor, d_0, …] at P.. reads the ring
(ending at P) but does not advance it; it stages the block's ids (`stage_verify`, per request row,
`verify_ids` [rows, ≥ w]). After acceptance SGLang's worker commits c = 1 + accepted tokens
(`commit_verify`): the ring then holds the ids up to P + c, exactly as if those c tokens had been
forwarded one at a time; rejected drafts leave nothing behind.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

#: History entry of a position before the start of the sequence.
NO_TOKEN = -1


class JoinedIds:
    """prompt + output as one read-only sequence without concatenating them: `len` and slices only
    (what `host_history` reads), so building a request's history copies its last K ids, not its
    whole context."""

    __slots__ = ("prompt", "output")

    def __init__(self, prompt: Sequence[int], output: Sequence[int]) -> None:
        self.prompt, self.output = prompt, output

    def __len__(self) -> int:
        return len(self.prompt) + len(self.output)

    def __getitem__(self, part: slice) -> list[int]:
        if not isinstance(part, slice) or part.step not in (None, 1):
            raise TypeError("JoinedIds takes contiguous slices only")
        lo, hi, _ = part.indices(len(self))
        n = len(self.prompt)
        return list(self.prompt[min(lo, n):min(hi, n)]) + list(self.output[max(lo - n, 0):max(hi - n, 0)])


def host_history(tokens: Sequence[Sequence[int]], starts: Sequence[int], history_len: int,
                 device: torch.device | str = "cpu") -> Tensor:
    """int64 [B, K]: ids tokens[b][starts[b] − K : starts[b]], left-filled with NO_TOKEN.

    Raises when a request holds fewer than starts[b] ids (its history is not on the host)."""
    K = history_len
    out = torch.full((len(tokens), K), NO_TOKEN, dtype=torch.int64)
    for b, (ids, start) in enumerate(zip(tokens, starts)):
        if len(ids) < start:
            raise RuntimeError(f"sglang-dsv41: Engram history of request {b} needs its ids before position "
                               f"{start}, but only {len(ids)} are known on the host")
        lo = max(0, start - K)
        if start > lo:
            out[b, K - (start - lo):] = torch.as_tensor(list(ids[lo:start]), dtype=torch.int64)
    return out.to(device)


@dataclass
class EngramHistoryRing:
    """Last K remapped ids of each request row (`ids`, int32 [rows, K], NO_TOKEN = none) and the
    position after them (`end`, int64 [rows], −1 = never written); under DSpark, `verify_ids`
    int32 [rows, verify width] holds each row's last verify block (module doc)."""

    ids: Tensor
    end: Tensor
    verify_ids: Tensor | None = None

    @classmethod
    def allocate(cls, num_req_rows: int, history_len: int, device: torch.device | str,
                 verify_width: int = 0) -> "EngramHistoryRing":
        if verify_width < 0:
            raise ValueError(f"Engram verify width must be ≥ 0, got {verify_width}")
        staged = (torch.full((num_req_rows, verify_width), NO_TOKEN, dtype=torch.int32, device=device)
                  if verify_width else None)
        return cls(ids=torch.full((num_req_rows, history_len), NO_TOKEN, dtype=torch.int32, device=device),
                   end=torch.full((num_req_rows,), -1, dtype=torch.int64, device=device), verify_ids=staged)

    @property
    def verify_width(self) -> int:
        return 0 if self.verify_ids is None else int(self.verify_ids.shape[1])

    def stage_verify(self, req_rows: Tensor, local: Tensor, ids: Tensor, live: Tensor) -> None:
        """Stage a verify batch's ids: token t (request row `req_rows[t]`, index `local[t]` in its
        block) → verify_ids[row, local]; tokens with `live` False (graph padding) write nothing."""
        if self.verify_ids is None:
            raise RuntimeError("sglang-dsv41: a DSpark verify forward on caches built without a verify width "
                               "(the pool was built without --speculative-algorithm)")
        local = local.clamp(max=self.verify_width - 1)
        held = self.verify_ids[req_rows, local]
        self.verify_ids[req_rows, local] = torch.where(live, ids.to(self.verify_ids.dtype), held)

    def commit_verify(self, req_rows: Tensor, prefix_lens: Tensor, commit_lens: Tensor, check: bool) -> None:
        """Advance each row from P = `prefix_lens` to P + `commit_lens` with its staged block's first
        commit_lens ids (module doc); `check` (host sync) refuses a row not at P or a commit
        longer than the staged block."""
        if self.verify_ids is None:
            raise RuntimeError("sglang-dsv41: Engram verify commit without a staged verify block")
        req_rows, prefix_lens, commit_lens = (x.to(device=self.ids.device, dtype=torch.int64).reshape(-1)
                                              for x in (req_rows, prefix_lens, commit_lens))
        W = self.verify_width
        if check and bool(((commit_lens < 1) | (commit_lens > W)).any()):
            raise RuntimeError(f"sglang-dsv41: Engram verify commit of {commit_lens.tolist()} tokens, staged blocks "
                               f"hold {W}")
        history = self.read(req_rows, prefix_lens, check)
        B = req_rows.numel()
        block = self.verify_ids[req_rows].to(torch.int64).reshape(-1)
        tail = history_tail(history, block, torch.arange(B, device=block.device) * W, prefix_lens, commit_lens)
        self.advance(req_rows, prefix_lens + commit_lens, tail)

    @property
    def history_len(self) -> int:
        return int(self.ids.shape[1])

    def bytes_per_request_row(self) -> int:
        return (self.history_len + self.verify_width) * self.ids.element_size() + self.end.element_size()

    def read(self, req_rows: Tensor, prefix_lens: Tensor, check: bool) -> Tensor:
        """int64 [B, K] history of the requests at `req_rows` (all NO_TOKEN where the prefix is
        empty); `check` (host sync) raises when a row with a prefix was last written up to another
        position than its prefix length."""
        fresh = prefix_lens == 0
        if check:
            stale = (self.end[req_rows] != prefix_lens) & ~fresh
            if bool(stale.any()):
                b = int(torch.nonzero(stale)[0, 0])
                raise RuntimeError(f"sglang-dsv41: Engram history of request row {int(req_rows[b])} ends at "
                                   f"position {int(self.end[req_rows[b]])}, not at its prefix length "
                                   f"{int(prefix_lens[b])}: an extend must carry the history from the host")
        ids = self.ids[req_rows].to(torch.int64)
        return torch.where(fresh[:, None], torch.full_like(ids, NO_TOKEN), ids)

    def advance(self, req_rows: Tensor, seq_lens: Tensor, tail: Tensor, live: Tensor | None = None) -> None:
        """Store `tail` [B, K] (the ids at positions seq_len − K .. seq_len − 1) for each row;
        requests with `live` False (CUDA-graph padding) write nothing."""
        ids = tail.to(self.ids.dtype)
        end = seq_lens.to(self.end.dtype)
        if live is not None:
            ids = torch.where(live[:, None], ids, self.ids[req_rows])
            end = torch.where(live, end, self.end[req_rows])
        self.ids[req_rows] = ids
        self.end[req_rows] = end


def history_tail(history: Tensor, ids: Tensor, starts: Tensor, prefix_lens: Tensor,
                 extend_lens: Tensor) -> Tensor:
    """int64 [B, K]: the ids at positions seq_len − K .. seq_len − 1 of each request, taken from
    this batch's `ids` [N] (positions ≥ prefix_len) or from its `history` [B, K] (before)."""
    K = history.shape[1]
    offset = extend_lens[:, None] - K + torch.arange(K, device=ids.device)[None, :]   # relative to prefix
    from_batch = ids[(starts[:, None] + offset).clamp(min=0, max=max(ids.numel() - 1, 0))].to(torch.int64)
    from_history = history.gather(1, (offset + K).clamp(min=0, max=K - 1))
    return torch.where(offset >= 0, from_batch, from_history)

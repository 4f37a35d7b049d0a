"""Per-request Engram history (`runtime/engram_history.py`): built from a request's own ids on the
host for extends, kept in a per-request-row ring for decode, never per cache slot — so a prefix
hit, a chunk, a re-prefill after preemption or a stale row give the reference's history or a
clear error. The forward-level checks against `ReferenceModel` are in tests/test_runtime_forward.py
(prefix shared through slots, retract + re-prefill, chunked prefill, packed scenarios)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang_dsv41.runtime.engram_history import NO_TOKEN, EngramHistoryRing, JoinedIds, history_tail, host_history
from sglang_dsv41.runtime.sglang_hooks import attach_engram_history_hook


def test_host_history_takes_the_k_ids_before_each_start() -> None:
    got = host_history([[5, 6, 7, 8, 9], [1, 2], [3]], [4, 1, 0], 3)
    assert got.tolist() == [[6, 7, 8], [NO_TOKEN, NO_TOKEN, 1], [NO_TOKEN] * 3]
    with pytest.raises(RuntimeError, match="only 2 are known on the host"):
        host_history([[1, 2]], [3], 3)


def test_tail_mixes_batch_ids_and_history() -> None:
    """Request 0 extends 2 tokens after history [10, 11, 12]; request 1 extends 4 (tail from the
    batch only); request 2 decodes one token after [NO, NO, 7]."""
    history = torch.tensor([[10, 11, 12], [NO_TOKEN] * 3, [NO_TOKEN, NO_TOKEN, 7]])
    ids = torch.tensor([20, 21, 30, 31, 32, 33, 40])
    starts, prefix, extend = torch.tensor([0, 2, 6]), torch.tensor([3, 0, 1]), torch.tensor([2, 4, 1])
    tail = history_tail(history, ids, starts, prefix, extend)
    assert tail.tolist() == [[12, 20, 21], [31, 32, 33], [NO_TOKEN, 7, 40]]


def test_ring_reads_what_it_advanced_and_refuses_a_stale_row() -> None:
    ring = EngramHistoryRing.allocate(4, 3, "cpu")
    rows, seq = torch.tensor([1, 2]), torch.tensor([5, 2])
    ring.advance(rows, seq, torch.tensor([[3, 4, 5], [NO_TOKEN, 8, 9]]))
    assert ring.read(rows, seq, check=True).tolist() == [[3, 4, 5], [NO_TOKEN, 8, 9]]
    assert ring.read(torch.tensor([1]), torch.tensor([0]), check=True).tolist() == [[NO_TOKEN] * 3]  # fresh
    with pytest.raises(RuntimeError, match="row 1 ends at position 5, not at its prefix length 4"):
        ring.read(torch.tensor([1]), torch.tensor([4]), check=True)
    ring.advance(torch.tensor([1, 0]), torch.tensor([6, 1]), torch.tensor([[4, 5, 6], [1, 1, 1]]),
                 live=torch.tensor([True, False]))                       # padding request: no write
    assert ring.ids[0].tolist() == [NO_TOKEN] * 3 and int(ring.end[0]) == -1
    assert ring.ids[1].tolist() == [4, 5, 6] and int(ring.end[1]) == 6
    assert ring.bytes_per_request_row() == 3 * 4 + 8


def _forward_batch(mode: str, seq_lens: list[int], extend_lens: list[int]) -> SimpleNamespace:
    return SimpleNamespace(forward_mode=SimpleNamespace(name=mode), seq_lens=torch.tensor(seq_lens),
                           seq_lens_cpu=torch.tensor(seq_lens), extend_seq_lens_cpu=extend_lens)


class _Model:
    """Stands in for DeepseekV41ForCausalLM's staging of the history (the forward takes it)."""

    engram_history_len = 3

    def __init__(self) -> None:
        self.staged: list[tuple[list[int], torch.Tensor]] = []

    def stage_engram_history(self, starts, history) -> None:
        self.staged.append((starts, history))


def test_init_new_hook_stages_the_history_of_extends_only() -> None:
    """What SGLang hands the forward: a fresh prompt, a prefix hit at 4 and a re-prefill of
    prompt + outputs at 6 get their ids before the chunk; decode batches and other models get nothing."""
    model = _Model()
    runner = SimpleNamespace(model=model)
    reqs = [SimpleNamespace(origin_input_ids=[1, 2, 3], output_ids=[]),
            SimpleNamespace(origin_input_ids=[4, 5, 6, 7, 8, 9], output_ids=[]),
            SimpleNamespace(origin_input_ids=[10, 11, 12], output_ids=[13, 14, 15])]
    attach_engram_history_hook(_forward_batch("EXTEND", [3, 6, 7], [3, 2, 1]), None, SimpleNamespace(reqs=reqs), runner)
    (starts, history), = model.staged
    assert starts == [0, 4, 6] and history.tolist() == [[NO_TOKEN] * 3, [5, 6, 7], [13, 14, 15]]
    attach_engram_history_hook(_forward_batch("DECODE", [4], [1]), None, SimpleNamespace(reqs=reqs[:1]), runner)
    assert len(model.staged) == 1
    fb = _forward_batch("EXTEND", [3], [3])
    assert attach_engram_history_hook(fb, None, SimpleNamespace(reqs=reqs[:1]),
                                      SimpleNamespace(model=torch.nn.Linear(1, 1))) is fb
    with pytest.raises(RuntimeError, match="2 requests but 1 sequence lengths"):
        attach_engram_history_hook(_forward_batch("EXTEND", [3], [3]), None, SimpleNamespace(reqs=reqs[:2]), runner)


def test_the_forward_takes_only_the_history_staged_for_its_batch() -> None:
    """`DeepseekV41ForCausalLM` hands the staged history to the layout of the same extend (chunk
    starts equal), once; another batch's, or none, is an error; decode takes nothing."""
    from sglang_dsv41.runtime.model import DeepseekV41ForCausalLM as M

    history = torch.zeros(2, 3, dtype=torch.int64)
    model = SimpleNamespace(engram_history_len=3, _staged_history=None)
    M.stage_engram_history(model, [0, 4], history)
    assert M.take_engram_history(model, _forward_batch("EXTEND", [3, 6], [3, 2])) is history
    with pytest.raises(RuntimeError, match=r"chunk starts \[0, 4\], staged None"):
        M.take_engram_history(model, _forward_batch("EXTEND", [3, 6], [3, 2]))      # taken once
    M.stage_engram_history(model, [0, 5], history)
    with pytest.raises(RuntimeError, match=r"staged \[0, 5\]"):
        M.take_engram_history(model, _forward_batch("EXTEND", [3, 6], [3, 2]))
    assert M.take_engram_history(model, _forward_batch("DECODE", [7], [1])) is None


class _NoWholeCopy(list):
    """A request's ids that refuse to be iterated whole (`list(ids)`): only slices may be read."""

    def __iter__(self):
        raise AssertionError("the whole context was copied to build a K-id history")


def test_the_hook_copies_only_the_history_not_the_context() -> None:
    """A 32K-token prefix hit copies its K ids, not 32K (`JoinedIds`); slices of prompt + output
    equal the concatenation's at every bound."""
    model, prompt = _Model(), _NoWholeCopy(range(100, 100 + 32768))
    req = SimpleNamespace(origin_input_ids=prompt, output_ids=_NoWholeCopy([7, 8]))
    attach_engram_history_hook(_forward_batch("EXTEND", [32770], [96]), None, SimpleNamespace(reqs=[req]),
                               SimpleNamespace(model=model))
    (starts, history), = model.staged
    assert starts == [32674] and history.tolist() == [[100 + 32671, 100 + 32672, 100 + 32673]]
    joined, whole = JoinedIds([1, 2, 3], [4, 5]), [1, 2, 3, 4, 5]
    for lo in range(-1, 7):
        for hi in range(-1, 7):
            assert joined[lo:hi] == whole[lo:hi], (lo, hi)
    assert len(joined) == 5

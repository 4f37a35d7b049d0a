"""Host work of the CUDA serving path's eager forward (`benchmarks/host_ops.py`, docs/performance.md).

What is pinned:
* serving mode's sync-free value handling (`TorchForward.value_checks` off: ids remapped with a
  device-side assertion, Engram rows by `engram_rows.static_row_ids`, no Engram row-id range check) gives
  the CPU forward's hidden states bit for bit, on a batch of two extends after different prefixes;
* (slow, a child under TRITON_INTERPRET=1) the CUDA path's code — Triton backend, kernel
  attention, mHC and MoE, every kernel in the interpreter, `matmul_ogs` shape-only — issues at most
  `MAX_ATEN_OPS` aten ops and `MAX_LAUNCHES` Triton launches per 32-token extend of the tiny
  checkpoint, no host sync, and the same ops at every line after a 64- and a 1,024-token prefix
  (the checks are `tests/host_ops_cases.py`'s, a child run queued when collection ends: `tests/child_runs.py`).
"""
from __future__ import annotations

from pathlib import Path

import child_runs
import pytest
import torch

from sglang_dsv41.checkpoint.loader import load_reference_weights
from sglang_dsv41.config import DeepseekV41Config
from sglang_dsv41.engram_hash import EngramHasher, _load_fast_tokenizer, compressed_token_map
from sglang_dsv41.runtime.batch import make_layout
from sglang_dsv41.runtime.cache import RuntimeCaches
from sglang_dsv41.runtime.engram_history import host_history
from sglang_dsv41.runtime.forward import TorchForward

#: per-forward bounds of one 32-token extend on the tiny checkpoint (CPU count, `host_ops.py`): the count
#: measured at the last change that lowered it (each change and its count: docs/performance.md, "Host work")
MAX_ATEN_OPS = 921
MAX_LAUNCHES = 265


def _two_extends(forward: TorchForward, cfg: DeepseekV41Config, page: int = 64):
    """ids, layout, caches of request rows 1 and 2 extending 7 and 9 tokens after 6 and 0 cached ones."""
    prefixes, extends, rows = [6, 0], [7, 9], [1, 2]
    g = torch.Generator().manual_seed(3)
    full = [torch.randint(3, 900, (p + n,), generator=g) for p, n in zip(prefixes, extends)]
    table = torch.zeros(4, 2 * page, dtype=torch.int32)
    for r, seq in zip(rows, full):
        table[r, :seq.numel()] = torch.arange(r * page, r * page + seq.numel(), dtype=torch.int32)
    positions = torch.cat([torch.arange(p, p + n) for p, n in zip(prefixes, extends)])
    out = torch.cat([table[r, p:p + n].to(torch.int64) for r, p, n in zip(rows, prefixes, extends)])
    layout = make_layout(torch.tensor(rows), torch.tensor(prefixes), torch.tensor(extends), positions, out, table,
                         engram_history=host_history([s.tolist() for s in full], prefixes,
                                                     forward.hasher.history_len))
    caches = RuntimeCaches.allocate(cfg.text, 4 * page, 4, page_size=page)
    ids = torch.cat([s[p:] for s, p in zip(full, prefixes)])
    return ids, layout, caches


def test_serving_value_handling_gives_the_same_bits(tiny_checkpoint, monkeypatch) -> None:
    cfg = DeepseekV41Config.from_file(tiny_checkpoint)
    weights = load_reference_weights(tiny_checkpoint, cfg, vision=False, dspark=False)
    token_map, _ = compressed_token_map(_load_fast_tokenizer(tiny_checkpoint))
    forward = TorchForward(cfg, weights, EngramHasher.from_config(cfg, token_map))
    ids, layout, caches = _two_extends(forward, cfg)
    assert forward.value_checks(layout)                                     # CPU: checked on the host
    checked = forward.hidden_states(ids, layout, caches)
    rows_checked = forward.engram_rows(ids, layout, _two_extends(forward, cfg)[2])
    monkeypatch.setattr(TorchForward, "value_checks", lambda self, layout: False)        # CUDA serving
    ids, layout, caches = _two_extends(forward, cfg)
    served = forward.hidden_states(ids, layout, caches)
    rows_served = forward.engram_rows(ids, layout, _two_extends(forward, cfg)[2])
    assert all(torch.equal(a, b) for a, b in zip(rows_checked, rows_served)) and len(rows_served) == 2
    assert torch.equal(checked, served)


#: no pytest-timeout in the child: ahead at nice 19 it may wait long for a core (the wait below bounds it)
HOST_WORK_ARGV = child_runs.interpreter_argv(Path(__file__).resolve().parent / "host_ops_cases.py", "-o", "timeout=0")


@pytest.mark.slow
@pytest.mark.child_run(*HOST_WORK_ARGV)
def test_cuda_path_host_work_is_bounded_and_flat_in_context() -> None:
    """`tests/host_ops_cases.py`'s checks (module doc), in a child pytest that may have run ahead on a
    spare core (`child_runs`): the two cases side by side, each a process under TRITON_INTERPRET=1."""
    child_runs.assert_all_passed(HOST_WORK_ARGV, timeout_s=850)   # under the suite's 900 s
